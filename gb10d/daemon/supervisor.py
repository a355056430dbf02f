"""The supervisor: the loop over attempts, and what follows the end of each.

One coroutine owns the sequence of attempts. A sequence begins by fetching
what vLLM runs from (`pull.Pull`: a container image, pulled with progress;
nothing for a venv), so that the settings learned for that very image apply.
Each attempt (`attempt.Attempt`, followed by `following.Following` with the
config changes, restarts and parks asked meanwhile)
follows one start of vLLM and returns how it ended; the supervisor decides
what comes next with the pure `policy` (retry with corrected settings, back
off, or give up), runs the checks around each start (`preflight`: the
machine's memory budget shared with other gb10d instances, which a start
may wait for, and free memory), applies reloads (`keeper`), and on a pair
of machines lets the cluster (`pair`) say when vLLM may start and whether a
machine left. Every wait is on the fact queue (`loop`) with a deadline;
nothing sleeps blindly. A stop signal, wherever it comes, ends the sequence,
and `supervise()` then stops everything in one place (`stopladder`).
"""

from __future__ import annotations

from typing import Awaitable, Callable

from ..base.command import Tunables, build_argv
from ..base.config import Config
from ..base.errors import GiveUp
from ..base.image import PreparedImage
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..base.units import gib
from ..core import budget, policy
from ..core.cluster import vllm_flags
from ..core.facts import (
    ClusterSeen,
    Edited,
    Fact,
    KernelSaid,
    ParkAsked,
    Pulled,
    PullEnded,
    Reload,
    RestartAsked,
    Stop,
    Tick,
    WakeAsked,
)
from ..core.host import HostFacts
from ..core.lifecycle import start_time_asked
from ..core.memory import ALONE, MemInfo
from ..core.outcome import Cause, Ended, Failed, NodeLost, Parked, Reloaded, Stopped, WakeFailed
from ..core.policy import History
from ..core.statefile import DaemonState
from ..launch.runtime import Launcher
from ..vllm import sleepmode
from .attempt import Attempt, Start
from .following import Following
from .keeper import ConfigKeeper
from .loop import FactLoop
from .pair import Pair
from .preflight import Preflight
from .pull import Pull
from .reporter import Reporter
from .stopladder import StopLadder

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
        self.ladder = StopLadder(keeper, reporter, loop)
        self.following = Following(keeper, reporter, loop, self.ladder, pair, preflight.meminfo)
        # on_demand.park = "stop": vLLM does not run until the front asks for it, at the start and after each park.
        self._parked = sleepmode.stops(keeper.config)

    async def supervise(self) -> int:
        """Start vLLM, restart it as the policy says, until a stop signal (exit 0) or GiveUp.

        Every stop (a signal during an attempt, a wait, a back-off) ends the sequence of attempts; the stop ladder
        then runs here, and only here."""
        await self._until_stopped()
        return await self.ladder.stop_all(self.attempt, self.pair)

    async def _until_stopped(self) -> None:
        """The sequences of attempts, until a stop signal; a GiveUp goes up from here."""
        if self.pair is not None and await self.pair.start(self._between):
            return
        tunables: Tunables | None = None  # None: a new sequence, which fetches its image and then picks its settings
        history = History()
        reason = "initial"
        self.keeper.avoid_rejected()
        while True:
            if self.pair is not None and await self.pair.wait_whole(self._between):
                return
            if self._fresh_start:
                self._fresh_start, tunables, history = False, None, History()
            if self._parked:
                if await self._wait_parked():
                    return
                self._parked = False
            if tunables is None:
                prepared = await self._prepare()
                if isinstance(prepared, Stopped):
                    return
                if isinstance(prepared, Reloaded):
                    history, reason = History(), "reload"
                    continue
                tunables = self.keeper.starting_tunables(prepared.info.identity if prepared else None)
            await self.preflight.clear_leftovers(await self.launchers(self.keeper.config), history.attempts + 1)
            others = await self.preflight.admit(tunables, history.attempts > 0, self._pause)
            if others is None:
                return
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
                return
            baseline = self.attempt.start.baseline if self.attempt else None
            if isinstance(ended, (Parked, Reloaded, WakeFailed)):
                # A new sequence once the memory is back: measured before, the new start would be lowered or refused,
                # and the front waits for a park's memory before it starts another model.
                await self.close()
                if await self.preflight.memory_back(baseline, self._pause):
                    return
                self._parked = isinstance(ended, Parked)
                tunables, history, reason = None, History(), NEW_SEQUENCE_REASON[type(ended)]
                continue
            if isinstance(ended, Failed) and ended.cause is Cause.WORKER_LOST and self.pair is not None:
                confirmed = await self._confirm_node_loss(ended)
                if confirmed is None:
                    return
                ended = confirmed
            if isinstance(ended, NodeLost):
                # Not vLLM's failure: the same settings start again, uncounted, once the cluster is whole.
                await self.close()
                history, reason = policy.uncounted(history), "node_lost"
                self.reporter.failure("node_lost", ended.why, "starting vLLM again once the cluster is whole")
                self.reporter.restarting(reason)
                if await self.preflight.memory_back(baseline, self._pause):
                    return
                continue
            if not ended.was_ready and self.keeper.is_candidate():
                # A changed program that never served is not retried: the last good one serves again (a counted start).
                if await self._roll_back(ended, history, baseline):
                    return
                tunables, reason = None, "rollback"
                continue
            around = budget.neighbours(self.preflight.others()) if ended.cause is Cause.FREE_MEMORY else ALONE
            history, decision = policy.after_failure(ended, tunables, history, self.keeper.config, self.host, around)
            short = isinstance(decision, policy.GiveUp) and ended.cause is Cause.FREE_MEMORY
            if short and self._park_for_memory(policy.describe(ended)):
                await self.close()
                if await self.preflight.memory_back(baseline, self._pause):
                    return
                tunables, history, reason = None, History(), "wake"
                continue
            self._tell_failure(ended, decision, history)
            await self.close()
            if isinstance(decision, policy.GiveUp):
                raise GiveUp(decision.message, decision.exit_status, told=True)
            if await self.preflight.memory_back(baseline, self._pause):
                return
            if decision.delay_s > 0:
                self.reporter.extend(start_time_asked(self.keeper.config, decision.delay_s))
                if await self._pause(decision.delay_s):
                    return
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

    async def _run_attempt(self, tunables: Tunables, number: int, reason: str) -> Ended:
        """Start vLLM once and follow it until it ends."""
        config = self.keeper.config
        launcher = await self.launchers(config)
        argv = build_argv(config.vllm, tunables, (*(vllm_flags(config.cluster) if config.cluster else ()), *sleepmode.vllm_flags(config)), config.daemon.stop_timeout_s)
        env = {**launcher.environment(self.keeper.snapshot.vllm, tunables.env), **(self.pair.env() if self.pair else {}), **sleepmode.vllm_env(config)}
        self._serial += 1
        start = Start(self._serial, number, tunables, argv, env, reason, self.preflight.meminfo(), self.pair.view if self.pair else None)
        self.attempt = attempt = await Attempt.launch(start, launcher, config, self.reporter, self.loop.post, self._served)
        return await self.following.run(attempt)

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

    async def _confirm_node_loss(self, outcome: Failed) -> Failed | NodeLost | None:
        assert self.pair is not None and self.attempt is not None
        return await self.pair.confirm_node_loss(outcome, self.attempt.start.start_view, self.attempt.runtime.pid, self._between)

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
            self.reporter.say("stopping", f"received {fact.signame} while {self.reporter.situation.doing()}; stopping", PRIORITY_INFO)
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
            self.reporter.say("restart_ignored", f"asked to restart vLLM while {self.reporter.situation.doing()}: no vLLM runs, nothing to restart", PRIORITY_INFO)
        return False

    async def _pause(self, seconds: float) -> bool:
        return await self.loop.pause(seconds, self._between)

    async def close(self) -> None:
        """Make sure the current attempt's processes and tasks are gone."""
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            await attempt.close()
