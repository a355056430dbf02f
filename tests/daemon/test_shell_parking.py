"""Parking by stop (on_demand.park = "stop") in one process and virtual time: gb10d waits parked, active for
systemd, until the front's wake; a park stops vLLM through the stop ladder and is no failure.

vLLM is a scripted `Runtime`; the supervisor, the reporter, the memory ledger and sd_notify are gb10d's own. The
front's "wake" and "park" reach the supervisor as the control socket posts them: WakeAsked and ParkAsked facts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_OK
from gb10d.core.budget import Stage
from gb10d.core.facts import ParkAsked, WakeAsked
from gb10d.core.statefile import DaemonState
from gb10d.machine.ledger import read_ledger
from gb10d.machine.statefile import read_state
from harness import Setup
from shell_support import Script, VirtualClock, finish, healthy_start, run_virtual, start_shell

PARKED = "parked: starts on the first request"


def test_a_parked_instance_starts_vllm_only_when_woken_and_a_park_stops_it_without_counting_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    setup = Setup(tmp_path, extra={"on_demand": {"idle_timeout_s": 30.0}, "memory.ledger_dir": str(ledger)})

    def stage() -> Stage:
        (record,) = read_ledger(ledger)
        return record.stage

    def state() -> DaemonState | None:
        record = read_state(setup.state_file)
        return record.state if record is not None else None

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(healthy_start())], clock)
        try:
            await shell.ready()
            ready = next(m for m in shell.notify.messages if m.get("READY") == "1")
            assert ready["STATUS"].startswith(PARKED), "active for systemd while vLLM does not run"
            assert shell.launcher.started == [] and state() is DaemonState.PARKED and stage() is Stage.PARKED
            assert shell.said(r"parked: starts on the first request: vLLM is not running, tiny starts when a request for it arrives")

            shell.loop.post(WakeAsked())
            await shell.ready(2)
            assert len(shell.launcher.started) == 1 and state() is DaemonState.SERVING and stage() is Stage.SERVING
            assert shell.said(r"starting vLLM: the front asked for it, a request waits")

            shell.loop.post(ParkAsked())
            await shell.ready(3)
            assert shell.launcher.started[0].signals == ["SIGTERM"], "the stop ladder, which vLLM obeyed"
            assert state() is DaemonState.PARKED and stage() is Stage.PARKED, "parked, and its reservation given back"
            assert shell.said(r"parking: stopping vLLM \(pid \d+\) after \d+ s serving, as the front asked")
            parks = [s for s in shell.notify.statuses() if s.startswith(("parking", PARKED))]
            assert parks[-2] == "parking: stopping vLLM and waiting for its memory to come back" and parks[-1].startswith(PARKED)
            restarts = [s.value for m in shell.reporter.metrics.registry.collect() for s in m.samples if s.name == "gb10d_restarts_total"]
            assert restarts and sum(restarts) == 0
            assert len(shell.launcher.started) == 1, "a park is no failure: nothing restarts vLLM"

            shell.loop.post(WakeAsked())
            await shell.ready(4)
            assert len(shell.launcher.started) == 2
            assert len(shell.said(r"started vLLM as .*\(attempt 1/")) == 2, "each start on demand is a first attempt"
            shell.stop()
            assert await shell.exit_status() == EXIT_OK
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_stop_while_parked_exits_cleanly_without_ever_starting_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = Setup(tmp_path, extra={"on_demand": {"idle_timeout_s": 30.0}})

    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(setup, [Script(healthy_start())], clock)
        try:
            await shell.ready()
            shell.loop.post(ParkAsked())  # already parked: nothing to do
            shell.stop()
            assert await shell.exit_status() == EXIT_OK
            assert shell.launcher.started == []
            assert shell.said(r"received SIGTERM while parked; stopping")
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)
