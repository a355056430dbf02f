"""A share that cannot hold the model: weights on disk plus one max_model_len sequence's KV cache, warned about before the start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gb10d.base.units import GIB
from gb10d.core.modelfit import ModelOnDisk, kv_bytes_per_token, max_model_len, share_warning
from gb10d.daemon.lab import write_meminfo
from gb10d.machine.memory import model_on_disk
from harness import Daemon, NotifySocket, Setup

# Qwen3-Embedding-8B's figures: 36 layers, 8 KV heads of 128, bfloat16, 40960 positions.
QWEN3_8B: dict[str, Any] = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                            "hidden_size": 4096, "torch_dtype": "bfloat16", "max_position_embeddings": 40960}
TOTAL = int(119.7 * GIB)


def test_the_kv_cache_of_a_token_follows_from_the_attention_layers_heads_and_dtype() -> None:
    assert kv_bytes_per_token(QWEN3_8B, None) == 2 * 36 * 8 * 128 * 2
    assert kv_bytes_per_token(QWEN3_8B, "fp8") == 2 * 36 * 8 * 128
    hybrid = {**QWEN3_8B, "num_hidden_layers": 4, "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
    assert kv_bytes_per_token({"text_config": hybrid}, None) == 2 * 1 * 8 * 128 * 2
    assert kv_bytes_per_token({"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, "auto") == 61 * 576 * 2
    assert kv_bytes_per_token({"architectures": ["X"]}, None) is None


@pytest.mark.parametrize(("arg", "length"), [(None, 40960), (32768, 32768), ("32k", 32000), ("32K", 32768), ("auto", None)])
def test_max_model_len_is_read_as_vllm_reads_it(arg: Any, length: int | None) -> None:
    assert max_model_len(arg, QWEN3_8B) == length


def test_a_share_that_cannot_hold_weights_and_one_sequence_is_a_warning_with_the_numbers_and_both_fixes() -> None:
    warning = share_warning(ModelOnDisk(int(15.1 * GIB), QWEN3_8B), 0.1, TOTAL, 32768, None)
    assert warning == (
        "the share of 0.1 (11.97 GiB of 119.70 GiB) cannot hold the weights (15.10 GiB on disk) plus the KV cache of one "
        "32768-token sequence (4.50 GiB): 19.60 GiB; vLLM would load for minutes and then exit with no_kv_memory; "
        "raise vllm.gpu_memory_utilization to at least 0.17"
    )
    lower = share_warning(ModelOnDisk(int(10 * GIB), QWEN3_8B), 0.1, TOTAL, 32768, None)
    assert lower is not None and lower.endswith("raise vllm.gpu_memory_utilization to at least 0.13 or lower max_model_len to at most 14345")


def test_a_model_that_fits_or_whose_size_is_unknown_gets_no_warning() -> None:
    assert share_warning(ModelOnDisk(int(15.1 * GIB), QWEN3_8B), 0.3, TOTAL, 32768, None) is None
    assert share_warning(ModelOnDisk(0, QWEN3_8B), 0.1, TOTAL, 32768, None) is None


def model_dir(root: Path, weights_gib: float) -> Path:
    """A local model directory whose safetensors take `weights_gib` on disk (sparse: nothing is written)."""
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    with open(model / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(int(weights_gib * GIB))
    return model


def test_a_cache_holding_two_revisions_counts_the_weights_of_the_one_refs_main_names(tmp_path: Path) -> None:
    repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-8B"
    for commit, weights_gib in (("a" * 40, 15.1), ("b" * 40, 16.0)):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(QWEN3_8B))
        with open(snapshot / "model-00001-of-00001.safetensors", "wb") as f:
            f.truncate(int(weights_gib * GIB))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    found = model_on_disk(("Qwen/Qwen3-8B", {"HF_HOME": str(tmp_path / "hf")}))
    assert found is not None and found.weights == int(16.0 * GIB), "the revision vLLM loads, counted once"


@pytest.mark.slow
def test_check_config_warns_and_passes_when_the_share_cannot_hold_the_model(tmp_path: Path) -> None:
    from gb10d.sim import make_venv

    make_venv(tmp_path / "venv")
    write_meminfo(tmp_path / "meminfo", 119.7, 110.0, None)
    config = tmp_path / "gb10d.toml"
    config.write_text(f'[vllm]\nvenv = "{tmp_path / "venv"}"\nmodel = "{model_dir(tmp_path, 15.1)}"\ngpu_memory_utilization = 0.1\n'
                      f'args = {{ max_model_len = 32768 }}\n\n[memory]\nmeminfo_path = "{tmp_path / "meminfo"}"\n')
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    done = subprocess.run([sys.executable, "-m", "gb10d", "check-config", "--config", str(config)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "gb10d: warning: vllm.gpu_memory_utilization: the share of 0.1 (11.97 GiB of 119.70 GiB) cannot hold the weights (15.10 GiB on disk)" in done.stderr


@pytest.mark.slow
def test_the_preflight_warns_in_the_journal_before_a_start_that_ends_in_no_kv_memory_and_still_starts(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    model = model_dir(tmp_path, 96.0)
    setup = Setup(tmp_path / "deploy", extra={"vllm.model": str(model), "vllm.args": {"max_model_len": 32768}})
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    warned = daemon.wait_line(r"<4>gb10d: preflight: the share of 0\.8 \(97\.35 GiB of 121\.69 GiB\) cannot hold the weights \(96\.00 GiB on disk\)")
    assert "raise vllm.gpu_memory_utilization to at least 0.83" in warned.string
    # A warning, not a refusal: vLLM starts, loads, and only then finds no room for the KV cache.
    daemon.wait_line(r"gb10d: started vLLM")
    notify.wait_for(lambda m: m.get("STATUS", "").startswith("failed: no memory is left for the KV cache"), 90)
