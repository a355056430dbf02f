"""`gb10d run`: the supervisor loop.

One coroutine owns all state (the attempt, its settings, the startup phase,
the child). Everything else only reports facts to it through one queue:
signal handlers (`Stop`, `Reload`), the pipe readers (`Parsed` events; the
raw lines are forwarded to the journal on the spot), the child's exit
(`Exited`) and the probes (`Probed`). The loop asks the pure core what the
facts mean (`phases.advance`, `policy.classify`, `policy.next_attempt`,
`memory.preflight`) and carries out the answer: spawn, notify systemd, log,
update metrics and the state file, or stop the process group. It never
sleeps blindly: every wait is on the queue with a deadline derived from the
state (stall timer, start timeout, health interval, watchdog).
"""

from __future__ import annotations

import asyncio
import enum
import os
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Union

from . import learned, liveness, policy
from .cluster import (
    View,
    cluster_env,
    death_notice_s,
    has_joined,
    interpreter,
    is_whole,
    lost_since,
    lost_text,
    ray_argv,
    ray_program,
    view_state,
    view_text,
    vllm_flags,
    waiting_text,
    watcher_argv,
)
from .command import Tunables, build_argv, build_env, shell_line
from .config import load_config
from .interfaces import Choice, InterfaceError, find
from .reload import ConfigDiff, ConfigSnapshot, ConfigWatcher, WatchUnavailable, diff_configs
from .devices import check_gpu_access
from .errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_MEMORY_NOT_RETURNED, EXIT_OK, ConfigError, GiveUp, SpawnError
from .events import EngineDied, Event, Failure, RayWorkerLost, SpecDecodingLogged, StartupCompleted, StatsLogged
from .journal import DEFAULT_SOCKET_PATH, Journal, connected_to_journal
from .logparse import BarCollapser, Classifier, EventScanner, Line, LineFramer
from .memory import (
    MemInfo,
    PreflightRefused,
    evict_page_cache,
    memory_returned,
    preflight,
    read_meminfo,
    safetensors_files,
)
from .metrics import Metrics
from .notify import Notifier, unit_name
from .phases import Phase, StartupState, advance, enter, note_io, start, status_text
from .policy import Cause, History, Outcome, Retry
from .probe import Prober, base_url
from .process import ProcessGroup, become_subreaper, describe_exit, group_alive, group_io_bytes, group_members
from .raynode import RayNode
from .statefile import write_state

PRIORITY_ERR, PRIORITY_WARNING, PRIORITY_INFO, PRIORITY_DEBUG = 3, 4, 6, 7

# How much longer than the stall timeout systemd waits after each sign of progress:
# gb10d's own stall detection must always fire first.
EXTEND_MARGIN_S = 60.0
# Bytes of I/O by vLLM's processes that count as a sign of life while no line is printed.
IO_PROGRESS_MIN_BYTES = 1 << 20
# How often that I/O is sampled while starting (at most; a quarter of the stall timeout if shorter).
IO_SAMPLE_S = 2.0
# How long /health may refuse connections after `Application startup complete.` (uvicorn listens just after).
LISTEN_GRACE_S = 30.0
# How long the pipes may stay open after the API server exited before gb10d acts on the exit anyway.
PIPE_DRAIN_S = 2.0
# While a machine of a pair waits for the other, it asks systemd for this much more start time, a third of it at a time.
CLUSTER_EXTEND_S = 90.0
# How long a machine of a pair waits for its link interface to come up at boot before refusing the config.
LINK_WAIT_S = 120.0


# --- what the loop is told ---------------------------------------------------


@dataclass(frozen=True)
class Stop:
    """SIGTERM or SIGINT arrived."""

    signame: str


@dataclass(frozen=True)
class Reload:
    """SIGHUP arrived (systemctl reload)."""


@dataclass(frozen=True)
class Edited:
    """The config file or a drop-in changed on disk (a burst of writes, debounced)."""


@dataclass(frozen=True)
class Parsed:
    """A fact parsed from vLLM's output during the attempt with serial `attempt`."""

    attempt: int
    event: Event


@dataclass(frozen=True)
class Exited:
    """The API-server process of the attempt with serial `attempt` exited (pipes drained, or given up on)."""

    attempt: int
    status: int


class ProbeKind(enum.Enum):
    HEALTHY = "healthy"  # /health answered 200 before ready: start the readiness checks
    WARMING = "warming"  # /health and /v1/models passed; the warm-up completion is running
    READY = "ready"  # every readiness check passed
    NOT_READY = "not_ready"  # a readiness check failed for a reason no wait can fix
    DEAD = "dead"  # while serving: /health 503, or nothing listens any more
    HUNG = "hung"  # while serving: the engine answers /health but generates nothing


@dataclass(frozen=True)
class Probed:
    """An HTTP probe's conclusion during the attempt with serial `attempt`."""

    attempt: int
    kind: ProbeKind
    detail: str = ""
    status: int | None = None
    cause: Cause | None = None
    label: str = ""  # the liveness verdict's metrics label (hung, probe_timeout, health)


@dataclass(frozen=True)
class ClusterSeen:
    """The Ray cluster's node table changed, or cannot be read (raynode.RayNode)."""

    view: View


Item = Union[Stop, Reload, Edited, Parsed, Exited, Probed, ClusterSeen]


@dataclass
class Attempt:
    """The mutable facts of the attempt in progress; only the loop touches them."""

    number: int
    serial: int
    tunables: Tunables
    process: ProcessGroup
    startup: StartupState
    spawned_at: float
    baseline: MemInfo | None
    failures: list[Failure] = field(default_factory=list)
    ready_since: float | None = None  # monotonic, once ready
    startup_complete_at: float | None = None
    readiness: asyncio.Task[None] | None = None
    last_io: int | None = None  # None until the first sample: the baseline counts as no progress
    next_io_at: float = 0.0
    last_extend: float = 0.0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    prober: Prober | None = None
    start_view: View | None = None  # on a pair: the machines vLLM was placed on

    @property
    def ready(self) -> bool:
        """READY=1 was sent for this attempt; derived from `ready_since`, so the two cannot disagree."""
        return self.ready_since is not None


class _Stream:
    """One of vLLM's pipes: frames its bytes, forwards each line to the journal, posts what it means.

    This is the hot path (every byte vLLM prints), so lines are not queued:
    only parsed events go to the loop.
    """

    def __init__(self, journal: Journal, collapser: BarCollapser, post: Callable[[Event], None]) -> None:
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
        for line in lines:
            text = line.text
            # One classification serves both the journal's priority and the event scan.
            record = self._classifier.classify(text)
            if self._collapser.forward(text):
                self._journal.vllm_line(text, record.priority)
            for event in self._scanner.feed_message(record.message):
                # A remote Ray worker's failure says which machine it happened on.
                self._post(replace(event, node=record.node) if record.node and isinstance(event, Failure) else event)
        self._journal.flush()


