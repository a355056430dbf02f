"""The stand-in tells a cache hit from a download as vLLM does, so a test can count downloads.

A model in the Hugging Face cache it is given loads with no download line;
a model missing from it is fetched with huggingface_hub's byte bars and
`Time spent downloading weights for ...`; offline, a miss fails the start.
"""

from __future__ import annotations

import re
from pathlib import Path

from hub_support import populate_hub
from sim_support import StartSim, physical_lines

MODEL = "Qwen/Qwen3.6-27B-FP8"
DOWNLOADED = re.compile(rb"Time spent downloading weights for Qwen/Qwen3\.6-27B-FP8: [\d.]+ seconds")


def downloads(stdout: bytes) -> int:
    return len(DOWNLOADED.findall(stdout))


def test_model_in_the_given_cache_loads_without_a_download(sim: StartSim, tmp_path: Path) -> None:
    populate_hub(tmp_path / "hf" / "hub", MODEL)
    s = sim(MODEL, env={"HF_HOME": str(tmp_path / "hf")})
    s.wait_ready()
    assert downloads(bytes(s.stdout)) == 0
    assert b"safetensors: " not in bytes(s.stderr) and b"config.json: " not in bytes(s.stderr)


def test_model_missing_from_the_cache_is_downloaded_once_per_start_with_hub_bars(sim: StartSim, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    hub.mkdir()
    s = sim(MODEL, env={"HF_HUB_CACHE": str(hub)})
    s.wait_ready()
    assert downloads(bytes(s.stdout)) == 1
    finished = [line.rsplit("\r", 1)[-1] for line in physical_lines(bytes(s.stderr)) if "100%|" in line and "B/s]" in line]
    names = sorted({line.split(":")[0] for line in finished})
    assert names == ["config.json", *(f"model-{k:05d}-of-00006.safetensors" for k in range(1, 7))], finished
    assert all(re.search(r"\| [\d.]+[kMG]?/[\d.]+[kMG]? \[[\d:]+<[\d:?]+, [\d.?]+[kMG]?B/s\]$", line) for line in finished), finished
    # The download is shown, not stored: nothing is written into a cache the stand-in has no weights for.
    assert list(hub.iterdir()) == []


def test_hf_hub_cache_wins_over_hf_home_as_in_huggingface_hub(sim: StartSim, tmp_path: Path) -> None:
    populate_hub(tmp_path / "elsewhere", MODEL)
    (tmp_path / "home").mkdir()
    s = sim(MODEL, env={"HF_HOME": str(tmp_path / "home"), "HF_HUB_CACHE": str(tmp_path / "elsewhere")})
    s.wait_ready()
    assert downloads(bytes(s.stdout)) == 0


def test_offline_with_the_model_missing_fails_the_start_as_an_unknown_model(sim: StartSim, tmp_path: Path) -> None:
    s = sim(MODEL, env={"HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"})
    assert s.wait_exit() == 1
    s.drain()
    assert b"ValueError: Invalid repository ID or local directory specified: 'Qwen/Qwen3.6-27B-FP8'." in bytes(s.stderr)
    assert downloads(bytes(s.stdout)) == 0


def test_a_local_model_directory_is_never_downloaded(sim: StartSim, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    s = sim(str(model), env={"HF_HOME": str(tmp_path / "hf")})
    s.wait_ready()
    assert b"Time spent downloading" not in bytes(s.stdout)
