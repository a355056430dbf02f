"""An instance that parks by sleep (on_demand.park = "sleep"), run as real `gb10d run` over gb10d.sim, no front.

vLLM's development endpoints are on for such an instance, and anyone who reaches its port can put it to sleep: asleep,
it answers /health and /v1/models 200 and holds every request. gb10d's liveness watch notices, says so in one
line, and wakes it as it wakes a vLLM it parked itself. A sleep gb10d did ask for (the front's park over the
control socket) shows as asleep in `gb10d status --all`, the memory ledger's view.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gb10d.core.statefile import DaemonState
from gb10d.daemon.control import ask
from gb10d.machine.statefile import read_state
from gb10d.vllm.sleepmode import control_path
from harness import Daemon, Setup, wait_until

pytestmark = pytest.mark.slow

LIVENESS = {"health_interval_s": 0.5, "idle_probe_interval_s": 1.0, "probe_timeout_s": 5.0, "progress_timeout_s": 10.0}


def start(root: Path, utilization: float) -> Daemon:
    ledger = root / "ledger"
    ledger.mkdir()
    extra = {"on_demand": {"park": "sleep"}, "liveness": LIVENESS, "memory.ledger_dir": str(ledger)}
    daemon = Daemon(Setup(root, utilization=utilization, extra=extra), None)
    daemon.wait_line(r"vLLM is ready after")
    return daemon


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[Daemon]:
    # A level-1 sleep keeps a host copy of the weights on GB10, which its wake does not give back: at a share this
    # small, the weights fit twice.
    daemon = start(tmp_path, utilization=0.3)
    try:
        yield daemon
    finally:
        daemon.kill_everything()


def state_of(daemon: Daemon) -> DaemonState | None:
    record = read_state(daemon.setup.state_file)
    return record.state if record is not None else None


def answers(daemon: Daemon) -> str:
    """A completion sent straight to vLLM's port: its text (it must answer 200)."""
    reply = httpx.post(
        f"http://127.0.0.1:{daemon.setup.port}/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 4}, timeout=60,
    )
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def test_a_sleep_someone_else_asked_vllm_for_is_told_and_vllm_is_woken_and_serves_again(sleeper: Daemon) -> None:
    before = answers(sleeper)
    slept = httpx.post(f"http://127.0.0.1:{sleeper.setup.port}/sleep", params={"level": "1"}, timeout=30)
    assert slept.status_code == 200, "straight to vLLM's port, past gb10d and its front"
    told = sleeper.wait_line(
        r"<4>gb10d: vLLM is asleep, and gb10d did not ask it to sleep \(someone called /sleep on its port (\d+) directly, "
        r"not through gb10d or its front\): (.*); asleep, it holds every request unanswered: waking it"
    )
    assert int(told[1]) == sleeper.setup.port and told[2], "the port, and the evidence"
    sleeper.wait_line(r"woke vLLM in [\d.]+ s \(weights, reload_weights, kv_cache\) and checked it")
    wait_until(lambda: state_of(sleeper) is DaemonState.SERVING, 60, "serving")
    assert answers(sleeper) == before, "it serves again, as before the sleep"
    assert httpx.get(f"http://127.0.0.1:{sleeper.setup.port}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    assert len([line for line in sleeper.lines if "started vLLM as" in line]) == 1, "woken, not restarted"


def status_all(daemon: Daemon) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gb10d", "--config", str(daemon.setup.config), "status", "--all"], capture_output=True, text=True, timeout=60,
    )
    return done.stdout


def test_an_instance_parked_by_sleep_shows_asleep_in_the_memory_ledger(sleeper: Daemon) -> None:
    socket = control_path(sleeper.setup.state_file)
    assert "serving" in status_all(sleeper).splitlines()[2]
    assert asyncio.run(ask(socket, "park")) == "ok"
    wait_until(lambda: state_of(sleeper) is DaemonState.ASLEEP, 60, "asleep")
    row = status_all(sleeper).splitlines()[2].split()
    assert row[1] == "asleep" and "serving" not in row, row
    assert " ".join(row[2:]).startswith("parked by vLLM's level-2 sleep"), row
    assert asyncio.run(ask(socket, "wake")) == "ok"
    wait_until(lambda: state_of(sleeper) is DaemonState.SERVING, 60, "serving")
    assert status_all(sleeper).splitlines()[2].split()[1] == "serving"
    assert not sleeper.own_lines() or not any("did not ask it to sleep" in line for line in sleeper.own_lines()), "its own park is no surprise"


def test_an_unasked_sleep_whose_wake_fails_is_ended_by_a_cold_start(tmp_path: Path) -> None:
    # At gpu_memory_utilization 0.8 the level-1 sleep's host copy of the weights leaves no room for the wake's second
    # copy: the engine dies of CUDA's out-of-memory error, as on a real GB10.
    daemon = start(tmp_path, utilization=0.8)
    try:
        assert httpx.post(f"http://127.0.0.1:{daemon.setup.port}/sleep", params={"level": "1"}, timeout=30).status_code == 200
        daemon.wait_line(r"<4>gb10d: vLLM is asleep, and gb10d did not ask it to sleep .*: waking it")
        daemon.wait_line(r"<4>gb10d: the wake's POST /wake_up\?tags=kv_cache answered 500; stopping vLLM and starting it cold")
        wait_until(lambda: len([line for line in daemon.lines if "vLLM is ready after" in line]) == 2, 60, "the cold start ready")
        wait_until(lambda: state_of(daemon) is DaemonState.SERVING, 60, "serving")
        assert answers(daemon)
    finally:
        daemon.kill_everything()
