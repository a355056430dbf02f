"""The liveness core: evidence over time in, a verdict out (a hung engine is not a busy one).

Each case is a timeline of what gb10d saw (a /metrics sample, a /health
answer, the idle probe going out and coming back) and the verdict at a
given moment, with the limits of a 27B model on GB10 (the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import pytest

from gb10d.base.config import LivenessSection
from gb10d.core.facts import ADMISSION_REFUSED
from gb10d.core.liveness import (
    Alive,
    AskIfAsleep,
    Asleep,
    Dead,
    Hung,
    LivenessState,
    MetricsSample,
    next_deadline,
    next_probe_due,
    observe_health,
    observe_metrics,
    observe_probe,
    observe_sleep_check,
    parse_metrics,
    probe_may_go,
    probe_sent,
    sleep_check_sent,
    sleep_check_wanted,
    start,
    verdict,
)
from gb10d.daemon.probe import ProbeResult

LIMITS = LivenessSection()  # progress_timeout_s 120, idle_probe_interval_s 60, probe_timeout_s 60


@dataclass(frozen=True)
class M:
    """A /metrics sample at `t`."""

    t: float
    running: float | None
    tokens: float | None
    waiting: float | None = 0
    prompt: float | None = None
    asleep: bool | None = None  # vllm:engine_sleep_state


@dataclass(frozen=True)
class H:
    """A /health answer at `t` (status None: no HTTP answer, for `reason`)."""

    t: float
    status: int | None
    reason: str = "OK"


@dataclass(frozen=True)
class Sent:
    """The idle probe went out at `t`."""

    t: float


@dataclass(frozen=True)
class P:
    """The idle probe came back at `t`."""

    t: float
    status: int | None
    reason: str
    seconds: float


@dataclass(frozen=True)
class Ask:
    """GET /is_sleeping went out at `t`."""

    t: float


@dataclass(frozen=True)
class Slept:
    """/is_sleeping came back at `t`: `sleeping` as it answered, None when it did not (timed out)."""

    t: float
    sleeping: bool | None


Seen = Union[M, H, Sent, P, Ask, Slept]


def replay(timeline: list[Seen], sleep_checks: bool = False) -> LivenessState:
    state = start(0.0, sleep_checks=sleep_checks)
    for item in timeline:
        if isinstance(item, Ask):
            state = sleep_check_sent(state, item.t)
        elif isinstance(item, Slept):
            answer = ProbeResult(200, "OK", 0.01) if item.sleeping is not None else ProbeResult(None, "timed out", 60.0)
            state = observe_sleep_check(state, item.sleeping, answer, item.t)
        elif isinstance(item, M):
            state = observe_metrics(state, MetricsSample(item.running, item.waiting, item.tokens, item.prompt, item.asleep), item.t)
        elif isinstance(item, H):
            state = observe_health(state, ProbeResult(item.status, item.reason, 0.01), item.t)
        elif isinstance(item, Sent):
            state = probe_sent(state, item.t)
        else:
            state = observe_probe(state, ProbeResult(item.status, item.reason, item.seconds), item.t)
    return state


def every(step: float, until: float, running: float, tokens_at: Callable[[float], float], since: float = 0.0) -> list[Seen]:
    """Samples every `step` s from `since` to `until` inclusive."""
    count = int((until - since) / step)
    return [M(since + i * step, running, tokens_at(since + i * step)) for i in range(count + 1)]


def decoding(t: float) -> float:
    """About 20 tokens/s per stream, four streams."""
    return 80 * t


def stuck_after(moment: float) -> Callable[[float], float]:
    return lambda t: decoding(min(t, moment))


CASES = [
    pytest.param(every(10, 600, 4, decoding), 600, Alive, None, [], id="busy_and_advancing_is_alive"),
    pytest.param(every(10, 230, 4, stuck_after(100)), 230, Hung, "hung",
                 ["no generated token for 130 s", "liveness.progress_timeout_s 120", "counter at 8000", "last moved 130 s ago",
                  "4 request(s) running, 0 waiting"],
                 id="busy_and_stuck_past_progress_timeout_is_hung"),
    pytest.param(every(10, 210, 4, stuck_after(100)), 210, Alive, None, [], id="busy_and_stuck_within_progress_timeout_is_alive"),
    pytest.param(every(10, 500, 0, lambda t: 0.0) + every(10, 600, 1, lambda t: 0.0, since=510), 600, Alive, None, [],
                 id="long_prefill_within_progress_timeout_is_alive_however_long_it_was_idle_before"),
    pytest.param(every(10, 500, 0, lambda t: 0.0) + every(10, 640, 1, lambda t: 0.0, since=510), 640, Hung, "hung",
                 ["no generated token for 130 s"], id="prefill_that_never_ends_is_hung_counting_from_when_it_began"),
    # An embedding model generates no token: the prompts it processes are its progress.
    pytest.param([M(t, 4, 0, prompt=50.0 * t) for t in range(0, 610, 10)], 600, Alive, None, [],
                 id="busy_pooling_model_processing_prompts_is_alive"),
    pytest.param([M(t, 4, 0, prompt=50.0 * min(t, 100)) for t in range(0, 240, 10)], 230, Hung, "hung",
                 ["no generated token for 130 s"], id="busy_pooling_model_whose_prompts_stop_is_hung"),
    pytest.param([M(0, 0, 500), M(10, 0, 500), M(20, 0, 0, waiting=3), M(150, 0, 0, waiting=3)], 150, Hung, "hung",
                 ["0 request(s) running, 3 waiting"], id="queued_requests_never_scheduled_are_hung"),
    pytest.param([M(0, 0, 500), Sent(60), P(60.4, 200, "OK", 0.4), M(70, 0, 501), Sent(121), P(121.3, 200, "OK", 0.3),
                  M(200, 0, 502)], 200, Alive, None, [], id="idle_and_probe_ok_is_alive"),
    pytest.param([M(0, 0, 500), M(50, 0, 500), Sent(60), M(70, 1, 500), P(120, None, "timed out", 60.0)], 120, Hung,
                 "probe_timeout",
                 ["the idle probe (a 1-token completion) sent 60 s ago did not finish within liveness.probe_timeout_s 60",
                  "counter at 500, unchanged since ready 120 s ago", "1 request(s) running"],
                 id="idle_and_probe_timing_out_is_hung"),
    pytest.param([M(0, 0, 500), Sent(60), M(70, 1, 500), H(125, 200), M(125, 1, 500)], 125, Hung, "probe_timeout",
                 ["sent 65 s ago", "/health 200"], id="probe_still_out_past_probe_timeout_is_hung"),
    pytest.param([M(0, 0, 500), Sent(60), M(70, 1, 500), M(110, 1, 500)], 110, Alive, None, [],
                 id="probe_out_within_probe_timeout_is_alive"),
    pytest.param([M(0, 0, 500), Sent(60), M(70, 3, 500), P(120, None, "timed out", 60.0), M(130, 3, 500)], 130, Alive, None,
                 [], id="probe_stuck_behind_a_long_prefill_is_left_to_the_progress_rule"),
    pytest.param([M(0, 0, 500), Sent(60), M(70, 3, 500), P(120, None, "timed out", 60.0), M(190, 3, 500)], 190, Hung, "hung",
                 ["no generated token for 120 s", "3 request(s) running", "last idle probe timed out after 60.0 s, 70 s ago"],
                 id="prefill_that_outlasts_the_progress_timeout_is_hung"),
    pytest.param([M(0, 0, 500), Sent(60)] + every(10, 120, 17, lambda t: 500 + 160 * (t - 60), since=70)
                 + [P(121, None, "timed out", 61.0), M(130, 17, 500 + 160 * 70)], 130, Alive, None, [],
                 id="slow_probe_while_tokens_flow_is_alive"),
    pytest.param([M(0, 3, 100), H(10, 503, "Service Unavailable")], 10, Dead, "health", ["/health answered 503"],
                 id="health_503_is_dead_at_once"),
    pytest.param([M(0, 0, 100), H(10, None, "connection refused")], 10, Dead, "health",
                 ["/health failed (connection refused): vLLM no longer listens on its port"], id="refused_health_is_dead_at_once"),
    pytest.param([M(0, 0, 100), Sent(60), P(60.1, None, "connection refused", 0.001)], 60.1, Dead, "health",
                 ["the idle probe failed (connection refused)"], id="refused_probe_is_dead_at_once"),
    pytest.param([M(0, 2, 100), H(10, None, "timed out"), M(20, 2, 140)], 20, Alive, None, [],
                 id="one_slow_health_answer_is_not_death"),
    pytest.param([M(0, 2, 100), H(10, 503, "Service Unavailable"), M(20, 2, 140)], 20, Dead, "health", [],
                 id="death_is_not_forgotten_when_later_figures_look_fine"),    pytest.param([M(0, 0, 100), Sent(60), P(60.1, 503, ADMISSION_REFUSED, 0.01), M(70, 16, 180)], 70, Alive, None, [],
                 id="a_probe_refused_by_a_full_request_queue_is_not_death"),
]


@pytest.mark.parametrize("timeline, now, kind, cause, facts", CASES)
def test_verdict(timeline: list[Seen], now: float, kind: type, cause: str | None, facts: list[str]) -> None:
    found = verdict(replay(timeline), now, LIMITS)
    assert isinstance(found, kind), found
    if isinstance(found, Hung):
        assert found.cause == cause
        for fact in facts:
            assert fact in found.evidence, found.evidence
    if isinstance(found, Dead):
        assert found.cause == cause
        for fact in facts:
            assert fact in found.reason, found.reason


def test_hung_evidence_names_the_last_probe_when_there_was_one() -> None:
    timeline: list[Seen] = [M(0, 0, 10), Sent(60), P(60.5, 200, "OK", 0.5), M(70, 2, 10), M(200, 2, 10)]
    found = verdict(replay(timeline), 200, LIMITS)
    assert isinstance(found, Hung)
    assert "last idle probe answered 200 in 0.5 s, 140 s ago" in found.evidence


@pytest.mark.parametrize(
    "timeline, now, due",
    [
        pytest.param([M(10, 0, 5)], 10, 60, id="idle_after_ready_probes_one_interval_after_ready"),
        pytest.param([M(10, 3, 5)], 10, None, id="never_while_requests_run"),
        pytest.param([M(10, 0, 5, waiting=1)], 10, None, id="never_while_requests_wait"),
        pytest.param([M(10, 0, 5), Sent(60)], 70, None, id="never_while_a_probe_is_out"),
        pytest.param([M(10, 2, 5), M(100, 2, 900), M(110, 0, 950)], 110, 170, id="tokens_moving_are_proof_of_life"),
        pytest.param([M(10, 0, 5), Sent(60), P(60.5, 200, "OK", 0.5)], 61, 120.5, id="next_probe_one_interval_after_the_last"),
        pytest.param([], 0, 60, id="before_any_sample"),
    ],
)
def test_next_probe_due(timeline: list[Seen], now: float, due: float | None) -> None:
    assert next_probe_due(replay(timeline), now, LIMITS) == due


@pytest.mark.parametrize(
    "timeline, deadline",
    [
        pytest.param([M(10, 0, 5)], None, id="idle_without_probe_has_no_deadline"),
        pytest.param([M(10, 4, 5), M(20, 4, 9)], 140, id="busy_counts_from_the_last_token"),
        pytest.param([M(10, 0, 5), Sent(60), M(70, 1, 5)], 120, id="probe_out_ends_at_probe_timeout"),
        pytest.param([M(10, 4, 5), M(20, 4, 9), M(141, 4, 9)], None, id="a_deadline_judged_on_a_later_sample_is_spent"),
    ],
)
def test_next_deadline(timeline: list[Seen], deadline: float | None) -> None:
    assert next_deadline(replay(timeline), LIMITS) == deadline


SIM_LIKE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 12345.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7646e+09
"""


