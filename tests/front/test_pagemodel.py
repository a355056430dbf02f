"""What the front's page shows, as tables: the memory bar adds up to MemTotal whatever the readings, a model that
would not fit is named with its numbers, rates come from two /metrics samples, only the right clients may act, the
event stream speaks only on a change (and a comment after 15 s of silence), and the cards say what the state file
says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gb10d.core.budget import Reservation, Stage
from gb10d.core.memory import MemInfo
from gb10d.core.statefile import DaemonState, LastFailure, Memory, Progress, StateRecord
from gb10d.front.core import Readiness
from gb10d.front.pagemodel import (
    COMMENT_EVERY_S,
    Holder,
    Pace,
    Rates,
    Sample,
    card,
    is_loopback,
    may_act,
    memory_bar,
    parse_metrics,
    rates,
    shortfalls,
    visible,
)
from gb10d.front.routes import ApiKey

GIB = 2**30
TOTAL = int(121.69 * GIB)


def reservation(name: str, stage: Stage, share_gib: float, real_use_gib: float | None = None) -> Reservation:
    return Reservation(
        name, f"/etc/gb10d/{name}.toml", 100, stage, int(share_gib * GIB), 0.3, 0.0, 0.0, 0.0,
        real_use=int(real_use_gib * GIB) if real_use_gib is not None else None,
    )


def holder(name: str, record: Reservation | None, state: StateRecord | None = None, share_gib: float = 37.5) -> Holder:
    return Holder(name, record, state, int(share_gib * GIB), 0.3)


def kinds(bar: object) -> dict[str, float]:
    return {f"{s.kind}:{s.instance}": round(s.bytes / GIB, 2) for s in bar.segments}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("mem", "holders"), [
    # one serving model that measured its own start, one start in progress 10 GiB in, one parked
    (MemInfo(TOTAL, int(30 * GIB), int(40 * GIB), int(12 * GIB)), [
        holder("a", reservation("a", Stage.SERVING, 37.5, 35.0)),
        holder("b", reservation("b", Stage.STARTING, 37.5), StateRecord(state=DaemonState.STARTING, memory=None)),
        holder("c", reservation("c", Stage.PARKED, 37.5)),
    ]),
    # estimates larger than what /proc/meminfo shows in use: scaled down, never past MemTotal
    (MemInfo(TOTAL, int(100 * GIB), int(110 * GIB), int(5 * GIB)), [holder("a", reservation("a", Stage.SERVING, 37.5, 60.0))]),
    # reservations larger than MemAvailable
    (MemInfo(TOTAL, int(2 * GIB), int(3 * GIB), int(1 * GIB)), [holder("a", reservation("a", Stage.STARTING, 37.5))]),
    # no ledger: the state files say what runs
    (MemInfo(TOTAL, int(50 * GIB), int(60 * GIB), int(20 * GIB)), [holder("a", None, StateRecord(state=DaemonState.SERVING))]),
    # a machine with nothing of gb10d on it, and a cache larger than what is available
    (MemInfo(TOTAL, int(1 * GIB), int(2 * GIB), int(50 * GIB)), []),
])
def test_the_memory_segments_add_up_to_memtotal_exactly(mem: MemInfo, holders: list[Holder]) -> None:
    bar = memory_bar(mem, holders, 1.0)
    assert sum(s.bytes for s in bar.segments) == mem.total
    assert all(s.bytes >= 0 for s in bar.segments)
    assert bar.headroom_bytes == GIB


def test_a_serving_model_holds_what_its_start_measured_and_a_start_in_progress_reserves_the_rest_of_its_share() -> None:
    mem = MemInfo(TOTAL, int(30 * GIB), int(40 * GIB), int(12 * GIB))
    began = StateRecord(state=DaemonState.STARTING, memory=Memory(TOTAL, int(50 * GIB), int(40 * GIB), 0))
    bar = memory_bar(mem, [
        holder("a", reservation("a", Stage.SERVING, 37.5, 35.0)),
        holder("b", reservation("b", Stage.STARTING, 37.5), began),
        holder("c", reservation("c", Stage.PARKED, 37.5)),
    ], 1.0)
    # b's start took MemAvailable from 50 to 40 GiB: it holds 10 of its 37.5 GiB, the rest is reserved.
    assert kinds(bar) == {"model:a": 35.0, "model:b": 10.0, "reserved:b": 27.5, "other:": 36.69, "cache:": 12.0, "free:": 0.5}


def test_a_parked_model_that_would_not_fit_is_named_with_what_it_needs_and_what_there_is() -> None:
    mem = MemInfo(TOTAL, int(20 * GIB), int(25 * GIB), 0)
    parked = holder("b", reservation("b", Stage.PARKED, 37.5))
    serving = holder("a", reservation("a", Stage.SERVING, 37.5))
    found = shortfalls(mem, [serving, parked], int(25 * GIB))
    assert [(s.instance, round(s.need_bytes / GIB, 1), round(s.room_bytes / GIB, 1)) for s in found] == [("b", 37.5, 25.0)]
    assert shortfalls(mem, [serving, parked], int(40 * GIB)) == ()


VLLM_METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="alpha"} %s
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="alpha"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="alpha"} %s
vllm:time_to_first_token_seconds_count{engine="0",model_name="alpha"} %s
"""


