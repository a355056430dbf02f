"""The one back-off that every loop trying again shares: doubling from its first pause, up to its cap."""

from __future__ import annotations

import itertools

import pytest

from gb10d.base.backoff import doubled, pauses


@pytest.mark.parametrize(
    ("first", "times", "cap", "pause"),
    [
        (0.1, 0, 2.0, 0.1),  # the first pause
        (0.1, -1, 2.0, 0.1),  # no try yet counts as none
        (0.1, 3, 2.0, 0.8),
        (0.1, 5, 2.0, 2.0),  # capped
        (5, 2, 300, 20.0),
        (0.1, 5000, 2.0, 2.0),  # a count that 2.0 ** n would overflow
        (1.0, 5000, float("inf"), float("inf")),
    ],
)
def test_a_pause_doubles_per_try_up_to_its_cap(first: float, times: int, cap: float, pause: float) -> None:
    assert doubled(first, times, cap) == pytest.approx(pause)


def test_the_pauses_of_a_loop_double_from_the_first_and_stay_at_the_cap() -> None:
    assert list(itertools.islice(pauses(0.05, 0.5), 6)) == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5, 0.5])
    assert list(itertools.islice(pauses(1.0), 4)) == [1.0, 2.0, 4.0, 8.0]
