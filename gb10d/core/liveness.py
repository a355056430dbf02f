"""Liveness after ready: telling a hung engine from a busy one.

vLLM's /health only reads a flag, so a deadlocked engine keeps answering 200
while every request hangs. The verdict therefore rests on evidence gathered
over time, judged by the pure core below:

- while requests are in the engine (`vllm:num_requests_running` or
  `vllm:num_requests_waiting` > 0), `vllm:generation_tokens_total` or
  `vllm:prompt_tokens_total` must move within `liveness.progress_timeout_s`
  (a pooling model, an embedding model say, generates no token: only its
  prompt counter moves);
- while idle, a one-token completion every `liveness.idle_probe_interval_s`
  must finish within `liveness.probe_timeout_s`, unless tokens flowed
  meanwhile (a probe that is slow because the engine is saturated proves
  nothing);
- /health 503 or a refused connection means the engine is dead at once;
- an engine asleep is no hung one: vLLM with sleep mode holds every request
  while asleep and keeps answering /health and /v1/models 200, so a sleep
  that gb10d did not ask for (someone called /sleep on vLLM's port) looks
  like a hang. `vllm:engine_sleep_state` says so on every scrape; where
  the development endpoints are on (`sleep_checks`), `GET /is_sleeping`
  is asked before each idle probe and before a hang is called, and either
  saying asleep is the verdict `Asleep`.

The shell, `probing.watch_liveness`, samples /health and /metrics every
`liveness.health_interval_s`, runs the idle probe as its own task when the
core says it is due, and reports the first verdict that is not `Alive`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Union

from ..base.config import LivenessSection
from ..vllm.metricstext import family_sums, sample, sample_lines
from .facts import ADMISSION_REFUSED, ProbeResult

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
SLEEP_STATE = "vllm:engine_sleep_state"  # one sample per sleep_state label: awake, weights_offloaded, discard_all
_AWAKE = 'sleep_state="awake"'
# /is_sleeping is a call into the engine core, answered in milliseconds, between two steps at worst; a hung engine
# does not answer it at all, and waiting the whole probe timeout for that would only delay the hang's verdict.
SLEEP_CHECK_TIMEOUT_S = 10.0


def sleep_check_timeout(limits: LivenessSection) -> float:
    """How long one GET /is_sleeping may take."""
    return min(limits.probe_timeout_s, SLEEP_CHECK_TIMEOUT_S)
_FAMILIES = (RUNNING, WAITING, GENERATION_TOKENS, PROMPT_TOKENS)


# --- /metrics ------------------------------------------------------------------


@dataclass(frozen=True)
class MetricsSample:
    """The figures liveness needs from one /metrics scrape; None where vLLM did not report it."""

    running: float | None = None
    waiting: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    asleep: bool | None = None  # from vllm:engine_sleep_state; None where vLLM does not report it

    @property
    def busy(self) -> bool:
        """Requests are in the engine, so tokens are owed."""
        return (self.running or 0) > 0 or (self.waiting or 0) > 0


def parse_metrics(text: str) -> MetricsSample:
    """Sum each of the families over its label sets (engines, models); a family with no usable sample stays None,
    so a missing figure is never mistaken for zero."""
    sums = family_sums(text, _FAMILIES)
    awake = [v for line in sample_lines(text) for name, v in [sample(line)] if name == SLEEP_STATE and v is not None and _AWAKE in line]
    asleep = any(v == 0 for v in awake) if awake else None  # awake = 0: that engine sleeps
    return MetricsSample(sums.get(RUNNING), sums.get(WAITING), sums.get(GENERATION_TOKENS), sums.get(PROMPT_TOKENS), asleep)


# --- the core ------------------------------------------------------------------


@dataclass(frozen=True)
class Alive:
    """No evidence of a failure."""


@dataclass(frozen=True)
class Hung:
    """The engine is alive by /health but makes no progress; `evidence` goes to the journal verbatim.

    `cause` is the metrics label: `hung` (token counter stuck while busy) or
    `probe_timeout` (the idle probe did not finish).
    """

    evidence: str
    cause: str


@dataclass(frozen=True)
class Dead:
    """The engine is gone: /health 503 or a refused connection."""

    reason: str
    cause: str = "health"


@dataclass(frozen=True)
class Asleep:
    """vLLM sleeps, though liveness is watched only while gb10d has not put it to sleep; `evidence` says how it told."""

    evidence: str
    cause: str = "asleep"


@dataclass(frozen=True)
class AskIfAsleep:
    """The evidence says hung, but vLLM may only be asleep (it holds every request then): ask /is_sleeping first."""


Verdict = Union[Alive, Hung, Dead, Asleep, AskIfAsleep]


@dataclass(frozen=True)
class LivenessState:
    """Everything seen so far. `started_at` (ready) counts as the last proof of life."""

    started_at: float
    tokens: float | None = None
    tokens_moved_at: float | None = None
    sample: MetricsSample | None = None
    sampled_at: float | None = None
    busy_since: float | None = None
    health: ProbeResult | None = None
    probe_sent_at: float | None = None
    last_probe: ProbeResult | None = None
    last_probe_sent_at: float | None = None
    last_probe_done_at: float | None = None
    dead: str | None = None
    probe_words: str = "a 1-token completion"  # what the idle probe is, for the evidence
    sleep_checks: bool = False  # vLLM's development endpoints are on: /is_sleeping may be asked
    asleep: str | None = None  # how vLLM was found asleep, once it was
    sleep_check_sent_at: float | None = None  # a /is_sleeping in flight
    sleep_checked_at: float | None = None  # when the last answered one was sent

    @property
    def generated_at(self) -> float:
        """The last proof that the engine generates: the counter moving, else ready's warm-up completion."""
        return self.started_at if self.tokens_moved_at is None else self.tokens_moved_at


