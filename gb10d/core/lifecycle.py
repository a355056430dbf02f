"""One attempt's life, decided purely: `step(state, fact, now, config) -> (state, actions)`.

An attempt starts when vLLM is spawned and ends when it fails (its `Failed`
outcome) or is stopped from outside. Everything the supervisor learns about
it (a parsed line, the main process's exit, a probe's verdict, a deadline
passing with an I/O sample) is folded into an `AttemptState` here, and the
answer is a list of actions for the shell to carry out, in order: extend
systemd's start timeout, show the phase, log a decision, start the
readiness checks, announce readiness, or finish the attempt.

The rules that matter, each a table test:
- progress (a phase, a shard, I/O) extends the start timeout, throttled to
  once a second; nothing else does;
- no progress for `startup.stall_timeout_s` is a stall, the whole start
  taking longer than `startup.ready_timeout_s` a start timeout;
- once vLLM's main process has exited, the exit is the cause: a probe that
  fails meanwhile (the port closes with the process) defers to it, and so
  does a stall or start timeout reached while its last words are read;
- a liveness verdict of "dead" waits `EXIT_GRACE_S` for an exit to explain
  it, since a killed server closes its port a moment before it can be
  reaped;
- a serving vLLM found asleep, though gb10d did not put it to sleep
  (someone called /sleep on its port), is said in one line and woken where
  gb10d parks it by sleep (it knows how to wake and check it), else
  stopped and started again: asleep, it holds every request unanswered;
- the NVIDIA driver's out-of-memory line is told and counted, and stops
  vLLM only with evidence beside it (`driveroom`): a burst, MemAvailable
  below the headroom, a stalled load, an engine that stops answering;
- the pull of a container image before a start (`begin_pull`) is watched
  the same way: each step of it is progress, none for the stall timeout is
  a stalled pull.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence, Union

from ..base.command import Tunables
from ..base.config import Config
from ..base.levels import PRIORITY_ERR, PRIORITY_WARNING
from ..vllm.events import (
    DriverOutOfMemory,
    EngineDied,
    Event,
    Failure,
    GpuXid,
    RayWorkerLost,
    SpecDecodingLogged,
    StartupCompleted,
    StatsLogged,
    TasksSupported,
    VersionSeen,
)
from ..vllm.kernel import describe as describe_kernel
from ..vllm.kernel import xid_meaning
from ..vllm.sleepmode import sleeps
from .driveroom import DriverRoom, Found, calm, judge, not_answering, note, stall_deadline, stalled
from .facts import AttemptFact, DriverLine, Exited, ExitSeen, Parsed, Probed, ProbeKind, ProbeResult, Pulled, Tick
from .outcome import Cause, Failed, describe_exit
from .phases import Phase, StartupState, advance, describe, enter, note_io, note_pull, start, status_text
from .policy import classify

# How much longer than the stall timeout systemd waits after each sign of progress:
# gb10d's own stall detection must always fire first.
EXTEND_MARGIN_S = 60.0
# How long /health may refuse connections after `Application startup complete.` (uvicorn listens just after);
# past it the readiness check gives up quietly and the health poller and the stall timer take over.
LISTEN_GRACE_S = 30.0
# EXTEND_TIMEOUT_USEC at most this often: progress lines can come thousands a second.
EXTEND_EVERY_S = 1.0
# Bytes of I/O by vLLM's processes that count as a sign of life while no line is printed.
IO_PROGRESS_MIN_BYTES = 1 << 20
# How often that I/O is sampled while starting (at most; a quarter of the stall timeout if shorter).
IO_SAMPLE_S = 2.0
# How long a "dead" liveness verdict waits for vLLM's exit to explain it.
EXIT_GRACE_S = 1.0


def start_time_asked(config: Config, wait_s: float = 0.0) -> float:
    """The start time gb10d asks systemd for on a sign of progress (EXTEND_TIMEOUT_USEC), in seconds.

    Enough for `wait_s` (a back-off before the next start) and then a whole
    stall timeout, plus a margin: gb10d's own stall detection must fire
    before systemd's timeout does. Every extension of a start is this one.
    """
    return wait_s + config.startup.stall_timeout_s + EXTEND_MARGIN_S


# --- actions ------------------------------------------------------------------


@dataclass(frozen=True)
class Extend:
    """Ask systemd for `seconds` more start time (EXTEND_TIMEOUT_USEC)."""

    seconds: float


@dataclass(frozen=True)
class ShowPhase:
    """The phase or its progress changed: STATUS=, the metrics and the state file follow."""

    text: str


@dataclass(frozen=True)
class Say:
    """One decision line for the journal, with its event kind and structured fields."""

    kind: str
    message: str
    priority: int
    fields: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class Observe:
    """A periodic stats line of vLLM's, for the metrics."""

    event: Event