@pytest.mark.parametrize(
    "text, sample",
    [
        pytest.param(SIM_LIKE, MetricsSample(3, 1, 12345), id="vllm_exposition_with_comments_labels_and_created"),
        pytest.param(
            'vllm:num_requests_running{engine="0"} 2\nvllm:num_requests_running{engine="1"} 5\n'
            'vllm:generation_tokens_total{engine="0"} 10\nvllm:generation_tokens_total{engine="1"} 32\n',
            MetricsSample(7, None, 42),
            id="summed_over_engines",
        ),
        pytest.param("", MetricsSample(None, None, None), id="empty"),
        pytest.param("http_requests_total 4\n# vllm:num_requests_running 9\n", MetricsSample(None, None, None),
                     id="missing_families_stay_unknown_not_zero"),
        pytest.param("vllm:num_requests_running NaN\nvllm:generation_tokens_total{a=\"b\"} +Inf\nvllm:num_requests_waiting 0\n",
                     MetricsSample(None, 0, None), id="nan_and_inf_are_unknown"),
        pytest.param('vllm:generation_tokens_total{model_name="a {b} c",engine="0"} 99 1700000000000\n',
                     MetricsSample(None, None, 99), id="label_values_with_braces_and_a_timestamp"),
        pytest.param("vllm:num_requests_running{engine=\"0\"} lots\nvllm:num_requests_running{engine=\"1\"} 2\n",
                     MetricsSample(2, None, None), id="unparsable_values_are_skipped"),
    ],
)
def test_parse_metrics(text: str, sample: MetricsSample) -> None:
    assert parse_metrics(text) == sample


