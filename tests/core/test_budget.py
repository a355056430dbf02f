"""The memory budget the gb10d instances of a machine share: who may start, who waits for whom, who is refused."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from gb10d.base.units import GIB
from gb10d.core.budget import (
    Admit,
    Refuse,
    Reservation,
    Stage,
    Wait,
    admit,
    after,
    left,
    neighbours,
    progressed,
    real_use,
    share_bytes,
    taken_since,
)
from gb10d.core.memory import MemInfo

TOTAL = int(121.69 * GIB)
MEM = MemInfo(total=TOTAL, free=int(100 * GIB), available=int(110 * GIB), cached=int(10 * GIB))
SHARE_04 = share_bytes(0.4, TOTAL, 1.0)  # 48.68 GiB + 1 GiB headroom


def record(name: str, stage: Stage, share: int = SHARE_04, asked_at: float = 10.0, pid: int = 100, phase: str = "", progress_at: float = 0.0) -> Reservation:
    return Reservation(
        name=name, config=f"/etc/gb10d/{name}.toml", pid=pid, stage=stage, bytes=share, utilization=0.4,
        asked_at=asked_at, since=asked_at, progress_at=progress_at, phase=phase,
    )


ME = record("gb10d@c", Stage.WAITING, asked_at=30.0, pid=300)


def test_a_share_is_vllms_own_request_and_the_headroom() -> None:
    assert share_bytes(0.4, TOTAL, 1.0) == math.ceil(TOTAL * 0.4) + GIB
    assert share_bytes(0.4, TOTAL, 0.0) == math.ceil(TOTAL * 0.4)


@pytest.mark.parametrize(
    ("others", "admitted"),
    [
        ([], True),
        # A serving instance's memory is in MemAvailable already: not counted twice.
        ([record("gb10d@a", Stage.SERVING)], True),
        # One start's reservation leaves 110 - 49.68 = 60.32 GiB: it fits.
        ([record("gb10d@a", Stage.STARTING)], True),
        # Two leave 10.65 GiB: it does not.
        ([record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.STARTING)], False),
        # Between attempts the share stays reserved, as while starting.
        ([record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.RESTARTING)], False),
        # A wake from sleep reserves its share too: the memory it takes back shows in MemAvailable only bit by bit.
        ([record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.WAKING)], False),
        # Asleep, it holds only its CUDA context, which MemAvailable shows.
        ([record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.ASLEEP)], True),
        # A later waiter takes nothing from an earlier one.
        ([record("gb10d@a", Stage.STARTING), record("gb10d@d", Stage.WAITING, asked_at=40.0)], True),
    ],
)
def test_a_start_fits_when_its_share_fits_beside_the_reservations_of_the_starts_in_progress(others: list[Reservation], admitted: bool) -> None:
    decision = admit(ME, others, MEM, "wait")
    assert isinstance(decision, Admit if admitted else Wait), decision
    if admitted:
        assert isinstance(decision, Admit) and decision.fits and decision.others == tuple(others)


def test_a_waiter_says_whom_it_waits_for_with_their_shares_and_the_numbers() -> None:
    others = [record("gb10d@a", Stage.STARTING, phase="loading_weights"), record("gb10d@b", Stage.STARTING, asked_at=20.0)]
    decision = admit(ME, others, MEM, "wait")
    assert isinstance(decision, Wait)
    assert [b.name for b in decision.blockers] == ["gb10d@a", "gb10d@b"]
    assert decision.message == (
        "memory: gpu_memory_utilization 0.4 (48.68 GiB + 1.00 GiB headroom) does not fit beside the starts of "
        "gb10d@a (49.68 GiB, starting: loading_weights) and gb10d@b (49.68 GiB, starting): MemAvailable 110.00 GiB "
        'leaves 10.65 GiB; waiting until they serve or stop (memory.when_full = "wait")'
    )
    assert decision.status == (
        "waiting for memory: needs 49.68 GiB, 10.65 GiB left beside gb10d@a (49.68 GiB, starting: loading_weights) "
        "and gb10d@b (49.68 GiB, starting)"
    )


def test_waiters_are_served_in_the_order_they_asked_even_when_a_later_one_would_fit() -> None:
    big = record("gb10d@big", Stage.WAITING, share=share_bytes(0.7, TOTAL, 1.0), asked_at=20.0)
    starting = record("gb10d@a", Stage.STARTING)
    decision = admit(ME, [starting, big], MEM, "wait")
    assert isinstance(decision, Wait)
    assert [b.name for b in decision.blockers] == ["gb10d@a", "gb10d@big"]
    assert decision.message.startswith("memory: gpu_memory_utilization 0.4 (48.68 GiB + 1.00 GiB headroom) fits beside the starts of gb10d@a")
    assert "but gb10d@big (86.18 GiB, waiting) asked first and waits" in decision.message


@pytest.mark.parametrize(("twin", "waits"), [("gb10d@b", True), ("gb10d@d", False)])
def test_an_equal_asking_time_is_decided_by_the_name(twin: str, waits: bool) -> None:
    other = record(twin, Stage.WAITING, asked_at=ME.asked_at)
    decision = admit(ME, [other, record("gb10d@a", Stage.STARTING)], MEM, "wait")
    assert isinstance(decision, Wait if waits else Admit), decision


def test_nobody_waits_for_instances_that_serve_it_gives_up_and_the_free_memory_check_decides() -> None:
    serving = [record("gb10d@a", Stage.SERVING), record("gb10d@b", Stage.SERVING)]
    tight = MemInfo(total=TOTAL, free=int(12 * GIB), available=int(12.65 * GIB), cached=0)
    decision = admit(ME, serving, tight, "wait")
    assert isinstance(decision, Admit) and not decision.fits
    assert decision.message == (
        "memory: gpu_memory_utilization 0.4 (48.68 GiB + 1.00 GiB headroom) does not fit in MemAvailable 12.65 GiB beside "
        "gb10d@a (49.68 GiB, serving) and gb10d@b (49.68 GiB, serving), and no other start is left to wait for; "
        "the free-memory check decides"
    )


@pytest.mark.parametrize("stage", [Stage.RESTARTING, Stage.STARTING])
def test_a_restart_holds_its_share_before_the_waiters_that_asked_first(stage: Stage) -> None:
    # Its vLLM stopped for a reload (or crashed): the memory given back is still its own, not the queue's.
    me = record("gb10d@c", stage, asked_at=30.0, pid=300)
    waiter = record("gb10d@b", Stage.WAITING, share=share_bytes(0.6, TOTAL, 1.0), asked_at=5.0)
    decision = admit(me, [waiter], MEM, "wait")
    assert isinstance(decision, Admit) and decision.fits


def test_a_restart_that_waits_keeps_its_reservation_as_it_was_and_a_new_start_waits_reserving_nothing() -> None:
    held = record("gb10d@c", Stage.RESTARTING, asked_at=30.0, pid=300)
    grown = replace(held, bytes=share_bytes(0.9, TOTAL, 1.0), utilization=0.9)
    starting = record("gb10d@a", Stage.STARTING)
    decision = admit(grown, [starting], MEM, "wait")
    assert isinstance(decision, Wait) and [b.name for b in decision.blockers] == ["gb10d@a"]
    kept = after(held, grown, decision, Stage.STARTING, 40.0)
    assert (kept.stage, kept.bytes, kept.utilization, kept.waiting_for) == (Stage.RESTARTING, SHARE_04, 0.4, ("gb10d@a",))
    queued = after(ME, ME, admit(ME, [starting, kept], MEM, "wait"), Stage.STARTING, 40.0)
    assert queued.stage is Stage.WAITING
    # Admitted, the reservation becomes the new share.
    admitted = after(held, grown, admit(grown, [], MEM, "wait"), Stage.STARTING, 50.0)
    assert (admitted.stage, admitted.bytes, admitted.waiting_for) == (Stage.STARTING, grown.bytes, ())


def test_two_restarts_whose_shares_grew_do_not_wait_for_each_other() -> None:
    big = share_bytes(0.9, TOTAL, 1.0)
    other = replace(record("gb10d@a", Stage.RESTARTING), waiting_for=("gb10d@c",))
    me = record("gb10d@c", Stage.RESTARTING, share=big, asked_at=30.0, pid=300)
    decision = admit(me, [other], MEM, "wait")
    assert isinstance(decision, Admit) and not decision.fits


def test_when_full_fail_refuses_at_once_with_the_numbers() -> None:
    others = [record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.STARTING, asked_at=20.0)]
    decision = admit(ME, others, MEM, "fail")
    assert isinstance(decision, Refuse)
    assert decision.message.startswith("memory: gpu_memory_utilization 0.4 (48.68 GiB + 1.00 GiB headroom) does not fit beside the starts of gb10d@a")
    assert "MemAvailable 110.00 GiB leaves 10.65 GiB" in decision.message
    assert decision.message.endswith('not waiting (memory.when_full = "fail"): start it again once they serve or stop, or lower vllm.gpu_memory_utilization')


def test_when_full_fail_still_starts_what_fits() -> None:
    assert isinstance(admit(ME, [record("gb10d@a", Stage.STARTING)], MEM, "fail"), Admit)


def test_what_is_left_for_a_start_is_memavailable_less_the_starts_in_progress() -> None:
    others = [record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.SERVING), record("gb10d@d", Stage.WAITING)]
    assert left(others, MEM) == MEM.available - SHARE_04


def test_neighbours_reserve_what_their_starts_hold_and_name_everyone_holding_memory() -> None:
    around = neighbours([record("gb10d@a", Stage.STARTING), record("gb10d@b", Stage.SERVING, asked_at=5.0), record("gb10d@d", Stage.WAITING)])
    assert around.reserved == SHARE_04
    assert around.reserved_by == "gb10d@a"
    assert around.named == "gb10d@b (49.68 GiB, serving), gb10d@a (49.68 GiB, starting)"


def test_a_waiter_extends_its_timeout_only_when_one_it_waits_for_moved() -> None:
    a = record("gb10d@a", Stage.STARTING, progress_at=100.0)
    moved, seen = progressed({}, [a])
    assert moved  # a new one counts
    assert progressed(seen, [a]) == (False, seen)
    moved, seen = progressed(seen, [record("gb10d@a", Stage.STARTING, progress_at=101.5)])
    assert moved
    # The same name with another pid is another instance (it was restarted).
    assert progressed(seen, [record("gb10d@a", Stage.STARTING, progress_at=101.5, pid=999)])[0]


@pytest.mark.parametrize(
    ("before", "after", "used"),
    [
        ([], [], 40 * GIB),
        ([record("gb10d@a", Stage.SERVING)], [record("gb10d@a", Stage.SERVING)], 40 * GIB),
        # Waiters hold nothing.
        ([record("gb10d@d", Stage.WAITING)], [], 40 * GIB),
        # Another start in progress at either end: its memory moved too.
        ([record("gb10d@a", Stage.STARTING)], [record("gb10d@a", Stage.SERVING)], None),
        ([], [record("gb10d@a", Stage.STARTING)], None),
        # One stopped meanwhile: its memory came back during this start.
        ([record("gb10d@a", Stage.SERVING)], [], None),
    ],
)
def test_real_use_is_the_memavailable_drop_only_when_no_other_instance_changed_meanwhile(
    before: list[Reservation], after: list[Reservation], used: int | None
) -> None:
    assert real_use(100 * GIB, 60 * GIB, before, after) == used


def test_memory_that_grew_during_a_start_is_no_measure_of_it() -> None:
    assert real_use(60 * GIB, 70 * GIB, [], []) is None


def test_a_record_survives_its_json_and_a_record_of_another_version_is_read_for_what_it_has() -> None:
    r = record("gb10d@a", Stage.SERVING, phase="ready")
    assert Reservation.from_json(r.to_json()) == r
    assert Reservation.from_json({**r.to_json(), "future_field": 1}) == r
    assert Reservation.from_json({**r.to_json(), "stage": "dreaming"}) is None
    assert Reservation.from_json({**r.to_json(), "bytes": "lots"}) is None
    assert Reservation.from_json([1, 2]) is None


def test_a_record_whose_every_field_is_corrupt_in_turn_is_none_or_read_with_the_defaults_never_an_error() -> None:
    r = record("gb10d@a", Stage.STARTING, phase="loading_weights")
    for key in r.to_json():
        for odd in (None, True, "", [], ["x", 1], {}, 2.5):
            read = Reservation.from_json({**r.to_json(), key: odd})
            assert read is None or read == replace(r, **{key: read.__dict__[key]}), (key, odd)
    # What it can do without falls back to its default; what the budget needs makes it none.
    assert Reservation.from_json({**r.to_json(), "real_use": "lots", "phase": 3, "waiting_for": ["b", 1]}) == replace(r, phase="", waiting_for=("b",))
    assert Reservation.from_json({**r.to_json(), "pid": True}) is None
    assert Reservation.from_json({**r.to_json(), "name": ""}) is None


@pytest.mark.parametrize(
    ("then", "now", "taken"),
    [
        ([], [], 0),
        # Serving at both ends: its memory was in MemAvailable before this start already.
        ([record("gb10d@a", Stage.SERVING)], [record("gb10d@a", Stage.SERVING)], 0),
        # Started (or went on starting) since: its share may have come out of MemAvailable meanwhile.
        ([], [record("gb10d@a", Stage.STARTING)], SHARE_04),
        ([record("gb10d@a", Stage.STARTING)], [record("gb10d@a", Stage.SERVING)], SHARE_04),
        # The same unit restarted is another process, another share.
        ([record("gb10d@a", Stage.SERVING)], [record("gb10d@a", Stage.RESTARTING, pid=999)], SHARE_04),
        # Waiters and those that left hold nothing now.
        ([record("gb10d@a", Stage.SERVING)], [record("gb10d@d", Stage.WAITING)], 0),
        # Asleep at both ends, or fallen asleep since: it took nothing (a sleep gives memory back).
        ([record("gb10d@a", Stage.ASLEEP)], [record("gb10d@a", Stage.ASLEEP)], 0),
        ([record("gb10d@a", Stage.SERVING)], [record("gb10d@a", Stage.ASLEEP)], 0),
        # Woken since, or waking now: the wake took its memory back out of MemAvailable.
        ([record("gb10d@a", Stage.ASLEEP)], [record("gb10d@a", Stage.SERVING)], SHARE_04),
        ([record("gb10d@a", Stage.ASLEEP)], [record("gb10d@a", Stage.WAKING)], SHARE_04),
        # Parked by stop now: its vLLM is gone and holds nothing, whatever it did meanwhile (counted, it would hide
        # a leak of this start's about its size).
        ([record("gb10d@a", Stage.STARTING)], [record("gb10d@a", Stage.PARKED)], 0),
        ([], [record("gb10d@a", Stage.PARKED)], 0),
    ],
)
def test_memory_other_starts_took_meanwhile_is_not_memory_this_one_failed_to_give_back(
    then: list[Reservation], now: list[Reservation], taken: int
) -> None:
    assert taken_since(then, now) == taken


def test_an_admitted_start_says_what_is_left_for_it() -> None:
    beside = admit(ME, [record("gb10d@a", Stage.STARTING)], MEM, "wait")
    assert isinstance(beside, Admit) and beside.message == (
        "memory: gpu_memory_utilization 0.4 (48.68 GiB + 1.00 GiB headroom) fits beside the starts of gb10d@a: "
        "60.32 GiB of MemAvailable 110.00 GiB is left for it"
    )
    alone = admit(ME, [record("gb10d@a", Stage.SERVING)], MEM, "wait")
    assert isinstance(alone, Admit) and alone.message == "memory: gpu_memory_utilization 0.4 (48.68 GiB + 1.00 GiB headroom) fits in MemAvailable 110.00 GiB"