def test_tokens_per_second_and_time_to_first_token_come_from_two_samples_of_vllms_own_metrics() -> None:
    before = parse_metrics(VLLM_METRICS % (1000, 2.0, 10), 100.0)
    after = parse_metrics(VLLM_METRICS % (1500, 2.6, 13), 110.0)
    assert before == Sample(100.0, 1000.0, 2.0, 10.0)
    measured = rates(before, after)
    assert measured.tokens_per_s == pytest.approx(50.0) and measured.ttft_s == pytest.approx(0.2)
    # one sample, counters reset by a restart, no request in between: nothing is made up
    assert rates(None, after) == Rates(None, None)
    assert rates(after, before) == Rates(None, None)
    assert rates(after, parse_metrics(VLLM_METRICS % (1500, 2.6, 13), 120.0)) == Rates(0.0, None)


KEY = ApiKey(b"k1")
ALPHA_ONLY = ApiKey(b"k2", frozenset({"alpha"}))


@pytest.mark.parametrize(("key", "keys_set", "loopback", "header", "status"), [
    (None, False, True, True, None),  # no keys: this machine may
    (None, False, False, True, 403),  # no keys: another machine may not
    (None, False, True, False, 403),  # without the page's header (another site's form): never
    (KEY, True, False, True, None),  # a valid key, from anywhere
    (ALPHA_ONLY, True, False, True, None),
])
def test_who_may_wake_or_park_alpha(key: ApiKey | None, keys_set: bool, loopback: bool, header: bool, status: int | None) -> None:
    refusal = may_act(key, keys_set, loopback, header, ("alpha",))
    assert (refusal.status if refusal is not None else None) == status


def test_a_key_restricted_to_one_model_may_not_act_on_another_nor_see_its_card() -> None:
    refusal = may_act(ALPHA_ONLY, True, True, True, ("beta",))
    assert refusal is not None and refusal.status == 403 and "beta" in refusal.message
    cards = [card_of("alpha", StateRecord(state=DaemonState.SERVING)), card_of("beta", StateRecord(state=DaemonState.SERVING))]
    assert [c.instance for c in visible(cards, ALPHA_ONLY.models)] == ["alpha"]
    assert [c.instance for c in visible(cards, frozenset())] == ["alpha", "beta"]


@pytest.mark.parametrize(("address", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True), ("10.0.0.5", False), ("::ffff:10.0.0.5", False),
    (None, False),
])
def test_loopback_clients_are_told_apart(address: str | None, loopback: bool) -> None:
    assert is_loopback(address) is loopback


def test_the_stream_sends_the_data_only_when_it_changed_and_a_comment_after_15_s_of_silence() -> None:
    pace = Pace()
    assert pace.next('{"a": 1}', 0.0) == 'data: {"a": 1}\n\n'
    assert pace.next('{"a": 1}', 1.0) is None
    assert pace.next('{"a": 1}', COMMENT_EVERY_S - 0.1) is None
    assert pace.next('{"a": 1}', COMMENT_EVERY_S) == ": nothing changed\n\n"
    assert pace.next('{"a": 2}', COMMENT_EVERY_S + 1) == 'data: {"a": 2}\n\n'