def start(now: float, probe_words: str = "a 1-token completion", sleep_checks: bool = False) -> LivenessState:
    """The state right after READY (or a checked wake): the warm-up request has just proved the engine works."""
    return LivenessState(started_at=now, probe_words=probe_words, sleep_checks=sleep_checks)


def observe_metrics(state: LivenessState, sample: MetricsSample | None, now: float) -> LivenessState:
    """Take one /metrics scrape (None: it did not answer, which leaves the last figures standing)."""
    if sample is None:
        return state
    tokens, moved_at = state.tokens, state.tokens_moved_at
    if sample.generation_tokens is not None:
        # Any change counts, a drop included: a counter that moves is an engine that works.
        if tokens is not None and sample.generation_tokens != tokens:
            moved_at = now
        tokens = sample.generation_tokens
    before = state.sample.prompt_tokens if state.sample is not None else None
    if before is not None and sample.prompt_tokens is not None and sample.prompt_tokens != before:
        moved_at = now  # prompts processed: all a pooling model ever shows
    busy_since = (state.busy_since if state.busy_since is not None else now) if sample.busy else None
    asleep = state.asleep or ("vllm:engine_sleep_state says awake 0" if sample.asleep else None)
    return replace(state, tokens=tokens, tokens_moved_at=moved_at, sample=sample, sampled_at=now, busy_since=busy_since, asleep=asleep)


def observe_health(state: LivenessState, result: ProbeResult, now: float) -> LivenessState:
    """Take one /health answer; 503 and refused connections are death, anything else only a fact."""
    dead = state.dead or death(result, "/health")
    return replace(state, health=result, dead=dead)


def probe_sent(state: LivenessState, now: float) -> LivenessState:
    """The idle probe is on its way."""
    return replace(state, probe_sent_at=now)


def observe_probe(state: LivenessState, result: ProbeResult, now: float) -> LivenessState:
    """The idle probe came back (answered, failed or timed out)."""
    return replace(
        state,
        probe_sent_at=None,
        last_probe=result,
        last_probe_sent_at=state.probe_sent_at,
        last_probe_done_at=now,
        dead=state.dead or death(result, "the idle probe"),
    )