@dataclass(frozen=True)
class StartReadiness:
    """Run the readiness checks (/health, /v1/models, the warm-up), unless they are running."""


@dataclass(frozen=True)
class BecomeReady:
    """Every readiness check passed: make everything observable say so, then send READY=1."""

    message: str
    startup_s: float


@dataclass(frozen=True)
class ProcessExited:
    """vLLM's main process is gone: it no longer counts as up."""


@dataclass(frozen=True)
class LivenessFailed:
    """A serving engine was found hung or dead; `label` is the metrics label."""

    label: str


@dataclass(frozen=True)
class WakeUnasked:
    """vLLM sleeps, and gb10d did not ask it to: wake it as a parked one is woken (weights, reload_weights,
    kv_cache, then a check generation); a wake that cannot be trusted starts it cold."""


@dataclass(frozen=True)
class XidSeen:
    """The NVIDIA driver reported an Xid error: counted by its number."""

    xid: int


@dataclass(frozen=True)
class DriverOomSeen:
    """The NVIDIA driver's out-of-memory line: counted by the evidence that came with it ("none": only told)."""

    evidence: str = "none"


@dataclass(frozen=True)
class Finish:
    """The attempt is over: kill whatever of vLLM is left, and hand `outcome` to the supervisor."""

    outcome: Failed


Action = Union[
    Extend, ShowPhase, Say, Observe, StartReadiness, BecomeReady, ProcessExited, LivenessFailed, WakeUnasked, XidSeen, DriverOomSeen, Finish
]


# --- state ----------------------------------------------------------------------


@dataclass(frozen=True)
class AttemptState:
    """Everything one attempt knows; times are monotonic seconds."""

    number: int
    tunables: Tunables
    spawned_at: float
    startup: StartupState
    failures: tuple[Failure, ...] = ()
    ready_since: float | None = None
    startup_complete_at: float | None = None
    io_bytes: int | None = None  # the I/O total that last counted; None until the first sample
    next_io_at: float = 0.0
    extended_at: float | None = None
    exit_status: int | None = None  # set once the main process exited
    dead: Probed | None = None  # a "dead" verdict waiting for an exit to explain it
    dead_at: float = 0.0
    tasks: tuple[str, ...] | None = None  # what vLLM said the model serves (`Supported tasks`), once it did
    driver: DriverRoom = field(default_factory=DriverRoom)  # the driver's recent out-of-memory lines
    driver_said: DriverOutOfMemory | None = None  # the last of them
    version: str | None = None  # the vLLM release its banner named

    @property
    def ready(self) -> bool:
        return self.ready_since is not None


