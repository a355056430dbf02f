"""`gb10d run` against gb10d.sim and a real NOTIFY_SOCKET: what systemd and the journal see.

Each test starts the real daemon as a child process; the sim is a separate
program with a real process tree, real pipes and a real port, so what needs
them is exercised for real: the process group and what is left of it, I/O
read from /proc, a port taken by someone else, signals, liveness against a
real server. The order of things (retries, give-ups, stalls, phases, the
stop ladder) is tested in one process in test_shell_supervisor.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from gb10d.base.errors import EXIT_CONFIG
from gb10d.launch.process import group_alive, group_members
from harness import Daemon, NotifySocket, Setup, vllm_groups, wait_until

pytestmark = pytest.mark.slow


def run(setup: Setup, notify: NotifySocket | None, daemons: list[Daemon], env: dict[str, str] | None = None) -> Daemon:
    daemon = Daemon(setup, notify, env)
    daemons.append(daemon)
    return daemon


def ready(notify: NotifySocket, timeout: float = 90.0) -> dict[str, str]:
    return notify.wait_for(lambda m: m.get("READY") == "1", timeout)


def starts(daemon: Daemon) -> list[str]:
    return [line for line in daemon.own_lines() if "started vLLM as pid" in line]


def assert_no_vllm_left(daemon: Daemon) -> None:
    for pgid in vllm_groups(daemon.lines):
        wait_until(lambda pgid=pgid: not group_alive(pgid), 30, f"vLLM process group {pgid} gone")


def test_stall_at_0_of_66_is_detected_and_the_next_start_uses_eager(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, scenario="stall_at=0", sim_env={"GB10D_SIM_SHARDS": "66"}, extra={"startup.stall_timeout_s": 3.0})
    daemon = run(setup, notify, daemons)
    daemon.wait_line(r"gb10d: started vLLM as pid")
    bar = daemon.wait_line(r"Loading safetensors checkpoint shards:\s+0% Completed \| 0/66")
    seen_bar = time.monotonic()
    stall = daemon.wait_line(r"gb10d: no loading progress for \d+ s .*at shard 0/66")
    detected = time.monotonic()
    assert detected - seen_bar <= 3.0 + 2.0 + 1.0, "stall must be detected within stall_timeout + 2 s"
    # The stall is judged on the bar it follows, once vLLM also did no I/O, and ends the whole group.
    assert daemon.lines.index(bar.string) < daemon.lines.index(stall.string)
    assert stall.string.startswith("<3>gb10d: ") and "did no I/O; stopping the process group" in stall.string, stall.string
    first = next(vllm_groups(daemon.lines))
    wait_until(lambda: not group_alive(first), 30, "the stalled attempt's whole process group gone")
    ready(notify)
    assert "--safetensors-load-strategy eager" in starts(daemon)[1]
    daemon.stop()


def test_port_in_use_exits_78_without_retry(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    setup = Setup(tmp_path, port=holder.getsockname()[1])
    try:
        daemon = run(setup, notify, daemons)
        assert daemon.wait_exit() == EXIT_CONFIG
    finally:
        holder.close()
    assert len(starts(daemon)) == 1
    assert any(f"port {setup.port} is already in use" in line for line in daemon.own_lines()), daemon.tail()


def test_a_healthy_start_serves_and_sigterm_leaves_no_process(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # End to end with real processes; the order of the checks before READY=1 is in test_shell_supervisor.
    setup = Setup(tmp_path)
    daemon = run(setup, notify, daemons)
    message = ready(notify)
    assert message["STATUS"].startswith(f"serving tiny on 127.0.0.1:{setup.port}")
    names = [card["id"] for card in httpx.get(f"http://127.0.0.1:{setup.port}/v1/models").json()["data"]]
    assert names == ["tiny"]
    ready_line = daemon.wait_line(r"gb10d: vLLM is ready after")
    assert "/health 200, /v1/models lists tiny, warm-up completion took" in ready_line.string, ready_line.string
    pgid = next(vllm_groups(daemon.lines))
    assert len(group_members(pgid)) >= 2, "the sim runs an API server and an EngineCore child"
    assert daemon.stop() == 0
    assert not group_alive(pgid)
    assert notify.count("STOPPING", "1") == 1
    state = json.loads(setup.state_file.read_text())
    assert state["state"] == "stopped"


def test_gb10d_run_reads_its_config_file_once_to_serve(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # The command line loads and checks the config; the daemon serves with that load instead of parsing the file again.
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    opened = tmp_path / "opened"
    (hooks / "sitecustomize.py").write_text(
        "import os, sys\n"
        f"def _hook(event, args, _log={str(opened)!r}, _config={str(tmp_path / 'gb10d.toml')!r}):\n"
        "    if event == 'open' and str(args[0]) == _config:\n"
        "        with open(_log, 'a') as log:\n"
        "            log.write(f'{os.getpid()}\\n')\n"
        "sys.addaudithook(_hook)\n"
    )
    setup = Setup(tmp_path)
    daemon = run(setup, notify, daemons, env={"PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")]))})
    ready(notify)
    assert daemon.stop() == 0
    assert opened.read_text().split() == [str(daemon.proc.pid)]


def test_killed_api_server_leaves_no_orphaned_engine_and_is_recovered(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path)
    daemon = run(setup, notify, daemons)
    ready(notify)
    pgid = next(vllm_groups(daemon.lines))
    engine = [pid for pid in group_members(pgid) if pid != pgid]
    assert engine, "EngineCore child exists"
    os.kill(pgid, signal.SIGKILL)  # the API server only; vLLM's EngineCore would survive this on its own
    wait_until(lambda: not group_alive(pgid), 30, "old process group gone (EngineCore included)")
    notify.wait_for(lambda m: m.get("READY") == "1" and notify.count("READY", "1") >= 1 and len(starts(daemon)) == 2, 90)
    wait_until(lambda: len(starts(daemon)) == 2, 30, "second start")
    daemon.stop()
    assert_no_vllm_left(daemon)


def test_hung_engine_is_found_by_liveness_and_restarted(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # /health keeps answering 200 after the hang; only the idle probe (a one-token completion) shows it.
    setup = Setup(
        tmp_path,
        scenario="hang_after=300",
        extra={
            "liveness.health_interval_s": 0.5,
            "liveness.idle_probe_interval_s": 1.0,
            "liveness.probe_timeout_s": 2.0,
            "liveness.progress_timeout_s": 3.0,
            "restart.max_attempts": 5,
        },
    )
    daemon = run(setup, notify, daemons)
    ready(notify)
    line = daemon.wait_line(r"gb10d: vLLM's engine is hung: .*; stopping its process group")
    # /health still answered 200: the evidence is the idle probe that never finished.
    assert "the idle probe (a 1-token completion) sent" in line.string, line.string
    wait_until(lambda: notify.count("READY", "1") >= 2, 60, "READY=1 again after the hang")
    daemon.stop()
    assert_no_vllm_left(daemon)


def test_an_api_key_in_args_is_never_on_vllms_command_line(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, extra={"vllm.args.api_key": "sk-test-1"})
    daemon = run(setup, notify, daemons)
    ready(notify)  # the checks before READY=1 pass the key, as vLLM now demands it
    pid = int(daemon.wait_line(r"started vLLM as pid (\d+)").group(1))
    assert b"sk-test-1" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert b"VLLM_API_KEY=sk-test-1\0" in Path(f"/proc/{pid}/environ").read_bytes()
    assert not any("sk-test-1" in line for line in daemon.lines)
    models = f"http://127.0.0.1:{setup.port}/v1/models"
    assert httpx.get(models).status_code == 401
    assert httpx.get(models, headers={"Authorization": "Bearer sk-test-1"}).status_code == 200
    assert daemon.stop() == 0


def test_a_stop_lets_vllm_finish_the_requests_in_flight(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # daemon.stop_timeout_s 10: vLLM gets --shutdown-timeout 5 and drains instead of aborting.
    setup = Setup(tmp_path)
    daemon = run(setup, notify, daemons)
    ready(notify)
    assert "--shutdown-timeout 5" in starts(daemon)[0]
    body = {"model": "tiny", "prompt": "Tell a long story", "max_tokens": 2000, "stream": True}
    chunks: list[dict[str, object]] = []
    with httpx.stream("POST", f"http://127.0.0.1:{setup.port}/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=30.0)) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
                if len(chunks) == 1:
                    daemon.child.terminate()  # SIGTERM to gb10d, as systemctl stop sends it
    assert "choices" in chunks[-1], chunks[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]  # type: ignore[index]
    assert daemon.wait_exit() == 0
    daemon.wait_line(r"\[shutdown\] API server: stopping engine client mode=drain timeout=5s")


def test_fragmented_memory_is_told_with_its_numbers_and_the_start_goes_on(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # A week of uptime: 85 GiB free, nearly all in 4 KiB pages (order 0 of 11, 4 KiB pages).
    buddyinfo = tmp_path / "buddyinfo"
    buddyinfo.write_text("Node 0, zone   Normal 20000000 1000000 50000  20000   3000    100     10      2      0      0      0\n")
    setup = Setup(tmp_path, extra={"memory.buddyinfo_path": str(buddyinfo)})
    daemon = run(setup, notify, daemons)
    ready(notify)
    line = daemon.wait_line(r"gb10d: preflight: unified memory is fragmented: ([\d.]+) GiB free, but only ([\d.]+) GiB of it in blocks of 2 MiB or more")
    assert "reboot recommended" in line.string and line.string.startswith("<4>")
    assert len(starts(daemon)) == 1
    assert daemon.stop() == 0
