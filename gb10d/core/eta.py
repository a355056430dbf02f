"""How long a start has left, from how long each phase of the model's last complete start took.

A start of a large model on a GB10 takes half an hour, most of it loading weights; the operator watching it wants
`about 14 min left (the last start took 31 min)`, not a bare phase name. The durations come from the learned file
(gb10d.daemon.learnedfile keeps the last complete start's phases per model); this module only does the arithmetic,
so STATUS=, `gb10d status` and the front's page say the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .phases import Phase
from .statefile import DaemonState, StateRecord

NO_ESTIMATE = "no estimate yet: this is its first start"
_ORDER = [p.value for p in Phase]


def estimate(last_start: Mapping[str, float], phase: str, progress: tuple[int, int] | None, elapsed_s: float) -> str:
    """The time left as words. `last_start`: seconds per phase of the last complete start (empty: none known);
    `phase`: the phase now (Phase's value); `progress`: shards loaded of the total while loading weights;
    `elapsed_s`: since this start began.

    What is left is the rest of the current phase plus every later phase as long as they took last time. The rest
    of the current phase is its share not yet loaded when shards are counted, else what the last start had spent by
    the end of this phase less the time spent so far (never more than the phase's whole duration)."""
    total = sum(last_start.values())
    if total <= 0:
        return NO_ESTIMATE
    took = f"the last start took {_span(total)}"
    if phase not in _ORDER:
        left = max(total - elapsed_s, 0.0)
    else:
        here = _ORDER.index(phase)
        this = last_start.get(phase, 0.0)
        later = sum(s for p, s in last_start.items() if p in _ORDER and _ORDER.index(p) > here)
        through = sum(s for p, s in last_start.items() if p in _ORDER and _ORDER.index(p) <= here)
        if progress is not None and progress[1] > 0 and this > 0:
            current = this * (1 - min(progress[0], progress[1]) / progress[1])
        else:
            current = min(max(through - elapsed_s, 0.0), this)
        left = current + later
    if left <= 0:
        return f"taking longer than the last start ({_span(total)})"
    return f"about {_span(left)} left ({took})"


def of_state(state: StateRecord, now: float) -> str | None:
    """The estimate for a start a state file shows (None when it shows no start in progress); `now`: wall clock."""
    if state.state not in (DaemonState.STARTING, DaemonState.RESTARTING) or not state.phase:
        return None
    begun = state.memory_at or state.started_at or now
    progress = (state.progress.shards_done, state.progress.shards_total) if state.progress is not None else None
    return estimate(state.last_start, state.phase, progress, max(now - begun, 0.0))


@dataclass(frozen=True)
class PhaseClock:
    """The seconds each phase of one start took so far: told each phase as it begins (`moved`), read at ready."""

    phase: str | None = None
    since: float = 0.0
    seconds: Mapping[str, float] = field(default_factory=dict)

    def moved(self, phase: str, since: float) -> PhaseClock:
        """The clock once `phase` began at `since` (monotonic); the same phase told again changes nothing."""
        if phase == self.phase:
            return self
        seconds = dict(self.seconds)
        if self.phase is not None:
            seconds[self.phase] = seconds.get(self.phase, 0.0) + max(since - self.since, 0.0)
        return PhaseClock(phase, since, seconds)

    def until(self, now: float) -> dict[str, float]:
        """Every phase's seconds, the current one's counted up to `now`."""
        return dict(self.moved("", now).seconds)


def _span(seconds: float) -> str:
    """`40 s` under a minute and a half, else whole minutes (`14 min`); hours past 90 minutes (`2 h 5 min`)."""
    if seconds < 90:
        return f"{max(round(seconds), 1)} s"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min"
