"""statefile: atomic replacement, so `gb10d status` never reads half a state."""

from __future__ import annotations

import json
import math
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gb10d.core.statefile import PHASE_WRITE_GAP_S, WRITE_EVERY_S, StateRecord, write_delay
from gb10d.machine.statefile import read_state, write_state


def serving_state(**changes: Any) -> StateRecord:
    state: dict[str, Any] = {
        "pid": 4242,
        "started_at": 1_764_680_000.0,
        "updated_at": 1_764_680_412.5,
        "state": "serving",
        "phase": "ready",
        "progress": {"shards_done": 66, "shards_total": 66},
        "model": "Qwen/Qwen3-235B-A22B-FP8",
        "served_names": ["qwen3"],
        "url": "http://0.0.0.0:8000",
        "attempt": 2,
        "max_attempts": 5,
        "gpu_memory_utilization": 0.49,
        "load_strategy": "eager",
        "memory": {"total_bytes": 128_526_778_368, "available_bytes": 65_821_179_904,
                   "free_bytes": 44_023_414_784, "cached_bytes": 21_474_836_480},
        "vllm_pid": 4250,
        "ready_at": 1_764_680_410.0,
        "last_failure": None,
        "status_text": "serving qwen3 on http://0.0.0.0:8000",
        "metrics_url": "http://127.0.0.1:9400/metrics",
    }
    state.update(changes)
    return StateRecord.from_json(state)


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_written_state_reads_back_equal(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, serving_state())
    assert read_state(path) == serving_state()


def test_missing_directory_is_created(tmp_path: Path) -> None:
    path = tmp_path / "run" / "gb10d" / "state.json"
    write_state(path, serving_state())
    assert read_state(path) == serving_state()


def test_rewrite_replaces_the_whole_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, serving_state(status_text="x" * 10_000))
    write_state(path, serving_state(state="stopped"))
    assert read_state(path) == serving_state(state="stopped")
    assert leftovers(tmp_path) == []


def test_state_file_is_readable_by_every_operator(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, serving_state())
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


@pytest.mark.parametrize("bad", [object(), math.nan])
def test_unserialisable_state_keeps_the_previous_file(tmp_path: Path, bad: object) -> None:
    path = tmp_path / "state.json"
    write_state(path, serving_state())
    with pytest.raises((TypeError, ValueError)):
        write_state(path, replace(serving_state(), gpu_memory_utilization=bad))  # type: ignore[arg-type]
    assert read_state(path) == serving_state()
    assert leftovers(tmp_path) == []


def test_unwritable_location_raises_oserror(tmp_path: Path) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("a file where the directory should be\n")
    with pytest.raises(OSError):
        write_state(blocker / "state.json", serving_state())
    assert blocker.read_text() == "a file where the directory should be\n"


def test_reader_never_sees_a_partial_file_while_the_writer_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, serving_state(attempt=0))
    done = threading.Event()

    def writer() -> None:
        for n in range(300):
            write_state(path, serving_state(attempt=n, status_text="y" * (n * 37 % 5000)))
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    seen: list[int] = []
    while not done.is_set():
        state = read_state(path)
        assert state is not None
        assert state.attempt is not None
        seen.append(state.attempt)
    thread.join()
    assert read_state(path) == serving_state(attempt=299, status_text="y" * (299 * 37 % 5000))
    assert seen == sorted(seen), "a later read never shows an older state"
    assert leftovers(tmp_path) == []


def test_missing_file_means_no_state(tmp_path: Path) -> None:
    assert read_state(tmp_path / "state.json") is None


@pytest.mark.parametrize("content", [b"", b"{\"pid\": 12", b"[1, 2]", b"\xff\xfe not utf-8"])
def test_unusable_content_means_no_state(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(content)
    assert read_state(path) is None


def test_unreadable_path_is_an_error_not_an_absent_state(tmp_path: Path) -> None:
    (tmp_path / "state.json").mkdir()
    with pytest.raises(OSError):
        read_state(tmp_path / "state.json")


def test_file_is_plain_json_for_other_tools(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_state(path, serving_state())
    assert json.loads(path.read_text(encoding="utf-8"))["state"] == "serving"


def test_a_new_phase_is_written_at_once_unless_one_was_written_a_moment_ago() -> None:
    assert write_delay(True, 5.0) == 0.0
    assert write_delay(True, 0.0) == PHASE_WRITE_GAP_S  # output flapping between phases costs one write per gap
    assert write_delay(False, 0.25) == WRITE_EVERY_S - 0.25
    assert write_delay(False, WRITE_EVERY_S) == 0.0
