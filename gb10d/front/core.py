"""The front's decisions on time, free of I/O: whether a request for an instance goes now, waits, or is refused;
what an instance's state file means to a client; when to park or wake an on-demand model and how to make room.

Where a request goes is gb10d.front.routes'. The shell (gb10d.front.proxy, states, swaps) reads sockets and state
files and acts; everything it decides, it decides here, from values it passes in (what each instance's state file
says, how long a request has waited), so every case is a fast test.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..base.backoff import doubled
from ..core.statefile import DaemonState, StateRecord, not_running_reason


@dataclass(frozen=True)
class Instance:
    """One gb10d instance as its config describes it: the names it serves and its internal address."""

    name: str
    models: tuple[str, ...]
    host: str
    port: int


@dataclass(frozen=True)
class Readiness:
    """What the front knows of an instance now: from its state file, and whether its address refused a connection."""

    serving: bool
    # A running gb10d that will serve in time (starting, restarting, waiting for memory); False when stopped or failed.
    coming: bool
    # What a client is told while it waits, e.g. "loading weights 12/66".
    detail: str
    # Parked (on_demand: vLLM asleep, or stopped with its memory back): the front wakes it for a request.
    parked: bool = False

    @property
    def parking(self) -> bool:
        """Its gb10d puts vLLM to sleep or stops it: its memory is on its way back."""
        return self.detail == DaemonState.PARKING.value

    @property
    def asleep(self) -> bool:
        """Parked by vLLM's sleep, which keeps the process: its wake checks its own memory."""
        return self.detail == DaemonState.ASLEEP.value


@dataclass(frozen=True)
class Answer:
    """A reply the front gives itself (an error, the model list, its health), as an OpenAI-style JSON body."""

    status: int
    body: Mapping[str, object]
    retry_after_s: int | None = None

    @property
    def message(self) -> str:
        """An error's message, for the journal line that records it."""
        err = self.body.get("error")
        return str(err.get("message", "")) if isinstance(err, dict) else ""


def error(status: int, message: str, kind: str, retry_after_s: int | None = None) -> Answer:
    """An error in the shape OpenAI clients parse (`{"error": {"message", "type", "code"}}`)."""
    return Answer(status, {"error": {"message": message, "type": kind, "code": status}}, retry_after_s)


@dataclass(frozen=True)
class Go:
    pass


@dataclass(frozen=True)
class Wait:
    pass


Admission = Go | Wait | Answer

# A client told to retry comes back after this many seconds at most: soon enough to catch READY, rarely enough not to flood.
RETRY_AFTER_S = 5


def admit(
    instance: Instance, ready: Readiness, held: int, queue_limit: int, waited_s: float, hold_timeout_s: float, newly: bool,
    room: Room | None = None,
) -> Admission:
    """Whether a request for `instance` goes through, waits for it, or gets 503.

    `held`: requests already waiting for it (this one excluded when `newly`, the first ask); `waited_s`: how long
    this one has waited; `room`: `make_room`'s answer for a parked instance. A stopped or failed instance is not
    waited for, nor a parked model that can never fit: nothing would make it serve."""
    if ready.serving:
        return Go()
    if isinstance(room, Answer):
        return room
    what = f"{instance.name} is {ready.detail}"
    if not ready.coming:
        return error(503, f"{what}; it is not starting (systemctl start gb10d@{instance.name})", "ServiceUnavailableError", RETRY_AFTER_S)
    if newly and held >= queue_limit:
        return error(503, f"{what}, and {held} requests already wait for it (front.queue_limit)", "ServiceUnavailableError", RETRY_AFTER_S)
    if waited_s >= hold_timeout_s:
        return error(503, f"{what}; waited {waited_s:.0f} s (front.hold_timeout_s)", "ServiceUnavailableError", RETRY_AFTER_S)
    return Wait()


def model_list(instances: Sequence[Instance], readiness: Mapping[str, Readiness], now: float, allowed: frozenset[str] = frozenset()) -> Answer:
    """/v1/models for every configured model (those `allowed` when a key is restricted), each with its instance's
    state (`gb10d_state`), serving or not."""
    data = [
        {
            "id": model, "object": "model", "created": int(now), "owned_by": "gb10d",
            "gb10d_instance": instance.name,
            "gb10d_state": "serving" if readiness[instance.name].serving else readiness[instance.name].detail,
        }
        for instance in instances for model in instance.models if not allowed or model in allowed
    ]
    return Answer(200, {"object": "list", "data": data})


