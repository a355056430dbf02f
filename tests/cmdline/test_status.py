"""`gb10d status`: the summary of a running daemon and the systemctl-like exit status.

The command-line tests run the real `gb10d status` in a subprocess against a
state file whose pid is a real process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gb10d.base.errors import ConfigError
from gb10d.base.units import duration
from gb10d.cmdline.status import DEFAULT_STATE_FILE, render, state_file_path, status_config
from gb10d.core.statefile import StateRecord
from gb10d.machine.statefile import read_state, write_state
from harness import Daemon, NotifySocket, Setup, wait_until

NOW = 1_764_690_000.0


def state(**changes: Any) -> StateRecord:
    result: dict[str, Any] = {
        "pid": 4242,
        "started_at": NOW - 7000,
        "updated_at": NOW - 3,
        "state": "serving",
        "phase": "ready",
        "progress": {"shards_done": 66, "shards_total": 66},
        "model": "Qwen/Qwen3-235B-A22B-FP8",
        "served_names": ["qwen3", "default"],
        "url": "http://0.0.0.0:8000",
        "attempt": 2,
        "max_attempts": 5,
        "gpu_memory_utilization": 0.49,
        "load_strategy": "eager",
        "memory": {"total_bytes": 128 << 30, "available_bytes": 64 << 30, "free_bytes": 41 << 30,
                   "cached_bytes": 20 << 30},
        "memory_at": NOW - 6400,
        "vllm_pid": 4250,
        "ready_at": NOW - 200,
        "last_failure": {
            "cause": "free_memory",
            "message": "Free memory on device cuda:0 (61.3/119.7 GiB) on startup is less than desired GPU memory "
            "utilization (0.9, 107.73 GiB)",
            "action": "restarted with gpu_memory_utilization 0.49",
            "at": NOW - 6500,
        },
        "status_text": "serving qwen3 on http://0.0.0.0:8000",
        "metrics_url": "http://127.0.0.1:9400/metrics",
    }
    result.update(changes)
    return StateRecord.from_json(result)


def rows(text: str) -> dict[str, str]:
    """`Label: value` lines of the summary, keyed by label."""
    found: dict[str, str] = {}
    for line in text.splitlines()[1:]:
        label, sep, value = line.partition(": ")
        if sep and label.strip():
            found[label.strip()] = value
    return found


# --- rendering ---------------------------------------------------------------


def test_summary_of_a_serving_daemon_shows_every_fact() -> None:
    text = render(state(), NOW, alive=True)
    assert text.splitlines()[0] == "gb10d is running: serving"
    r = rows(text)
    assert r["Phase"] == "ready"
    assert r["Model"] == "Qwen/Qwen3-235B-A22B-FP8 (served as qwen3, default)"
    assert r["URL"] == "http://0.0.0.0:8000"
    assert r["Attempt"] == "2 of 5"
    assert r["GPU memory"] == "gpu_memory_utilization 0.49, load strategy eager"
    assert r["Memory"] == (
        "128.0 GiB total, 64.0 GiB available, 41.0 GiB free, 20.0 GiB page cache "
        "(measured 1h 46min ago, before the attempt started; free -g shows it now)"
    )
    assert r["PID"] == "4242 (gb10d), 4250 (vLLM)"
    assert r["Started"].endswith("; 1h 56min ago")
    assert r["Ready"].endswith("; 3min 20s ago")
    assert r["Last failure"] == "free_memory, 1h 48min ago"
    assert r["Action"] == "restarted with gpu_memory_utilization 0.49"
    assert "(61.3/119.7 GiB)" in text
    assert r["Status"] == "serving qwen3 on http://0.0.0.0:8000"
    assert r["Metrics"] == "http://127.0.0.1:9400/metrics"


def test_summary_while_loading_shows_shard_progress_and_no_ready_time() -> None:
    text = render(
        state(state="starting", phase="loading_weights", progress={"shards_done": 12, "shards_total": 66},
              ready_at=None, last_failure=None),
        NOW,
        alive=True,
    )
    r = rows(text)
    assert r["Phase"] == "loading_weights, 12/66 shards (18%)"
    assert "Ready" not in r and "Last failure" not in r and "Action" not in r


def test_summary_on_either_machine_of_a_pair_shows_the_pair() -> None:
    head_cluster = {"role": "head", "head_address": "10.0.0.1:6379", "node_ip": "10.0.0.1", "interface": "enp1s0f0np0",
                    "nodes_wanted": 2, "error": None, "nodes": [{"ip": "10.0.0.1", "head": True, "gpus": 1.0}, {"ip": "10.0.0.2", "head": False, "gpus": 1.0}]}
    r = rows(render(state(cluster=head_cluster), NOW, alive=True))
    assert r["Cluster"] == "head of a 2-machine Ray cluster; this machine is 10.0.0.1 on enp1s0f0np0"
    assert r["Machines"] == "2 of 2 with a GPU up: 10.0.0.1 (head), 10.0.0.2"
    worker_cluster = {**head_cluster, "role": "worker", "node_ip": "10.0.0.2", "nodes": [], "error": "Ray's GCS at 10.0.0.1:6379 does not answer"}
    r = rows(render(state(state="joining", cluster=worker_cluster), NOW, alive=True))
    assert r["Cluster"] == "worker of a 2-machine Ray cluster headed by 10.0.0.1:6379; this machine is 10.0.0.2 on enp1s0f0np0"
    assert r["Machines"] == "Ray's GCS at 10.0.0.1:6379 does not answer"
    assert "Cluster" not in rows(render(state(), NOW, alive=True))


def test_summary_of_a_dead_daemon_says_so_and_keeps_the_last_known_facts() -> None:
    text = render(state(), NOW, alive=False)
    assert text.splitlines()[0] == "gb10d is not running (pid 4242 has exited; last state: serving, last update 3s ago)"
    assert rows(text)["Last failure"] == "free_memory, 1h 48min ago"


def test_a_daemon_that_is_not_running_is_not_shown_ready() -> None:
    # Killed while serving (its state file still says serving), or stopped: no "Ready: since".
    assert "Ready" not in rows(render(state(), NOW, alive=False))
    assert "Ready" not in rows(render(state(state="stopped"), NOW, alive=True))
    assert "Ready" in rows(render(state(), NOW, alive=True))


def test_a_memory_snapshot_of_unknown_age_says_so() -> None:
    r = rows(render(state(memory_at=None), NOW, alive=True))
    assert r["Memory"].endswith("page cache (measured at an unknown time, before the attempt started; free -g shows it now)")


def test_summary_without_state_file() -> None:
    assert render(None, NOW, alive=False) == "gb10d is not running (no state file)\n"


def test_odd_field_types_are_skipped_not_fatal() -> None:
    text = render(
        StateRecord.from_json(
            {"pid": "4242", "state": 7, "memory": "lots", "progress": [1], "served_names": "qwen3", "attempt": True,
             "last_failure": "yes", "model": "m"}
        ),
        NOW,
        alive=True,
    )
    assert text.splitlines()[0] == "gb10d is running: unknown"
    assert rows(text) == {"Model": "m"}


def test_summary_is_ascii_for_any_terminal_or_status_line() -> None:
    assert render(state(), NOW, alive=True).isascii()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.9, "59s"), (61, "1min 1s"), (3600, "1h 0min"), (7000, "1h 56min"), (86400, "1 day 0h"),
     (3 * 86400 + 7200, "3 days 2h"), (-5, "0s")],
)
def test_durations_read_like_systemd(seconds: float, text: str) -> None:
    assert duration(seconds) == text


# --- the command ----------------------------------------------------------------


def gb10d(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "gb10d", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.fixture
def daemon_pid() -> Iterator[subprocess.Popen[bytes]]:
    """A real process standing in for the daemon; the test may kill it."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=60)