def test_unanswered_scrape_keeps_the_last_figures() -> None:
    state = replay([M(0, 2, 100)])
    assert observe_metrics(state, None, 50) == state


# --- a vLLM asleep that gb10d did not put to sleep ----------------------------------------------------------
# Asleep, vLLM answers /health 200 and holds every request: the idle probe and the busy rule would take it for hung.

PROBE_TIMED_OUT = [M(0, 0, 500), Sent(60), M(70, 1, 500), P(120, None, "timed out", 60.0)]
BUSY_STUCK = every(10, 230, 4, stuck_after(100))

SLEEP_CASES = [
    pytest.param([M(0, 0, 500), M(10, 0, 500, asleep=True)], False, 10, Asleep, "vllm:engine_sleep_state says awake 0",
                 id="the_sleep_state_metric_says_asleep_without_any_endpoint_asked"),
    pytest.param([M(0, 0, 500), M(10, 0, 500, asleep=False)], True, 10, Alive, None, id="the_sleep_state_metric_says_awake"),
    pytest.param(PROBE_TIMED_OUT, True, 120, AskIfAsleep, None, id="a_timed_out_probe_asks_is_sleeping_before_a_hang_is_called"),
    pytest.param([*PROBE_TIMED_OUT, Ask(120), Slept(120.01, True)], True, 120.01, Asleep, "GET /is_sleeping answered is_sleeping true",
                 id="is_sleeping_true_after_the_probe_went_is_asleep"),
    pytest.param([*PROBE_TIMED_OUT, Ask(120), Slept(120.01, False)], True, 120.01, Hung, "probe_timeout",
                 id="is_sleeping_false_after_the_probe_went_is_hung"),
    pytest.param([*PROBE_TIMED_OUT, Ask(120), Slept(180, None)], True, 180, Hung, "probe_timeout",
                 id="is_sleeping_unanswered_leaves_the_hang_standing"),
    pytest.param([M(0, 0, 500), Ask(59), Slept(59.01, False), Sent(60), M(70, 1, 500), P(120, None, "timed out", 60.0)], True, 120,
                 AskIfAsleep, None, id="an_awake_answer_from_before_the_probe_went_proves_nothing_about_it"),
    pytest.param(BUSY_STUCK, True, 230, AskIfAsleep, None, id="a_stuck_token_counter_asks_is_sleeping_first"),
    pytest.param([*BUSY_STUCK, Ask(230), Slept(230.1, True)], True, 230.1, Asleep, "is_sleeping true", id="busy_and_asleep_is_asleep"),
    pytest.param([*BUSY_STUCK, Ask(230), Slept(230.1, False)], True, 230.1, Hung, "hung", id="busy_stuck_and_awake_is_hung"),
    pytest.param(PROBE_TIMED_OUT, False, 120, Hung, "probe_timeout", id="without_the_development_endpoints_a_hang_is_a_hang"),
    pytest.param([M(0, 0, 500, asleep=True), H(10, 503, "Service Unavailable")], True, 10, Dead, "health", id="dead_beats_asleep"),
]


