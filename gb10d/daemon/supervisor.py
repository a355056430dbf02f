"""The supervisor: the loop over attempts, config changes during them, and the stop ladder.

One coroutine owns the sequence of attempts. A sequence begins by fetching
what vLLM runs from (`pull.Pull`: a container image, pulled with progress;
nothing for a venv), so that the settings learned for that very image apply.
Each attempt (`attempt.Attempt`)
follows one start of vLLM and returns how it ended; the supervisor decides
what comes next with the pure `policy` (retry with corrected settings, back
off, or give up), runs the checks around each start (`preflight`: the
machine's memory budget shared with other gb10d instances, which a start
may wait for, and free memory), applies reloads (`keeper`), and on a pair
of machines lets the cluster (`pair`) say when vLLM may start and whether a
machine left. Every wait is on the fact queue (`loop`) with a deadline;
nothing sleeps blindly.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from ..core import budget, policy
from ..vllm import sleepmode
from .attempt import Attempt, Start
from ..core.cluster import vllm_flags
from ..base.command import Tunables, build_argv
from ..base.config import Config
from ..base.errors import EXIT_OK, GiveUp, SpawnError
from ..vllm.events import DriverOutOfMemory, GpuXid
from ..core.facts import (
    ClusterSeen, DriverLine, Edited, Exited, Fact, KernelSaid, ParkAsked, Parsed, PullEnded, Pulled, Reload, RestartAsked, SleptUnasked, Stop, Tick, WakeAsked,
)
from ..core.host import HostFacts
from ..base.image import PreparedImage
from .keeper import ConfigKeeper
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..base.units import gib
from ..core.lifecycle import start_time_asked
from .loop import FactLoop
from ..core.memory import ALONE, MemInfo
from ..core.outcome import Cause, Ended, Failed, NodeLost, Parked, Reloaded, Stopped, WakeFailed
from .pair import Pair
from .parking import Parking
from ..core.policy import History
from ..core.reload import tells_systemd
from .preflight import Preflight
from .pull import Pull
from .reporter import Reporter
from ..core.statefile import DaemonState
from ..launch.runtime import Launcher

# Why the next start begins a new sequence of attempts (gb10d_start_attempts_total's reason).
NEW_SEQUENCE_REASON: dict[type[Ended], str] = {Parked: "wake", Reloaded: "reload", WakeFailed: "wake_failed"}

# How vLLM runs for a config (a local process, a container through an engine), as daemon.py picks it.
Launchers = Callable[[Config], Awaitable[Launcher]]


class Supervisor:
    """Runs vLLM under one config until stopped or given up; `supervise()` returns the exit status."""

    def __init__(
        self,
        keeper: ConfigKeeper,
        reporter: Reporter,
        loop: FactLoop,
        preflight: Preflight,
        launchers: Launchers,
        pair: Pair | None,
        host: HostFacts | None = None,
    ) -> None:
        self.keeper = keeper
        self.reporter = reporter
        self.loop = loop
        self.preflight = preflight
        self.launchers = launchers
        self.pair = pair
        self.host = host
        self.attempt: Attempt | None = None
        # Facts name the attempt by this serial, never by its budget number, which restarts at 1 after ready.
        self._serial = 0
        # A reload between attempts changed what vLLM runs with: the next start begins afresh.
        self._fresh_start = False
        self.parking = Parking(reporter, preflight.meminfo)
        # on_demand.park = "stop": vLLM does not run until the front asks for it, at the start and after each park.
        self._parked = sleepmode.stops(keeper.config)

    async def supervise(self) -> int:
        """Start vLLM, restart it as the policy says, until a stop signal (exit 0) or GiveUp."""
        if self.pair is not None and await self.pair.start(self._between):
            return await self._stop()
        tunables: Tunables | None = None  # None: a new sequence, which fetches its image and then picks its settings
        history = History()
        reason = "initial"
        self.keeper.avoid_rejected()
        while True:
            if self.pair is not None and await self.pair.wait_whole(self._between):
                return await self._stop()
            if self._fresh_start:
                self._fresh_start, tunables, history = False, None, History()
            if self._parked:
                if await self._wait_parked():
                    return await self._stop()
                self._parked = False
            if tunables is None:
                prepared = await self._prepare()
                if isinstance(prepared, Stopped):
                    return await self._stop()
                if isinstance(prepared, Reloaded):
                    history, reason = History(), "reload"
                    continue
                tunables = self.keeper.starting_tunables(prepared.info.identity if prepared else None)
            await self._clear_leftovers(history.attempts + 1)
            others = await self.preflight.admit(tunables, history.attempts > 0, self._pause)
            if others is None:
                return await self._stop()
            if self._fresh_start:
                continue  # a reload changed what vLLM runs with while the start waited: ask again with it
            try:
                tunables = self.preflight.fit(tunables, others)
            except GiveUp as refused:
                if not self._park_for_memory(refused.reason):
                    raise
                tunables, history, reason = None, History(), "wake"
                continue
            history = History(history.attempts + 1, history.backoffs)
            ended = await self._run_attempt(tunables, history.attempts, reason)
            if isinstance(ended, Stopped):
                return await self._stop()
            baseline = self.attempt.start.baseline if self.attempt else None
            if isinstance(ended, (Parked, Reloaded, WakeFailed)):
                # A new sequence once the memory is back: measured before, the new start would be lowered or refused,
                # and the front waits for a park's memory before it starts another model.
                await self.close()
                if await self.preflight.memory_back(baseline, self._pause):
                    return await self._stop()
                self._parked = isinstance(ended, Parked)
                tunables, history, reason = None, History(), NEW_SEQUENCE_REASON[type(ended)]
                continue
            if isinstance(ended, Failed) and ended.cause is Cause.WORKER_LOST and self.pair is not None:
                confirmed = await self._confirm_node_loss(ended)
                if confirmed is None:
                    return await self._stop()
                ended = confirmed
            if isinstance(ended, NodeLost):
                # Not vLLM's failure: the same settings start again, uncounted, once the cluster is whole.
                await self.close()
                history, reason = policy.uncounted(history), "node_lost"
                self.reporter.failure("node_lost", ended.why, "starting vLLM again once the cluster is whole")
                self.reporter.restarting(reason)
                if await self.preflight.memory_back(baseline, self._pause):
                    return await self._stop()
                continue
            if not ended.was_ready and self.keeper.is_candidate():
                # A changed program that never served is not retried: the last good one serves again (a counted start).
                if await self._roll_back(ended, history, baseline):
                    return await self._stop()
                tunables, reason = None, "rollback"
                continue
            around = budget.neighbours(self.preflight.others()) if ended.cause is Cause.FREE_MEMORY else ALONE
            history, decision = policy.after_failure(ended, tunables, history, self.keeper.config, self.host, around)
            short = isinstance(decision, policy.GiveUp) and ended.cause is Cause.FREE_MEMORY
            if short and self._park_for_memory(policy.describe(ended)):
                await self.close()
                if await self.preflight.memory_back(baseline, self._pause):
                    return await self._stop()
                tunables, history, reason = None, History(), "wake"
                continue
            self._tell_failure(ended, decision, history)
            await self.close()
            if isinstance(decision, policy.GiveUp):
                raise GiveUp(decision.message, decision.exit_status, told=True)
            if await self.preflight.memory_back(baseline, self._pause):
                return await self._stop()
            if decision.delay_s > 0:
                self.reporter.extend(start_time_asked(self.keeper.config, decision.delay_s))
                if await self._pause(decision.delay_s):
                    return await self._stop()
            tunables, reason = decision.tunables, ended.cause.value
            self.reporter.restarting(reason)

    async def _prepare(self) -> PreparedImage | Stopped | Reloaded | None:
        """Fetch what a new sequence of starts runs from (a container image); a stalled pull is pulled again, paced
        and counted as starts are; a pull that cannot succeed is a GiveUp."""
        history = History()
        while True:
            # This fetch is for the config in force now, a reload during a back-off included.
            self._fresh_start, config = False, self.keeper.config
            launcher = await self.launchers(config)
            history = History(history.attempts + 1, history.backoffs)
            self._serial += 1
            ended = await self._pull(Pull(self._serial, history.attempts, launcher, config, self.reporter, self.loop.post))
            if not isinstance(ended, Failed):
                return ended
            history, decision = policy.after_failure(ended, Tunables.from_config(config.vllm), history, config, self.host)
            self._tell_failure(ended, decision, history)
            if isinstance(decision, policy.GiveUp):
                raise GiveUp(decision.message, decision.exit_status, told=True)
            self.reporter.restarting(ended.cause.value)
            self.reporter.extend(start_time_asked(config, decision.delay_s))
            if await self._pause(decision.delay_s):
                return Stopped("")

    async def _pull(self, pull: Pull) -> PreparedImage | Failed | Stopped | Reloaded | None:
        """Follow one fetch until the image is there, it stalls, or a stop or a reload that changes vLLM ends it."""
        try:
            while True:
                fact = await self.loop.next(pull.deadline())
                ended: Failed | None = None
                if fact is None:
                    ended = pull.handle(Tick(None))
                elif isinstance(fact, PullEnded) and fact.attempt == pull.serial:
                    return pull.result()
                elif isinstance(fact, Pulled):
                    ended = pull.handle(fact) if fact.attempt == pull.serial else None
                elif isinstance(fact, (Reload, Edited)):
                    diff = self.keeper.take(requested=isinstance(fact, Reload))
                    if diff is not None and diff.needs_vllm_restart:
                        self.reporter.say("reload_applied", f"{diff.describe()}; fetching again for the new settings", PRIORITY_INFO)
                        return Reloaded(diff.describe())
                elif self._between(fact):
                    return Stopped(fact.signame if isinstance(fact, Stop) else "")
                if ended is not None:
                    return ended
        finally:
            await pull.close()

    async def _clear_leftovers(self, number: int) -> None:
        """Remove what a dead gb10d left under this config, before this start's memory is counted.

        A container whose gb10d was SIGKILLed still holds vLLM's port, its
        name and all its memory: measured first, that memory would make the
        free-memory check lower or refuse the start that replaces it. Its
        shared-memory segments are stale only once it is gone.
        """
        launcher = await self.launchers(self.keeper.config)
        try:
            removed = await launcher.clear_leftovers()
        except SpawnError as exc:
            raise GiveUp(str(exc), exc.exit_status) from None
        if removed is not None:
            self.reporter.say("container_removed", removed, PRIORITY_WARNING, attempt=number)
        self.preflight.clear_shm()

    async def _run_attempt(self, tunables: Tunables, number: int, reason: str) -> Ended:
        """Start vLLM once and follow it until it ends."""
        config = self.keeper.config
        launcher = await self.launchers(config)
        argv = build_argv(config.vllm, tunables, (*(vllm_flags(config.cluster) if config.cluster else ()), *sleepmode.vllm_flags(config)), config.daemon.stop_timeout_s)
        env = {**launcher.environment(self.keeper.snapshot.vllm, tunables.env), **(self.pair.env() if self.pair else {}), **sleepmode.vllm_env(config)}
        self._serial += 1
        start = Start(self._serial, number, tunables, argv, env, reason, self.preflight.meminfo(), self.pair.view if self.pair else None)
        self.attempt = attempt = await Attempt.launch(start, launcher, config, self.reporter, self.loop.post, self._served)
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
                    await attempt.runtime.stop(self.keeper.config.daemon.stop_timeout_s, self._on_escalate)
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

    def _park_for_memory(self, why: str) -> bool:
        """An on-demand instance whose start finds too little free memory waits parked instead of giving up: the memory
        is another on-demand model's, which the front parks to make room before it asks again. True when it parks."""
        config = self.keeper.config
        if config.on_demand is None or self.pair is not None:
            return False
        self.reporter.say(
            "parked_short_of_memory",
            f"{why}; not starting vLLM now: parked until the front asks again (it makes room first; [on_demand])",
            PRIORITY_WARNING,
        )
        self._parked = True
        return True

    async def _wait_parked(self) -> bool:
        """vLLM stays stopped until the front asks for it (on_demand.park = "stop"); True when a stop came meanwhile.

        The ledger's record reserves nothing while parked and says what a start would need; the state file and
        STATUS= say parked, and READY=1 goes out: gb10d is active for systemd, its model is served on demand."""
        config = self.keeper.config
        mem = self.preflight.meminfo()
        share = budget.share_bytes(config.vllm.gpu_memory_utilization, mem.total, config.memory.headroom_gib) if mem else 0
        self.reporter.parked(
            f"{sleepmode.PARKED_STATUS}: vLLM is not running, {config.vllm.served_names[0]} starts when a request for it "
            f"arrives (on_demand.park = \"{config.on_demand.park if config.on_demand else 'stop'}\"; a start reserves {gib(share)})",
            share, reservation_bytes=share,
        )
        while True:
            fact = await self.loop.next(None)
            if isinstance(fact, WakeAsked):
                self.reporter.say("unparking", "starting vLLM: the front asked for it, a request waits", PRIORITY_INFO)
                self.reporter.status("starting: the front asked for vLLM, a request waits", DaemonState.STARTING)
                return False
            if fact is not None and not isinstance(fact, ParkAsked) and self._between(fact):
                return True

    async def _park_by_stop(self, attempt: Attempt) -> Parked | None:
        """The front asked to park an idle instance that parks by stop: vLLM goes through the stop ladder, which is no
        failure (no restart follows); the supervisor then waits parked until the front asks for it again."""
        if not attempt.ready:
            self.reporter.say("park_ignored", "asked to park vLLM while it is not serving yet; nothing done", PRIORITY_INFO)
            return None
        serving_s = time.time() - self.reporter.ready_at if self.reporter.ready_at is not None else 0.0
        grace = self.keeper.config.daemon.stop_timeout_s
        self.reporter.say(
            "parking",
            f"parking: stopping vLLM ({attempt.runtime.label}) after {serving_s:.0f} s serving, as the front asked; "
            f"SIGTERM to {attempt.runtime.reaches}, SIGKILL after {grace:g} s",
            PRIORITY_INFO,
        )
        self.reporter.status("parking: stopping vLLM and waiting for its memory to come back", DaemonState.PARKING)
        await attempt.runtime.stop(grace, self._on_escalate)
        return Parked(serving_s)

    def _kernel_fact(self, serial: int, event: DriverOutOfMemory | GpuXid) -> Parsed | DriverLine:
        """A driver message during an attempt; the out-of-memory line comes with MemAvailable read now, its evidence."""
        if isinstance(event, GpuXid):
            return Parsed(serial, event)
        mem = self.preflight.meminfo()
        return DriverLine(serial, event, mem.available if mem is not None else None)

    async def _confirm_node_loss(self, outcome: Failed) -> Failed | NodeLost | None:
        assert self.pair is not None and self.attempt is not None
        return await self.pair.confirm_node_loss(outcome, self.attempt.start.start_view, self.attempt.runtime.pid, self._between)

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
        await attempt.runtime.stop(self.keeper.config.daemon.stop_timeout_s, self._on_escalate)
        return Reloaded(changes=diff.describe())

    async def _restart_asked(self, attempt: Attempt) -> Reloaded:
        """A restart asked over the control socket (the front's page): vLLM goes through the stop ladder and starts
        again with the config in force, as after a reload that changes its command line; no failure is counted."""
        self.reporter.say("restart_asked", f"restarting vLLM ({attempt.runtime.label}): asked over the control socket; a new start, no failure counted", PRIORITY_INFO)
        # The state file says so before vLLM stops: the front holds new requests instead of sending them to it.
        self.reporter.status("restarting: asked over the control socket", DaemonState.RESTARTING)
        await attempt.runtime.stop(self.keeper.config.daemon.stop_timeout_s, self._on_escalate)
        return Reloaded(changes="a restart asked over the control socket")

    def _served(self, tunables: Tunables) -> None:
        """The attempt reached ready: what it learned and the program it ran are kept."""
        self.keeper.served(tunables, self.attempt.state.version if self.attempt else None)

    async def _roll_back(self, outcome: Failed, history: History, baseline: MemInfo | None) -> bool:
        """One journal line (the candidate's failure, both programs, the way back), then the candidate is gone and its
        memory back; True when a stop came meanwhile."""
        cause = policy.describe(outcome)
        candidate, good = self.keeper.roll_back(cause, self.attempt.state.version if self.attempt else None)
        message = (
            f"the candidate {candidate.describe()} failed its start: {cause}; going back to the last good "
            f"{good.describe()} with the settings that served under it (attempt {history.attempts + 1}/"
            f"{self.keeper.config.restart.max_attempts})"
        )
        self.reporter.failure(outcome.cause.value, cause, f"going back to {good.path}")
        self.reporter.say("program_rolled_back", message, PRIORITY_ERR, attempt=history.attempts, cause=outcome.cause.value)
        self.reporter.status(message)
        self.reporter.restarting("rollback")
        await self.close()
        return await self.preflight.memory_back(baseline, self._pause)

    def _tell_failure(self, outcome: Failed, decision: policy.Retry | policy.GiveUp, history: History) -> None:
        """One journal line with the cause, the numbers and the action; STATUS= and the state file follow."""
        retry = isinstance(decision, policy.Retry)
        message = policy.failure_line(outcome, decision, history, self.keeper.config)
        cause = policy.describe(outcome)
        self.reporter.failure(outcome.cause.value, cause, decision.message)
        self.reporter.say(
            policy.event_kind(outcome.cause),
            message,
            PRIORITY_WARNING if retry else PRIORITY_ERR,
            attempt=history.attempts,
            cause=outcome.cause.value,
            gpu_memory_utilization=decision.tunables.gpu_memory_utilization if isinstance(decision, policy.Retry) else None,
            exit_status=decision.exit_status if isinstance(decision, policy.GiveUp) else None,
        )
        self.reporter.status(message)

    def _between(self, fact: Fact) -> bool:
        """A fact while no attempt runs (waiting to restart, for the cluster, for memory); True for a stop."""
        if isinstance(fact, Stop):
            self.reporter.say("stopping", f"received {fact.signame} while {self.reporter.doing()}; stopping", PRIORITY_INFO)
            return True
        if isinstance(fact, (Reload, Edited)):
            diff = self.keeper.take(requested=isinstance(fact, Reload))
            if diff is not None and diff.needs_vllm_restart:
                self._fresh_start = True
        elif isinstance(fact, ClusterSeen) and self.pair is not None:
            self.pair.seen(fact.view)
        elif isinstance(fact, KernelSaid):
            self.reporter.kernel(fact.event)
        elif isinstance(fact, RestartAsked):
            self.reporter.say("restart_ignored", f"asked to restart vLLM while {self.reporter.doing()}: no vLLM runs, nothing to restart", PRIORITY_INFO)
        return False

    async def _pause(self, seconds: float) -> bool:
        return await self.loop.pause(seconds, self._between)

    async def _stop(self) -> int:
        """The stop ladder: STOPPING=1, SIGTERM the group, grace, SIGKILL, nothing left; exit 0.

        A second stop signal during the grace skips to SIGKILL.
        """
        attempt = self.attempt
        grace = self.keeper.config.daemon.stop_timeout_s
        self.reporter.stopping("stopping Ray" if attempt is None and self.pair is not None else "stopping vLLM")
        if attempt is not None:
            self.reporter.say(
                "stopping",
                f"stopping vLLM ({attempt.runtime.label}): SIGTERM to {attempt.runtime.reaches}, SIGKILL after {grace:g} s",
                PRIORITY_INFO,
            )
            stop = asyncio.create_task(attempt.runtime.stop(grace, self._on_escalate))
            while not stop.done():
                second = asyncio.create_task(self.loop.queue.get())
                done, _ = await asyncio.wait({stop, second}, return_when=asyncio.FIRST_COMPLETED)
                if second in done and isinstance(second.result(), Stop):
                    self.reporter.say("stopping", f"second stop signal: killing vLLM ({attempt.runtime.reaches}) now", PRIORITY_WARNING)
                    await attempt.runtime.kill()
                if not second.done():
                    second.cancel()
            await stop
        if self.pair is not None:
            await self.pair.close()
        left = f"nothing of {attempt.runtime.reaches} is left" if attempt is not None else "nothing of it is left"
        self.reporter.say("stopped", f"vLLM stopped; {left}", PRIORITY_INFO)
        self.reporter.stopped()
        return EXIT_OK

    def _on_escalate(self, pids: list[int]) -> None:
        self.reporter.say(
            "stopping",
            f"vLLM did not exit within daemon.stop_timeout_s {self.keeper.config.daemon.stop_timeout_s:g} s; "
            f"sending SIGKILL to {len(pids)} remaining process(es): {pids}",
            PRIORITY_WARNING,
        )

    async def close(self) -> None:
        """Make sure the current attempt's processes and tasks are gone."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            await attempt.close()