def sse_error_event(message: str, code: int = 503) -> bytes:
    """The last event of a stream whose instance went away mid-answer, or that its hold ended without an answer:
    the client sees why instead of waiting."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 504: "GatewayTimeoutError"}.get(code, "ServiceUnavailableError" if code == 503 else "APIError")
    payload = json.dumps({"error": {"message": message, "type": kind, "code": code}})
    return f"event: error\ndata: {payload}\n\n".encode()


# How long an instance whose gb10d died without stopping (kill -9, a crash) is waited for: systemd's Restart= brings
# it back after RestartSec (30 s in gb10d@.service) and its start writes a new state file within a second.
RESTART_GRACE_S = 90.0


def readiness_of(state: StateRecord | None, alive: bool, dead_for_s: float = 0.0) -> Readiness:
    """An instance's readiness from its state file and whether its gb10d process lives.

    A gb10d that exited without saying it stopped or failed (its state is neither) died: its unit restarts it, so
    it is waited for during RESTART_GRACE_S (`dead_for_s`: since the front first saw it dead), not refused."""
    if state is not None and not alive and state.pid is not None and state.state is not None and not state.state.final:
        if dead_for_s < RESTART_GRACE_S:
            return Readiness(serving=False, coming=True, detail=f"restarting: its gb10d (pid {state.pid}) exited without stopping, and systemd restarts it")
        return Readiness(serving=False, coming=False, detail=f"not running (pid {state.pid} has exited, and no gb10d came back in {RESTART_GRACE_S:.0f} s)")
    reason = not_running_reason(state, alive)
    if reason is not None or state is None or state.state is None:
        return Readiness(serving=False, coming=False, detail=f"not running ({reason or 'no state yet'})")
    if state.state is DaemonState.SERVING:
        return Readiness(serving=True, coming=True, detail="serving")
    if state.state in (DaemonState.ASLEEP, DaemonState.PARKED, DaemonState.PARKING, DaemonState.WAKING):
        return Readiness(serving=False, coming=True, detail=state.state.value, parked=state.state in (DaemonState.ASLEEP, DaemonState.PARKED))
    detail = state.state.value
    if state.phase:
        detail += f": {state.phase}"
    if state.progress is not None:
        detail += f" {state.progress.shards_done}/{state.progress.shards_total}"
    return Readiness(serving=False, coming=True, detail=detail)


def reconnect_delay_s(refusals: int) -> float:
    """How long a request waits before it tries an instance whose address refused it `refusals` times in a row
    while its state file still said serving: 0.1 s doubling to 2 s, so a dead port costs a few connects a second,
    never a loop."""
    return doubled(0.1, refusals - 1, 2.0)


# A held stream hears from the front this often: proxies before it (nginx: 60 s) and clients keep waiting.
HOLD_COMMENT_S = 10.0


def sse_comment(text: str) -> bytes:
    """An SSE comment line, which clients ignore: what a held stream is told while its model starts."""
    return b": " + text.replace("\n", " ").replace("\r", " ").encode() + b"\n\n"


def should_wake(ready: Readiness, held: int, in_flight: int, asked: bool) -> bool:
    """Ask a parked instance to wake (or start): a request waits for it (held by the front, or sent just before it
    fell asleep, which vLLM holds), and no wake was asked since it parked. Whether it fits now is `make_room`'s."""
    return ready.parked and (held > 0 or in_flight > 0) and not asked


def should_park(ready: Readiness, held: int, in_flight: int, idle_s: float, idle_timeout_s: float | None, asked: bool) -> bool:
    """Ask an on-demand instance to park: it serves, nothing waits for it or runs on it, and it has been idle
    for its on_demand.idle_timeout_s."""
    return idle_timeout_s is not None and ready.serving and held == 0 and in_flight == 0 and idle_s >= idle_timeout_s and not asked


# --- models on demand: room for a parked model ------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One instance as a start on demand sees it: what its start reserves, whether the front may park it, whether
    it holds memory now, and when it was last used."""

    name: str
    need_bytes: int  # its share as the memory ledger counts it: gpu_memory_utilization x MemTotal + headroom
    on_demand: bool  # without [on_demand] an instance is pinned: the front never parks it
    running: bool  # its vLLM holds memory, or will: serving, starting, or parking (not parked, not stopped)
    serving: bool
    parking: bool  # asked to park, or parking: its memory is on its way back
    busy: bool  # requests held for it or in flight on it
    # Asked to start or wake, or starting, and its share not reserved in the memory ledger (yet, or without a
    # ledger): MemAvailable does not show it either, so the front counts it itself.
    unbooked: bool = False
    # Parked by sleep: its wake checks its own memory (on_demand.wake_margin_gib) and starts cold when it is short.
    asleep: bool = False
    active_at: float = 0.0  # its last request began or ended (monotonic seconds)
    waited_s: float = 0.0  # how long its oldest held request has waited (none held: 0)
    served_s: float = 0.0  # how long it has served since it last became ready (not serving: 0)


# A busy model is drained and parked for a parked one whose requests have waited this long, once it has served this
# long itself: each model with traffic gets turns of at least this, and no request waits out front.hold_timeout_s
# behind a model that is never idle. Shorter turns would swap more often than they serve (a swap takes seconds).
SWAP_TURN_S = 10.0


@dataclass(frozen=True)
class StartIt:
    """The parked model fits now: ask its gb10d to start (or wake) it."""

    message: str


@dataclass(frozen=True)
class Evict:
    """Park `victim`, the least recently used idle on-demand model, to make room; start the wanted one once the
    victim's memory is back. `drain`: the victim is busy and had its turn; its new requests wait from now on, and it
    is parked once those in flight are answered (a park stops vLLM, which would cut them)."""

    victim: str
    message: str
    drain: bool = False


@dataclass(frozen=True)
class AwaitRoom:
    """Not yet: a parked model's memory is on its way back, or every model that could give memory is busy."""

    message: str


