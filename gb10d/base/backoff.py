"""The one back-off: a pause that doubles after each try, up to a cap.

gb10d waits so in several places: the restart policy between starts, the front before it connects again to an
instance that refused, the readiness check before /health answers, the container engine before it shows the
container, and the alert sender between tries. Each names its first pause and its cap; the doubling is here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator


def doubled(first_s: float, times: int, cap_s: float = math.inf) -> float:
    """`first_s` doubled `times` times (none for 0 or less), at most `cap_s`; never an overflow, however many."""
    pause = first_s
    for _ in range(max(times, 0)):
        if pause >= cap_s:
            break
        pause *= 2
    return float(min(pause, cap_s))


def pauses(first_s: float, cap_s: float = math.inf) -> Iterator[float]:
    """The pauses of a loop that tries again: `first_s`, then each doubled, at most `cap_s`."""
    return (doubled(first_s, n, cap_s) for n in itertools.count())
