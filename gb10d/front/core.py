"""The front's decisions, free of I/O: which instance a request goes to, and whether it goes now, waits, or is refused.

The shell (gb10d.front.server) reads sockets and state files and acts; everything it decides, it decides here, from
values it passes in (the request's bytes, what each instance's state file says, how long a request has waited), so
every case is a fast test.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ..core.statefile import DaemonState, StateRecord
from ..daemon.status import not_running_reason

# RFC 9110 §7.6.1: meaningful for one connection only; a proxy never forwards them. `Connection` may name more.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade",
})

# Paths the front answers itself: a load balancer's health check must not wake or wait for any model.
FRONT_HEALTH = "/health"
MODELS = "/v1/models"


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
class Forward:
    instance: Instance


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


Route = Forward | Answer


def error(status: int, message: str, kind: str, retry_after_s: int | None = None) -> Answer:
    """An error in the shape OpenAI clients parse (`{"error": {"message", "type", "code"}}`)."""
    return Answer(status, {"error": {"message": message, "type": kind, "code": status}}, retry_after_s)


def forwarded_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers a proxy passes on: all but hop-by-hop ones, those `Connection` names, and Host and Content-Length
    (the shell sets both for the connection it writes to)."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = {token.strip().lower() for name, value in pairs if name == b"connection" for token in value.split(b",")}
    dropped = {h.encode() for h in HOP_BY_HOP} | named | {b"host", b"content-length"}
    return [(name, value) for name, value in pairs if name not in dropped]


@dataclass(frozen=True)
class ApiKey:
    """A key clients may send, and the models it may use (none named: every model)."""

    secret: bytes
    models: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entry: str) -> ApiKey:
        """`KEY`, or `KEY MODEL...` for a key restricted to those models (keys hold no spaces)."""
        secret, *models = entry.split()
        return cls(secret.encode(), frozenset(models))


def authorized(path: str, headers: Iterable[tuple[bytes, bytes]], keys: Sequence[ApiKey]) -> ApiKey | Answer | None:
    """The key the request carries, None when it needs none (no keys are set, or it is the front's /health), or 401.

    Every key is compared, each in constant time, so neither a key nor which one matched leaks through timing."""
    if not keys or path.split("?", 1)[0] == FRONT_HEALTH:
        return None
    given = b""
    for name, value in headers:
        name = name.lower()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            given = value[7:].strip()
        elif name == b"x-api-key":
            given = value.strip()
    matched: ApiKey | None = None
    for key in keys:
        if hmac.compare_digest(given, key.secret) and matched is None:
            matched = key
    if matched is not None:
        return matched
    return error(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)", "AuthenticationError")


def model_of(body: bytes, content_type: str) -> tuple[str | None, Answer | None]:
    """The request's `model` field, or None when the body names none, or a 400 for a body that is not JSON."""
    if not body.strip() or "json" not in content_type.lower():
        return None, None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, error(400, f"the request body is not valid JSON: {exc}", "BadRequestError")
    if not isinstance(parsed, dict):
        return None, error(400, "the request body must be a JSON object", "BadRequestError")
    model = parsed.get("model")
    if model is None:
        return None, None
    if not isinstance(model, str):
        return None, error(400, f'"model" must be a string (got {json.dumps(model)})', "BadRequestError")
    return model, None


def route(
    method: str, path: str, body: bytes, content_type: str, instances: Sequence[Instance], readiness: Mapping[str, Readiness], now: float,
    allowed: frozenset[str] = frozenset(),
) -> Route:
    """Where a request goes: the instance serving its `model`, or the only instance when it names none, or an answer
    (the front's own /health and /v1/models among them). `allowed`: the models the request's key may use (empty:
    every model); a restricted key sees only those, and gets 403 for the others."""
    bare = path.split("?", 1)[0]
    if bare == FRONT_HEALTH and method in ("GET", "HEAD"):
        return Answer(200, {"status": "ok"})
    if bare == MODELS and method == "GET":
        return model_list(instances, readiness, now, allowed)
    model, problem = model_of(body, content_type)
    if problem is not None:
        return problem
    served = sorted(name for instance in instances for name in instance.models if not allowed or name in allowed)
    if model is None:
        if len(instances) == 1:
            return _permitted(Forward(instances[0]), allowed, instances[0].models)
        return error(400, f'the request names no "model"; this endpoint serves {", ".join(served) or "no model"}', "BadRequestError")
    for instance in instances:
        if model in instance.models:
            return _permitted(Forward(instance), allowed, (model,))
    return error(404, f"The model `{model}` does not exist. This endpoint serves: {', '.join(served) or 'none'}.", "NotFoundError")


def _permitted(forward: Forward, allowed: frozenset[str], asked: Sequence[str]) -> Route:
    """`forward` when the key may use one of the models `asked` for, else 403 naming those it may use."""
    if not allowed or allowed.intersection(asked):
        return forward
    return error(403, f"this API key may not use {', '.join(asked)}; it may use {', '.join(sorted(allowed))}", "PermissionDeniedError")


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


def sse_error_event(message: str) -> bytes:
    """The last event of a stream whose instance went away mid-answer: the client sees why instead of waiting."""
    payload = json.dumps({"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}})
    return f"event: error\ndata: {payload}\n\n".encode()


def readiness_of(state: StateRecord | None, alive: bool) -> Readiness:
    """An instance's readiness from its state file and whether its gb10d process lives."""
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
    # Asked to start and not yet starting: its share is not in the ledger yet, but it will be.
    waking: bool = False
    # Parked by sleep: its wake checks its own memory (on_demand.wake_margin_gib) and starts cold when it is short.
    asleep: bool = False
    active_at: float = 0.0  # its last request began or ended (monotonic seconds)


@dataclass(frozen=True)
class StartIt:
    """The parked model fits now: ask its gb10d to start (or wake) it."""

    message: str


@dataclass(frozen=True)
class Evict:
    """Park `victim`, the least recently used idle on-demand model, to make room; start the wanted one once the
    victim's memory is back."""

    victim: str
    message: str


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
    if wanted.asleep:
        return StartIt("a wake from sleep checks its own memory (on_demand.wake_margin_gib)")
    room_bytes -= sum(o.need_bytes for o in others if o.waking)
    if wanted.need_bytes <= room_bytes:
        return StartIt(f"it needs {need} GiB, {_gib(room_bytes)} GiB is free")
    running = [o for o in others if o.running or o.waking]
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
    if not idle:
        return AwaitRoom(f"{short}; every model that could make room has requests or is pinned")
    victim = min(idle, key=lambda o: (o.active_at, o.name))
    return Evict(victim.name, f"{short}; parking {victim.name} ({_gib(victim.need_bytes)} GiB), the least recently used idle on-demand model")


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f}"
