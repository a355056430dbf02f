"""The machine's memory ledger in one process and virtual time: instances that wait for each other's starts.

Two gb10d instances (each its own Supervisor, Preflight and Reporter, each a
scripted vLLM) share one meminfo file and one ledger directory on a real
file system, as the instances of one machine do. What needs real
processes stays in test_instances: a kill -9 that frees a reservation, the
memory the sim's engines really take, `gb10d status --all`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_GAVE_UP, EXIT_OK
from gb10d.core.budget import Stage
from gb10d.core.facts import ParkAsked, RestartAsked, WakeAsked
from gb10d.daemon.lab import meminfo_text
from gb10d.launch.runtime import Escalation
from gb10d.machine.ledger import Booking
from harness import Setup
from shell_support import LINE_GAP_S, Script, ScriptedVllm, Shell, VirtualClock, finish, healthy_start, run_virtual, start_shell

HEALTHY = healthy_start()
# 0.5 of 121.69 GiB and 1 GiB of headroom: two such shares (2 x 61.84 GiB) do not fit in 117 GiB available.
SHARE = "61.84 GiB"


def configure(root: Path, name: str, **extra: object) -> Setup:
    """One instance of the machine under `root`: its share 0.5, the machine's meminfo and ledger."""
    return Setup(
        root / name,
        utilization=0.5,
        extra={
            "memory.meminfo_path": str(root / "meminfo"),
            "memory.ledger_dir": str(root / "ledger"),
            "startup.stall_timeout_s": 30.0,
            "startup.ready_timeout_s": 600.0,
            **extra,
        },
    )


@pytest.fixture
def machine(tmp_path: Path) -> Path:
    """121.69 GiB, 115 free and 117 available, and an empty ledger."""
    (tmp_path / "meminfo").write_text(meminfo_text(121.69, 115.0, 117.0))
    (tmp_path / "ledger").mkdir()
    return tmp_path


def loading_slowly() -> Script:
    """A healthy start whose shards take 20 s each: still starting while the other instance looks."""
    return Script(HEALTHY, gaps={i: 20.0 if "Loading safetensors checkpoint shards" in line else LINE_GAP_S for i, line in enumerate(HEALTHY)})


async def loading(shell: Shell) -> None:
    await shell.until(lambda: bool(shell.said(r"started vLLM as pid")), "the first instance's start")