def card_of(name: str, state: StateRecord | None, ready: Readiness | None = None, on_demand: bool = True, now: float = 5000.0) -> object:
    shown = ready or Readiness(serving=state is not None and state.state is DaemonState.SERVING, coming=True, detail="serving")
    return card(name, (name,), state, shown, 2, 1, on_demand, Rates(12.5, 0.25), "http://gb10:8000", False, now)


def test_a_card_says_what_the_state_file_says_for_each_state() -> None:
    loading = card_of("a", StateRecord(
        state=DaemonState.STARTING, phase="loading_weights", progress=Progress(12, 66), memory_at=4000.0,
        last_start={"loading_weights": 600.0, "compiling": 60.0}), Readiness(False, True, "starting: loading_weights 12/66"))
    assert (loading.state, loading.detail, loading.progress) == ("starting", "loading weights 12/66", (12, 66))  # type: ignore[attr-defined]
    assert loading.eta == "about 9 min left (the last start took 11 min)"  # type: ignore[attr-defined]
    assert loading.tokens_per_s is None and not loading.can_wake and not loading.can_park  # type: ignore[attr-defined]

    serving = card_of("a", StateRecord(state=DaemonState.SERVING, ready_at=4900.0, memory_at=4870.0, attempt=3))
    assert (serving.serving_since, serving.last_start_s, serving.restarts) == (4900.0, 30.0, 2)  # type: ignore[attr-defined]
    assert (serving.tokens_per_s, serving.ttft_s, serving.held, serving.in_flight) == (12.5, 0.25, 2, 1)  # type: ignore[attr-defined]
    assert serving.can_park and not serving.can_wake and serving.progress is None  # type: ignore[attr-defined]

    failure = LastFailure("model_not_found", "vLLM exited with status 1", "check vllm.model", 4000.0)
    failed = card_of("a", StateRecord(state=DaemonState.FAILED, last_failure=failure), Readiness(False, False, "not running (state is failed)"))
    assert (failed.state, failed.detail, failed.failure, failed.fix) == ("failed", "", "vLLM exited with status 1", "check vllm.model")  # type: ignore[attr-defined]

    parked = card_of("a", StateRecord(state=DaemonState.PARKED), Readiness(False, True, "parked", parked=True))
    assert parked.can_wake and not parked.can_park and not parked.can_restart  # type: ignore[attr-defined]
    pinned = card_of("a", StateRecord(state=DaemonState.SERVING), on_demand=False)
    assert not pinned.can_park and not pinned.can_wake and pinned.can_restart  # type: ignore[attr-defined]
    assert loading.can_restart and not failed.can_restart  # type: ignore[attr-defined]
    gone = card_of("a", None, Readiness(False, False, "not running (no state file)"))
    assert (gone.state, gone.detail) == ("not running", "not running (no state file)")  # type: ignore[attr-defined]


def test_the_curl_command_asks_the_model_through_the_front_and_carries_a_key_only_when_one_is_needed() -> None:
    plain = card_of("alpha", StateRecord(state=DaemonState.SERVING)).curl  # type: ignore[attr-defined]
    assert plain.startswith("curl -s http://gb10:8000/v1/chat/completions ") and "Authorization" not in plain
    assert json.loads(plain.split(" -d '", 1)[1].rstrip("'"))["model"] == "alpha"


def test_the_pages_files_ship_in_the_package_and_weigh_under_60_kb() -> None:
    ui = Path(__file__).parents[2] / "gb10d" / "front" / "ui"
    files = {p.name: p.stat().st_size for p in ui.iterdir()}
    assert set(files) == {"index.html", "page.css", "page.js"}
    assert sum(files.values()) < 60 * 1024
    text = "".join(p.read_text() for p in ui.iterdir())
    assert "http://" not in text and "https://" not in text, "no CDN: everything the page loads is the front's"