def sleep_check_sent(state: LivenessState, now: float) -> LivenessState:
    """A GET /is_sleeping is on its way."""
    return replace(state, sleep_check_sent_at=now)


def observe_sleep_check(state: LivenessState, sleeping: bool | None, result: ProbeResult, now: float) -> LivenessState:
    """/is_sleeping came back: `sleeping` as it answered, None when it did not (a hung engine may not answer it
    either: that leaves the other evidence to judge)."""
    sent_at = state.sleep_check_sent_at if state.sleep_check_sent_at is not None else now
    asleep = state.asleep or (f"GET /is_sleeping answered is_sleeping true in {result.seconds:.2f} s" if sleeping else None)
    return replace(state, sleep_check_sent_at=None, sleep_checked_at=sent_at, asleep=asleep)


def sleep_check_wanted(state: LivenessState, since: float) -> bool:
    """Whether /is_sleeping must be asked before anything is concluded from evidence that began at `since`: the
    endpoints are on, none is in flight, and none was sent since."""
    return state.sleep_checks and state.sleep_check_sent_at is None and not _checked_since(state, since)


def _checked_since(state: LivenessState, since: float) -> bool:
    """A /is_sleeping sent at or after `since` has answered."""
    return state.sleep_checked_at is not None and state.sleep_checked_at >= since


def probe_may_go(state: LivenessState, due: float) -> bool:
    """Whether the idle probe due at `due` may go now: with the development endpoints on, only once /is_sleeping said
    awake since it fell due, as a probe sent to a sleeping vLLM is only held."""
    return not state.sleep_checks or (_checked_since(state, due) and not state.asleep)


def death(result: ProbeResult, what: str) -> str | None:
    """Why an answer proves the engine dead (503, or nothing listens), or None."""
    if result.status == 503 and result.reason != ADMISSION_REFUSED:
        return f"{what} answered 503 Service Unavailable: vLLM reports its engine dead"
    if result.refused:
        return f"{what} failed ({result.reason}): vLLM no longer listens on its port"
    return None


def verdict(state: LivenessState, now: float, limits: LivenessSection) -> Verdict:
    """Judge the evidence: dead beats asleep beats hung; a stuck token counter while busy or an unfinished idle probe
    is hung, once /is_sleeping (where it exists) was asked after that evidence began and did not say asleep."""
    if state.dead:
        return Dead(state.dead)
    if state.asleep:
        return Asleep(state.asleep)
    hung, since = _hung(state, now, limits)
    if hung is None:
        return Alive()
    if state.sleep_checks and not _checked_since(state, since):
        return AskIfAsleep()
    return hung


def _hung(state: LivenessState, now: float, limits: LivenessSection) -> tuple[Hung | None, float]:
    """The hang the evidence shows, if any, and since when that evidence has been gathered."""
    stuck_since = _stuck_since(state)
    if stuck_since is not None and now - stuck_since >= limits.progress_timeout_s:
        return Hung(_stuck_evidence(state, stuck_since, now, limits), "hung"), stuck_since
    sent_at = _unfinished_probe_sent_at(state, now, limits)
    # A probe slowed by a saturated engine is no failure as long as tokens flowed after it was sent;
    # and a probe stuck behind other requests (a long prefill) is for the progress rule to judge.
    if sent_at is not None and state.generated_at <= sent_at and not _others_in_engine(state):
        return Hung(_probe_evidence(state, sent_at, now, limits), "probe_timeout"), sent_at
    return None, now


def _others_in_engine(state: LivenessState) -> bool:
    """More requests in the engine than the idle probe itself."""
    sample = state.sample
    return sample is not None and (sample.running or 0) + (sample.waiting or 0) > 1


def _stuck_since(state: LivenessState) -> float | None:
    """Since when tokens are owed and none came: the later of the last token and the start of the busy stretch."""
    if state.sample is None or not state.sample.busy or state.busy_since is None:
        return None
    return max(state.generated_at, state.busy_since)