Room = StartIt | Evict | AwaitRoom | Answer


def make_room(wanted: Slot, others: Sequence[Slot], room_bytes: int, total_bytes: int) -> Room:
    """Whether a parked model that a request waits for starts now, after another is parked, later, or never.

    `room_bytes`: what a start may count on now (MemAvailable less the reservations of the starts in progress, as
    the memory ledger's admission counts it); `total_bytes`: MemTotal. A model whose share is more than MemTotal less
    the shares of the pinned instances that run can never fit: it gets an error at once, with the numbers. One that
    does not fit now waits while another parks, or makes the least recently used idle on-demand model park, one at
    a time until it fits; it waits (bounded by front.hold_timeout_s) when every such model is busy."""
    need = _gib(wanted.need_bytes)
    # A model asleep gave back nearly its whole share (all but its CUDA context), and its wake takes it again: it is
    # made room for as a stopped one is, by parking another; its wake still checks its own memory.
    room_bytes -= sum(o.need_bytes for o in others if o.unbooked)
    if wanted.need_bytes <= room_bytes:
        return StartIt(f"it needs {need} GiB, {_gib(room_bytes)} GiB is free")
    running = [o for o in others if o.running or o.unbooked]
    pinned = [o for o in running if not o.on_demand]
    pinned_bytes = sum(o.need_bytes for o in pinned)
    if wanted.need_bytes > total_bytes - pinned_bytes:
        held = f"{_gib(pinned_bytes)} GiB ({', '.join(o.name for o in pinned)})" if pinned else "nothing"
        return error(
            503,
            f"{wanted.name} can never fit: it needs {need} GiB, the machine has {_gib(total_bytes)} GiB (MemTotal) and "
            f"pinned instances hold {held}, which leaves {_gib(max(total_bytes - pinned_bytes, 0))} GiB; lower its "
            "vllm.gpu_memory_utilization, or give a pinned instance [on_demand]",
            "ServiceUnavailableError",
        )
    short = f"it needs {need} GiB, {_gib(max(room_bytes, 0))} GiB is free"
    parking = sorted(o.name for o in running if o.parking)
    if parking:
        return AwaitRoom(f"{short}; waiting for the memory of {', '.join(parking)}, which parks")
    idle = [o for o in running if o.on_demand and o.serving and not o.busy]
    due = [o for o in running if o.on_demand and o.serving and o.busy and o.served_s >= SWAP_TURN_S]
    if not idle and due and wanted.waited_s >= SWAP_TURN_S:
        victim = max(due, key=lambda o: (o.served_s, o.name))
        return Evict(
            victim.name,
            f"{short}; its requests waited {wanted.waited_s:.0f} s and {victim.name} has served for {victim.served_s:.0f} s "
            f"(a turn is {SWAP_TURN_S:g} s): {victim.name}'s requests in flight finish, its new ones wait, then it parks",
            drain=True,
        )
    if not idle and wanted.asleep and not running:
        # No model of gb10d's holds the memory: its wake checks its own memory, and starts vLLM cold when it is short.
        # Beside a busy or starting model it waits as a stopped one does: its wake would find the memory short (or
        # count on a start's memory MemAvailable does not show yet), stop vLLM and start it cold, for nothing.
        return StartIt("a wake from sleep checks its own memory (on_demand.wake_margin_gib)")
    if not idle:
        # What neither gb10d's models nor free memory account for is other programs' (MemAvailable counts it).
        others_bytes = total_bytes - max(room_bytes, 0) - sum(o.need_bytes for o in running)
        if not running and others_bytes > 0:
            return AwaitRoom(f"{short}; no model of gb10d holds memory: other programs hold about {_gib(others_bytes)} GiB (MemTotal less MemAvailable), waiting for them to give it back")
        return AwaitRoom(f"{short}; every model that could make room has requests or is pinned")
    victim = min(idle, key=lambda o: (o.active_at, o.name))
    return Evict(victim.name, f"{short}; parking {victim.name} ({_gib(victim.need_bytes)} GiB), the least recently used idle on-demand model")


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f}"
