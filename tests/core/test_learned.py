"""Learned settings: kept for exactly the config they were learned with, in a file that is never a crash.

The core tests are tables of config changes; the file tests use real files
in tmp_path; `gb10d forget` runs as a real subprocess.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tomllib
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
import tomli_w

from config_support import make_config, write_config
from gb10d.base.command import Tunables
from gb10d.base.config import Config
from gb10d.core.learned import LearnedEntry, LearnedState, applicable, fingerprint, merge, remember
from gb10d.daemon.learnedfile import LearnedFileError, forget, load, save

AT = datetime(2026, 12, 2, 3, 14, 15, tzinfo=UTC)
WHY = "free memory 103.45 of 121.69 GiB below 0.92 requested"


RUNNING = {"vllm": {
    "model": "org/model",
    "executable": "/srv/vllm/bin/vllm",
    "gpu_memory_utilization": 0.92,
    "args": {"max_model_len": 32768, "kv-cache-dtype": "fp8"},
}}
config = partial(make_config, RUNNING)


def lowered(cfg: Config, utilization: float = 0.85) -> LearnedEntry:
    entry = remember(cfg, Tunables.from_config(cfg.vllm).with_(gpu_memory_utilization=utilization), WHY, AT)
    assert entry is not None
    return entry


# --- the core -------------------------------------------------------------------


def test_a_learned_utilization_applies_to_the_same_config_and_replaces_only_what_was_learned() -> None:
    cfg = config()
    entry = lowered(cfg)
    verdict = applicable(LearnedState(entry), config())
    assert verdict.entry == entry
    assert "starting from the settings learned for this config: gpu_memory_utilization 0.85" in verdict.reason
    assert WHY in verdict.reason
    assert merge(Tunables.from_config(cfg.vllm), entry) == Tunables(0.85, None, 32768)


def test_every_learned_tunable_is_kept_and_merged() -> None:
    cfg = config()
    tunables = Tunables(0.7, "prefetch", 16384)
    entry = remember(cfg, tunables, "stalled at shard 3/66 with eager loading", AT)
    assert entry is not None
    assert entry.values() == "gpu_memory_utilization 0.7, safetensors-load-strategy prefetch, max-model-len 16384"
    assert entry.learned_at == "2026-12-02T03:14:15+00:00"
    assert merge(Tunables.from_config(cfg.vllm), entry) == tunables


def test_nothing_is_learned_when_the_config_values_worked() -> None:
    cfg = config()
    assert remember(cfg, Tunables.from_config(cfg.vllm), WHY, AT) is None


def test_nothing_learned_gives_no_entry_and_nothing_to_say() -> None:
    verdict = applicable(LearnedState(), config())
    assert verdict.entry is None
    assert verdict.reason == ""


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        pytest.param({"gpu_memory_utilization": 0.95}, "vllm.gpu_memory_utilization 0.92 -> 0.95", id="utilization"),
        pytest.param({"model": "org/other"}, 'vllm.model "org/model" -> "org/other"', id="model"),
        pytest.param({"served_model_name": "chat"}, 'vllm.served_model_name ["org/model"] -> ["chat"]', id="served_name"),
        pytest.param({"args": {"max_model_len": 65536, "kv-cache-dtype": "fp8"}}, "vllm.args.max-model-len 32768 -> 65536", id="max_model_len"),
        pytest.param({"args": {"max_model_len": 32768, "kv-cache-dtype": "auto"}}, 'vllm.args.kv-cache-dtype "fp8" -> "auto"', id="kv_cache_dtype"),
        pytest.param({"args": {"max_model_len": 32768, "kv-cache-dtype": "fp8", "safetensors-load-strategy": "lazy"}},
                     'vllm.args.safetensors-load-strategy (not set) -> "lazy"', id="load_strategy"),
        pytest.param({"args": {"max_model_len": 32768, "kv-cache-dtype": "fp8", "speculative-config": {"method": "mtp", "num_speculative_tokens": 2}}},
                     'vllm.args.speculative-config (not set) -> {"method": "mtp", "num_speculative_tokens": 2}', id="speculative_config"),
        pytest.param({"extra_args": ["--enforce-eager"]}, 'vllm.extra_args (not set) -> ["--enforce-eager"]', id="extra_args"),
        pytest.param({"executable": None, "venv": "/srv/vllm-0.24"}, 'vllm.venv (not set) -> "/srv/vllm-0.24"', id="another_vllm"),
    ],
)
def test_changing_a_setting_that_matters_discards_what_was_learned_naming_the_key(changed: dict[str, Any], named: str) -> None:
    entry = lowered(config())
    verdict = applicable(LearnedState(entry), config(vllm=changed))
    assert verdict.entry is None
    assert named in verdict.reason
    assert verdict.reason.startswith("discarding the settings learned 2026-12-02T03:14:15+00:00 (gpu_memory_utilization 0.85)")
    assert verdict.reason.endswith("starting from the config's values")


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param({"port": 8001, "host": "127.0.0.1"}, id="where_vllm_listens"),
        pytest.param({"args": {"max-model-len": 32768, "kv_cache_dtype": "fp8"}}, id="flags_respelled"),
        pytest.param({"args": {"max_model_len": 32768, "kv-cache-dtype": "fp8", "api-key": "sk-rotated"}}, id="api_key"),
        pytest.param({"env": {"VLLM_LOGGING_LEVEL": "DEBUG"}}, id="environment"),
    ],
)
def test_changing_a_setting_that_does_not_matter_keeps_what_was_learned(changed: dict[str, Any]) -> None:
    before = config(vllm={"args": {"max_model_len": 32768, "kv-cache-dtype": "fp8", "api-key": "sk-old"}}) if "api-key" in str(changed) else config()
    entry = lowered(before)
    assert applicable(LearnedState(entry), config(vllm=changed)).entry == entry
    assert fingerprint(before) == fingerprint(config(vllm=changed))


def test_an_api_key_is_not_stored_with_what_was_learned(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save(path, LearnedState(lowered(config(vllm={"args": {"api-key": "sk-secret-1"}}))))
    assert "sk-secret-1" not in path.read_text()


# --- the file ---------------------------------------------------------------------


def test_save_and_load_round_trip_in_a_new_directory(tmp_path: Path) -> None:
    path = tmp_path / "var" / "lib" / "gb10d" / "state.toml"
    cfg = config(vllm={"args": {"max_model_len": 32768, "speculative-config": {"method": "mtp", "num_speculative_tokens": 2}}})
    entry = remember(cfg, Tunables(0.85, "prefetch", 32768), WHY, AT)
    assert entry is not None
    save(path, LearnedState(entry))
    assert load(path) == LearnedState(entry)
    assert applicable(load(path), cfg).entry == entry
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["state.toml"]


def test_saving_again_replaces_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save(path, LearnedState(lowered(config(), 0.85)))
    save(path, LearnedState(lowered(config(), 0.8)))
    state = load(path)
    assert state.entry is not None and state.entry.gpu_memory_utilization == 0.8


def test_the_file_is_readable_toml_saying_what_when_why_and_for_what(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save(path, LearnedState(lowered(config())))
    text = path.read_text()
    for expected in ("gpu_memory_utilization = 0.85", 'learned_at = "2026-12-02T03:14:15+00:00"', f'reason = "{WHY}"',
                     '"vllm.model" = "org/model"', '"vllm.gpu_memory_utilization" = 0.92', '"vllm.args.kv-cache-dtype" = "fp8"'):
        assert expected in text


def test_a_missing_or_empty_file_means_nothing_learned(tmp_path: Path) -> None:
    assert load(tmp_path / "missing.toml") == LearnedState()
    (tmp_path / "empty.toml").write_text("")
    assert load(tmp_path / "empty.toml") == LearnedState()


def _damaged(text: str | bytes, tmp_path: Path) -> Path:
    path = tmp_path / "state.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _edited(changes: dict[str, Any], tmp_path: Path) -> Path:
    """A file as gb10d saves it, then with keys of [learned] changed (None removes a key)."""
    path = tmp_path / "state.toml"
    save(path, LearnedState(lowered(config())))
    table = tomllib.loads(path.read_text())["learned"]
    for key, value in changes.items():
        if value is None:
            del table[key]
        else:
            table[key] = value
    path.write_text(tomli_w.dumps({"learned": table}))
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        pytest.param(lambda d: _damaged("[learned\ngpu_memory_utilization = 0.8\n", d), "are not valid TOML", id="syntax"),
        pytest.param(lambda d: _damaged(b"\xff\xfe[learned]", d), "are not UTF-8 text", id="binary"),
        pytest.param(lambda d: _edited({"gpu_memory_utilization": "0.8"}, d),
                     "learned.gpu_memory_utilization: Input should be a valid number", id="wrong_type"),
        pytest.param(lambda d: _edited({"gpu_memory_utilization": 1.5}, d),
                     "learned.gpu_memory_utilization: Input should be less than or equal to 1", id="out_of_range"),
        pytest.param(lambda d: _edited({"load_strategy": "fastest"}, d),
                     "learned.load_strategy: Value error, must be one of eager, lazy, prefetch, torchao", id="unknown_strategy"),
        pytest.param(lambda d: _edited({"fingerprint": None}, d), "learned.fingerprint: Field required", id="missing_key"),
        pytest.param(lambda d: _edited({"surprise": 1}, d), "learned.surprise: Extra inputs are not permitted", id="unknown_key"),
        pytest.param(lambda d: _damaged("learned = 3\n", d), "learned: Input should be a valid dictionary", id="not_a_table"),
    ],
)
def test_a_damaged_file_is_one_line_of_reason_and_nothing_learned(tmp_path: Path, make: Callable[[Path], Path], says: str) -> None:
    path = make(tmp_path)
    state = load(path)
    assert state.entry is None
    assert state.problem is not None and "\n" not in state.problem
    assert str(path) in state.problem and says in state.problem
    assert "starting from the config's values" in state.problem


def test_a_directory_in_place_of_the_file_is_a_reason_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "state.toml").mkdir()
    state = load(tmp_path / "state.toml")
    assert state.entry is None and state.problem is not None
    assert state.problem.startswith(f"cannot read the learned settings {tmp_path / 'state.toml'}: Is a directory")


def test_saving_where_no_directory_can_be_made_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "lib").write_text("a file, not a directory")
    with pytest.raises(LearnedFileError, match=r"^cannot save the learned settings to .*lib/gb10d/state.toml: Not a directory$"):
        save(tmp_path / "lib" / "gb10d" / "state.toml", LearnedState(lowered(config())))


def test_forget_removes_the_file_and_reports_whether_there_was_one(tmp_path: Path) -> None:
    path = tmp_path / "state.toml"
    save(path, LearnedState(lowered(config())))
    assert forget(path) is True
    assert not path.exists()
    assert forget(path) is False


# --- gb10d forget -------------------------------------------------------------------


def gb10d(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "gb10d", *args], capture_output=True, text=True, timeout=60)


# Root may remove any file; without its capabilities it is held to the file modes like anyone else.
WITHOUT_ROOT_POWERS = ("setpriv", "--bounding-set=-all", "--inh-caps=-all") if os.geteuid() == 0 else ()


def running_config(tmp_path: Path, learned_file: Path) -> Path:
    """RUNNING as a gb10d.toml, its learned settings kept in learned_file."""
    return write_config(tmp_path / "gb10d.toml", RUNNING, daemon={"learned_file": str(learned_file)})


@pytest.mark.slow
def test_gb10d_forget_clears_what_was_learned_and_says_what_it_was(tmp_path: Path) -> None:
    learned = tmp_path / "lib" / "state.toml"
    save(learned, LearnedState(lowered(config())))
    result = gb10d("forget", "--config", str(running_config(tmp_path, learned)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"removed {learned}: forgot the settings gpu_memory_utilization 0.85 (learned 2026-12-02T03:14:15+00:00: {WHY}).")
    assert "begins from the config's values" in result.stdout
    assert not learned.exists()

    again = gb10d("forget", "--config", str(running_config(tmp_path, learned)))
    assert again.returncode == 0, again.stderr
    assert again.stdout == f"nothing was learned: {learned} does not exist\n"


@pytest.mark.slow
def test_gb10d_forget_removes_a_damaged_file_too(tmp_path: Path) -> None:
    learned = _damaged("not toml at all [", tmp_path)
    result = gb10d("forget", "--config", str(running_config(tmp_path, learned)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"removed {learned}: it held nothing gb10d could use.")
    assert not learned.exists()


@pytest.mark.slow
def test_gb10d_forget_of_a_named_file_needs_no_valid_config(tmp_path: Path) -> None:
    learned = tmp_path / "state.toml"
    save(learned, LearnedState(lowered(config())))
    (tmp_path / "gb10d.toml").write_text("[vllm\n")
    result = gb10d("forget", "--config", str(tmp_path / "gb10d.toml"), "--learned-file", str(learned))
    assert result.returncode == 0, result.stderr
    assert not learned.exists()


@pytest.mark.slow
@pytest.mark.skipif(bool(WITHOUT_ROOT_POWERS) and shutil.which("setpriv") is None, reason="root without setpriv may remove any file")
def test_gb10d_forget_without_permission_says_who_may(tmp_path: Path) -> None:
    directory = tmp_path / "lib"
    learned = directory / "state.toml"
    save(learned, LearnedState(lowered(config())))
    directory.chmod(0o555)
    try:
        result = gb10d("forget", "--config", str(running_config(tmp_path, learned)), prefix=WITHOUT_ROOT_POWERS)
    finally:
        directory.chmod(0o755)
    assert result.returncode == 1
    assert result.stderr == f"gb10d: cannot remove {learned}: Permission denied; run as root or as the gb10d user\n"
    assert learned.exists()
