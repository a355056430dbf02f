"""Models on demand: whether a parked model starts now, after the least recently used idle on-demand model is parked,
later, or never (`front.core.make_room`), from the numbers the memory ledger and /proc/meminfo give."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gb10d.core.statefile import DaemonState, StateRecord
from gb10d.front.core import (
    SWAP_TURN_S,
    Answer,
    AwaitRoom,
    Evict,
    Instance,
    Readiness,
    Slot,
    StartIt,
    Wait,
    admit,
    error,
    make_room,
    readiness_of,
)

GIB = 2**30
TOTAL = 120 * GIB
WANTED = Slot("beta", 50 * GIB, on_demand=True, running=False, serving=False, parking=False, busy=True)


def model(name: str, gib: int, active_at: float = 0.0, **changes: bool) -> Slot:
    """An on-demand model that serves, idle, last used at `active_at`."""
    slot = Slot(name, gib * GIB, on_demand=True, running=True, serving=True, parking=False, busy=False, active_at=active_at)
    return replace(slot, **changes)


def test_a_parked_model_that_fits_starts_at_once_and_says_its_numbers() -> None:
    decided = make_room(WANTED, [model("alpha", 50)], 60 * GIB, TOTAL)
    assert decided == StartIt("it needs 50.00 GiB, 60.00 GiB is free")


def test_the_least_recently_used_idle_on_demand_model_is_parked_to_make_room() -> None:
    others = [model("alpha", 50, active_at=200.0), model("gamma", 30, active_at=100.0), model("delta", 30, active_at=50.0, busy=True)]
    decided = make_room(WANTED, others, 10 * GIB, TOTAL)
    assert isinstance(decided, Evict) and decided.victim == "gamma", "delta was used longer ago but has requests"
    assert decided.message == (
        "it needs 50.00 GiB, 10.00 GiB is free; parking gamma (30.00 GiB), the least recently used idle on-demand model"
    )


@pytest.mark.parametrize("changes", [
    {"on_demand": False},  # pinned: no [on_demand]
    {"busy": True},  # requests held for it or in flight
    {"serving": False},  # still starting: its gb10d could not park it yet
])
def test_a_pinned_busy_or_starting_model_is_never_evicted_and_the_request_waits(changes: dict[str, bool]) -> None:
    others = [model("alpha", 60, **changes)]
    if changes.get("on_demand") is False:
        others.append(model("gamma", 60, busy=True))  # something could still make room, later
    decided = make_room(WANTED, others, 10 * GIB, TOTAL)
    assert decided == AwaitRoom("it needs 50.00 GiB, 10.00 GiB is free; every model that could make room has requests or is pinned")


def test_while_a_model_parks_nothing_else_is_evicted_the_request_waits_for_its_memory() -> None:
    others = [model("alpha", 50, parking=True, serving=False), model("gamma", 30)]
    decided = make_room(WANTED, others, 10 * GIB, TOTAL)
    assert decided == AwaitRoom("it needs 50.00 GiB, 10.00 GiB is free; waiting for the memory of alpha, which parks")


def test_a_model_asked_to_start_counts_before_its_share_is_in_the_ledger() -> None:
    # Two parked models whose requests arrive in one poll: the first one woken takes the room the second saw.
    first = replace(WANTED, name="alpha", running=False, serving=False, unbooked=True)
    decided = make_room(WANTED, [first], 60 * GIB, TOTAL)
    assert decided == AwaitRoom("it needs 50.00 GiB, 10.00 GiB is free; every model that could make room has requests or is pinned")


@pytest.mark.parametrize(("other", "room", "free"), [
    # Asked to start, not yet admitted: MemAvailable 86 GiB does not show its 50 yet, nor does the ledger.
    (replace(WANTED, name="alpha", running=False, serving=False, unbooked=True), 86, "36.00"),
    # Starting, before its record reserves its share.
    (model("alpha", 50, serving=False, unbooked=True), 86, "36.00"),
    # Starting with its share reserved: the room the ledger leaves counts it already.
    (model("alpha", 50, serving=False), 36, "36.00"),
    # Serving with requests: nothing to park.
    (model("alpha", 50, busy=True), 36, "36.00"),
])
def test_a_model_asleep_beside_a_busy_or_starting_model_waits_as_a_stopped_one_does(other: Slot, room: int, free: str) -> None:
    # Its wake would check MemAvailable, short now or not yet showing the other start's memory: woken, it would find
    # the memory short and start cold (a failed wake each time, found by the soak), or both models would come up and
    # the pinned model's next restart would find its share taken (soak, seed 7).
    asleep = replace(WANTED, asleep=True)
    assert make_room(asleep, [other], room * GIB, TOTAL) == AwaitRoom(
        f"it needs 50.00 GiB, {free} GiB is free; every model that could make room has requests or is pinned"
    )


def test_a_model_that_can_never_fit_is_refused_at_once_with_the_numbers() -> None:
    pinned = model("chat", 80, on_demand=False)
    decided = make_room(WANTED, [pinned, model("alpha", 20)], 10 * GIB, TOTAL)
    assert isinstance(decided, Answer) and decided.status == 503 and decided.retry_after_s is None
    assert decided.message == (
        "beta can never fit: it needs 50.00 GiB, the machine has 120.00 GiB (MemTotal) and pinned instances hold 80.00 GiB "
        "(chat), which leaves 40.00 GiB; lower its vllm.gpu_memory_utilization, or give a pinned instance [on_demand]"
    )
    alone = make_room(replace(WANTED, need_bytes=121 * GIB), [], 110 * GIB, TOTAL)
    assert isinstance(alone, Answer) and "pinned instances hold nothing, which leaves 120.00 GiB" in alone.message


def test_memory_other_processes_hold_is_waited_for_not_refused() -> None:
    # Nothing gb10d runs holds the memory: it may come back, so the request is held (up to front.hold_timeout_s).
    decided = make_room(WANTED, [], 10 * GIB, TOTAL)
    assert decided == AwaitRoom(
        "it needs 50.00 GiB, 10.00 GiB is free; no model of gb10d holds memory: other programs hold about 110.00 GiB "
        "(MemTotal less MemAvailable), waiting for them to give it back"
    )


def test_models_are_parked_one_at_a_time_until_the_wanted_one_fits() -> None:
    others = [model("alpha", 20, active_at=1.0), model("gamma", 20, active_at=2.0)]
    assert make_room(WANTED, others, 20 * GIB, TOTAL) == Evict(
        "alpha", "it needs 50.00 GiB, 20.00 GiB is free; parking alpha (20.00 GiB), the least recently used idle on-demand model",
    )
    others[0] = model("alpha", 20, running=False, serving=False)  # parked: its memory is back
    assert isinstance(make_room(WANTED, others, 40 * GIB, TOTAL), Evict)


def test_a_model_parked_by_sleep_is_made_room_for_as_a_stopped_one_is() -> None:
    # Its sleep gave its share back and its wake takes it again: beside a model that leaves too little, that one is
    # parked first (before, the wake found its memory short and vLLM started cold at a lower utilization beside it).
    asleep = replace(WANTED, asleep=True)
    assert make_room(asleep, [model("alpha", 70)], 10 * GIB, TOTAL) == Evict(
        "alpha", "it needs 50.00 GiB, 10.00 GiB is free; parking alpha (70.00 GiB), the least recently used idle on-demand model",
    )
    assert make_room(asleep, [model("alpha", 20)], 60 * GIB, TOTAL) == StartIt("it needs 50.00 GiB, 60.00 GiB is free")
    # Nothing of gb10d's to park: the wake goes ahead and checks its own memory (other programs may hold it).
    assert make_room(asleep, [], 10 * GIB, TOTAL) == StartIt("a wake from sleep checks its own memory (on_demand.wake_margin_gib)")


def test_a_stopped_pinned_instance_holds_nothing_and_a_parked_model_gives_nothing_more() -> None:
    stopped = model("chat", 80, on_demand=False, running=False, serving=False)
    parked = model("alpha", 50, running=False, serving=False)
    assert make_room(WANTED, [stopped, parked], 60 * GIB, TOTAL) == StartIt("it needs 50.00 GiB, 60.00 GiB is free")
    assert isinstance(make_room(WANTED, [stopped, parked], 40 * GIB, TOTAL), AwaitRoom), "a stopped pinned instance counts for nothing"


@pytest.mark.parametrize(("state", "parked"), [(DaemonState.PARKED, True), (DaemonState.ASLEEP, True), (DaemonState.PARKING, False)])
def test_a_parked_instance_is_held_for_and_woken_and_a_parking_one_is_on_its_way(state: DaemonState, parked: bool) -> None:
    ready = readiness_of(StateRecord(pid=1, started_at=0.0, updated_at=0.0, state=state), alive=True)
    assert (ready.serving, ready.coming, ready.parked, ready.parking, ready.detail) == (False, True, parked, state is DaemonState.PARKING, state.value)


PARKED = Readiness(serving=False, coming=True, detail="parked", parked=True)
BETA = Instance("beta", ("beta",), "127.0.0.1", 8102)


@pytest.mark.parametrize("room", [None, StartIt("fits"), AwaitRoom("later"), Evict("alpha", "room")])
def test_a_request_for_a_parked_model_that_may_fit_is_held(room: StartIt | AwaitRoom | Evict | None) -> None:
    assert admit(BETA, PARKED, 0, 256, 0.0, 900.0, True, room) == Wait()


def test_a_request_for_a_parked_model_that_can_never_fit_is_refused_not_held() -> None:
    never = error(503, "beta can never fit: ...", "ServiceUnavailableError")
    assert admit(BETA, PARKED, 0, 256, 0.0, 900.0, True, never) is never


def test_a_busy_model_that_had_its_turn_is_drained_for_one_whose_requests_waited_a_turn() -> None:
    # Without turns a model that always has requests keeps the memory, and the other's requests wait out
    # front.hold_timeout_s and get 503 (found by the soak: two models with steady traffic).
    waiting = replace(WANTED, waited_s=SWAP_TURN_S)
    others = [model("alpha", 60, busy=True, served_s=SWAP_TURN_S + 5), model("gamma", 40, busy=True, served_s=SWAP_TURN_S + 30)]
    assert make_room(waiting, others, 10 * GIB, TOTAL) == Evict(
        "gamma",
        "it needs 50.00 GiB, 10.00 GiB is free; its requests waited 10 s and gamma has served for 40 s (a turn is 10 s): "
        "gamma's requests in flight finish, its new ones wait, then it parks",
        drain=True,
    )


@pytest.mark.parametrize(("waited_s", "served_s"), [(SWAP_TURN_S - 1, SWAP_TURN_S + 60), (SWAP_TURN_S + 60, SWAP_TURN_S - 1)])
def test_a_busy_model_keeps_serving_until_both_turns_are_due(waited_s: float, served_s: float) -> None:
    decided = make_room(replace(WANTED, waited_s=waited_s), [model("alpha", 60, busy=True, served_s=served_s)], 10 * GIB, TOTAL)
    assert decided == AwaitRoom("it needs 50.00 GiB, 10.00 GiB is free; every model that could make room has requests or is pinned")


def test_an_idle_model_is_parked_before_a_busy_one_is_drained() -> None:
    waiting = replace(WANTED, waited_s=SWAP_TURN_S * 3)
    others = [model("alpha", 60, busy=True, served_s=SWAP_TURN_S * 3), model("gamma", 60, active_at=5.0)]
    decided = make_room(waiting, others, 10 * GIB, TOTAL)
    assert isinstance(decided, Evict) and (decided.victim, decided.drain) == ("gamma", False)


def test_a_pinned_busy_model_is_never_drained() -> None:
    waiting = replace(WANTED, waited_s=SWAP_TURN_S * 3)
    pinned = model("chat", 60, on_demand=False, busy=True, served_s=SWAP_TURN_S * 3)
    assert isinstance(make_room(waiting, [pinned], 10 * GIB, TOTAL), AwaitRoom)