def _unfinished_probe_sent_at(state: LivenessState, now: float, limits: LivenessSection) -> float | None:
    """When the probe that failed to finish within probe_timeout_s was sent, if one did."""
    if state.probe_sent_at is not None and now - state.probe_sent_at >= limits.probe_timeout_s:
        return state.probe_sent_at
    last = state.last_probe
    if last is not None and state.last_probe_sent_at is not None and not last.ok and last.status is None:
        if last.reason == "timed out" or last.seconds >= limits.probe_timeout_s:
            return state.last_probe_sent_at
    return None


def next_probe_due(state: LivenessState, now: float, limits: LivenessSection) -> float | None:
    """When the idle probe should go out: never while requests are in the engine or a probe is out.

    The interval counts from the last proof of life: tokens moving, a probe
    answering, or ready itself.
    """
    if state.probe_sent_at is not None or (state.sample is not None and state.sample.busy):
        return None
    proof = max(state.generated_at, state.last_probe_done_at or state.started_at)
    return proof + limits.idle_probe_interval_s


def next_deadline(state: LivenessState, limits: LivenessSection) -> float | None:
    """When the verdict would turn without new evidence, so the shell samples then rather than later.

    A deadline already judged on a sample taken after it is spent.
    """
    deadlines: list[float] = []
    if (stuck_since := _stuck_since(state)) is not None:
        deadlines.append(stuck_since + limits.progress_timeout_s)
    if state.probe_sent_at is not None:
        deadlines.append(state.probe_sent_at + limits.probe_timeout_s)
    pending = [d for d in deadlines if state.sampled_at is None or d > state.sampled_at]
    return min(pending) if pending else None


# --- evidence texts ---------------------------------------------------------------


def _count(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0f}"


def _tokens_fact(state: LivenessState, now: float) -> str:
    if state.tokens is None:
        return "vLLM reported no vllm:generation_tokens_total"
    if state.tokens_moved_at is None:
        return f"generation token counter at {state.tokens:.0f}, unchanged since ready {now - state.started_at:.0f} s ago"
    return f"generation token counter at {state.tokens:.0f}, last moved {now - state.tokens_moved_at:.0f} s ago"


def _requests_fact(state: LivenessState) -> str:
    sample = state.sample or MetricsSample()
    return f"{_count(sample.running)} request(s) running, {_count(sample.waiting)} waiting"


def _probe_fact(state: LivenessState, now: float) -> str:
    last = state.last_probe
    if last is None or state.last_probe_done_at is None:
        return "no idle probe finished since ready"
    outcome = f"answered {last.status} in {last.seconds:.1f} s" if last.status is not None else f"{last.reason} after {last.seconds:.1f} s"
    return f"last idle probe {outcome}, {now - state.last_probe_done_at:.0f} s ago"


def _health_fact(state: LivenessState) -> str:
    health = state.health
    if health is None:
        return "/health not sampled yet"
    return f"/health {health.status} in {health.seconds:.2f} s" if health.status is not None else f"/health {health.reason}"


def _stuck_evidence(state: LivenessState, stuck_since: float, now: float, limits: LivenessSection) -> str:
    return (
        f"no generated token for {now - stuck_since:.0f} s while requests are in "
        f"the engine (liveness.progress_timeout_s {limits.progress_timeout_s:g}): {_tokens_fact(state, now)}; "
        f"{_requests_fact(state)}; {_probe_fact(state, now)}; {_health_fact(state)}"
    )


def _probe_evidence(state: LivenessState, sent_at: float, now: float, limits: LivenessSection) -> str:
    return (
        f"the idle probe ({state.probe_words}) sent {now - sent_at:.0f} s ago did not finish within "
        f"liveness.probe_timeout_s {limits.probe_timeout_s:g} and no token was generated since: "
        f"{_tokens_fact(state, now)}; {_requests_fact(state)}; {_health_fact(state)}"
    )
