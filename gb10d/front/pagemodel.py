"""What the front's page (/ui/) shows, decided without I/O: the machine's memory as one bar whose segments add up
to MemTotal, a card per instance from its state file and the front's counts, vLLM's token rate and time to first
token from two samples of its /metrics, who may act on a model, and when the page's event stream speaks.

gb10d.front.page reads the files, sockets and clocks and hands the readings here; every number the page shows is
computed here, so each case is a table test.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..base.units import GIB
from ..core.budget import Reservation, Stage
from ..core.eta import of_state
from ..core.liveness import GENERATION_TOKENS
from ..core.memory import MemInfo
from ..core.statefile import DaemonState, StateRecord
from ..vllm.metricstext import family_sums
from .core import Answer, Readiness, error
from .routes import ApiKey

# The page's event stream sends the page's data at most this often, and only when it changed ...
SEND_EVERY_S = 1.0
# ... and otherwise a comment this often, so that proxies and the browser keep the stream open.
COMMENT_EVERY_S = 15.0
# vLLM's /metrics is read this often for each serving instance, and only while a page is open.
METRICS_EVERY_S = 10.0
# What the page may ask of an instance's gb10d over its control socket.
ACTIONS = frozenset({"wake", "park", "restart"})
# The states in which a vLLM runs (or starts) for a restart to stop and start again.
RESTARTABLE = frozenset({DaemonState.SERVING, DaemonState.STARTING, DaemonState.RESTARTING, DaemonState.ASLEEP})
# The recent decisions shown: the front's and its instances' together, the latest.
DECISIONS = 50


@dataclass(frozen=True)
class Segment:
    """One stretch of the memory bar: what holds it (`kind`: model, reserved, other, cache, free), whose it is
    (an instance's name for model and reserved), and its size."""

    kind: str
    label: str
    bytes: int
    instance: str = ""


@dataclass(frozen=True)
class Shortfall:
    """A parked or stopped model that would not fit now: what its start reserves and what a start can count on."""

    instance: str
    need_bytes: int
    room_bytes: int


@dataclass(frozen=True)
class MemoryBar:
    total_bytes: int
    segments: tuple[Segment, ...]
    headroom_bytes: int
    shortfalls: tuple[Shortfall, ...] = ()


@dataclass(frozen=True)
class Holder:
    """One instance as the memory bar counts it: its ledger record (None without a ledger), its state file, and
    what its start reserves (utilization x MemTotal + headroom)."""

    name: str
    record: Reservation | None
    state: StateRecord | None
    share_bytes: int
    utilization: float


def memory_bar(mem: MemInfo, holders: Sequence[Holder], headroom_gib: float) -> MemoryBar:
    """MemTotal as the sum of: what each instance's vLLM holds, what each start in progress has reserved and not
    yet taken, other programs, the page cache that can be reclaimed, and free memory.

    A serving vLLM holds what its own start measured (the ledger's real_use), else utilization x MemTotal; a start
    in progress holds the drop of MemAvailable since it began (its state file's baseline), within its share, and the
    rest of its share is reserved. What is in use beyond the instances is other programs'. When the estimates
    exceed what /proc/meminfo shows in use, they are scaled down to it, so the segments always add up exactly."""
    used = max(mem.total - mem.available, 0)
    held: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for h in holders:
        stage = h.record.stage if h.record is not None else _stage_of(h.state)
        if stage is Stage.SERVING:
            real = h.record.real_use if h.record is not None else None
            held[h.name] = real if real is not None else math.ceil(mem.total * h.utilization)
        elif stage is not None and stage.pending:
            share = h.record.bytes if h.record is not None else h.share_bytes
            baseline = h.state.memory.available_bytes if h.state is not None and h.state.memory is not None else mem.available
            taken = min(max(baseline - mem.available, 0), share)
            held[h.name], reserved[h.name] = taken, share - taken
    held = _fit(held, used)
    reserved = _fit(reserved, mem.available)
    segments = [Segment("model", f"{name} holds", size, name) for name, size in held.items() if size > 0]
    segments += [Segment("reserved", f"{name} reserved, not yet taken", size, name) for name, size in reserved.items() if size > 0]
    segments.append(Segment("other", "other programs", used - sum(held.values())))
    rest = mem.available - sum(reserved.values())
    cache = min(max(mem.cached, 0), rest)
    segments += [Segment("cache", "page cache", cache), Segment("free", "free", rest - cache)]
    return MemoryBar(mem.total, tuple(segments), math.ceil(headroom_gib * GIB))


def shortfalls(mem: MemInfo, holders: Sequence[Holder], room_bytes: int) -> tuple[Shortfall, ...]:
    """The models that run no vLLM (parked, stopped, failed, waiting for memory) and whose share is more than a
    start may count on now (`room_bytes`: MemAvailable less the starts in progress)."""
    out = []
    for h in holders:
        stage = h.record.stage if h.record is not None else _stage_of(h.state)
        if stage in (None, Stage.PARKED, Stage.WAITING) and h.share_bytes > room_bytes:
            out.append(Shortfall(h.name, h.share_bytes, max(room_bytes, 0)))
    return tuple(out)


def _stage_of(state: StateRecord | None) -> Stage | None:
    """The ledger's stage from a state file, for an instance without a ledger record."""
    if state is None or state.state is None:
        return None
    if state.state in (DaemonState.SERVING, DaemonState.ASLEEP, DaemonState.PARKING, DaemonState.WAKING):
        return Stage.SERVING
    if state.state in (DaemonState.STARTING, DaemonState.RESTARTING):
        return Stage.STARTING
    if state.state is DaemonState.WAITING_FOR_MEMORY:
        return Stage.WAITING
    return Stage.PARKED if state.state is DaemonState.PARKED else None


def _fit(sizes: dict[str, int], limit: int) -> dict[str, int]:
    """`sizes` scaled down together so that they add up to `limit` at most."""
    whole = sum(sizes.values())
    if whole <= limit or whole == 0:
        return sizes
    scaled = {name: size * max(limit, 0) // whole for name, size in sizes.items()}
    return scaled


# --- vLLM's own figures -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """The counters of one read of vLLM's /metrics that the page turns into rates, and when (monotonic seconds)."""

    at: float
    generation_tokens: float
    ttft_sum_s: float
    ttft_count: float


TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
TTFT_COUNT = "vllm:time_to_first_token_seconds_count"


def parse_metrics(text: str, at: float) -> Sample:
    """The generated tokens and the time-to-first-token histogram's sum and count from Prometheus text, summed over
    every label set (one per model name and engine)."""
    sums = family_sums(text, (GENERATION_TOKENS, TTFT_SUM, TTFT_COUNT))
    return Sample(at, sums.get(GENERATION_TOKENS, 0.0), sums.get(TTFT_SUM, 0.0), sums.get(TTFT_COUNT, 0.0))


@dataclass(frozen=True)
class Rates:
    tokens_per_s: float | None
    ttft_s: float | None


def rates(before: Sample | None, after: Sample | None) -> Rates:
    """Tokens per second and the mean time to first token of the requests between two samples; None where the
    samples do not tell (one sample, a restart that reset the counters, no request in between)."""
    if before is None or after is None or after.at <= before.at or after.generation_tokens < before.generation_tokens:
        return Rates(None, None)
    tokens = (after.generation_tokens - before.generation_tokens) / (after.at - before.at)
    asked = after.ttft_count - before.ttft_count
    ttft = (after.ttft_sum_s - before.ttft_sum_s) / asked if asked > 0 else None
    return Rates(tokens, ttft)


# --- the cards --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Card:
    """One instance as the page shows it."""

    instance: str
    models: tuple[str, ...]
    state: str  # serving, starting, parked, asleep, failed, stopped, ... (DaemonState's words, or "not running")
    detail: str  # what it does now, e.g. "loading weights 12/66"
    progress: tuple[int, int] | None = None
    failure: str = ""
    fix: str = ""
    eta: str = ""
    serving_since: float | None = None  # wall clock: the page counts the uptime itself, so the data stays unchanged
    restarts: int | None = None
    last_start_s: float | None = None
    in_flight: int = 0
    held: int = 0
    tokens_per_s: float | None = None
    ttft_s: float | None = None
    can_wake: bool = False
    can_park: bool = False
    can_restart: bool = False
    curl: str = ""


def card(
    instance: str, models: tuple[str, ...], state: StateRecord | None, ready: Readiness, held: int, in_flight: int,
    on_demand: bool, measured: Rates, front_url: str, keyed: bool, now: float,
) -> Card:
    """The card of one instance: its state in words, the failure and its fix from the state file, its times, its
    queue and vLLM's figures; wake and park offered to an on-demand instance where they mean something, a restart
    while a vLLM runs or starts.
    The time left comes from the phase durations of its last complete start, which its state file carries; `now`:
    wall clock."""
    words = state.state.value if state is not None and state.state is not None else "not running"
    if not ready.coming and words not in ("failed", "stopped"):
        words = "not running"
    serving = state is not None and state.state is DaemonState.SERVING
    starting = state is not None and state.state in (DaemonState.STARTING, DaemonState.RESTARTING)
    progress = (state.progress.shards_done, state.progress.shards_total) if starting and state is not None and state.progress else None
    failure = state.last_failure if state is not None else None
    eta = (of_state(state, now) if state is not None else None) or ""
    since = state.ready_at if serving and state is not None else None
    last_start = (
        state.ready_at - state.memory_at if state is not None and state.ready_at is not None and state.memory_at is not None else None
    )
    restarts = max(state.attempt - 1, 0) if state is not None and state.attempt else None
    return Card(
        instance=instance, models=models, state=words, detail=_detail(state, ready), progress=progress,
        failure=failure.message if failure is not None and not serving else "",
        fix=failure.action if failure is not None and not serving else "",
        eta=eta, serving_since=since, restarts=restarts, last_start_s=last_start, in_flight=in_flight, held=held,
        tokens_per_s=measured.tokens_per_s if serving else None, ttft_s=measured.ttft_s if serving else None,
        can_wake=on_demand and ready.parked, can_park=on_demand and ready.serving,
        can_restart=ready.coming and state is not None and state.state in RESTARTABLE,
        curl=curl_for(front_url, models[0] if models else "", keyed),
    )


def _detail(state: StateRecord | None, ready: Readiness) -> str:
    """What the instance does now: the front's words for a client, which name the phase and its progress."""
    if state is not None and state.state in (DaemonState.STARTING, DaemonState.RESTARTING) and state.phase:
        words = state.phase.replace("_", " ")
        if state.progress is not None:
            words += f" {state.progress.shards_done}/{state.progress.shards_total}"
        return words
    if state is not None and state.state is not None and state.state.final:
        return ""  # the state says it; the failure, if any, is shown with its fix
    return ready.detail


def curl_for(front_url: str, model: str, keyed: bool) -> str:
    """A command that asks the model for a short completion through the front."""
    key = ' -H "Authorization: Bearer $KEY"' if keyed else ""
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}' % model
    return f"curl -s {front_url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d '{body}'"


def visible(cards: Iterable[Card], allowed: frozenset[str]) -> list[Card]:
    """The cards a key may see, as /v1/models lists models: every one without a restriction, else those of an
    instance that serves one of the key's models."""
    return [c for c in cards if not allowed or allowed.intersection(c.models)]


# --- who may act --------------------------------------------------------------------------------------------------

# A header a cross-site form or a simple fetch cannot send without a CORS preflight, which the front does not grant.
ACTION_HEADER = "x-gb10d-page"


def may_act(key: ApiKey | None, keys_set: bool, loopback: bool, has_header: bool, models: tuple[str, ...]) -> Answer | None:
    """None when the page may act on an instance serving `models`; else the refusal. With front api_keys, a valid
    key (checked before) that may use one of its models; without keys, a client on this machine only. Always the
    page's own header, so that another site's page cannot post here through the operator's browser."""
    if not has_header:
        return error(403, f"actions need the page's {ACTION_HEADER} header", "PermissionDeniedError")
    if keys_set:
        if key is not None and key.models and not key.models.intersection(models):
            return error(403, f"this API key may not use {', '.join(models)}", "PermissionDeniedError")
        return None
    if not loopback:
        return error(403, "without front.api_keys, models are woken, parked or restarted only from this machine (loopback): use an SSH tunnel, or set front.api_keys", "PermissionDeniedError")
    return None


def is_loopback(address: str | None) -> bool:
    return address is not None and (address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1") or address.startswith("::ffff:127."))


# --- the event stream ---------------------------------------------------------------------------------------------


@dataclass
class Pace:
    """When the page's event stream speaks: the data when it changed, at most every SEND_EVERY_S; a comment after
    COMMENT_EVERY_S of silence."""

    sent: str = ""
    spoke_at: float = field(default_factory=lambda: -math.inf)

    def next(self, data: str, now: float) -> str | None:
        """The event to send now (a data event or a comment line), or None."""
        if data != self.sent:
            self.sent, self.spoke_at = data, now
            return "data: " + data.replace("\n", "\ndata: ") + "\n\n"
        if now - self.spoke_at >= COMMENT_EVERY_S:
            self.spoke_at = now
            return ": nothing changed\n\n"
        return None