class Supervisor:
    """Runs vLLM under one config until stopped or given up; `run()` returns the exit status."""

    def __init__(self, config_path: Path, snapshot: ConfigSnapshot, journal: Journal, notifier: Notifier, metrics: Metrics) -> None:
        self.config_path = config_path
        # What vLLM was started with (env_file contents included): reloads are compared with this.
        self.snapshot = snapshot
        self.config = snapshot.config
        self.journal = journal
        self.notifier = notifier
        self.metrics = metrics
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.started_at = time.time()
        self.attempt: Attempt | None = None
        self.state = "starting"
        self.last_failure: dict[str, object] | None = None
        self.ready_at: float | None = None
        self._next_watchdog = 0.0
        # Facts name the attempt by this serial, never by its budget number, which restarts at 1 after ready.
        self._serial = 0
        # Why the settings now in use differ from the config's, for the learned-settings file.
        self._correction = ""
        # A reload between attempts changed what vLLM runs with: the next start begins afresh.
        self._fresh_start = False
        self._written_phase: Phase | None = None
        self._written_at = 0.0
        self._deferred_write: asyncio.TimerHandle | None = None
        # A pair of machines ([cluster]): the link interface, this machine's Ray, the latest node table.
        self.link: Choice | None = None
        self.ray: RayNode | None = None
        self.view: View | None = None
        self.previous_view: View | None = None
        self.joined = False
        self._state_warned = False  # the unwritable state file is reported once
        self.death_notice_s = 0.0  # how long Ray may take to declare a machine dead (set with Ray's environment)

    @property
    def max_attempts(self) -> int:
        return self.config.restart.max_attempts

    # --- the main loop ---------------------------------------------------

    async def run(self) -> int:
        """Supervise until a stop signal (exit 0) or a reason to give up (its exit status)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.queue.put_nowait, Stop(sig.name))
        loop.add_signal_handler(signal.SIGHUP, self.queue.put_nowait, Reload())
        self._serve_metrics()
        watcher = self._watch_config(loop)
        try:
            problem = check_gpu_access(unit_name())
            if problem is not None:
                raise GiveUp(problem, EXIT_CONFIG)
            if self.config.cluster is not None:
                if await self._start_ray():
                    return await self._stopped()
                if self.config.cluster.role == "worker":
                    return await self._serve_worker()
            return await self._supervise()
        except GiveUp as exc:
            self.state = "failed"
            self.journal.event("gave_up", exc.reason, PRIORITY_ERR, exit_status=exc.exit_status)
            self.notifier.status(f"failed: {exc.reason}"[:200])
            self._write_state(status_text_=f"failed: {exc.reason}")
            return exc.exit_status
        finally:
            if watcher is not None:
                watcher.stop()
            await self._discard_attempt()
            if self.ray is not None:
                await self.ray.close()
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                loop.remove_signal_handler(sig)
            self.metrics.close()
            self.journal.flush()

    async def _supervise(self) -> int:
        tunables = self._starting_tunables()
        history = History()
        reason = "initial"
        while True:
            if self.config.cluster is not None and await self._wait_whole():
                return await self._stopped()
            if self._fresh_start:
                self._fresh_start, tunables, history = False, self._starting_tunables(), History()
            tunables = await self._preflight(tunables)
            history = History(history.attempts + 1, history.backoffs)
            outcome = await self._run_attempt(tunables, history.attempts, reason)
            if outcome is None:
                return await self._stopped()
            if outcome.cause is Cause.RELOAD:
                await self._discard_attempt()
                tunables, history, reason = self._starting_tunables(), History(), "reload"
                continue
            if outcome.cause is Cause.WORKER_LOST and self.config.cluster is not None:
                confirmed = await self._confirm_node_loss(outcome)
                if confirmed is None:
                    return await self._stopped()
                outcome = confirmed
            if outcome.cause is Cause.NODE_LOST:
                # Not vLLM's failure: the same settings start again, uncounted, once the cluster is whole.
                baseline = self.attempt.baseline if self.attempt else None
                await self._discard_attempt()
                history, reason = History(history.attempts - 1, history.backoffs), outcome.cause.value
                self.last_failure = {"cause": reason, "message": outcome.detail, "action": "starting vLLM again once the cluster is whole", "at": time.time()}
                self.metrics.restart(reason)
                if await self._memory_gate(baseline):
                    return await self._stopped()
                continue
            if self.attempt is not None and self.attempt.ready_since is not None:
                outcome = replace(outcome, served_s=time.monotonic() - self.attempt.ready_since)
            if policy.starts_new_count(outcome, self.config):
                history = History(1, 0)
            decision = policy.next_attempt(outcome, tunables, history, self.config)
            self._log_failure(outcome, decision, history.attempts)
            baseline = self.attempt.baseline if self.attempt else None
            await self._discard_attempt()
            if isinstance(decision, policy.GiveUp):
                raise GiveUp(decision.message, decision.exit_status)
            if await self._memory_gate(baseline):
                return await self._stopped()
            if decision.delay_s > 0:
                history = History(history.attempts, history.backoffs + 1)
                self.notifier.extend_timeout(decision.delay_s + self.config.startup.stall_timeout_s + EXTEND_MARGIN_S)
                if await self._wait_stop(decision.delay_s):
                    return await self._stopped()
            tunables = decision.tunables
            reason = outcome.cause.value
            self.metrics.restart(reason)

    async def _next_item(self, deadline: float | None) -> Item | None:
        """The next fact, or None once `deadline` (monotonic) passes; pings the watchdog meanwhile."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            if self.notifier.watchdog_usec is not None and now >= self._next_watchdog:
                self.notifier.watchdog()
                self._next_watchdog = now + self.notifier.watchdog_usec / 2e6
            until = deadline
            if self.notifier.watchdog_usec is not None:
                until = self._next_watchdog if until is None else min(until, self._next_watchdog)
            timeout = None if until is None else max(0.0, until - now)
            try:
                return await asyncio.wait_for(self.queue.get(), timeout)
            except asyncio.TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    return None

    async def _wait_stop(self, seconds: float, until: Callable[[], bool] | None = None) -> bool:
        """Wait `seconds`, or until `until()` holds after a change, unless a stop signal comes first (True).

        Facts about an attempt are stale here; config changes and node tables are taken in.
        """
        deadline = asyncio.get_running_loop().time() + seconds
        while (until is None or not until()) and (item := await self._next_item(deadline)) is not None:
            if isinstance(item, Stop):
                self.journal.event("stopping", f"received {item.signame} while {self._waiting_for()}; stopping", PRIORITY_INFO)
                return True
            if isinstance(item, (Reload, Edited)):
                diff = self._take_config(requested=isinstance(item, Reload))
                if diff is not None and diff.needs_vllm_restart:
                    self._fresh_start = True
            if isinstance(item, ClusterSeen):
                self._seen(item.view)
        return False

    def _waiting_for(self) -> str:
        return {"waiting": "waiting for the Ray cluster", "joining": "waiting to join the Ray cluster", "serving": "serving"}.get(
            self.state, "waiting to restart"
        )

    # --- one attempt -----------------------------------------------------

    async def _run_attempt(self, tunables: Tunables, number: int, reason: str) -> Outcome | None:
        """Start vLLM once and follow it until it fails (its Outcome) or a stop is requested (None)."""
        v = self.config.vllm
        cluster = self.config.cluster
        argv = build_argv(v, tunables, vllm_flags(cluster) if cluster else ())
        env = {**build_env(v), **self._cluster_env()}
        baseline = self._meminfo()
        try:
            process = await ProcessGroup.spawn(argv, env)
        except SpawnError as exc:
            raise GiveUp(str(exc), exc.exit_status) from None
        self.journal.event(
            "starting",
            f"started vLLM as pid {process.pid} (attempt {number}/{self.max_attempts}, gpu_memory_utilization "
            f"{tunables.gpu_memory_utilization:g}): {shell_line(argv)}",
            PRIORITY_INFO,
            attempt=number,
            vllm_pid=process.pid,
            gpu_memory_utilization=tunables.gpu_memory_utilization,
            load_strategy=tunables.load_strategy,
            mem_available_bytes=baseline.available if baseline else None,
        )
        self.metrics.start_attempt(reason)
        self.metrics.set_utilization(tunables.gpu_memory_utilization)
        if self.config.metrics.proxy_vllm:
            self.metrics.set_vllm_target(base_url(v.host, v.port) + "/metrics")
        now = time.monotonic()
        self._serial += 1
        attempt = Attempt(number, self._serial, tunables, process, enter(start(now), Phase.SPAWNING, now), now, baseline)
        attempt.start_view = self.view
        # One client per attempt, made now: building it (TLS context included) must not delay READY=1 later.
        attempt.prober = Prober(base_url(v.host, v.port), v.api_key, timeout_s=self.config.liveness.probe_timeout_s)
        self.attempt = attempt
        self.state = "starting" if number == 1 else "restarting"
        attempt.tasks.append(asyncio.create_task(self._follow_output(attempt)))
        attempt.tasks.append(asyncio.create_task(self._poll_until_healthy(attempt)))
        self.metrics.set_vllm_up(True)
        self._extend(attempt, force=True)
        self._show_phase(attempt)

        while True:
            item = await self._next_item(self._attempt_deadline(attempt))
            if item is None:
                outcome = await self._on_deadline(attempt)
                if outcome is not None:
                    return outcome
                continue
            if isinstance(item, Stop):
                return None
            if isinstance(item, (Reload, Edited)):
                outcome = await self._on_config_change(attempt, requested=isinstance(item, Reload))
                if outcome is not None:
                    return outcome
                continue
            if getattr(item, "attempt", attempt.serial) != attempt.serial:
                continue  # a late fact about an attempt already over
            if isinstance(item, ClusterSeen):
                outcome = self._on_cluster(attempt, item.view)
            elif isinstance(item, Parsed):
                outcome = await self._on_event(attempt, item.event)
            elif isinstance(item, Exited):
                return self._on_exit(attempt, item.status)
            else:
                outcome = await self._on_probe(attempt, item)
            if outcome is not None:
                await self._kill(attempt)
                return outcome

    def _attempt_deadline(self, attempt: Attempt) -> float | None:
        """When the loop must look again without news: the next I/O sample, the stall timer or the start timeout."""
        if attempt.ready:
            return None
        stall = attempt.startup.last_progress_at + self.config.startup.stall_timeout_s
        start = attempt.spawned_at + self.config.startup.ready_timeout_s
        return min(stall, start, attempt.next_io_at)

    def _sample_io(self, attempt: Attempt, now: float) -> None:
        """Silent reading or writing by vLLM's processes counts as life (a shard slower than the stall timeout).

        Sampled on a timer, not per line: summing /proc/PID/io walks /proc.
        """
        io = group_io_bytes(attempt.process.pgid)
        grew = attempt.last_io is not None and io - attempt.last_io >= IO_PROGRESS_MIN_BYTES
        if attempt.last_io is None or grew:
            attempt.last_io = io
        if grew:
            attempt.startup = note_io(attempt.startup, io, now)
            self._extend(attempt)
        attempt.next_io_at = now + min(IO_SAMPLE_S, self.config.startup.stall_timeout_s / 4)

    async def _on_deadline(self, attempt: Attempt) -> Outcome | None:
        """No news before a deadline: a stall, the start timeout, or silent I/O that still counts as life."""
        now = time.monotonic()
        s = self.config.startup
        if now >= attempt.spawned_at + s.ready_timeout_s:
            self.journal.event(
                "stall_detected",
                f"vLLM did not become ready within startup.ready_timeout_s {s.ready_timeout_s:g} s "
                f"(phase {attempt.startup.phase.value}); stopping it",
                PRIORITY_ERR,
                attempt=attempt.number,
            )
            await self._kill(attempt)
            return Outcome(Cause.START_TIMEOUT, detail=f"not ready after {s.ready_timeout_s:g} s")
        self._sample_io(attempt, now)
        if now < attempt.startup.last_progress_at + s.stall_timeout_s:
            return None
        where = self._where(attempt.startup)
        self.journal.event(
            "stall_detected",
            f"no loading progress for {now - attempt.startup.last_progress_at:.0f} s (startup.stall_timeout_s "
            f"{s.stall_timeout_s:g}) {where}, and vLLM's processes did no I/O; stopping the process group",
            PRIORITY_ERR,
            attempt=attempt.number,
            phase=attempt.startup.phase.value,
            shards_done=attempt.startup.shards_done,
            shards_total=attempt.startup.shards_total,
        )
        await self._kill(attempt)
        return Outcome(Cause.STALL, detail=f"stalled {where}")

    @staticmethod
    def _where(startup: StartupState) -> str:
        if startup.phase is Phase.LOADING_WEIGHTS and startup.shards_total:
            return f"at shard {startup.shards_done}/{startup.shards_total}"
        return f"in phase {startup.phase.value}"

    async def _on_event(self, attempt: Attempt, event: Event) -> Outcome | None:
        """Track the phase, extend systemd's timeout on progress, start readiness checks, spot deaths."""
        now = time.monotonic()
        before = attempt.startup
        attempt.startup = advance(before, event, now)
        if isinstance(event, (StatsLogged, SpecDecodingLogged)):
            self.metrics.observe(event)
        if isinstance(event, Failure):
            attempt.failures.append(event)
            if attempt.ready and isinstance(event, EngineDied):
                cause = Cause.WORKER_LOST if isinstance(event, RayWorkerLost) else Cause.ENGINE_DEAD
                return Outcome(cause, event, None, True, event.message or "engine core died")
        if attempt.startup.progressed and not attempt.ready:
            self._extend(attempt)
        if attempt.startup.phase is not before.phase or attempt.startup.shards_done != before.shards_done:
            self._show_phase(attempt)
        if isinstance(event, StartupCompleted) and not attempt.ready:
            attempt.startup_complete_at = now
            self._start_readiness(attempt)
        return None

    def _on_exit(self, attempt: Attempt, status: int) -> Outcome:
        """vLLM's API server exited by itself: classify from what it printed (or from the cluster it lost)."""
        self.metrics.set_vllm_up(False)
        cluster = self.config.cluster
        if cluster is not None and self._placement_lost(attempt):
            return self._node_lost(attempt, f"vLLM (pid {attempt.process.pid}) {describe_exit(status)}")
        outcome = policy.classify(attempt.failures, status, attempt.ready)
        if not outcome.detail:
            outcome = Outcome(outcome.cause, outcome.failure, status, outcome.was_ready, f"vLLM {describe_exit(status)}")
        return outcome

    async def _on_probe(self, attempt: Attempt, probed: Probed) -> Outcome | None:
        if probed.kind is ProbeKind.HEALTHY and not attempt.ready:
            self._start_readiness(attempt)
        elif probed.kind is ProbeKind.WARMING:
            attempt.startup = enter(attempt.startup, Phase.WARMING_UP, time.monotonic())
            self._show_phase(attempt)
        elif probed.kind is ProbeKind.READY:
            self._became_ready(attempt, probed.detail)
        elif probed.kind is ProbeKind.NOT_READY:
            self.journal.event(
                "served_name_mismatch" if probed.cause is Cause.SERVED_NAME else "crashed",
                probed.detail,
                PRIORITY_ERR,
                attempt=attempt.number,
            )
            return Outcome(probed.cause or Cause.CRASH, detail=probed.detail)
        elif probed.kind in (ProbeKind.DEAD, ProbeKind.HUNG) and attempt.ready:
            hung = probed.kind is ProbeKind.HUNG
            self.journal.event(
                "engine_hung" if hung else "engine_dead",
                f"vLLM's engine is {'hung' if hung else 'dead'}: {probed.detail}; stopping its process group",
                PRIORITY_ERR,
                attempt=attempt.number,
            )
            self.metrics.liveness_failure(probed.label)
            return Outcome(Cause.ENGINE_HUNG if hung else Cause.ENGINE_DEAD, None, None, True, probed.detail)
        return None

    def _became_ready(self, attempt: Attempt, detail: str) -> None:
        now = time.monotonic()
        attempt.ready_since = now
        attempt.startup = enter(attempt.startup, Phase.READY, now)
        self.state = "serving"
        self.ready_at = time.time()
        status = self._serving_status(attempt)
        self.notifier.ready(status)
        since_complete = (now - attempt.startup_complete_at) if attempt.startup_complete_at else None
        self.journal.event(
            "ready",
            f"vLLM is ready after {now - attempt.spawned_at:.1f} s: {detail}"
            + (f"; READY=1 {since_complete * 1000:.0f} ms after 'Application startup complete.'" if since_complete is not None else ""),
            PRIORITY_INFO,
            attempt=attempt.number,
            startup_seconds=round(now - attempt.spawned_at, 3),
            gpu_memory_utilization=attempt.tunables.gpu_memory_utilization,
        )
        self.metrics.set_ready(True)
        self.metrics.set_phase(Phase.READY.value)
        self.metrics.set_startup_seconds(now - attempt.spawned_at)
        self._write_state(status_text_=status)
        self._remember(attempt.tunables)
        if self.config.liveness.enabled:
            attempt.tasks.append(asyncio.create_task(self._watch_liveness(attempt)))

    # --- a pair of machines ([cluster]) ----------------------------------------

    async def _start_ray(self) -> bool:
        """Find the link, then start this machine's Ray and the node-table watcher; True if a stop came first.

        A link still coming up at boot is waited for (LINK_WAIT_S), with STATUS= saying so; after that
        the refusal stands and gb10d exits 78.
        """
        cluster = self.config.cluster
        assert cluster is not None
        deadline = time.monotonic() + LINK_WAIT_S
        while True:
            try:
                self.link = find(cluster.role, cluster.head_address, cluster.interface)
                break
            except InterfaceError as exc:
                if time.monotonic() >= deadline:
                    raise
                if self.state != "waiting for the link":
                    self.state = "waiting for the link"
                    self.journal.event("cluster_waiting", f"waiting up to {LINK_WAIT_S:g} s for the link: {exc}", PRIORITY_WARNING)
                    self.notifier.status(f"waiting for the link: {exc}"[:200])
                if await self._wait_stop(2.0):  # no event tells of an address appearing; look again shortly
                    return True
        self.state = "waiting" if cluster.role == "head" else "joining"
        self.journal.event(
            "cluster_link",
            f"cluster {cluster.role}: using {self.link.interface.name} ({self.link.address}) because {self.link.reason}",
            PRIORITY_INFO,
        )
        ray = ray_program(cluster, self.config.vllm)
        try:
            python = interpreter(ray.read_text(errors="replace")[:512], ray)
        except OSError as exc:
            raise GiveUp(f"cannot start Ray: {ray} cannot be read ({exc.strerror or exc}); check cluster.ray or vllm.venv", EXIT_GAVE_UP) from None
        env = {**build_env(self.config.vllm), **self._cluster_env()}
        self.death_notice_s = death_notice_s(env)
        self.ray = RayNode(
            ray_argv(cluster, self.config.vllm, str(self.link.address)),
            watcher_argv(python, cluster),
            env,
            self.journal,
            lambda view: self.queue.put_nowait(ClusterSeen(view)),
            lambda exits: policy.backoff_delay(self.config, exits),
        )
        self.ray.start()
        return False

    def _cluster_env(self) -> dict[str, str]:
        cluster, link = self.config.cluster, self.link
        if cluster is None or link is None:
            return {}
        return cluster_env(cluster, link.interface.name, str(link.address))

    async def _confirm_node_loss(self, outcome: Outcome) -> Outcome | None:
        """vLLM lost a Ray worker: ask the cluster whether its machine left (NODE_LOST) or only the worker died.

        vLLM notices a dead worker within a second; Ray's GCS marks the machine dead only after its
        health checks fail (seconds to a minute). A machine that left is not vLLM's failure and must
        not spend an attempt; a worker that died on a machine still there is. None: stopped meanwhile.
        """
        attempt = self.attempt
        assert attempt is not None
        where = f" on {outcome.failure.node}" if outcome.failure is not None and outcome.failure.node else ""
        lost, waiting = f"vLLM lost a Ray worker{where}", f"waiting up to {self.death_notice_s:g} s for Ray to tell whether its machine left the cluster"
        text = f"{lost}; {waiting}"
        self.journal.event("node_lost", f"{lost} ({outcome.detail}); {waiting}", PRIORITY_WARNING, attempt=attempt.number)
        self.state = "restarting"
        self.notifier.status(text[:200])
        self._write_state(status_text_=text)
        if await self._wait_stop(self.death_notice_s, until=lambda: self._placement_lost(attempt)):
            return None
        if self._placement_lost(attempt):
            return self._node_lost(attempt, f"vLLM (pid {attempt.process.pid}) was stopped when it lost its Ray worker there")
        return outcome

    def _seen(self, view: View) -> None:
        """Take in a new node table; while waiting, STATUS= and the state file follow it."""
        self.previous_view, self.view = self.view, view
        cluster = self.config.cluster
        assert cluster is not None
        self.metrics.set_cluster_nodes(len(view.serving_nodes()))
        if self.state in ("waiting", "joining"):
            text = waiting_text(view, cluster)
            self.notifier.status(text[:200])
            self._write_state(status_text_=text)

    async def _wait_whole(self) -> bool:
        """On the head, before each start of vLLM: wait until `nodes` machines with a GPU are up; True if stopped meanwhile."""
        cluster = self.config.cluster
        assert cluster is not None
        if is_whole(self.view, cluster):
            return False
        self.state = "waiting"
        text = waiting_text(self.view, cluster)
        self.journal.event("cluster_waiting", text, PRIORITY_INFO)
        self.notifier.status(text[:200])
        self._write_state(status_text_=text)
        while not is_whole(self.view, cluster):
            # The wait may be long (the other machine is off): systemd's start timeout must not end it.
            self.notifier.extend_timeout(CLUSTER_EXTEND_S)
            if await self._wait_stop(CLUSTER_EXTEND_S / 3, until=lambda: is_whole(self.view, cluster)):
                return True
        self.journal.event("cluster_whole", f"the Ray cluster is whole ({view_text(self.view, cluster)}); starting vLLM", PRIORITY_INFO)
        return False

    def _on_cluster(self, attempt: Attempt, view: View) -> Outcome | None:
        """A node table during an attempt: a machine gone means vLLM cannot go on.

        A table that could not be read (the GCS hiccuped, the watcher restarts) says nothing
        about the machines; vLLM's own output and exit tell whether it still serves.
        """
        self._seen(view)
        if view.error or not self._placement_lost(attempt):
            return None
        return self._node_lost(attempt, "")

    def _placement_lost(self, attempt: Attempt) -> bool:
        """Whether a machine `attempt`'s vLLM was placed on is gone from the latest node table."""
        cluster = self.config.cluster
        assert cluster is not None
        return lost_since(attempt.start_view, self.view, cluster)

    def _node_lost(self, attempt: Attempt, how: str) -> Outcome:
        """Say which machine left and why, and end the attempt uncounted; `how` tells how vLLM ended, if it already did."""
        cluster = self.config.cluster
        assert cluster is not None
        why = lost_text(attempt.start_view, self.view or View(), cluster)
        self.journal.event(
            "node_lost",
            f"{why}; {how or f'stopping vLLM (pid {attempt.process.pid})'}: it cannot serve without all "
            f"{cluster.nodes} machines; it starts again once the cluster is whole (not counted as a failed attempt)",
            PRIORITY_ERR,
            attempt=attempt.number,
        )
        self.notifier.status(f"node lost: {why}"[:200])
        return Outcome(Cause.NODE_LOST, None, None, attempt.ready, why)

    async def _serve_worker(self) -> int:
        """The worker's whole job: keep Ray joined to the head; READY=1 once the head lists this machine with its GPU."""
        cluster, link, ray = self.config.cluster, self.link, self.ray
        assert cluster is not None and link is not None and ray is not None
        me = str(link.address)

        def changed() -> bool:
            return has_joined(self.view, me, ray.started_at) != self.joined

        self._seen(self.view or View())
        while True:
            if not self.joined:
                self.notifier.extend_timeout(CLUSTER_EXTEND_S)
            if await self._wait_stop(CLUSTER_EXTEND_S / 3, until=changed):
                return await self._stopped()
            if not changed():
                continue
            self.joined = not self.joined
            if self.joined:
                self.state, self.ready_at = "serving", time.time()
                text = f"joined the Ray cluster at {cluster.head_address}:{cluster.port} as {me} with its GPU ({view_text(self.view, cluster)})"
                self.journal.event("cluster_joined", text, PRIORITY_INFO)
                self.notifier.ready(text[:200])
                self._write_state(status_text_=text)
            else:
                self.state, self.ready_at = "joining", None
                self.journal.event(
                    "cluster_left",
                    f"this machine ({me}) is no longer in the Ray cluster: {lost_text(self.previous_view, self.view or View(), cluster)}; "
                    "Ray here is restarted until it joins again",
                    PRIORITY_WARNING,
                )
                self._seen(self.view or View())

    # --- configuration: learned settings, reloads, file watching -----------

    def _starting_tunables(self) -> Tunables:
        """The config's settings, or what a corrected start learned for this very config."""
        base = Tunables.from_config(self.config.vllm)
        self._correction = ""
        state = learned.load(self.config.daemon.learned_file)
        if state.problem:
            self.journal.event("learned_discarded", f"{state.problem}; starting from the config's values", PRIORITY_WARNING)
        verdict = learned.applicable(state, self.config)
        if verdict.entry is not None:
            self.journal.event("learned_applied", verdict.reason, PRIORITY_INFO, gpu_memory_utilization=verdict.entry.gpu_memory_utilization)
            self._correction = verdict.entry.reason
            return learned.merge(base, verdict.entry)
        if verdict.reason:
            self.journal.event("learned_discarded", verdict.reason, PRIORITY_INFO)
        return base

    def _remember(self, tunables: Tunables) -> None:
        """After a corrected start reached ready, keep what worked for the next boot."""
        entry = learned.remember(self.config, tunables, self._correction or "a corrected start", datetime.now(timezone.utc))
        if entry is None:
            return
        try:
            learned.save(self.config.daemon.learned_file, learned.LearnedState(entry))
        except learned.LearnedFileError as exc:
            self.journal.event("learned_discarded", f"cannot keep the learned settings: {exc}", PRIORITY_WARNING)

    def _watch_config(self, loop: asyncio.AbstractEventLoop) -> ConfigWatcher | None:
        if not self.config.daemon.watch_config:
            return None
        watcher = ConfigWatcher(self.config_path, loop, lambda: self.queue.put_nowait(Edited()))
        try:
            watcher.start()
        except WatchUnavailable as exc:
            self.journal.event("config_changed_on_disk", f"not watching the config for changes: {exc}", PRIORITY_WARNING)
            return None
        return watcher

    def _take_config(self, requested: bool) -> ConfigDiff | None:
        """Re-read and validate the config; apply it if asked to; the changes applied, or None.

        An invalid file is logged problem by problem and changes nothing. An
        edit seen on disk is only reported unless `daemon.apply_on_change`.
        """
        if requested:
            self.journal.event("reload_requested", f"reload requested: re-reading {self.config_path}", PRIORITY_INFO)
        try:
            new = ConfigSnapshot.take(load_config(self.config_path))
        except ConfigError as exc:
            for problem in exc.problems:
                self.journal.event("reload_invalid", f"config not applied: {problem}", PRIORITY_ERR)
            self.journal.event(
                "reload_invalid",
                "keeping the running configuration; fix the file, check it with gb10d check-config, then: systemctl reload gb10d",
                PRIORITY_ERR,
            )
            return None
        if new.config.cluster != self.config.cluster:
            self.journal.event(
                "reload_invalid",
                "config not applied: [cluster] changed, and this machine's part in a Ray cluster changes only at a start; "
                "keeping the running configuration; apply it with: systemctl restart gb10d",
                PRIORITY_ERR,
            )
            return None
        diff = diff_configs(self.snapshot, new)
        if not requested and not self.config.daemon.apply_on_change:
            if diff:
                self.journal.event(
                    "config_changed_on_disk",
                    f"config changed ({len(diff.changes)} keys); run systemctl reload gb10d to apply: {diff.describe()}",
                    PRIORITY_INFO,
                )
            else:
                self.journal.event("config_changed_on_disk", f"{self.config_path} changed on disk; it is valid and nothing gb10d uses differs", PRIORITY_INFO)
            return None
        if not diff:
            self.journal.event("reload_applied", "config re-read: nothing changed", PRIORITY_INFO)
            return diff
        listen_before = self.config.metrics.listen
        self.config, self.snapshot = new.config, new
        if self.config.metrics.listen != listen_before:
            self.metrics.close()
            self._serve_metrics()
        return diff

    async def _on_config_change(self, attempt: Attempt, requested: bool) -> Outcome | None:
        """SIGHUP or an edit on disk during an attempt: apply in place, or restart vLLM if its command changed.

        systemd hears RELOADING=1 ... READY=1 only while vLLM serves; during a
        start the next READY=1 is the start's own.
        """
        tell_systemd = attempt.ready and (requested or self.config.daemon.apply_on_change)
        if tell_systemd:
            self.notifier.reloading()
        diff = self._take_config(requested)
        if diff is None or not diff.needs_vllm_restart:
            if diff:
                self.journal.event(
                    "reload_applied",
                    f"applied without restarting vLLM (pid {attempt.process.pid}): {diff.describe()}",
                    PRIORITY_INFO,
                )
            if tell_systemd:
                self.notifier.ready(self._serving_status(attempt))
            return None
        grace = self.config.daemon.stop_timeout_s
        self.journal.event(
            "reload_applied",
            f"{diff.describe()}; vLLM's command line changes: stopping vLLM (pid {attempt.process.pid}) and starting it with the new settings",
            PRIORITY_INFO,
        )
        self.notifier.status("reloading: restarting vLLM with the new settings")
        await attempt.process.stop(grace, self._on_escalate)
        return Outcome(Cause.RELOAD, detail=diff.describe())

    def _serving_status(self, attempt: Attempt) -> str:
        v = self.config.vllm
        return (
            f"serving {v.served_names[0]} on {v.host}:{v.port} (attempt {attempt.number}, "
            f"gpu_memory_utilization={attempt.tunables.gpu_memory_utilization:g})"
        )

    # --- helpers the loop calls ---------------------------------------------

    def _extend(self, attempt: Attempt, force: bool = False) -> None:
        """EXTEND_TIMEOUT_USEC on real progress only (throttled), so a stuck start still times out."""
        now = time.monotonic()
        if attempt.ready or (not force and now - attempt.last_extend < 1.0):
            return
        attempt.last_extend = now
        self.notifier.extend_timeout(self.config.startup.stall_timeout_s + EXTEND_MARGIN_S)

    def _show_phase(self, attempt: Attempt) -> None:
        text = status_text(attempt.startup, attempt.number, self.max_attempts, attempt.tunables.gpu_memory_utilization)
        self.notifier.status(text)
        self.metrics.set_phase(attempt.startup.phase.value)
        if attempt.startup.shards_total:
            self.metrics.set_load_progress(attempt.startup.shards_done / attempt.startup.shards_total)
        # Every phase change reaches the state file at once; shard steps at most once a second (each
        # write fsyncs), the latest one always last.
        now = time.monotonic()
        if self._deferred_write is not None:
            self._deferred_write.cancel()
            self._deferred_write = None
        wait = 1.0 - (now - self._written_at)
        if attempt.startup.phase is not self._written_phase or wait <= 0:
            self._written_phase, self._written_at = attempt.startup.phase, now
            self._write_state(status_text_=text)
        else:
            self._deferred_write = asyncio.get_running_loop().call_later(wait, self._show_phase, attempt)

    def _start_readiness(self, attempt: Attempt) -> None:
        """Run the readiness checks, unless they are running; a check that gave up may run again."""
        if attempt.readiness is None or attempt.readiness.done():
            attempt.readiness = asyncio.create_task(self._check_ready(attempt))
            attempt.tasks.append(attempt.readiness)

    async def _check_ready(self, attempt: Attempt) -> None:
        """/health 200, the served name in /v1/models, and (if configured) one tiny completion."""
        v = self.config.vllm
        prober = attempt.prober
        assert prober is not None
        post = self.queue.put_nowait
        n = attempt.serial
        deadline = time.monotonic() + LISTEN_GRACE_S
        delay = 0.005
        while not (await prober.health()).ok:
            if time.monotonic() > deadline:
                return  # the fallback poller and the stall timer take it from here
            await asyncio.sleep(delay)  # uvicorn listens moments after logging startup complete
            delay = min(delay * 2, 0.5)
        models = await prober.models()
        missing = [name for name in v.served_names if name not in models.models]
        if not models.ok or missing:
            shown = ", ".join(models.models) or f"nothing (HTTP {models.status or models.reason})"
            post(Probed(n, ProbeKind.NOT_READY, f"vLLM serves {shown} but the config expects "
                 f"{', '.join(v.served_names)}: clients asking for {missing[0] if missing else v.served_names[0]} would get 404",
                 cause=Cause.SERVED_NAME))
            return
        detail = f"/health 200, /v1/models lists {', '.join(models.models)}"
        if self.config.startup.warmup:
            post(Probed(n, ProbeKind.WARMING))
            result = await prober.complete(v.served_names[0], timeout_s=self.config.liveness.probe_timeout_s)
            if not result.ok:
                post(Probed(n, ProbeKind.NOT_READY, f"the warm-up completion failed ({result.status or result.reason})", cause=Cause.CRASH))
                return
            detail += f", warm-up completion took {result.seconds:.2f} s"
        post(Probed(n, ProbeKind.READY, detail))

    async def _poll_until_healthy(self, attempt: Attempt) -> None:
        """Fallback for a missed `Application startup complete.` (e.g. --uvicorn-log-level warning),
        or for readiness checks that gave up waiting for the port: poll /health until ready."""
        prober = attempt.prober
        assert prober is not None
        while not attempt.ready:
            await asyncio.sleep(self.config.startup.health_poll_interval_s)
            idle = attempt.readiness is None or attempt.readiness.done()
            if idle and not attempt.ready and (await prober.health(timeout_s=5.0)).ok:
                self.queue.put_nowait(Probed(attempt.serial, ProbeKind.HEALTHY))

    async def _watch_liveness(self, attempt: Attempt) -> None:
        """After ready: tell a hung engine from a busy one (liveness.py) and report the verdict to the loop."""
        assert attempt.prober is not None

        def on_verdict(found: liveness.Hung | liveness.Dead) -> None:
            if isinstance(found, liveness.Hung):
                self.queue.put_nowait(Probed(attempt.serial, ProbeKind.HUNG, found.evidence, label=found.cause))
            else:
                self.queue.put_nowait(Probed(attempt.serial, ProbeKind.DEAD, found.reason, label=found.cause))

        await liveness.watch(attempt.prober, self.config.liveness, on_verdict, model=self.config.vllm.served_names[0])

    async def _follow_output(self, attempt: Attempt) -> None:
        """Forward every vLLM line to the journal and parse it; report the exit once both pipes close."""
        n = attempt.serial
        collapser = BarCollapser()
        streams = [_Stream(self.journal, collapser, lambda event: self.queue.put_nowait(Parsed(n, event))) for _ in range(2)]
        readers = asyncio.gather(*attempt.process.readers(streams[0].feed, streams[1].feed))
        status = await attempt.process.wait()
        try:
            # The exit's last words are still in the pipes; an orphaned EngineCore may hold them open forever.
            await asyncio.wait_for(asyncio.shield(readers), PIPE_DRAIN_S)
            for stream in streams:
                stream.finish()
        except asyncio.TimeoutError:
            pass
        self.queue.put_nowait(Exited(n, status))
        await readers

    async def _kill(self, attempt: Attempt) -> None:
        """SIGKILL the whole group at once (a failed or stalled start has nothing to drain)."""
        if not await attempt.process.kill():
            self.journal.event("crashed", f"processes of vLLM's group {attempt.process.pgid} survived SIGKILL: {group_members(attempt.process.pgid)}", PRIORITY_ERR)
        self.metrics.set_vllm_up(False)

    async def _discard_attempt(self) -> None:
        """Make sure the attempt's processes and tasks are gone before anything else starts."""
        attempt, self.attempt = self.attempt, None
        if self._deferred_write is not None:
            self._deferred_write.cancel()
            self._deferred_write = None
        if attempt is None:
            return
        for task in attempt.tasks:
            task.cancel()
        if group_alive(attempt.process.pgid):
            await attempt.process.kill()
        await asyncio.gather(*attempt.tasks, return_exceptions=True)
        if attempt.prober is not None:
            await attempt.prober.close()
        self.metrics.set_ready(False)

    async def _stopped(self) -> int:
        """The stop ladder: STOPPING=1, SIGTERM the group, grace, SIGKILL, nothing left; exit 0."""
        attempt = self.attempt
        self.state = "stopping"
        grace = self.config.daemon.stop_timeout_s
        self.notifier.stopping("stopping Ray" if attempt is None and self.ray is not None else "stopping vLLM")
        self._write_state(status_text_="stopping")
        if attempt is not None:
            self.journal.event("stopping", f"stopping vLLM (pid {attempt.process.pid}): SIGTERM to its process group, SIGKILL after {grace:g} s", PRIORITY_INFO)
            stop = asyncio.create_task(attempt.process.stop(grace, self._on_escalate))
            while not stop.done():
                second = asyncio.create_task(self.queue.get())
                done, _ = await asyncio.wait({stop, second}, return_when=asyncio.FIRST_COMPLETED)
                if second in done and isinstance(second.result(), Stop):
                    self.journal.event("stopping", "second stop signal: killing vLLM's process group now", PRIORITY_WARNING)
                    await attempt.process.kill()
                if not second.done():
                    second.cancel()
            await stop
        if self.ray is not None:
            self.journal.event("stopping", "stopping Ray on this machine", PRIORITY_INFO)
            await self.ray.close()
        self.state = "stopped"
        what = "Ray stopped" if self.config.cluster is not None and self.config.cluster.role == "worker" else "vLLM stopped"
        self.journal.event("stopped", f"{what}; no process of its group is left", PRIORITY_INFO)
        self._write_state(status_text_="stopped")
        return EXIT_OK

    def _on_escalate(self, pids: list[int]) -> None:
        self.journal.event(
            "stopping",
            f"vLLM did not exit within daemon.stop_timeout_s {self.config.daemon.stop_timeout_s:g} s; "
            f"sending SIGKILL to {len(pids)} remaining process(es): {pids}",
            PRIORITY_WARNING,
        )

    async def _preflight(self, tunables: Tunables) -> Tunables:
        """Lower the utilization (or evict the model's page cache) before launching, so the free-memory check passes."""
        m = self.config.memory
        if not m.preflight:
            return tunables
        self.metrics.set_phase(Phase.PREFLIGHT.value)
        evicted = False
        while True:
            mem = self._meminfo()
            if mem is None:
                return tunables
            files = safetensors_files(self.config.vllm.model, build_env(self.config.vllm)) if m.evict_page_cache else []
            decision = preflight(tunables.gpu_memory_utilization, mem, m.headroom_gib, m.min_gpu_memory_utilization, evicted, bool(files))
            if isinstance(decision, PreflightRefused):
                raise GiveUp(f"preflight: {decision.reason}; {top_memory_users()}", EXIT_GAVE_UP)
            if decision.evict:
                covered = evict_page_cache(files)
                self.journal.event("page_cache_evicted", f"preflight: {decision.reason}; dropped the page cache of {len(files)} files ({covered / 2**30:.2f} GiB)", PRIORITY_INFO, mem_free_bytes=mem.free, mem_available_bytes=mem.available)
                evicted = True
                continue
            if decision.utilization != tunables.gpu_memory_utilization:
                self.journal.event(
                    "preflight_lowered",
                    f"preflight: {decision.reason} ({mem.summary()})",
                    PRIORITY_WARNING,
                    gpu_memory_utilization=decision.utilization,
                    mem_free_bytes=mem.free,
                    mem_available_bytes=mem.available,
                )
                self._correction = f"preflight: {decision.reason}"
                return tunables.with_(gpu_memory_utilization=decision.utilization)
            return tunables

    async def _memory_gate(self, baseline: MemInfo | None) -> bool:
        """After vLLM exits, wait (bounded) until MemAvailable is back; True if a stop came meanwhile.

        Raises GiveUp when memory stays missing: retrying would only fail again.
        """
        if baseline is None:
            return False
        m = self.config.memory
        deadline = time.monotonic() + m.recovery_timeout_s
        while True:
            now_mem = self._meminfo()
            if now_mem is None or memory_returned(baseline, now_mem, m.recovery_tolerance_gib):
                return False
            if time.monotonic() >= deadline:
                lost = (baseline.available - now_mem.available) / 2**30
                raise GiveUp(
                    f"memory was not returned after vLLM exited: MemAvailable is {now_mem.available_gib:.2f} GiB, "
                    f"was {baseline.available_gib:.2f} GiB before it started ({lost:.2f} GiB missing) and no vLLM "
                    f"process is left; not retrying. A reboot may be needed ({top_memory_users()})",
                    EXIT_MEMORY_NOT_RETURNED,
                )
            # /proc/meminfo offers no change notification: look again shortly.
            if await self._wait_stop(0.5):
                return True

    def _meminfo(self) -> MemInfo | None:
        try:
            mem = read_meminfo(self.config.memory.meminfo_path)
        except (OSError, ValueError) as exc:
            self.journal.event("preflight_lowered", f"cannot read {self.config.memory.meminfo_path}: {exc}; memory checks skipped", PRIORITY_WARNING)
            return None
        self.metrics.set_memory(mem.total, mem.available, mem.free, mem.cached)
        return mem

    def _log_failure(self, outcome: Outcome, decision: Retry | policy.GiveUp, attempt: int) -> None:
        kind = {
            Cause.FREE_MEMORY: "free_memory_retry",
            Cause.STALL: "load_strategy_changed",
            Cause.CUDA_OOM: "cuda_oom",
            Cause.KV_CACHE: "kv_cache_insufficient",
            Cause.NO_KV_MEMORY: "kv_cache_insufficient",
            Cause.ENGINE_DEAD: "engine_dead",
            Cause.WORKER_LOST: "engine_dead",
            Cause.ENGINE_HUNG: "engine_hung",
        }.get(outcome.cause, "config_error" if outcome.cause in policy.CONFIG_CAUSES else "crashed")
        cause = policy.describe(outcome)
        if isinstance(decision, Retry):
            wait = f" in {decision.delay_s:g} s" if decision.delay_s else ""
            message = f"{cause}; {decision.message}{wait} (attempt {attempt + 1}/{self.max_attempts})"
            utilization = decision.tunables.gpu_memory_utilization
        else:
            message = f"{cause}: {decision.message}" if outcome.cause not in policy.CONFIG_CAUSES else decision.message
            utilization = None
        self.last_failure = {"cause": outcome.cause.value, "message": cause, "action": decision.message, "at": time.time()}
        self._correction = cause
        self.journal.event(kind, message, PRIORITY_WARNING if isinstance(decision, Retry) else PRIORITY_ERR,
                           attempt=attempt, cause=outcome.cause.value, gpu_memory_utilization=utilization)
        self.notifier.status(message[:200])

    def _serve_metrics(self) -> None:
        address = self.config.metrics.address
        if address is None:
            return
        try:
            self.metrics.serve(*address)
        except OSError as exc:
            self.journal.event("metrics_unavailable", f"cannot listen for metrics on {self.config.metrics.listen}: {exc.strerror or exc}; metrics disabled (set metrics.listen)", PRIORITY_WARNING)

    def _write_state(self, status_text_: str) -> None:
        attempt = self.attempt
        v = self.config.vllm
        startup = attempt.startup if attempt else None
        mem = attempt.baseline if attempt else None
        state = {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "updated_at": time.time(),
            "state": self.state,
            "phase": startup.phase.value if startup else "exited",
            "progress": {"shards_done": startup.shards_done, "shards_total": startup.shards_total} if startup and startup.shards_total else None,
            "model": v.model,
            "served_names": v.served_names,
            "url": f"http://{v.host}:{v.port}",
            "attempt": attempt.number if attempt else 0,
            "max_attempts": self.max_attempts,
            "gpu_memory_utilization": attempt.tunables.gpu_memory_utilization if attempt else v.gpu_memory_utilization,
            "load_strategy": attempt.tunables.load_strategy if attempt else None,
            "memory": {"total_bytes": mem.total, "available_bytes": mem.available, "free_bytes": mem.free, "cached_bytes": mem.cached} if mem else None,
            "vllm_pid": attempt.process.pid if attempt else None,
            "ready_at": self.ready_at if attempt and attempt.ready else None,
            "last_failure": self.last_failure,
            "status_text": status_text_,
            "metrics_url": f"http://{self.config.metrics.listen}/metrics" if self.config.metrics.listen else None,
        }
        cluster, link = self.config.cluster, self.link
        if cluster is not None:
            state["cluster"] = view_state(self.view, cluster, str(link.address) if link else "", link.interface.name if link else "")
            if cluster.role == "worker":
                # vLLM and its API run on the head: here there is only Ray, ready once joined.
                state.update(ready_at=self.ready_at, url=None, phase=None, attempt=None, gpu_memory_utilization=None)
        try:
            write_state(self.config.daemon.state_file, state)
        except OSError as exc:
            if not self._state_warned:
                self._state_warned = True
                self.journal.event("state_file_unwritable", f"cannot write the state file {self.config.daemon.state_file}: {exc.strerror or exc}; gb10d status will not work (set daemon.state_file)", PRIORITY_WARNING)


def top_memory_users(count: int = 3) -> str:
    """The largest processes by resident memory, for messages about memory that is not free."""
    users: list[tuple[int, int, str]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = fields.get("VmRSS", "0 kB").split()
        if rss and rss[0].isdigit():
            users.append((int(rss[0]) * 1024, int(entry), fields.get("Name", "?").strip()))
    users.sort(reverse=True)
    shown = ", ".join(f"{name} (pid {pid}) {rss / 2**30:.1f} GiB" for rss, pid, name in users[:count])
    return f"largest processes: {shown}" if shown else "no process information available"


def run_daemon(config_path: Path) -> int:
    """Load the config and supervise; the body of `gb10d run`."""
    config = load_config(config_path)
    snapshot = ConfigSnapshot.take(config)
    journal = Journal(sys.stdout, socket_path=DEFAULT_SOCKET_PATH if connected_to_journal(sys.stdout) else None)
    notifier = Notifier(on_error=lambda message: journal.event("watchdog", message, PRIORITY_ERR))
    metrics = Metrics()
    supervisor = Supervisor(config_path, snapshot, journal, notifier, metrics)
    become_subreaper()
    return asyncio.run(supervisor.run())
