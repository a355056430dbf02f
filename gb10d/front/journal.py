"""The front's journal lines: one per decision, and one per cause per interval when the same thing repeats.

A flood of 744 rejections, or an accept loop out of file descriptors, is one line at once and then one line a
REPEAT_S with the count, never a line (or a traceback) per event: the journal stays readable and journald's rate
limit never drops the line that matters.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

from ..machine.journal import Journal

# Repeats of one cause are summed over this long.
REPEAT_S = 10.0
# The front's page shows this many of the latest lines.
RECENT = 50


@dataclass
class Repeats:
    """Which lines of a repeating cause are said, decided from the cause and the time alone."""

    interval_s: float = REPEAT_S
    # cause -> (when its last line was said, repeats since, the last line of them)
    pending: dict[str, tuple[float, int, str]] = field(default_factory=dict)

    def offer(self, cause: str, line: str, now: float) -> bool:
        """Whether `line` is said now: the first of its cause in an interval is; the others are counted."""
        last = self.pending.get(cause)
        if last is None or (now - last[0] >= self.interval_s and last[1] == 0):
            self.pending[cause] = (now, 0, line)
            return True
        said_at, count, _ = last
        self.pending[cause] = (said_at, count + 1, line)
        return False

    def due(self, now: float) -> list[tuple[str, int, float]]:
        """The summaries to say now: (the last repeated line, how many, over how many seconds) for each cause whose
        interval has passed with repeats; a cause quiet for a whole interval is forgotten."""
        out = []
        for cause, (said_at, count, line) in list(self.pending.items()):
            if now - said_at < self.interval_s:
                continue
            if count:
                out.append((line, count, now - said_at))
                self.pending[cause] = (now, 0, line)
            else:
                del self.pending[cause]
        return out


class FrontJournal:
    """`<N>gb10d-front: ...` lines on stdout, which journald takes with priority N, written by the one `Journal`."""

    def __init__(self) -> None:
        self.repeats = Repeats()
        # stdout only, as the front always wrote: its lines are not events with a kind for the native socket.
        self.journal = Journal(sys.stdout, socket_path=None, identifier="gb10d-front")
        # The latest lines said, (wall-clock time, priority, line), for the page's recent decisions.
        self.recent: deque[tuple[float, int, str]] = deque(maxlen=RECENT)

    def say(self, line: str, level: int = 6, cause: str | None = None) -> None:
        """Say a decision; with a `cause`, repeats of it within REPEAT_S are counted and summed up later (flush)."""
        if cause is None or self.repeats.offer(cause, line, time.monotonic()):
            self._print(level, line)

    def flush(self) -> None:
        """Say the sums of the repeats whose interval has passed (called from the front's periodic loop)."""
        for line, count, span_s in self.repeats.due(time.monotonic()):
            self._print(4, f"{count} more like this in the last {span_s:.0f} s, the last: {line}")

    def _print(self, level: int, line: str) -> None:
        self.recent.append((time.time(), level, line))
        self.journal.say(line, level)
