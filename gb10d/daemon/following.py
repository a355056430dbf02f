"""One attempt followed until it ends: its facts, and what is asked of vLLM while it runs.

The supervisor starts vLLM (`attempt.Attempt`) and hands it here; `run`
takes each fact of the loop in turn until the attempt ends, and returns how:
the attempt's own facts (output, probes, exit, ticks) go to the attempt; a
reload or an edit is applied in place or restarts vLLM (`keeper`); a
restart asked over the control socket, a park or a wake asked by the front
(`parking`, or the stop ladder where vLLM parks by stop), a node table of
the pair (`pair`) and a driver line of the kernel's are carried out here.
Whatever stops vLLM here goes through the same `StopLadder`.
"""

from __future__ import annotations

import time
from typing import Callable

from ..base.levels import PRIORITY_INFO
from ..core.facts import (
    ClusterSeen,
    DriverLine,
    Edited,
    Exited,
    KernelSaid,
    ParkAsked,
    Parsed,
    PullEnded,
    Reload,
    RestartAsked,
    SleptUnasked,
    Stop,
    WakeAsked,
)
from ..core.memory import MemInfo
from ..core.outcome import Ended, Failed, Parked, Reloaded, Stopped
from ..core.reload import tells_systemd
from ..core.statefile import DaemonState
from ..vllm import sleepmode
from ..vllm.events import DriverOutOfMemory, GpuXid
from .attempt import Attempt
from .keeper import ConfigKeeper
from .loop import FactLoop
from .pair import Pair
from .parking import Parking
from .reporter import Reporter
from .stopladder import StopLadder


class Following:
    """Follows the attempt in progress until it ends; `parking` keeps what its sleeps gave back."""

    def __init__(
        self, keeper: ConfigKeeper, reporter: Reporter, loop: FactLoop, ladder: StopLadder, pair: Pair | None, meminfo: Callable[[], MemInfo | None]
    ) -> None:
        self.keeper = keeper
        self.reporter = reporter
        self.loop = loop
        self.ladder = ladder
        self.pair = pair
        self.meminfo = meminfo
        self.parking = Parking(reporter, meminfo)

    async def run(self, attempt: Attempt) -> Ended:
        """Follow `attempt` until it ends (or a stop signal comes: Stopped)."""
        while True:
            fact = await self.loop.next(attempt.deadline())
            ended: Ended | None
            if fact is None:
                ended = await attempt.tick()
            elif isinstance(fact, Stop):
                return Stopped(fact.signame)
            elif isinstance(fact, (Reload, Edited)):
                ended = await self._config_change(attempt, requested=isinstance(fact, Reload))
            elif isinstance(fact, RestartAsked):
                ended = await self._restart_asked(attempt)
            elif isinstance(fact, (ParkAsked, WakeAsked)) and sleepmode.stops(self.keeper.config):
                ended = await self._park_by_stop(attempt) if isinstance(fact, ParkAsked) else None
            elif isinstance(fact, (ParkAsked, WakeAsked)) or (isinstance(fact, SleptUnasked) and fact.attempt == attempt.serial):
                ended = await self.parking.handle(fact, attempt)
                if ended is not None:
                    await self.ladder.stop(attempt.runtime, restarts=True)
            elif isinstance(fact, KernelSaid):
                ended = await attempt.handle(self._kernel_fact(attempt.serial, fact.event))
            elif isinstance(fact, ClusterSeen):
                ended = self.pair.on_view(fact.view, attempt.start.start_view, attempt.runtime.pid, attempt.ready) if self.pair else None
                if ended is not None:
                    await attempt.kill()
            elif isinstance(fact, (PullEnded, SleptUnasked)) or fact.attempt != attempt.serial:
                continue  # a late fact about an attempt (or a fetch) already over
            else:
                ended = await attempt.handle(fact)
                if isinstance(ended, Failed) and isinstance(fact, Exited) and self.pair is not None:
                    ended = self.pair.explain_exit(ended, attempt.start.start_view, attempt.runtime.pid)
            if ended is not None:
                return ended

    async def _park_by_stop(self, attempt: Attempt) -> Parked | None:
        """The front asked to park an idle instance that parks by stop: vLLM goes through the stop ladder, which is no
        failure (no restart follows); the supervisor then waits parked until the front asks for it again."""
        if not attempt.ready:
            self.reporter.say("park_ignored", "asked to park vLLM while it is not serving yet; nothing done", PRIORITY_INFO)
            return None
        ready_at = self.reporter.situation.ready_at
        serving_s = time.time() - ready_at if ready_at is not None else 0.0
        grace = self.keeper.config.daemon.stop_timeout_s
        self.reporter.say(
            "parking",
            f"parking: stopping vLLM ({attempt.runtime.label}) after {serving_s:.0f} s serving, as the front asked; "
            f"SIGTERM to {attempt.runtime.reaches}, SIGKILL after {grace:g} s",
            PRIORITY_INFO,
        )
        self.reporter.status("parking: stopping vLLM and waiting for its memory to come back", DaemonState.PARKING)
        await self.ladder.stop(attempt.runtime, restarts=False)
        return Parked(serving_s)

    def _kernel_fact(self, serial: int, event: DriverOutOfMemory | GpuXid) -> Parsed | DriverLine:
        """A driver message during an attempt; the out-of-memory line comes with MemAvailable read now, its evidence."""
        if isinstance(event, GpuXid):
            return Parsed(serial, event)
        mem = self.meminfo()
        return DriverLine(serial, event, mem.available if mem is not None else None)

    async def _config_change(self, attempt: Attempt, requested: bool) -> Reloaded | None:
        """SIGHUP or an edit on disk during an attempt: apply in place, or restart vLLM if its command changed.

        systemd hears RELOADING=1 ... READY=1 only while vLLM serves; during a
        start the next READY=1 is the start's own.
        """
        tell_systemd = tells_systemd(attempt.ready, requested, self.keeper.config.daemon.apply_on_change)
        if tell_systemd:
            self.reporter.reload_begins()
        diff = self.keeper.take(requested)
        if diff is None or not diff.needs_vllm_restart:
            if diff:
                attempt.config = self.keeper.config
                self.reporter.say(
                    "reload_applied", f"applied without restarting vLLM ({attempt.runtime.label}): {diff.describe()}", PRIORITY_INFO
                )
            if tell_systemd:
                self.reporter.reload_ends()
            return None
        self.reporter.say(
            "reload_applied",
            f"{diff.describe()}; vLLM's command line changes: stopping vLLM ({attempt.runtime.label}) and starting it with the new settings",
            PRIORITY_INFO,
        )
        # Said in the state file too, before vLLM is stopped: the front holds new requests from now on instead of
        # sending them to a vLLM that is stopping, and gb10d status no longer says serving.
        self.reporter.status("reloading: restarting vLLM with the new settings", DaemonState.RESTARTING)
        await self.ladder.stop(attempt.runtime, restarts=True)
        return Reloaded(changes=diff.describe())

    async def _restart_asked(self, attempt: Attempt) -> Reloaded:
        """A restart asked over the control socket (the front's page): vLLM goes through the stop ladder and starts
        again with the config in force, as after a reload that changes its command line; no failure is counted."""
        self.reporter.say("restart_asked", f"restarting vLLM ({attempt.runtime.label}): asked over the control socket; a new start, no failure counted", PRIORITY_INFO)
        # The state file says so before vLLM stops: the front holds new requests instead of sending them to it.
        self.reporter.status("restarting: asked over the control socket", DaemonState.RESTARTING)
        await self.ladder.stop(attempt.runtime, restarts=True)
        return Reloaded(changes="a restart asked over the control socket")
