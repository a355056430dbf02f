"""`gb10d run` against gb10d.sim and a real NOTIFY_SOCKET: what systemd and the journal see.

Each test starts the real daemon as a child process; the sim is a separate
program with a real process tree, real pipes and a real port, so recovery,
readiness and process-group handling are exercised for real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from gb10d.errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_MEMORY_NOT_RETURNED
from gb10d.process import group_alive, group_members

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


def test_healthy_start_sends_ready_once_after_health_and_served_name(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path)
    daemon = run(setup, notify, daemons)
    message = ready(notify)
    assert message["STATUS"].startswith("serving tiny on 127.0.0.1:")
    # READY=1 is only sent once /health answers and /v1/models lists the configured name.
    assert httpx.get(f"http://127.0.0.1:{setup.port}/health").status_code == 200
    names = [card["id"] for card in httpx.get(f"http://127.0.0.1:{setup.port}/v1/models").json()["data"]]
    assert "tiny" in names
    ready_line = daemon.wait_line(r"gb10d: vLLM is ready after")
    assert "/health 200" in ready_line.string and "/v1/models lists tiny" in ready_line.string
    assert "warm-up completion took" in ready_line.string
    assert notify.count("READY", "1") == 1
    assert daemon.stop() == 0
    assert_no_vllm_left(daemon)


def test_status_passes_through_the_startup_phases_and_extends_the_timeout(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, scenario="slow_shards=60", extra={"startup.stall_timeout_s": 30.0})
    daemon = run(setup, notify, daemons)
    ready(notify)
    statuses = notify.statuses()
    assert any(re.match(r"loading weights \d+/6 \(\d+%\), attempt 1/3, gpu_memory_utilization=0.8", s) for s in statuses), statuses
    for phase in ("loading weights", "compiling", "capturing CUDA graphs", "starting API server", "warming up"):
        assert any(s.startswith(phase) for s in statuses), (phase, statuses)
    assert notify.count("EXTEND_TIMEOUT_USEC") >= 3
    first_ready = next(i for i, (_, m) in enumerate(notify.messages) if m.get("READY") == "1")
    assert all("EXTEND_TIMEOUT_USEC" not in m for _, m in notify.messages[first_ready:])
    daemon.stop()


def test_free_memory_failure_is_retried_once_with_a_fitting_utilization(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # 0.92 of 121.69 GiB is 111.95 GiB but only 103.45 GiB are free; preflight off, so vLLM's own check fails.
    setup = Setup(tmp_path, free_gib=103.45, utilization=0.92, extra={"memory.preflight": False})
    daemon = run(setup, notify, daemons)
    ready(notify)
    line = daemon.wait_line(r"gb10d: free memory 103.45 of 121.69 GiB is below gpu_memory_utilization 0.92 \(111.95 GiB\); restarting with (0\.\d+) \(attempt 2/3\)")
    new = float(line.group(1))
    assert new == 0.84  # floor((103.45 - 1.0 headroom) / 121.69, 2)
    assert len(starts(daemon)) == 2
    assert "--gpu-memory-utilization 0.84" in starts(daemon)[1]
    assert notify.count("READY", "1") == 1
    daemon.stop()
    assert_no_vllm_left(daemon)


def test_preflight_lowers_utilization_before_the_first_start(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, free_gib=90.0, available_gib=90.5, utilization=0.9)
    daemon = run(setup, notify, daemons)
    ready(notify)
    assert len(starts(daemon)) == 1
    assert "--gpu-memory-utilization 0.73" in starts(daemon)[0]  # floor((90 - 1) / 121.69, 2)
    assert any("preflight: gpu_memory_utilization 0.9" in line for line in daemon.own_lines())
    daemon.stop()


def test_stall_at_0_of_66_is_detected_and_the_next_start_uses_eager(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, scenario="stall_at=0", sim_env={"GB10D_SIM_SHARDS": "66"}, extra={"startup.stall_timeout_s": 3.0})
    daemon = run(setup, notify, daemons)
    daemon.wait_line(r"gb10d: started vLLM as pid")
    bar = daemon.wait_line(r"Loading safetensors checkpoint shards:\s+0% Completed \| 0/66")
    seen_bar = time.monotonic()
    stall = daemon.wait_line(r"gb10d: no loading progress for \d+ s .*at shard 0/66")
    detected = time.monotonic()
    assert detected - seen_bar <= 3.0 + 2.0 + 1.0, "stall must be detected within stall_timeout + 2 s"
    assert bar and stall
    first = next(vllm_groups(daemon.lines))
    wait_until(lambda: not group_alive(first), 30, "the stalled attempt's whole process group gone")
    ready(notify)
    assert "--safetensors-load-strategy eager" in starts(daemon)[1]
    daemon.stop()


def test_slow_but_advancing_shards_are_not_called_stalled(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # 30 s per shard at GB10D_SIM_SPEED 0.05 is 1.5 s per shard; the stall timeout (3 s) is never reached.
    setup = Setup(tmp_path, scenario="slow_shards=30", speed=0.05, extra={"startup.stall_timeout_s": 3.0})
    daemon = run(setup, notify, daemons)
    ready(notify, timeout=120)
    assert len(starts(daemon)) == 1
    assert not any("no loading progress" in line for line in daemon.own_lines())
    daemon.stop()


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [("model_not_found", "is neither a local directory nor a Hugging Face repository"), ("bad_parser", "vLLM rejected its command line")],
)
def test_config_failures_exit_78_without_retry(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon], scenario: str, expected: str) -> None:
    setup = Setup(tmp_path, scenario=scenario)
    daemon = run(setup, notify, daemons)
    assert daemon.wait_exit() == EXIT_CONFIG
    assert len(starts(daemon)) == 1
    assert any(expected in line for line in daemon.own_lines()), daemon.tail()
    assert notify.count("READY") == 0


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


def test_permanent_failure_gives_up_after_max_attempts(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, scenario="cuda_oom_during=load", extra={"memory.min_gpu_memory_utilization": 0.1, "restart.max_attempts": 3})
    daemon = run(setup, notify, daemons)
    assert daemon.wait_exit(120) == EXIT_GAVE_UP
    assert len(starts(daemon)) == 3
    assert any("giving up after 3 failed starts" in line for line in daemon.own_lines()), daemon.tail()
    assert_no_vllm_left(daemon)


def test_memory_not_returned_stops_the_loop(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # The sim's failed engine keeps 40 GiB "trapped" (it lowers MemAvailable in the meminfo file), as crashed CUDA processes do on GB10.
    setup = Setup(tmp_path, scenario="cuda_oom_during=profile,leak_gib=40", extra={"memory.recovery_timeout_s": 2.0})
    daemon = run(setup, notify, daemons)
    assert daemon.wait_exit(120) == EXIT_MEMORY_NOT_RETURNED
    assert len(starts(daemon)) == 1
    assert any("memory was not returned after vLLM exited" in line and "A reboot may be needed" in line for line in daemon.own_lines()), daemon.tail()


def test_sigterm_stops_vllm_and_leaves_no_process(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path)
    daemon = run(setup, notify, daemons)
    ready(notify)
    pgid = next(vllm_groups(daemon.lines))
    assert len(group_members(pgid)) >= 2, "the sim runs an API server and an EngineCore child"
    assert daemon.stop() == 0
    assert not group_alive(pgid)
    assert notify.count("STOPPING", "1") == 1
    state = json.loads(setup.state_file.read_text())
    assert state["state"] == "stopped"


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


def test_engine_death_after_serving_reset_after_s_is_recovered_with_a_new_count(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # Each start serves about 2 s, longer than restart.reset_after_s: every death begins a new count,
    # so a budget of 2 never runs out.
    setup = Setup(
        tmp_path,
        scenario="engine_dies_after=200",
        extra={"liveness.health_interval_s": 0.5, "restart.max_attempts": 2, "restart.reset_after_s": 0.5},
    )
    daemon = run(setup, notify, daemons)
    ready(notify)
    daemon.wait_line(r"gb10d: .*(engine is dead|engine core died|EngineDeadError|engine_dead)")
    # The restarted vLLM serves again; the dead attempt's own exit is not mistaken for the new one crashing.
    wait_until(lambda: notify.count("READY", "1") >= 3, 90, "READY=1 again after two restarts")
    assert not any("crash:" in line for line in daemon.own_lines()), daemon.own_lines()
    assert not any("giving up" in line for line in daemon.own_lines()), daemon.own_lines()
    daemon.stop()
    assert_no_vllm_left(daemon)


def test_an_engine_that_dies_soon_after_every_ready_is_given_up_on(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # Serving about 2 s is less than restart.reset_after_s (600 s by default): the deaths add up like failed starts.
    setup = Setup(tmp_path, scenario="engine_dies_after=200", extra={"liveness.health_interval_s": 0.5, "restart.max_attempts": 3})
    daemon = run(setup, notify, daemons)
    assert daemon.wait_exit(180) == EXIT_GAVE_UP
    assert notify.count("READY", "1") == 3
    assert len(starts(daemon)) == 3
    own = daemon.own_lines()
    assert any("it served only" in line and "so this counts as a failed start" in line and "(attempt 2/3)" in line for line in own), own
    assert any("giving up after 3 failed starts" in line for line in own), own
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
    assert "idle probe" in line.string or "probe" in line.string
    wait_until(lambda: notify.count("READY", "1") >= 2, 60, "READY=1 again after the hang")
    daemon.stop()
    assert_no_vllm_left(daemon)


def test_ready_is_found_by_polling_when_uvicorn_lines_are_hidden(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # --uvicorn-log-level warning hides 'Application startup complete.'; /health polling still finds the server.
    setup = Setup(tmp_path, extra={"vllm.args": {"max_model_len": 2048, "uvicorn_log_level": "warning"}, "startup.health_poll_interval_s": 0.5})
    daemon = run(setup, notify, daemons)
    ready(notify)
    daemon.wait_line(r"gb10d: vLLM is ready after .*/health 200")
    assert not any("Application startup complete." in line for line in daemon.lines)
    daemon.stop()


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