def begin(number: int, tunables: Tunables, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    """A freshly spawned attempt: its state, systemd's first extension and the first STATUS=."""
    state = AttemptState(number, tunables, now, enter(start(now), Phase.SPAWNING, now), next_io_at=now)
    state, extend = _extend(state, now, config, force=True)
    return state, [*extend, ShowPhase(_status(state, config))]


def begin_pull(number: int, tunables: Tunables, now: float) -> AttemptState:
    """The fetch of what a sequence of starts runs from, watched for stalls; quiet until the engine reports a pull
    (an image that is there already, or a venv, needs none)."""
    return AttemptState(number, tunables, now, enter(start(now), Phase.PULLING, now), next_io_at=now)


def deadline(state: AttemptState, config: Config) -> float | None:
    """When the attempt must be looked at again without news (a `Tick`): I/O sample, stall, start timeout, grace."""
    if state.startup.phase is Phase.PULLING:
        last = _last_progress(state)
        return last + config.startup.stall_timeout_s
    times: list[float] = []
    if state.dead is not None:
        times.append(state.dead_at + EXIT_GRACE_S)
    if not state.ready and state.exit_status is None:
        s = config.startup
        last = _last_progress(state)
        times += [last + s.stall_timeout_s, state.spawned_at + s.ready_timeout_s, state.next_io_at]
        driver_stall = stall_deadline(state.driver, last, config.memory.driver_oom_window_s)
        if driver_stall is not None:
            times.append(driver_stall)
    return min(times) if times else None


def step(state: AttemptState, fact: AttemptFact, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    """Fold one fact into the attempt; the actions say what to do about it, in order."""
    if isinstance(fact, Parsed):
        return _on_event(state, fact.event, now, config)
    if isinstance(fact, DriverLine):
        return _on_driver_line(state, fact, now, config)
    if isinstance(fact, ExitSeen):
        return replace(state, exit_status=fact.status), [ProcessExited()]
    if isinstance(fact, Exited):
        return state, [ProcessExited(), Finish(_exit_outcome(state, fact.status))]
    if isinstance(fact, Probed):
        return _on_probe(state, fact, now, config)
    if isinstance(fact, Pulled):
        state = replace(state, startup=note_pull(state.startup, fact.progress, now))
        state, extend = _extend(state, now, config)
        return state, [*extend, ShowPhase(_status(state, config))]
    if state.startup.phase is Phase.PULLING:
        return state, _pull_stalled(state, now, config)
    return _on_tick(state, fact, now, config)


def _pull_stalled(state: AttemptState, now: float, config: Config) -> list[Action]:
    """A tick while pulling: nothing moved for the stall timeout means the pull stalled (a registry or network that hangs)."""
    last = _last_progress(state)
    stall_s = config.startup.stall_timeout_s
    if now < last + stall_s:
        return []
    where = describe(state.startup)
    say = Say(
        "stall_detected",
        f"the image's pull made no progress for {now - last:.0f} s (startup.stall_timeout_s {stall_s:g}): {where}; cancelling it",
        PRIORITY_ERR,
        (("attempt", state.number), ("phase", Phase.PULLING.value)),
    )
    return [say, Finish(Failed(cause=Cause.PULL_STALLED, detail=f"stalled while {where}"))]


def _exit_outcome(state: AttemptState, status: int) -> Failed:
    """vLLM exited by itself: classified from what it printed, the exit status for detail."""
    outcome = classify(state.failures, status, state.ready)
    if not outcome.detail:
        outcome = replace(outcome, detail=f"vLLM {describe_exit(status)}")
    return outcome


def kernel_said(event: DriverOutOfMemory | GpuXid, number: int | None = None) -> list[Action]:
    """What a driver message of the kernel log means while no vLLM runs that it could be about: an Xid is told and
    counted; a driver out of memory is told as the warning it is and counted, with nothing to stop."""
    fields: tuple[tuple[str, object], ...] = (("attempt", number),) if number is not None else ()
    if isinstance(event, GpuXid):
        serious = xid_meaning(event.xid).serious
        return [Say("gpu_xid", describe_kernel(event), PRIORITY_ERR if serious else PRIORITY_WARNING, (*fields, ("xid", event.xid))), XidSeen(event.xid)]
    return [Say("driver_oom", f"{describe_kernel(event)}; no vLLM of this instance runs", PRIORITY_WARNING, fields), DriverOomSeen()]


def _on_event(state: AttemptState, event: Event, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    if isinstance(event, DriverOutOfMemory):
        return _on_driver_line(state, DriverLine(0, event), now, config)
    if isinstance(event, GpuXid):
        return state, kernel_said(event, state.number)
    actions: list[Action] = []
    before = state.startup
    state = replace(state, startup=advance(before, event, now))
    if isinstance(event, (StatsLogged, SpecDecodingLogged)):
        actions.append(Observe(event))
    if isinstance(event, VersionSeen):
        state = replace(state, version=event.version)
    if isinstance(event, Failure):
        state = replace(state, failures=(*state.failures, event))
        if state.ready and state.exit_status is None and isinstance(event, EngineDied):
            cause = Cause.WORKER_LOST if isinstance(event, RayWorkerLost) else Cause.ENGINE_DEAD
            return state, [*actions, Finish(Failed(cause=cause, failure=event, was_ready=True, detail=event.message or "engine core died"))]
    if state.startup.progressed and not state.ready:
        state, extend = _extend(state, now, config)
        actions += extend
    if state.startup.phase is not before.phase or state.startup.shards_done != before.shards_done:
        actions.append(ShowPhase(_status(state, config)))
    if isinstance(event, TasksSupported):
        state = replace(state, tasks=event.tasks)
    if isinstance(event, StartupCompleted) and not state.ready:
        state = replace(state, startup_complete_at=now)
        actions.append(StartReadiness())
    return state, actions


def _on_driver_line(state: AttemptState, line: DriverLine, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    """The driver's out-of-memory line while vLLM runs: told and counted; vLLM is stopped only with evidence beside it."""
    if state.exit_status is not None:
        return state, kernel_said(line.event, state.number)
    memory = config.memory
    state = replace(state, driver=note(state.driver, now, memory.driver_oom_window_s), driver_said=line.event)
    loading = not state.ready
    stalled_s = now - _last_progress(state) if loading else None
    found = judge(state.driver, now, line.mem_available, stalled_s, memory)
    if found is None:
        message = f"{describe_kernel(line.event)}; {calm(state.driver, now, line.mem_available, loading, memory)}"
        return state, [Say("driver_oom", message, PRIORITY_WARNING, (("attempt", state.number),)), DriverOomSeen()]
    state, actions = _driver_stop(state, line.event, found)
    return state, [DriverOomSeen(found.evidence.value), *actions]


def _driver_stop(state: AttemptState, event: DriverOutOfMemory, found: Found) -> tuple[AttemptState, list[Action]]:
    """Evidence came with the driver's out-of-memory line, or after it within the window: stop vLLM before the whole
    machine freezes."""
    state = replace(state, failures=(*state.failures, event))
    stop = Say(
        "driver_oom",
        f"{describe_kernel(event)}, with evidence: {found.text}; a freeze of the whole machine can follow: stopping vLLM",
        PRIORITY_ERR,
        (("attempt", state.number), ("evidence", found.evidence.value)),
    )
    outcome = Failed(cause=Cause.DRIVER_OOM, failure=event, was_ready=state.ready, detail=f"{event.detail}; {found.text}")
    return state, [stop, Finish(outcome)]


def _on_probe(state: AttemptState, probed: Probed, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    kind = probed.kind
    if kind is ProbeKind.HEALTHY and not state.ready:
        return state, [StartReadiness()]
    if kind is ProbeKind.WARMING and not state.ready:
        state = replace(state, startup=enter(state.startup, Phase.WARMING_UP, now))
        return state, [ShowPhase(_status(state, config))]
    if kind is ProbeKind.READY and not state.ready:
        return _became_ready(state, probed.detail, now)
    if kind in (ProbeKind.NOT_READY, ProbeKind.WRONG_NAME) and not state.ready:
        if state.exit_status is not None:
            return state, []  # the exit explains why the checks failed
        wrong_name = kind is ProbeKind.WRONG_NAME
        cause = Cause.SERVED_NAME if wrong_name else Cause.CRASH
        say = Say("served_name_mismatch" if wrong_name else "crashed", probed.detail, PRIORITY_ERR, (("attempt", state.number),))
        return state, [say, Finish(Failed(cause=cause, detail=probed.detail))]
    if kind is ProbeKind.HUNG and state.ready and state.exit_status is None:
        return _liveness_failure(state, probed, hung=True, now=now, config=config)
    if kind is ProbeKind.DEAD and state.ready and state.exit_status is None and state.dead is None:
        return replace(state, dead=probed, dead_at=now), []
    if kind is ProbeKind.ASLEEP and state.ready and state.exit_status is None and state.dead is None:
        return state, _asleep_unasked(state, probed, config)
    return state, []


def _asleep_unasked(state: AttemptState, probed: Probed, config: Config) -> list[Action]:
    """vLLM sleeps though gb10d watches it only while it has not put it to sleep: woken where gb10d parks it by sleep,
    else restarted (gb10d has no checked wake for it)."""
    v = config.vllm
    found = (
        f"vLLM is asleep, and gb10d did not ask it to sleep (someone called /sleep on its port {v.port} directly, "
        f"not through gb10d or its front): {probed.detail}; asleep, it holds every request unanswered"
    )
    fields = (("attempt", state.number),)
    if sleeps(config):
        say = Say("slept_unasked", f"{found}: waking it (weights, reload_weights, kv_cache) and checking that it answers", PRIORITY_WARNING, fields)
        return [say, LivenessFailed(probed.label), WakeUnasked()]
    say = Say("slept_unasked", f"{found}: stopping its process group and starting it again (gb10d wakes only a vLLM it parks by sleep)", PRIORITY_ERR, fields)
    failed = Failed(cause=Cause.ENGINE_HUNG, was_ready=True, detail=f"asleep, not asked to by gb10d: {probed.detail}")
    return [say, LivenessFailed(probed.label), Finish(failed)]


def _liveness_failure(state: AttemptState, probed: Probed, hung: bool, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    """A serving engine found hung or dead: stopped; within the window of a driver out-of-memory line, as its evidence."""
    found = not_answering(state.driver, now, probed.detail, config.memory.driver_oom_window_s)
    if found is not None and state.driver_said is not None:
        state, actions = _driver_stop(state, state.driver_said, found)
        return state, [LivenessFailed(probed.label), *actions]
    word = "hung" if hung else "dead"
    say = Say(
        f"engine_{word}",
        f"vLLM's engine is {word}: {probed.detail}; stopping its process group",
        PRIORITY_ERR,
        (("attempt", state.number),),
    )
    cause = Cause.ENGINE_HUNG if hung else Cause.ENGINE_DEAD
    return state, [say, LivenessFailed(probed.label), Finish(Failed(cause=cause, was_ready=True, detail=probed.detail))]


def _became_ready(state: AttemptState, detail: str, now: float) -> tuple[AttemptState, list[Action]]:
    state = replace(state, ready_since=now, startup=enter(state.startup, Phase.READY, now), dead=None)
    startup_s = now - state.spawned_at
    message = f"vLLM is ready after {startup_s:.1f} s: {detail}"
    if state.startup_complete_at is not None:
        message += f"; READY=1 {(now - state.startup_complete_at) * 1000:.0f} ms after 'Application startup complete.'"
    if state.version is not None:
        message += f"; vLLM version {state.version}"
    return state, [BecomeReady(message, startup_s)]


def _on_tick(state: AttemptState, tick: Tick, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    if state.dead is not None and now >= state.dead_at + EXIT_GRACE_S:
        if state.exit_status is not None:
            return replace(state, dead=None), []
        return _liveness_failure(replace(state, dead=None), state.dead, hung=False, now=now, config=config)
    if state.ready or state.exit_status is not None:
        return state, []
    s = config.startup
    if now >= state.spawned_at + s.ready_timeout_s:
        say = Say(
            "stall_detected",
            f"vLLM did not become ready within startup.ready_timeout_s {s.ready_timeout_s:g} s "
            f"(phase {state.startup.phase.value}); stopping it",
            PRIORITY_ERR,
            (("attempt", state.number),),
        )
        return state, [say, Finish(Failed(cause=Cause.START_TIMEOUT, detail=f"not ready after {s.ready_timeout_s:g} s"))]
    actions: list[Action] = []
    if now >= state.next_io_at:
        state, actions = _sample_io(state, tick.io_bytes, now, config)
    last = _last_progress(state)
    window_s = config.memory.driver_oom_window_s
    if state.driver.times and not state.driver.recent(now, window_s):
        state = replace(state, driver=DriverRoom())  # its stall deadline has passed: it must not come round again
    found = stalled(state.driver, now, now - last, window_s)
    if found is not None and state.driver_said is not None:
        state, stop = _driver_stop(state, state.driver_said, found)
        return state, [*actions, *stop]
    if now < last + s.stall_timeout_s:
        return state, actions
    where = _where(state.startup)
    say = Say(
        "stall_detected",
        f"no loading progress for {now - last:.0f} s (startup.stall_timeout_s "
        f"{s.stall_timeout_s:g}) {where}, and vLLM's processes did no I/O; stopping the process group",
        PRIORITY_ERR,
        (
            ("attempt", state.number),
            ("phase", state.startup.phase.value),
            ("shards_done", state.startup.shards_done),
            ("shards_total", state.startup.shards_total),
        ),
    )
    return state, [*actions, say, Finish(Failed(cause=Cause.STALL, detail=f"stalled {where}"))]


def _sample_io(state: AttemptState, io_bytes: int | None, now: float, config: Config) -> tuple[AttemptState, list[Action]]:
    """Silent reading or writing by vLLM's processes counts as life (a shard slower than the stall timeout).

    The first sample is only a baseline; after that, growth of at least
    `IO_PROGRESS_MIN_BYTES` since the last sample that counted is progress.
    """
    state = replace(state, next_io_at=now + min(IO_SAMPLE_S, config.startup.stall_timeout_s / 4))
    if io_bytes is None:
        return state, []
    if state.io_bytes is None:
        return replace(state, io_bytes=io_bytes), []
    if io_bytes - state.io_bytes < IO_PROGRESS_MIN_BYTES:
        return state, []
    state = replace(state, io_bytes=io_bytes, startup=note_io(state.startup, io_bytes, now))
    state, extend = _extend(state, now, config)
    return state, list(extend)


def _extend(state: AttemptState, now: float, config: Config, force: bool = False) -> tuple[AttemptState, Sequence[Action]]:
    """EXTEND_TIMEOUT_USEC on real progress only, throttled, so a stuck start still times out."""
    if state.ready or (not force and state.extended_at is not None and now - state.extended_at < EXTEND_EVERY_S):
        return state, ()
    return replace(state, extended_at=now), (Extend(start_time_asked(config)),)


def _last_progress(state: AttemptState) -> float:
    """When the start last made progress (a phase, a shard, I/O), or was spawned."""
    return state.startup.last_progress_at if state.startup.last_progress_at is not None else state.spawned_at


def _where(startup: StartupState) -> str:
    if startup.phase is Phase.LOADING_WEIGHTS and startup.shards_total:
        return f"at shard {startup.shards_done}/{startup.shards_total}"
    return f"in phase {startup.phase.value}"


def _status(state: AttemptState, config: Config) -> str:
    return status_text(state.startup, state.number, config.restart.max_attempts, state.tunables.gpu_memory_utilization)


def served_name_problem(expected: Sequence[str], models: ProbeResult) -> str | None:
    """Why clients would get 404 from /v1/models' answer, or None when every expected name is served."""
    missing = [name for name in expected if name not in models.models]
    if models.ok and not missing:
        return None
    shown = ", ".join(models.models) or f"nothing (HTTP {models.status or models.reason})"
    return (
        f"vLLM serves {shown} but the config expects {', '.join(expected)}: clients asking for "
        f"{missing[0] if missing else expected[0]} would get 404"
    )


def waits_for_listen(waited_s: float) -> bool:
    """Whether the readiness check still waits for vLLM's port after `Application startup complete.`."""
    return waited_s <= LISTEN_GRACE_S
