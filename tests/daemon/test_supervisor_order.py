"""The order of effects, observed from outside: what systemd, `gb10d status` and a scrape see, and when.

Each test is a regression test of an ordering bug: READY=1 before the state
file and the metrics said ready; watchdog pings that stopped while a reload
waited for vLLM to exit; a killed vLLM reported as a dead engine because a
failed probe arrived before the exit. (An env_file read again at every
crash-restart is tested in one process, in test_shell_reload.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from gb10d.core.statefile import DaemonState
from gb10d.machine.statefile import read_state
from harness import Daemon, NotifySocket, Setup, free_port, vllm_groups

pytestmark = pytest.mark.slow


def run(setup: Setup, notify: NotifySocket, daemons: list[Daemon], env: dict[str, str] | None = None) -> Daemon:
    daemon = Daemon(setup, notify, env)
    daemons.append(daemon)
    return daemon


def ready(notify: NotifySocket, since: int = 0) -> dict[str, str]:
    return notify.wait_for(lambda m: m.get("READY") == "1", 90, since=since)


def vllm_pids(daemon: Daemon) -> list[int]:
    return list(vllm_groups(daemon.lines))


def test_the_state_file_and_the_metrics_say_ready_before_ready_is_sent(tmp_path: Path, daemons: list[Daemon]) -> None:
    port = free_port()
    setup = Setup(tmp_path, extra={"metrics.listen": f"127.0.0.1:{port}"})
    seen: dict[str, object] = {}
    arrived = threading.Event()

    def at_ready(message: dict[str, str]) -> None:
        # What `systemctl start gb10d && gb10d status` and a scrape right after READY=1 would see.
        if message.get("READY") == "1" and not arrived.is_set():
            record = read_state(setup.state_file)
            seen["state"] = record.state if record else None
            seen["phase"] = record.phase if record else None
            seen["metrics"] = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            arrived.set()

    notify = NotifySocket(on_message=at_ready)
    try:
        daemon = run(setup, notify, daemons)
        ready(notify)
        assert arrived.wait(30)
        assert seen["state"] is DaemonState.SERVING
        assert seen["phase"] == "ready"
        metrics = str(seen["metrics"])
        assert "gb10d_ready 1.0" in metrics
        assert 'gb10d_phase{phase="ready"} 1.0' in metrics
        daemon.wait_line(r"gb10d: vLLM is ready after")
    finally:
        notify.close()
    assert daemon.stop() == 0


def test_watchdog_pings_go_on_while_a_reload_waits_for_vllm_to_exit(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # WatchdogSec=2: a ping a second. vLLM is frozen (SIGSTOP), so the reload's stop ladder waits its
    # whole grace before SIGKILL; systemd must keep hearing from gb10d meanwhile.
    setup = Setup(tmp_path, extra={"daemon.stop_timeout_s": 5.0})
    daemon = run(setup, notify, daemons, env={"WATCHDOG_USEC": "2000000"})
    ready(notify)
    pgid = vllm_pids(daemon)[0]
    os.killpg(pgid, signal.SIGSTOP)
    setup.extra["vllm.args"] = {"max_model_len": 4096}
    setup.write_config()
    since = len(notify.messages)
    daemon.proc.send_signal(signal.SIGHUP)
    daemon.wait_line(r"gb10d: .*vLLM's command line changes: stopping vLLM")
    daemon.wait_line(r"gb10d: vLLM did not exit within daemon.stop_timeout_s 5 s; sending SIGKILL")
    ready(notify, since)
    pings = [at for at, m in notify.messages[since:] if m.get("WATCHDOG") == "1"]
    assert len(pings) >= 5, notify.keys()
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < 1.9, gaps
    assert daemon.stop() == 0


def test_a_killed_vllm_is_reported_by_its_signal_not_as_a_dead_engine(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # /health is polled five times a second, so the failed probe after the kill races the exit report,
    # which waits for the pipes that the orphaned EngineCore keeps open.
    setup = Setup(tmp_path, extra={"liveness.health_interval_s": 0.2, "restart.max_attempts": 5})
    daemon = run(setup, notify, daemons)
    ready(notify)
    since = len(daemon.lines)
    killed_at = time.monotonic()
    os.kill(vllm_pids(daemon)[0], signal.SIGKILL)  # the API server only
    line = daemon.wait_line(r"gb10d: (crash|engine_dead|vLLM's engine is)", since=since)
    assert line.group(0) == "gb10d: crash", line.string
    assert "crash: vLLM was killed by SIGKILL (out of memory? see journalctl -k);" in line.string
    assert line.string.endswith("restarting with the same settings in 0.2 s (attempt 2/5)"), line.string
    assert time.monotonic() - killed_at < 30
    assert not [line for line in daemon.lines[since:] if "engine is dead" in line or "engine_dead" in line]
    ready(notify, 1)
    assert daemon.stop() == 0
