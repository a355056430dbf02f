"""The supervisor's sequencing, in one process and virtual time: what the journal, sd_notify and the metrics show.

vLLM is a scripted `Runtime` replaying recorded starts from the corpus;
everything of gb10d is its own. What needs real processes (signals,
process groups, pipes, the engines, the units) stays in the process-level
suites.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_MEMORY_NOT_RETURNED, EXIT_OK
from gb10d.core.statefile import Progress
from gb10d.machine.statefile import read_state
from harness import Setup
from shell_support import Script, VirtualClock, corpus, engine_death, finish, healthy_start, run_virtual, start_shell

HEALTHY = healthy_start()


def test_a_healthy_start_sends_ready_once_after_health_served_name_and_warm_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(Setup(tmp_path), [Script(HEALTHY)], clock)
        try:
            await shell.ready()
            ready_line = shell.said(r"vLLM is ready after")
            assert ready_line and "/health 200" in ready_line[0] and "/v1/models lists tiny" in ready_line[0]
            assert "warm-up completion took" in ready_line[0]
            ready = next(m for m in shell.notify.messages if m.get("READY") == "1")
            assert ready["STATUS"].startswith(f"serving tiny on 127.0.0.1:{shell.setup.port}")
            assert shell.metric("gb10d_ready") == 1.0 and shell.metric("gb10d_vllm_up") == 1.0
            assert shell.metric("gb10d_start_attempts_total", reason="initial") == 1.0
            shell.stop()
            assert await shell.exit_status() == EXIT_OK
            assert shell.notify.count("READY", "1") == 1 and shell.notify.count("STOPPING", "1") == 1
            assert shell.launcher.started[0].signals == ["SIGTERM"]
            assert shell.said(r"vLLM stopped; nothing of its process group is left")
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def free_memory_failure(free_gib: float, total_gib: float, utilization: float) -> list[str]:
    """vLLM's recorded free-memory failure, with this machine's numbers in it."""
    wanted = f"({utilization:g}, {utilization * total_gib:.2f} GiB)"
    return [
        line.replace("(103.45/123.73 GiB)", f"({free_gib}/{total_gib} GiB)").replace("(0.92, 113.83 GiB)", wanted)
        for line in corpus("sim-free")
    ]


def test_a_free_memory_failure_is_retried_once_with_a_fitting_utilization(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 0.92 of 121.69 GiB is 111.95 GiB but only 103.45 GiB are free; preflight off, so vLLM's own check fails.
    setup = Setup(tmp_path, free_gib=103.45, utilization=0.92, extra={"memory.preflight": False})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(free_memory_failure(103.45, 121.69, 0.92), then=1), Script(HEALTHY)], clock)
        try:
            await shell.ready()
            failure = shell.said(r"free memory 103.45 of 121.69 GiB is below gpu_memory_utilization 0.92 \(111.95 GiB\); restarting with (0\.\d+) \(attempt 2/3\)")
            assert len(failure) == 1 and failure[0].startswith("<4>")
            assert "restarting with 0.84 " in failure[0]  # floor((103.45 - 1.0 headroom) / 121.69, 2)
            assert [argv[argv.index("--gpu-memory-utilization") + 1] for argv in shell.launcher.argvs] == ["0.92", "0.84"]
            assert any(s.startswith("free memory 103.45 of 121.69 GiB") for s in shell.notify.statuses())
            assert shell.notify.count("READY", "1") == 1
            assert shell.metric("gb10d_restarts_total", cause="free_memory") == 1.0
            assert shell.metric("gb10d_gpu_memory_utilization") == 0.84
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_preflight_lowers_utilization_before_the_first_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(Setup(tmp_path, free_gib=90.0, available_gib=90.5, utilization=0.9), [Script(HEALTHY)], clock)
        try:
            await shell.ready()
            assert len(shell.launcher.argvs) == 1
            assert "--gpu-memory-utilization 0.73" in " ".join(shell.launcher.argvs[0])  # floor((90 - 1) / 121.69, 2)
            lowered = shell.said(r"preflight: gpu_memory_utilization 0.9")
            started = shell.said(r"started vLLM as pid")
            assert lowered and shell.own().index(lowered[0]) < shell.own().index(started[0])
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_stall_is_detected_after_stall_timeout_s_and_the_next_start_loads_eagerly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path, extra={"startup.stall_timeout_s": 3.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(corpus("sim-stall"), then="hang"), Script(HEALTHY)], clock)
        try:
            await shell.until(lambda: any("3/6" in line for line in shell.lines()), "the bar at shard 3/6")
            bar_at = clock.now
            await shell.until(lambda: bool(shell.said("no loading progress")), "the stall")
            stall = shell.said(r"no loading progress for (\d+) s \(startup.stall_timeout_s 3\) at shard 3/6")
            assert stall and stall[0].startswith("<3>"), shell.own()
            assert 3.0 <= clock.now - bar_at <= 3.0 + 2.0, "detected within stall_timeout + one I/O sample"
            await shell.ready()
            assert shell.launcher.started[0].signals == ["SIGKILL"], "a stalled start has nothing to drain"
            assert "eager" in shell.launcher.argvs[1][shell.launcher.argvs[1].index("--safetensors-load-strategy") + 1]
            assert shell.metric("gb10d_restarts_total", cause="stall") == 1.0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def slow_shards(gap_s: float) -> Script:
    """The healthy start, each shard `gap_s` after the last (the page cache is cold, the disk slow)."""
    return Script(HEALTHY, gaps={i: gap_s for i, line in enumerate(HEALTHY) if "Loading safetensors checkpoint shards" in line})


def test_slow_but_advancing_shards_are_not_called_stalled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2.5 s per shard; the stall timeout (3 s) is never reached between two of them.
    setup = Setup(tmp_path, extra={"startup.stall_timeout_s": 3.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [slow_shards(2.5)], clock)
        try:
            began = clock.now
            await shell.ready()
            assert clock.now - began >= 8 * 2.5, "the shards took their time"
            assert len(shell.launcher.argvs) == 1
            assert not shell.said("no loading progress")
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_permanent_failure_gives_up_after_max_attempts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path, extra={"memory.min_gpu_memory_utilization": 0.1, "restart.max_attempts": 3})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(corpus("sim-oom"), then=1)], clock)
        try:
            assert await shell.exit_status() == EXIT_GAVE_UP
            assert len(shell.launcher.argvs) == 3
            # The third failure's line says the cause, the decision and the fix; the last line points to it.
            told = shell.said(r"^<3>gb10d: CUDA out of memory allocating 1.71 GiB: giving up after 3 failed starts")
            assert len(told) == 1 and told[0].endswith("fix the cause, then: systemctl restart gb10d"), told
            assert shell.own()[-1] == "<3>gb10d: giving up with exit status 75: the line above says what to do"
            # systemctl status shows the cause, and where the fix is.
            assert shell.notify.statuses()[-1] == (
                "failed: giving up after 3 failed starts (last: CUDA out of memory allocating 1.71 GiB); the journal says how to fix it"
            )
            assert shell.notify.count("READY") == 0
            assert not any(vllm.alive() for vllm in shell.launcher.started)
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_memory_that_is_not_returned_after_a_failure_stops_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The failed engine keeps 40 GiB trapped, as crashed CUDA processes do on GB10.
    setup = Setup(tmp_path, extra={"memory.recovery_timeout_s": 2.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(corpus("sim-oom"), then=1)], clock)
        try:
            await shell.until(lambda: bool(shell.launcher.argvs), "the first start")
            setup.write_meminfo(setup.free_gib - 40, setup.free_gib - 40)
            assert await shell.exit_status() == EXIT_MEMORY_NOT_RETURNED
            assert len(shell.launcher.argvs) == 1
            assert any("A reboot may be needed" in line for line in shell.said("memory was not returned after vLLM exited"))
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_stop_during_the_start_sends_sigterm_then_sigkill_after_stop_timeout_s(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path, extra={"daemon.stop_timeout_s": 4.0, "startup.stall_timeout_s": 600.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(corpus("sim-stall"), then="hang")], clock)
        try:
            await shell.until(lambda: any("3/6" in line for line in shell.lines()), "loading")
            shell.stop()
            stopping_at = clock.now
            assert await shell.exit_status() == EXIT_OK
            assert 4.0 <= clock.now - stopping_at < 5.0
            assert shell.launcher.started[0].signals == ["SIGTERM", "SIGKILL"]
            assert shell.said(r"stopping vLLM \(pid \d+\): SIGTERM to its process group, SIGKILL after 4 s")
            assert shell.said(r"did not exit within daemon.stop_timeout_s 4 s; sending SIGKILL to 1 remaining process")
            assert shell.notify.count("STOPPING", "1") == 1 and shell.notify.count("READY") == 0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_second_stop_signal_kills_vllm_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path, extra={"daemon.stop_timeout_s": 60.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(corpus("sim-stall"), then="hang")], clock)
        try:
            await shell.until(lambda: any("3/6" in line for line in shell.lines()), "loading")
            shell.stop()
            await shell.until(lambda: bool(shell.said("SIGKILL after 60 s")), "the stop ladder")
            shell.stop("SIGINT")
            second_at = clock.now
            assert await shell.exit_status() == EXIT_OK
            assert clock.now - second_at < 1.0, "killed at once, not after the 60 s grace"
            assert shell.said(r"second stop signal: killing vLLM \(its process group\) now")
            assert shell.launcher.started[0].signals == ["SIGTERM", "SIGKILL"]
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_status_passes_through_the_startup_phases_and_extends_the_timeout_only_before_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = Setup(tmp_path, extra={"startup.stall_timeout_s": 30.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [slow_shards(2.5)], clock)
        try:
            await shell.ready()
            statuses = shell.notify.statuses()
            assert any(re.match(r"loading weights \d+/6 \(\d+%\), attempt 1/3, gpu_memory_utilization=0.8", s) for s in statuses), statuses
            for phase in ("loading weights", "compiling", "capturing CUDA graphs", "starting API server", "warming up"):
                assert any(s.startswith(phase) for s in statuses), (phase, statuses)
            # Each shard is progress: systemd waits the stall timeout and a margin past it, never longer.
            extends = [m["EXTEND_TIMEOUT_USEC"] for m in shell.notify.messages if "EXTEND_TIMEOUT_USEC" in m]
            assert len(extends) >= 6 and set(extends) == {str(90 * 1_000_000)}, extends
            first_ready = next(i for i, m in enumerate(shell.notify.messages) if m.get("READY") == "1")
            assert all("EXTEND_TIMEOUT_USEC" not in m for m in shell.notify.messages[first_ready:])
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_ready_is_found_by_polling_when_uvicorn_lines_are_hidden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # --uvicorn-log-level warning hides 'Application startup complete.'; /health polling still finds the server.
    setup = Setup(tmp_path, extra={"startup.health_poll_interval_s": 0.5})
    quiet = [line for line in HEALTHY if not line.startswith("INFO:")]

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(quiet)], clock)
        try:
            await shell.ready()
            assert shell.said(r"vLLM is ready after [\d.]+ s: /health 200, /v1/models lists tiny"), shell.own()
            assert not any("Application startup complete." in line for line in shell.lines())
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def dies_after_serving(seconds: float) -> Script:
    """A healthy start whose engine core dies `seconds` after it serves."""
    return Script(HEALTHY, dies_after_s=seconds, last_words=engine_death())


def test_an_engine_that_dies_soon_after_every_ready_is_given_up_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Serving 2 s is less than restart.reset_after_s (600 s by default): the deaths add up like failed starts.
    setup = Setup(tmp_path, extra={"liveness.health_interval_s": 0.5, "restart.max_attempts": 3})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [dies_after_serving(2.0)], clock)
        try:
            assert await shell.exit_status() == EXIT_GAVE_UP
            assert shell.notify.count("READY", "1") == 3
            assert len(shell.launcher.argvs) == 3
            counted = shell.said(r"it served only [\d.]+ s .*so this counts as a failed start.*\(attempt 2/3\)")
            assert len(counted) == 1, shell.own()
            assert shell.said(r"^<3>gb10d: engine_dead: .*: giving up after 3 failed starts")
            assert shell.own()[-1] == "<3>gb10d: giving up with exit status 75: the line above says what to do"
            assert not any(vllm.alive() for vllm in shell.launcher.started)
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_an_engine_death_after_serving_reset_after_s_begins_a_new_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each start serves 2 s, longer than restart.reset_after_s: every death begins a new count, so a budget of 2 never runs out.
    setup = Setup(tmp_path, extra={"liveness.health_interval_s": 0.5, "restart.max_attempts": 2, "restart.reset_after_s": 0.5})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [dies_after_serving(2.0)], clock)
        try:
            await shell.ready(4)
            deaths = shell.said(r"^<4>gb10d: engine_dead: .*engine core exited unexpectedly; starting cleanup; restarting with the same settings \(attempt \d/2\)$")
            assert len(deaths) == 3, shell.own()
            # Each death is the first failure of a new count, and the dead attempt's own exit is not taken for a crash.
            assert all(line.endswith("(attempt 2/2)") for line in deaths), deaths
            assert not shell.said(r"crash:|giving up"), shell.own()
            assert shell.metric("gb10d_restarts_total", cause="engine_dead") == 3.0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


@pytest.mark.parametrize(
    ("recording", "expected"),
    [("sim-mnf", "is neither a local directory nor a Hugging Face repository"), ("sim-parser", "vLLM rejected its command line")],
)
def test_a_config_failure_exits_78_without_retry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recording: str, expected: str) -> None:
    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(Setup(tmp_path), [Script(corpus(recording), then=1)], clock)
        try:
            assert await shell.exit_status() == EXIT_CONFIG
            assert len(shell.launcher.argvs) == 1
            assert shell.said(expected), shell.own()
            assert shell.notify.count("READY") == 0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_the_state_file_shows_the_phase_of_the_start_under_way_never_the_one_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first vLLM loads its 6 shards, serves, and its engine dies; the next one is slow to print its first line.
    setup = Setup(tmp_path, extra={"liveness.health_interval_s": 0.5})
    slow = Script(HEALTHY, gaps={0: 3.0})  # within startup.stall_timeout_s 5

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [dies_after_serving(2.0), slow], clock)
        try:
            await shell.ready()
            first = read_state(setup.state_file)
            assert first is not None and first.phase == "ready" and first.progress == Progress(6, 6)
            seen: list[tuple[str, str | None, Progress | None, str]] = []

            def sample() -> bool:
                record = read_state(setup.state_file)
                if record is not None and record.state is not None:
                    seen.append((record.state.value, record.phase, record.progress, record.status_text or ""))
                return record is not None and record.phase == "loading_weights"  # the new start's own progress

            await shell.until(sample, "the second start loading its weights")
            serving = ("serving", "ready", Progress(6, 6))
            after = [s[:3] for s in seen if s[:3] != serving or not s[3].startswith("serving tiny")]
            assert after and all(s[0] == "restarting" and s[1] in (None, "spawning", "loading_weights") for s in after), after
            assert ("restarting", None, None) in after, "between the starts: restarting, no start's phase"
            assert ("restarting", "spawning", None) in after, "the new start's own phase, while it is under way"
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)