@pytest.mark.slow
def test_running_daemon_is_summarised_with_exit_0(tmp_path: Path, daemon_pid: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "state.json"
    write_state(path, state(pid=daemon_pid.pid))
    result = gb10d("status", "--state-file", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "gb10d is running: serving"
    assert "Attempt: 2 of 5" in result.stdout


@pytest.mark.slow
def test_exit_3_once_the_daemon_process_is_gone(tmp_path: Path, daemon_pid: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "state.json"
    write_state(path, state(pid=daemon_pid.pid))
    daemon_pid.kill()
    daemon_pid.wait(timeout=60)
    result = gb10d("status", "--state-file", str(path))
    assert result.returncode == 3
    assert result.stdout.startswith(f"gb10d is not running (pid {daemon_pid.pid} has exited;")


@pytest.mark.slow
def test_exit_3_when_the_state_says_stopped(tmp_path: Path, daemon_pid: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "state.json"
    write_state(path, state(pid=daemon_pid.pid, state="stopped"))
    result = gb10d("status", "--state-file", str(path))
    assert result.returncode == 3
    assert "state is stopped" in result.stdout.splitlines()[0]


@pytest.mark.slow
def test_exit_3_without_state_file(tmp_path: Path) -> None:
    result = gb10d("status", "--state-file", str(tmp_path / "state.json"))
    assert result.returncode == 3
    assert result.stdout == "gb10d is not running (no state file)\n"
    assert result.stderr == ""


@pytest.mark.slow
def test_json_output_is_one_object_with_running_flag(tmp_path: Path, daemon_pid: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "state.json"
    write_state(path, state(pid=daemon_pid.pid))
    result = gb10d("status", "--json", "--state-file", str(path))
    assert result.returncode == 0
    answer = json.loads(result.stdout)
    assert answer == {**state(pid=daemon_pid.pid).to_json(), "running": True, "state_file": str(path)}


@pytest.mark.slow
def test_json_output_when_not_running_gives_the_reason(tmp_path: Path) -> None:
    result = gb10d("status", "--json", "--state-file", str(tmp_path / "state.json"))
    assert result.returncode == 3
    assert json.loads(result.stdout) == {
        "running": False, "state_file": str(tmp_path / "state.json"), "reason": "no state file"
    }


@pytest.mark.slow
def test_unreadable_state_file_exits_4_without_traceback(tmp_path: Path) -> None:
    (tmp_path / "state.json").mkdir()
    result = gb10d("status", "--state-file", str(tmp_path / "state.json"))
    assert result.returncode == 4
    assert result.stderr.startswith(f"gb10d: cannot read the state file {tmp_path / 'state.json'}:")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_state_file_location_comes_from_the_config(tmp_path: Path, daemon_pid: subprocess.Popen[bytes]) -> None:
    path = tmp_path / "run" / "state.json"
    config = tmp_path / "gb10d.toml"
    config.write_text(
        f'[vllm]\nmodel = "m"\nexecutable = "{sys.executable}"\n\n[daemon]\nstate_file = "{path}"\n',
        encoding="utf-8",
    )
    write_state(path, state(pid=daemon_pid.pid))
    result = gb10d("status", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[0] == "gb10d is running: serving"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--json",), ("--all",)])
def test_a_named_config_that_does_not_load_is_the_answer_with_exit_78(tmp_path: Path, extra: tuple[str, ...]) -> None:
    # Falling back to the default state file would show another instance's status as this one's.
    config = tmp_path / "gb10d.toml"
    config.write_text("[vllm\n", encoding="utf-8")
    result = gb10d("status", *extra, "--config", str(config))
    assert result.returncode == 78
    assert result.stdout == ""
    assert str(config) in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_config_named_by_gb10d_config_that_does_not_load_is_the_answer_with_exit_78(tmp_path: Path) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text("[vllm\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "gb10d", "status"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "GB10D_CONFIG": str(config)},
    )
    assert result.returncode == 78 and result.stdout == ""
    assert str(config) in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_named_state_file_is_read_whatever_the_config(tmp_path: Path, daemon_pid: subprocess.Popen[bytes]) -> None:
    config = tmp_path / "gb10d.toml"
    config.write_text("[vllm\n", encoding="utf-8")
    path = tmp_path / "state.json"
    write_state(path, state(pid=daemon_pid.pid))
    result = gb10d("status", "--state-file", str(path), "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "gb10d is running: serving"


def test_a_default_config_that_does_not_load_falls_back_to_the_default_state_file(tmp_path: Path) -> None:
    # The daemon may run from an earlier, valid version of the file; nobody named this one.
    config = tmp_path / "gb10d.toml"
    config.write_text("[vllm\n", encoding="utf-8")
    assert status_config(config, named=False) is None
    assert state_file_path(None, None) == DEFAULT_STATE_FILE
    with pytest.raises(ConfigError):
        status_config(config, named=True)


# --- against a real `gb10d run` with gb10d.sim ------------------------------------


@pytest.mark.slow
def test_status_of_a_serving_daemon_then_exit_3_after_it_stops(tmp_path: Path, notify: NotifySocket) -> None:
    setup = Setup(tmp_path)
    daemon = Daemon(setup, notify)
    try:
        notify.wait_for(lambda m: m.get("READY") == "1", 120)
        result = gb10d("status", "--config", str(setup.config))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.splitlines()[0] == "gb10d is running: serving"
        r = rows(result.stdout)
        assert r["Phase"] == "ready"
        assert r["Model"] == "/srv/models/tiny-llama (served as tiny)"
        assert r["URL"] == f"http://127.0.0.1:{setup.port}"
        assert r["Attempt"] == "1 of 3"
        assert r["GPU memory"].startswith("gpu_memory_utilization 0.8")
        assert r["Memory"].startswith("121.7 GiB total")
        # gb10d measured it when the attempt started, and says when: a snapshot, not the memory now.
        assert re.search(r" page cache \(measured \d+s ago, before the attempt started; free -g shows it now\)$", r["Memory"]), r["Memory"]
        answer = json.loads(gb10d("status", "--json", "--config", str(setup.config)).stdout)
        assert answer["running"] is True and answer["pid"] == daemon.proc.pid
        assert isinstance(answer["vllm_pid"], int) and answer["ready_at"] is not None
    finally:
        daemon.stop()
        daemon.kill_everything()
    result = gb10d("status", "--config", str(setup.config))
    assert result.returncode == 3
    assert result.stdout.startswith("gb10d is not running (")


@pytest.mark.slow
def test_status_while_weights_load_shows_the_shard_count(tmp_path: Path, notify: NotifySocket) -> None:
    # The sim stops at shard 3 of 6 and the stall timeout is far away, so the phase holds still.
    setup = Setup(tmp_path, scenario="stall_at=3", extra={"startup.stall_timeout_s": 300.0})
    daemon = Daemon(setup, notify)
    try:
        notify.wait_for(lambda m: "loading weights 3/6" in m.get("STATUS", ""), 120)
        # The state file follows the same change the STATUS= line reported.
        wait_until(
            lambda: (record := read_state(setup.state_file)) is not None and record.progress is not None and record.progress.shards_done == 3,
            60,
            "state file at shard 3",
        )
        result = gb10d("status", "--state-file", str(setup.state_file))
        assert result.returncode == 0
        assert result.stdout.splitlines()[0] == "gb10d is running: starting"
        assert rows(result.stdout)["Phase"] == "loading_weights, 3/6 shards (50%)"
        assert "Ready" not in rows(result.stdout)
    finally:
        daemon.stop()
        daemon.kill_everything()