@pytest.mark.parametrize("timeline, sleep_checks, now, kind, said", SLEEP_CASES)
def test_verdict_on_a_sleeping_vllm(timeline: list[Seen], sleep_checks: bool, now: float, kind: type, said: str | None) -> None:
    found = verdict(replay(timeline, sleep_checks), now, LIMITS)
    assert type(found) is kind, found
    if isinstance(found, Asleep):
        assert said is not None and said in found.evidence and found.cause == "asleep"
    if isinstance(found, Hung):
        assert found.cause == said


@pytest.mark.parametrize(
    "timeline, sleep_checks, may_go, wanted",
    [
        pytest.param([M(0, 0, 500)], False, True, False, id="without_the_endpoints_the_probe_goes_when_due"),
        pytest.param([M(0, 0, 500)], True, False, True, id="with_them_is_sleeping_is_asked_first"),
        pytest.param([M(0, 0, 500), Ask(60)], True, False, False, id="while_it_is_out_nothing_goes"),
        pytest.param([M(0, 0, 500), Ask(60), Slept(60.01, False)], True, True, False, id="awake_since_due_the_probe_goes"),
        pytest.param([M(0, 0, 500), Ask(30), Slept(30.01, False)], True, False, True, id="an_answer_from_before_due_is_asked_again"),
        pytest.param([M(0, 0, 500), Ask(60), Slept(60.01, True)], True, False, False, id="asleep_no_probe_is_sent_to_be_held"),
    ],
)
def test_the_idle_probe_goes_only_once_is_sleeping_said_awake(timeline: list[Seen], sleep_checks: bool, may_go: bool, wanted: bool) -> None:
    state = replay(timeline, sleep_checks)
    due = next_probe_due(state, 60, LIMITS)
    assert due == 60
    assert probe_may_go(state, due) is may_go
    assert sleep_check_wanted(state, due) is wanted


@pytest.mark.parametrize(
    "text, asleep",
    [
        pytest.param('vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 1.0\n'
                     'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="weights_offloaded"} 0.0\n', False, id="awake"),
        pytest.param('vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"} 0.0\n'
                     'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="weights_offloaded"} 1.0\n', True, id="level_1"),
        pytest.param('vllm:engine_sleep_state{engine="0",sleep_state="awake"} 1\nvllm:engine_sleep_state{engine="1",sleep_state="awake"} 0\n',
                     True, id="one_engine_of_two_asleep"),
        pytest.param("vllm:num_requests_running 0\n", None, id="not_reported"),
    ],
)
def test_the_sleep_state_is_read_from_metrics(text: str, asleep: bool | None) -> None:
    assert parse_metrics(text).asleep is asleep
