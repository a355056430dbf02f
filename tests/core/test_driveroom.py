"""The NVIDIA driver's out-of-memory line: told and counted always, vLLM stopped only with evidence beside it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from config_support import make_config
from gb10d.base.command import Tunables
from gb10d.base.config import MemorySection
from gb10d.base.levels import PRIORITY_ERR, PRIORITY_WARNING
from gb10d.base.units import GIB
from gb10d.core.driveroom import DriverRoom, Evidence, judge, not_answering, note, stall_deadline, stalled
from gb10d.core.facts import DriverLine, Parsed, Probed, ProbeKind, Tick
from gb10d.core.lifecycle import AttemptState, DriverOomSeen, Finish, LivenessFailed, Say, begin, deadline, kernel_said, step
from gb10d.core.outcome import Cause
from gb10d.vllm.events import DriverOutOfMemory, ShardsProgressed

LINE = DriverOutOfMemory(detail="nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)")
PLENTY = 40 * GIB
MEMORY = MemorySection()  # burst 50 within 60 s, headroom 1 GiB


config = make_config


def room(*times: float, window_s: float = MEMORY.driver_oom_window_s) -> DriverRoom:
    r = DriverRoom()
    for t in times:
        r = note(r, t, window_s)
    return r


# --- the pure rules -------------------------------------------------------------


def test_a_line_is_forgotten_once_it_is_older_than_the_window() -> None:
    assert room(0.0, 30.0, 61.0).times == (30.0, 61.0)
    assert room(0.0, 60.0).times == (60.0,)


@pytest.mark.parametrize(
    ("lines", "mem_available", "stalled_s", "expected"),
    [
        # Healthy starts log one such line, hosts at rest dozens: none of these is evidence.
        (1, PLENTY, None, None),
        (1, PLENTY, 10.0, None),
        (1, None, 59.0, None),
        (16, PLENTY, None, None),
        (49, PLENTY, None, None),
        (49, GIB, None, None),  # exactly the headroom is not below it
        # The burst, whatever else.
        (50, PLENTY, None, Evidence.BURST),
        (50, 0, 120.0, Evidence.BURST),
        (200, None, None, Evidence.BURST),
        # MemAvailable below the headroom, before a stall.
        (1, GIB - 1, None, Evidence.LOW_MEMORY),
        (1, 0, 120.0, Evidence.LOW_MEMORY),
        # A load without progress for the window.
        (1, PLENTY, 60.0, Evidence.STALL),
        (1, None, 300.0, Evidence.STALL),
    ],
)
def test_only_evidence_beside_the_line_stops_vllm(lines: int, mem_available: int | None, stalled_s: float | None, expected: Evidence | None) -> None:
    r = room(*(100.0 + i * 0.01 for i in range(lines)))
    found = judge(r, r.times[-1], mem_available, stalled_s, MEMORY)
    assert (found.evidence if found else None) is expected


def test_the_burst_and_its_window_are_the_operators_keys() -> None:
    strict = MemorySection(driver_oom_burst=1)
    found = judge(room(0.0), 0.0, PLENTY, None, strict)
    assert found is not None and found.evidence is Evidence.BURST
    wide = MemorySection(driver_oom_burst=3, driver_oom_window_s=600)
    assert judge(room(0.0, 200.0, window_s=600), 200.0, PLENTY, None, wide) is None
    found = judge(room(0.0, 200.0, 400.0, window_s=600), 400.0, PLENTY, None, wide)
    assert found is not None and found.text == (
        "a burst of 3 such lines within 600 s (memory.driver_oom_burst 3 within memory.driver_oom_window_s)"
    )


def test_a_stall_or_an_engine_that_stops_answering_counts_only_within_the_window_of_a_line() -> None:
    r = room(100.0)
    assert stalled(r, 150.0, 60.0, 60.0) is not None
    assert stalled(r, 161.0, 120.0, 60.0) is None
    assert stalled(r, 150.0, 59.0, 60.0) is None
    assert stalled(DriverRoom(), 150.0, 600.0, 60.0) is None
    assert not_answering(r, 160.0, "no token for 120 s", 60.0) is not None
    assert not_answering(r, 160.5, "no token for 120 s", 60.0) is None


def test_the_stall_deadline_falls_while_the_last_line_is_within_the_window() -> None:
    assert stall_deadline(room(100.0), 90.0, 60.0) == 150.0
    assert stall_deadline(room(100.0), 100.0, 60.0) == 160.0
    assert stall_deadline(room(100.0), 101.0, 60.0) is None  # progress after the line: the line is not its doing
    assert stall_deadline(DriverRoom(), 90.0, 60.0) is None


# --- in the lifecycle ---------------------------------------------------------------


def loading(at: float = 100.0) -> AttemptState:
    state, _ = begin(1, Tunables(0.8), at, config())
    return state


def serving(at: float = 100.0) -> AttemptState:
    return replace(loading(at), ready_since=at + 50)


def say(actions: list) -> Say:
    return next(a for a in actions if isinstance(a, Say))


def test_one_line_during_a_healthy_load_is_a_warning_and_counted_not_a_stop() -> None:
    _, actions = step(loading(), DriverLine(1, LINE, PLENTY), 110.0, config())
    assert not any(isinstance(a, Finish) for a in actions)
    assert DriverOomSeen("none") in actions
    line = say(actions)
    assert line.kind == "driver_oom" and line.priority == PRIORITY_WARNING
    assert line.message == (
        "the NVIDIA driver ran out of memory (nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)); "
        "1 such line within 60 s, MemAvailable 40.00 GiB, the load progressing: no sign of trouble with it, vLLM keeps running "
        "(it is stopped for a burst of memory.driver_oom_burst lines, MemAvailable below memory.headroom_gib, a stalled load "
        "or an engine that stops answering)"
    )


def test_a_burst_at_rest_below_the_rate_is_told_line_by_line_and_the_one_at_the_rate_stops_vllm() -> None:
    state = serving()
    for i in range(49):
        state, actions = step(state, DriverLine(1, LINE, PLENTY), 200.0 + i, config())
        assert not any(isinstance(a, Finish) for a in actions), i
        assert say(actions).priority == PRIORITY_WARNING
    assert "49 such lines within 60 s, MemAvailable 40.00 GiB, vLLM serving" in say(actions).message
    state, actions = step(state, DriverLine(1, LINE, PLENTY), 249.0, config())
    stop = say(actions)
    assert stop.priority == PRIORITY_ERR and ("evidence", "burst") in stop.fields
    assert stop.message.endswith(
        "with evidence: a burst of 50 such lines within 60 s (memory.driver_oom_burst 50 within memory.driver_oom_window_s); "
        "a freeze of the whole machine can follow: stopping vLLM"
    )
    assert DriverOomSeen("burst") in actions
    finish = actions[-1]
    assert isinstance(finish, Finish) and finish.outcome.cause is Cause.DRIVER_OOM and finish.outcome.was_ready


def test_a_line_with_memavailable_below_the_headroom_stops_vllm_and_says_so() -> None:
    _, actions = step(loading(), DriverLine(1, LINE, GIB // 2), 110.0, config())
    assert "with evidence: MemAvailable 0.50 GiB is below memory.headroom_gib 1" in say(actions).message
    finish = actions[-1]
    assert isinstance(finish, Finish) and finish.outcome.cause is Cause.DRIVER_OOM and not finish.outcome.was_ready


def test_a_line_followed_by_a_load_without_progress_for_the_window_stops_vllm_as_a_stall() -> None:
    state, _ = step(loading(), DriverLine(1, LINE, PLENTY), 110.0, config())
    state, actions = step(state, Tick(None), 159.0, config())
    assert not any(isinstance(a, Finish) for a in actions)
    assert deadline(state, config()) == 160.0
    state, actions = step(state, Tick(None), 160.0, config())
    assert ("evidence", "stall") in say(actions).fields
    assert "with evidence: the load has made no progress for 60 s (memory.driver_oom_window_s 60)" in say(actions).message
    assert isinstance(actions[-1], Finish) and actions[-1].outcome.cause is Cause.DRIVER_OOM


def test_progress_after_the_line_clears_it_and_an_old_line_sets_no_deadline() -> None:
    state, _ = step(loading(), DriverLine(1, LINE, PLENTY), 110.0, config())
    state, _ = step(state, Parsed(1, ShardsProgressed(1, 4)), 115.0, config())
    assert deadline(state, config()) != 175.0
    state, actions = step(state, Tick(None), 175.0, config())
    assert not any(isinstance(a, Finish) for a in actions)
    # A tick long after the line forgets it: its stall deadline does not come round again and again.
    state, _ = step(state, Tick(None), 200.0, config())
    assert state.driver == DriverRoom()


def test_an_engine_that_stops_answering_within_the_window_of_a_line_is_its_evidence() -> None:
    state, _ = step(serving(), DriverLine(1, LINE, PLENTY), 200.0, config())
    _, actions = step(state, Probed(1, ProbeKind.HUNG, "no token for 120 s", "hung"), 230.0, config())
    assert LivenessFailed("hung") in actions
    assert "with evidence: vLLM's engine no longer answers (no token for 120 s)" in say(actions).message
    assert isinstance(actions[-1], Finish) and actions[-1].outcome.cause is Cause.DRIVER_OOM
    # Long after the line, a hang is a hang.
    _, actions = step(state, Probed(1, ProbeKind.HUNG, "no token for 120 s", "hung"), 400.0, config())
    assert isinstance(actions[-1], Finish) and actions[-1].outcome.cause is Cause.ENGINE_HUNG


def test_a_line_while_no_vllm_runs_is_a_warning_and_counted() -> None:
    actions = kernel_said(LINE)
    assert say(actions).priority == PRIORITY_WARNING and say(actions).message.endswith("; no vLLM of this instance runs")
    assert DriverOomSeen("none") in actions
