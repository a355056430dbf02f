"""The Hugging Face cache as huggingface_hub finds it, and whether it holds a model.

gb10d and gb10d.sim each read the cache their own way (so that a mistake is
not shared by both sides of every cache test); both are held to the same
tables, written from huggingface_hub's rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.base.hfcache import cached_snapshot, hub_cache, is_repo_id, offline, repo_folder
from gb10d.sim import hub as sim_hub
from hub_support import COMMIT, populate_hub

HOME = "/home/alice"
READERS = ("gb10d", "sim")


def hub_dir(reader: str, env: dict[str, str]) -> str:
    return hub_cache(env, HOME) if reader == "gb10d" else sim_hub.hub_dir({**env, "HOME": HOME})


def snapshot(reader: str, hub: Path, model: str, revision: str = "main") -> Path | None:
    return cached_snapshot(hub, model, revision) if reader == "gb10d" else sim_hub.snapshot_with_config(str(hub), model, revision)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "/home/alice/.cache/huggingface/hub"),
        ({"XDG_CACHE_HOME": "/srv/cache"}, "/srv/cache/huggingface/hub"),
        ({"HF_HOME": "/srv/hf", "XDG_CACHE_HOME": "/srv/cache"}, "/srv/hf/hub"),
        ({"HUGGINGFACE_HUB_CACHE": "/srv/legacy", "HF_HOME": "/srv/hf"}, "/srv/legacy"),
        ({"HF_HUB_CACHE": "/srv/hub", "HUGGINGFACE_HUB_CACHE": "/srv/legacy", "HF_HOME": "/srv/hf"}, "/srv/hub"),
        ({"HF_HOME": "~/models"}, "/home/alice/models/hub"),
        ({"HF_HUB_CACHE": "$DATA/hub", "DATA": "/data"}, "/data/hub"),
        ({"HF_HOME": ""}, "/home/alice/.cache/huggingface/hub"),
    ],
)
@pytest.mark.parametrize("reader", READERS)
def test_hub_cache_follows_huggingface_hubs_order(reader: str, env: dict[str, str], expected: str) -> None:
    assert hub_dir(reader, env) == expected


@pytest.mark.parametrize(
    ("model", "repo"),
    [("Qwen/Qwen3.6-27B-FP8", True), ("gpt2", True), ("/srv/models/q", False), ("./q", False), ("~/q", False), ("a/b/c", False)],
)
def test_repo_ids_are_told_from_local_paths(model: str, repo: bool) -> None:
    assert is_repo_id(model) is repo
    assert sim_hub.names_a_repo(model) is repo


def test_repo_folder_is_huggingface_hubs_name() -> None:
    assert repo_folder("Qwen/Qwen3.6-27B-FP8") == "models--Qwen--Qwen3.6-27B-FP8"


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("ON", True), ("0", False), ("", False)])
def test_offline_reads_hf_hub_offline_as_huggingface_hub_does(value: str, expected: bool) -> None:
    assert offline({"HF_HUB_OFFLINE": value}) is expected


@pytest.mark.parametrize("reader", READERS)
def test_a_snapshot_with_config_json_is_a_hit_and_anything_less_is_not(reader: str, tmp_path: Path) -> None:
    folder = populate_hub(tmp_path, "Qwen/Qwen3.6-27B-FP8")
    assert snapshot(reader, tmp_path, "Qwen/Qwen3.6-27B-FP8") == folder
    assert snapshot(reader, tmp_path, "Qwen/Qwen3.6-27B-FP8", COMMIT) == folder
    assert snapshot(reader, tmp_path, "Qwen/Other") is None
    (folder / "config.json").unlink()
    assert snapshot(reader, tmp_path, "Qwen/Qwen3.6-27B-FP8") is None
