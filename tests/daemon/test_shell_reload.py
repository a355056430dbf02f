"""`systemctl reload gb10d` in one process and virtual time: which changes restart vLLM, and what systemd hears.

The daemon's own Supervisor, ConfigKeeper and Reporter re-read the real
config file; vLLM is the scripted `Runtime` of shell_support. Edits seen
on disk by the file watcher (inotify, debounce) stay in the process-level
suite, as does the learned utilization carried across restarts of gb10d.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_MEMORY_NOT_RETURNED
from gb10d.machine.statefile import read_state
from harness import Setup
from shell_support import Script, Shell, VirtualClock, finish, healthy_start, run_virtual, start_shell

HEALTHY = healthy_start()


def index(shell: Shell, key: str, value: str, nth: int = 1) -> int:
    """Where the `nth` sd_notify message with KEY=value came, among all of them."""
    found = [i for i, m in enumerate(shell.notify.messages) if m.get(key) == value]
    assert len(found) >= nth, (key, value, shell.notify.messages)
    return found[nth - 1]


def test_an_invalid_edit_and_reload_keep_the_same_vllm_serving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path)

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(HEALTHY)], clock)
        try:
            await shell.ready()
            setup.config.write_text(setup.config.read_text().replace("gpu_memory_utilization = 0.8", "gpu_memory_utilization = 1.5"))
            shell.hup()
            await shell.ready(2)
            assert shell.said(r"config not applied: .*gb10d.toml:\d+: vllm.gpu_memory_utilization: must be > 0 and <= 1 \(got 1.5\)")
            assert shell.said(r"keeping the running configuration; fix the file")
            # systemd hears RELOADING=1 (with the time it began) and READY=1 again, around the same vLLM.
            reloading = shell.notify.messages[index(shell, "RELOADING", "1")]
            assert int(reloading["MONOTONIC_USEC"]) > 0
            assert index(shell, "READY", "1") < index(shell, "RELOADING", "1") < index(shell, "READY", "1", 2)
            assert len(shell.launcher.argvs) == 1 and shell.launcher.started[0].alive()
            assert shell.launcher.started[0].signals == []
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_daemon_only_change_is_applied_without_restarting_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path)

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(HEALTHY)], clock)
        try:
            await shell.ready()
            shell.reload(**{"restart.max_attempts": 7})
            await shell.ready(2)
            assert shell.said(r"applied without restarting vLLM \(pid 4243\): .*restart.max_attempts 3 -> 7")
            assert shell.config.restart.max_attempts == 7
            assert len(shell.launcher.argvs) == 1 and shell.launcher.started[0].signals == []
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_served_name_change_stops_vllm_then_starts_it_with_the_new_flag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path)

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(HEALTHY)], clock)
        try:
            await shell.ready()
            setup.served_name = "renamed"
            shell.reload()
            await shell.ready(2)
            first = shell.launcher.started[0]
            assert len(shell.launcher.started) == 2
            assert first.signals == ["SIGTERM"] and not first.alive()
            assert "--served-model-name renamed" in " ".join(shell.launcher.argvs[1])
            own = shell.own()
            stopping = shell.said(r'vllm.served_model_name "tiny" -> "renamed".*stopping vLLM \(pid 4243\)')
            started = shell.said(r"started vLLM as pid 4244")
            assert stopping and started and own.index(stopping[0]) < own.index(started[0])
            # The second READY=1 is the new start's own, after its readiness checks found the new name.
            assert shell.said(r"vLLM is ready after .*/v1/models lists renamed")
            assert index(shell, "RELOADING", "1") < index(shell, "READY", "1", 2)
            assert shell.metric("gb10d_start_attempts_total", reason="reload") == 1.0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_reload_that_restarts_vllm_waits_for_its_memory_as_a_failure_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Measured before the old vLLM's memory is back, the new start would be lowered or refused for memory that
    # is only on its way back. Here 10 GiB never come back (held by something else, as a crashed CUDA process
    # traps it on GB10): the reload ends as a failure whose memory stays missing does, without a second start.
    setup = Setup(tmp_path, extra={"memory.recovery_timeout_s": 2.0})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(HEALTHY)], clock)
        try:
            await shell.ready()
            setup.write_meminfo(setup.free_gib - 10, setup.free_gib - 10)
            setup.served_name = "renamed"
            shell.reload()
            seen: set[tuple[str, str | None]] = set()

            def sample() -> bool:
                record = read_state(setup.state_file)
                if record is not None and record.state is not None:
                    seen.add((record.state.value, record.phase))
                return shell.task.done()

            await shell.until(sample, "gb10d exited")
            assert await shell.exit_status() == EXIT_MEMORY_NOT_RETURNED
            assert len(shell.launcher.argvs) == 1
            # While it waits for the memory, the front's hold reason is "restarting", not the last start's "ready 6/6".
            assert ("restarting", None) in seen and not any(state != "serving" and phase == "ready" for state, phase in seen), seen
            assert shell.said(r"^<3>gb10d: memory was not returned after vLLM exited")
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_the_env_file_is_read_at_start_and_reload_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / "vllm.env"
    env_file.write_text("GB10D_TEST_MARK=one\n")
    setup = Setup(tmp_path, extra={"vllm.env_file": str(env_file), "restart.max_attempts": 5})
    # Each vLLM serves a moment, then crashes: every restart builds its environment again.
    crashing = Script(HEALTHY, dies_after_s=1.0)

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [crashing, crashing, Script(HEALTHY)], clock)
        try:
            await shell.ready()
            # An edit alone changes nothing: the crash-restart that follows starts with what was read at start.
            env_file.write_text("GB10D_TEST_MARK=two\n")
            await shell.ready(2)
            # Nor does removing it stop a running gb10d: the next restart still has the variables.
            env_file.unlink()
            await shell.ready(3)
            assert [env["GB10D_TEST_MARK"] for env in shell.launcher.envs] == ["one", "one", "one"]
            # A reload reads it again, and refuses a config whose env_file is gone, keeping the running one.
            shell.hup()
            await shell.until(lambda: bool(shell.said(r"keeping the running configuration")), "the reload refused")
            assert shell.said(r"^<3>gb10d: config not applied: .*vllm\.env_file.*cannot read")
            assert not shell.task.done() and len(shell.launcher.argvs) == 3 and shell.launcher.started[2].alive()
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)
