"""One start of vLLM, from spawn to its end: the runtime, the tasks that read and probe it, and its core state.

The attempt forwards every line vLLM prints to the journal on the spot (the
hot path: lines are never queued, only the events parsed from them), posts
what it learns to the supervisor's queue as facts tagged with its serial,
and, when the supervisor hands a fact back, asks the lifecycle core what it
means and carries out the answer. It decides nothing itself.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from ..base.command import Tunables, shell_line
from ..base.config import Config
from ..base.errors import GiveUp, SpawnError
from ..base.levels import PRIORITY_DEBUG, PRIORITY_ERR, PRIORITY_INFO
from ..base.tasks import Probe
from ..base.tasks import choose as choose_probe
from ..core import lifecycle
from ..core.cluster import View
from ..core.facts import AttemptFact, Exited, ExitSeen, Fact, Parsed, Probed, ProbeKind, SleptUnasked, Tick
from ..core.lifecycle import Action, AttemptState
from ..core.memory import MemInfo
from ..core.outcome import Failed
from ..launch.runtime import Launcher, Runtime
from ..machine.journal import Journal
from ..vllm.events import Event, Failure, GraphsProgressed, ShardsProgressed
from ..vllm.logparse import BarCollapser, Classifier, EventScanner, Line, LineFramer
from ..vllm.sleepmode import sleep_freed, sleeps
from .probe import Prober, base_url, own_access_line
from .probing import check_ready, poll_until_healthy, watch_liveness
from .reporter import Reporter

# How long the pipes may stay open after the API server exited before gb10d acts on the exit anyway.
PIPE_DRAIN_S = 2.0


class OutputStream:
    """One of vLLM's pipes: frames its bytes, forwards each line to the journal, posts what it means.

    This is the hot path (every byte vLLM prints), so lines are not queued:
    only parsed events go to the loop.
    """

    def __init__(self, journal: Journal, collapser: BarCollapser, post: Callable[[Event], None], on_message: Callable[[str], None] | None = None) -> None:
        self.on_message = on_message  # sees every message, for the one line of sleep mode that is no Event
        self._journal = journal
        self._collapser = collapser
        self._post = post
        self._framer = LineFramer()
        self._classifier = Classifier()
        self._scanner = EventScanner()

    def feed(self, chunk: bytes) -> None:
        self._lines(self._framer.feed(chunk))

    def finish(self) -> None:
        """At EOF: the last unterminated line, and a failure message still waiting for its end."""
        self._lines(self._framer.flush())
        for event in self._scanner.flush():
            self._post(event)

    def _lines(self, lines: list[Line]) -> None:
        found: list[Event] = []
        classify, forward, scan, vllm_line = self._classifier.classify, self._collapser.forward, self._scanner.feed_message, self._journal.vllm_line
        for line in lines:
            text = line.text
            # One classification serves both the journal's priority and the event scan.
            record = classify(text)
            if forward(text):
                # gb10d's own probes fill uvicorn's access log (some 19,000 lines a day idle): debug priority.
                vllm_line(text, PRIORITY_DEBUG if own_access_line(record.message) else record.priority)
            if self.on_message is not None:
                self.on_message(record.message)
            events = scan(record.message)
            if events:
                # A remote Ray worker's failure says which machine it happened on.
                found += [replace(e, node=record.node) if record.node and isinstance(e, Failure) else e for e in events]
        # The lines reach the journal before what they mean reaches the loop.
        self._journal.flush()
        for event in skip_between_steps(found):
            self._post(event)


def _same_bar(a: Event, b: Event) -> bool:
    """Whether `b` is a later step of the same bar as `a` (shards or CUDA graphs, counting up to the same total)."""
    if isinstance(a, ShardsProgressed) and isinstance(b, ShardsProgressed):
        return a.total == b.total and a.eager == b.eager and a.done <= b.done
    if isinstance(a, GraphsProgressed) and isinstance(b, GraphsProgressed):
        return not a.finished and not b.finished and a.total == b.total and a.done <= b.done
    return False


def skip_between_steps(events: list[Event]) -> list[Event]:
    """The events of one read of vLLM's pipe, without the steps a bar took between its first and last in that read.

    tqdm redraws a CUDA-graph bar dozens of times on one physical line, so one
    read holds many steps of it; the loop would fold each into the start's
    state and say each on STATUS=, though it arrives in the same instant as
    the last. The first step of a run stays (it shows a new shard pass, 8/8
    then 0/8), and so does the last (where the bar got to); every other event
    is kept as it is, in order.
    """
    if len(events) < 3:
        return events
    kept = [events[0]]
    for before, event, after in zip(events, events[1:], events[2:]):
        if not (_same_bar(before, event) and _same_bar(event, after)):
            kept.append(event)
    kept.append(events[-1])
    return kept


@dataclass(frozen=True)
class Start:
    """One start of vLLM as the supervisor decided it: which, with what, why, and what it saw before."""

    serial: int  # names this attempt's facts
    number: int  # its place in the restart budget
    tunables: Tunables
    argv: Sequence[str]
    env: Mapping[str, str]
    reason: str  # why it starts: initial, reload, or the cause it retries after
    baseline: MemInfo | None  # /proc/meminfo before it started, for the memory gate
    start_view: View | None  # on a pair: the machines vLLM is placed on


class Attempt:
    """One start of vLLM; `handle` and `tick` return its `Failed` outcome once it is over."""

    def __init__(
        self,
        start: Start,
        state: AttemptState,
        runtime: Runtime,
        config: Config,
        reporter: Reporter,
        post: Callable[[Fact], None],
        on_ready: Callable[[Tunables], None],
    ) -> None:
        self.start = start
        self.serial = start.serial
        self.state = state
        self.runtime = runtime
        self.config = config
        self.reporter = reporter
        self._post = post
        self._on_ready = on_ready
        v = config.vllm
        # One client per attempt, made now: building it (TLS context included) must not delay READY=1 later.
        self.prober = Prober(base_url(v.host, v.port), v.api_key, timeout_s=config.liveness.probe_timeout_s)
        self._readiness: asyncio.Task[None] | None = None
        self._poller: asyncio.Task[None] | None = None
        self._liveness: asyncio.Task[None] | None = None
        # vLLM's `Sleep mode freed X GiB memory, Y GiB memory is still in use.`, once per sleep (on_demand.park).
        self.slept: tuple[int, int] | None = None
        self.slept_seen = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def launch(
        cls, start: Start, launcher: Launcher, config: Config, reporter: Reporter, post: Callable[[Fact], None], on_ready: Callable[[Tunables], None]
    ) -> Attempt:
        """Start vLLM and the tasks that follow it; a program that cannot start at all is a GiveUp."""
        number, tunables, argv, env, baseline = start.number, start.tunables, start.argv, start.env, start.baseline
        try:
            runtime = await launcher.launch(argv, env)
        except SpawnError as exc:
            raise GiveUp(str(exc), exc.exit_status) from None
        reporter.say(
            "starting",
            f"started vLLM as {runtime.label} (attempt {number}/{config.restart.max_attempts}, gpu_memory_utilization "
            f"{tunables.gpu_memory_utilization:g}): {shell_line(launcher.command_line(argv, env))}",
            PRIORITY_INFO,
            attempt=number,
            vllm_pid=runtime.pid,
            gpu_memory_utilization=tunables.gpu_memory_utilization,
            load_strategy=tunables.load_strategy,
            mem_available_bytes=baseline.available if baseline else None,
        )
        reporter.attempt_started(number, tunables, runtime.pid, baseline, start.reason)
        if config.metrics.proxy_vllm:
            reporter.vllm_metrics_at(base_url(config.vllm.host, config.vllm.port))
        state, actions = lifecycle.begin(number, tunables, time.monotonic(), config)
        attempt = cls(start, state, runtime, config, reporter, post, on_ready)
        attempt._tasks.append(asyncio.create_task(attempt._follow_output()))
        attempt._poller = asyncio.create_task(
            poll_until_healthy(attempt.prober, config.startup.health_poll_interval_s, attempt._awaiting_health, attempt._post_probe)
        )
        attempt._tasks.append(attempt._poller)
        await attempt._carry_out(actions)
        return attempt

    @property
    def number(self) -> int:
        return self.state.number

    @property
    def ready(self) -> bool:
        return self.state.ready

    def deadline(self) -> float | None:
        """When to `tick` without news (monotonic), or None."""
        return lifecycle.deadline(self.state, self.config)

    async def tick(self) -> Failed | None:
        """A deadline passed: sample vLLM's I/O and let the core judge stall, timeout or grace."""
        return await self.handle(Tick(self.runtime.io_bytes()))

    async def handle(self, fact: AttemptFact) -> Failed | None:
        """Fold a fact about this attempt into its state and carry out what the core decides."""
        self.state, actions = lifecycle.step(self.state, fact, time.monotonic(), self.config)
        return await self._carry_out(actions)

    async def _carry_out(self, actions: list[Action]) -> Failed | None:
        for action in actions:
            if self.reporter.tell(action, self.state.startup):
                continue
            if isinstance(action, lifecycle.StartReadiness):
                self._start_readiness()
            elif isinstance(action, lifecycle.BecomeReady):
                self._became_ready(action)
            elif isinstance(action, lifecycle.ProcessExited):
                self.reporter.vllm_down()
            elif isinstance(action, lifecycle.WakeUnasked):
                self.pause_liveness()  # its watch has ended with that verdict; a checked wake resumes it
                self._post(SleptUnasked(self.serial))  # parking wakes it, as it wakes a vLLM parked by sleep
            elif isinstance(action, lifecycle.Finish):
                await self.kill()
                outcome = action.outcome
                if self.state.ready_since is not None:
                    outcome = replace(outcome, served_s=time.monotonic() - self.state.ready_since)
                return outcome
        return None

    def _became_ready(self, action: lifecycle.BecomeReady) -> None:
        if self._poller is not None:
            self._poller.cancel()
        self.reporter.ready(self.state.startup, action.message, action.startup_s, self.number)
        self._on_ready(self.state.tunables)
        self.resume_liveness()

    def pause_liveness(self) -> None:
        """Asleep, vLLM generates nothing by design: the liveness watch would take it for hung."""
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None

    def resume_liveness(self) -> None:
        """Watch a serving vLLM from now on (after ready, and after a checked wake)."""
        if self.config.liveness.enabled and self._liveness is None:
            self._liveness = asyncio.create_task(
                watch_liveness(
                    self.prober, self.config.liveness, self._post_probe, model=self.config.vllm.served_names[0], probe=self._probe(),
                    sleep_checks=sleeps(self.config),
                )
            )
            self._tasks.append(self._liveness)

    def _message(self, message: str) -> None:
        freed = sleep_freed(message)
        if freed is not None:
            self.slept = freed
            self.slept_seen.set()

    def _start_readiness(self) -> None:
        """Run the readiness checks, unless they are running; a check that gave up may run again."""
        if self._readiness is None or self._readiness.done():
            self._readiness = asyncio.create_task(check_ready(self.prober, self.config, self._post_probe, self._probe()))
            self._tasks.append(self._readiness)

    def _probe(self) -> Probe:
        """The warm-up and idle probe request for what this vLLM said its model serves."""
        return choose_probe(self.config.liveness.probe_route, self.state.tasks)

    def _awaiting_health(self) -> bool:
        """The health poller's question: not ready, and no readiness check running."""
        return not self.state.ready and (self._readiness is None or self._readiness.done())

    def _post_probe(self, kind: ProbeKind, detail: str = "", label: str = "") -> None:
        self._post(Probed(self.serial, kind, detail, label))

    async def _follow_output(self) -> None:
        """Forward every vLLM line to the journal and parse it; report the exit at once, and again once
        the pipes are read to the end."""
        n = self.serial
        collapser = BarCollapser()
        on_message = self._message if sleeps(self.config) else None
        streams = [OutputStream(self.reporter.journal, collapser, lambda event: self._post(Parsed(n, event)), on_message) for _ in range(2)]
        readers = asyncio.gather(*self.runtime.readers(streams[0].feed, streams[1].feed))
        status = await self.runtime.wait()
        self._post(ExitSeen(n, status))
        try:
            # The exit's last words are still in the pipes; an orphaned EngineCore may hold them open forever.
            await asyncio.wait_for(asyncio.shield(readers), PIPE_DRAIN_S)
            for stream in streams:
                stream.finish()
        except asyncio.TimeoutError:
            pass
        self._post(Exited(n, status))
        await readers

    async def kill(self) -> None:
        """SIGKILL whatever is left of vLLM at once (a failed or stalled start has nothing to drain). Its share in
        the memory ledger is reserved first: the memory the kill gives back is still this instance's."""
        self.reporter.keeps_share()
        if self.runtime.alive() and not await self.runtime.kill():
            self.reporter.say(
                "crashed", f"processes of vLLM ({self.runtime.label}) survived SIGKILL: {self.runtime.members()}", PRIORITY_ERR
            )
        self.reporter.vllm_down()

    async def close(self) -> None:
        """Make sure vLLM's processes and this attempt's tasks are gone before anything else starts."""
        for task in self._tasks:
            task.cancel()
        if self.runtime.alive():
            await self.runtime.kill()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prober.close()
        self.reporter.attempt_over()