def test_a_start_that_does_not_fit_waits_for_the_one_loading_and_starts_once_it_stops(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main(clock: VirtualClock) -> None:
        a = await start_shell(configure(machine, "a"), [loading_slowly()], clock)
        await loading(a)
        b = await start_shell(configure(machine, "b"), [Script(HEALTHY)], clock)
        try:
            name = re.escape(str(a.setup.config))
            await b.until(lambda: bool(b.said(rf"does not fit beside the starts of {name} \({SHARE}, starting")), "b waiting for a")
            assert b.said(r"^<6>gb10d: memory: gpu_memory_utilization 0\.5 \(60\.84 GiB \+ 1\.00 GiB headroom\) does not fit .*MemAvailable 117\.00 GiB leaves")
            assert any(s.startswith(f"waiting for memory: needs {SHARE}, ") for s in b.notify.statuses()), b.notify.statuses()
            assert b.metric("gb10d_memory_waiting") == 1.0 and not b.launcher.argvs
            # While a loads shard after shard, systemd is asked to wait longer for b too.
            since = len(b.notify.messages)
            await b.until(lambda: any("EXTEND_TIMEOUT_USEC" in m for m in b.notify.messages[since:]), "b's start timeout extended")
            a.stop()
            assert await a.exit_status() == EXIT_OK
            await b.ready()
            assert b.said(rf"; waited \d+ s for {name}$")
            assert b.metric("gb10d_memory_waiting") == 0.0 and len(b.launcher.argvs) == 1
        finally:
            await finish(b)
            await finish(a)

    run_virtual(monkeypatch, main)


def test_a_waiting_instance_stops_at_once_on_sigterm(machine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(clock: VirtualClock) -> None:
        a = await start_shell(configure(machine, "a"), [loading_slowly()], clock)
        await loading(a)
        b = await start_shell(configure(machine, "b"), [Script(HEALTHY)], clock)
        try:
            await b.until(lambda: bool(b.said(r"does not fit beside the starts of")), "b waiting")
            b.stop()
            stopped_at = clock.now
            assert await b.exit_status() == EXIT_OK
            assert clock.now - stopped_at < 1.0, "a stop while waiting for memory waits for nothing"
            assert b.said(r"^<6>gb10d: received SIGTERM while waiting for memory; stopping")
            assert not b.launcher.argvs
            assert not a.task.done() and a.launcher.started[0].signals == []
        finally:
            await finish(b)
            await finish(a)

    run_virtual(monkeypatch, main)


def test_with_when_full_fail_a_start_that_does_not_fit_gives_up_at_once_with_the_numbers(
    machine: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main(clock: VirtualClock) -> None:
        a = await start_shell(configure(machine, "a", **{"memory.when_full": "fail"}), [loading_slowly()], clock)
        await loading(a)
        b = await start_shell(configure(machine, "b", **{"memory.when_full": "fail"}), [Script(HEALTHY)], clock)
        try:
            assert await b.exit_status() == EXIT_GAVE_UP
            line = b.said(r"memory: gpu_memory_utilization 0\.5 .* does not fit beside the starts of")
            assert line and f"{a.setup.config} ({SHARE}, " in line[0], b.own()
            assert 'not waiting (memory.when_full = "fail")' in line[0] and "MemAvailable 117.00 GiB leaves" in line[0], line[0]
            assert b.notify.statuses()[-1].startswith("failed: memory: ")
            assert not b.launcher.argvs
            await a.ready()
        finally:
            await finish(b)
            await finish(a)

    run_virtual(monkeypatch, main)


@pytest.mark.parametrize("asked", ["reload", "restart"])
def test_a_reload_or_asked_restart_keeps_its_share_while_vllm_restarts_so_a_model_woken_meanwhile_waits_for_it(
    machine: Path, monkeypatch: pytest.MonkeyPatch, asked: str
) -> None:
    # The on-demand b asked first (it parked at its start), then a started and served. a's reload with a new
    # utilization (or a restart asked over the control socket) stops its vLLM; b, woken by the front while a's
    # memory comes back, must not take a's share: a restarts into it and serves again, b waits until a serves.
    async def main(clock: VirtualClock) -> None:
        b = await start_shell(configure(machine, "b", on_demand={"idle_timeout_s": 30.0}), [Script(HEALTHY)], clock)
        await b.ready()
        a = await start_shell(configure(machine, "a"), [Script(HEALTHY), Script(HEALTHY)], clock)
        try:
            await a.ready()
            # a's vLLM holds its share (and more: b's parked share is counted as taken), until its stop gives it back.
            (machine / "meminfo").write_text(meminfo_text(121.69, 28.0, 30.0))
            if asked == "reload":
                a.reload(**{"vllm.gpu_memory_utilization": 0.45})
            else:
                a.loop.post(RestartAsked())  # the front's page, over the control socket
            booking = a.reporter.ledger.booking
            assert booking is not None
            await a.until(lambda: booking.record is not None and booking.record.stage is Stage.RESTARTING, "a's vLLM gone")
            b.loop.post(WakeAsked())
            name = re.escape(str(a.setup.config))
            await b.until(lambda: bool(b.said(rf"does not fit beside the starts of {name}")), "b waiting for a's restart")
            (machine / "meminfo").write_text(meminfo_text(121.69, 115.0, 117.0))
            b_first: list[bool] = []

            def a_serves() -> bool:
                if b.launcher.argvs and not b_first:
                    b_first.append(a.notify.count("READY", "1") < 2)
                return a.notify.count("READY", "1") >= 2

            await a.until(a_serves, "a serving again")
            assert b_first in ([], [False]), "b started into a's share while a restarted"
            assert ("0.45" if asked == "reload" else "0.5") in a.launcher.argvs[1], a.launcher.argvs
            assert not a.said(r"does not fit|waiting"), a.own()
            await b.ready(2)
            assert b.said(rf"; waited \d+ s for {name}$")
        finally:
            await finish(b)
            await finish(a)

    run_virtual(monkeypatch, main)


@pytest.mark.parametrize(("asked", "stage_at_stop"), [("reload", Stage.RESTARTING), ("restart", Stage.RESTARTING), ("park", Stage.SERVING)])
def test_a_vllm_stopped_to_start_again_is_reserved_before_its_memory_comes_back_and_a_park_is_not(
    machine: Path, monkeypatch: pytest.MonkeyPatch, asked: str, stage_at_stop: Stage
) -> None:
    # Reserved only once vLLM was gone, its memory showed free for a moment beside a record that said serving: the
    # front woke another model into it and the pinned instance's restart found its share taken (soak, seed 7). A park
    # gives the memory back on purpose: the model the front parks it for starts into it.
    seen: list[Stage | None] = []
    stop = ScriptedVllm.stop

    async def stopped_with_the_record_seen(self: ScriptedVllm, grace_s: float, on_escalate: Escalation | None = None) -> bool:
        seen.append(booking.record.stage if booking.record is not None else None)
        return await stop(self, grace_s, on_escalate)

    monkeypatch.setattr(ScriptedVllm, "stop", stopped_with_the_record_seen)

    async def main(clock: VirtualClock) -> None:
        nonlocal booking
        on_demand = {"on_demand": {"idle_timeout_s": 600.0}} if asked == "park" else {}
        a = await start_shell(configure(machine, "a", **on_demand), [Script(HEALTHY), Script(HEALTHY)], clock)
        try:
            if asked == "park":
                await a.until(lambda: bool(a.said(r"parked: starts on the first request")), "a parked")
                a.loop.post(WakeAsked())
            await a.ready(2 if asked == "park" else 1)  # parked, gb10d said READY=1 once already
            assert a.reporter.ledger.booking is not None
            booking = a.reporter.ledger.booking
            if asked == "reload":
                a.reload(**{"vllm.gpu_memory_utilization": 0.45})
            else:
                a.loop.post(RestartAsked() if asked == "restart" else ParkAsked())
            await a.until(lambda: bool(seen), "a's vLLM stopped")
        finally:
            await finish(a)

    booking: Booking = None  # type: ignore[assignment]  # set once the instance has its record
    run_virtual(monkeypatch, main)
    assert seen[0] is stage_at_stop
