"""Whether the NVIDIA driver's out-of-memory line is worth stopping vLLM for: pure, times passed in.

On GB10 the driver logs `NVRM: ... Out of memory [NV_ERR_NO_MEMORY] (0x00000051)`
in healthy starts too: on driver 580.95.05 each successful start of four
logged exactly one, the failed one none, and a host at rest logged dozens a
day, sixteen in one second. The line alone proves nothing. The freeze of the
whole machine that can follow comes under sustained pressure, with
MemAvailable collapsing. So every line is told and counted, and vLLM is
stopped only when evidence comes with it:

- a burst: `memory.driver_oom_burst` lines or more within
  `memory.driver_oom_window_s`;
- MemAvailable below `memory.headroom_gib`, read when the line comes;
- a stalled load: during a start, no loading progress (no line, no shard,
  no I/O) for `memory.driver_oom_window_s`, with a line within that window;
- an engine that no longer answers or is dead, with a line within the window.

The journal names the evidence. `memory.driver_oom_burst = 1` stops at the
first line, as gb10d did before it knew better.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..base.config import MemorySection
from ..base.units import GIB, gib


@dataclass(frozen=True)
class DriverRoom:
    """The driver's out-of-memory lines of one attempt: the monotonic times of those within the window, oldest first."""

    times: tuple[float, ...] = ()

    def recent(self, now: float, window_s: float) -> bool:
        """Whether a line came within the window: what follows it may be its doing."""
        return bool(self.times) and now - self.times[-1] <= window_s


class Evidence(enum.Enum):
    """What, beside the line, says the driver's memory really ran short."""

    BURST = "burst"
    LOW_MEMORY = "low_memory"
    STALL = "stall"
    NOT_ANSWERING = "not_answering"


@dataclass(frozen=True)
class Found:
    """Evidence that stops vLLM, and the words the journal gives it."""

    evidence: Evidence
    text: str


def note(room: DriverRoom, now: float, window_s: float) -> DriverRoom:
    """One more line at `now`; those older than the window are forgotten."""
    return DriverRoom((*(t for t in room.times if now - t < window_s), now))


def judge(room: DriverRoom, now: float, mem_available: int | None, stalled_s: float | None, memory: MemorySection) -> Found | None:
    """The evidence that comes with the line just noted, or None: told, counted, not acted on.

    `mem_available` is MemAvailable in bytes read when the line came (None:
    unreadable); `stalled_s` how long the load has gone without progress
    (None: not loading, vLLM serves).
    """
    count = sum(1 for t in room.times if now - t < memory.driver_oom_window_s)
    if count >= memory.driver_oom_burst:
        return Found(
            Evidence.BURST,
            f"a burst of {count} such lines within {memory.driver_oom_window_s:g} s "
            f"(memory.driver_oom_burst {memory.driver_oom_burst} within memory.driver_oom_window_s)",
        )
    if mem_available is not None and mem_available < memory.headroom_gib * GIB:
        return Found(
            Evidence.LOW_MEMORY, f"MemAvailable {gib(mem_available)} is below memory.headroom_gib {memory.headroom_gib:g}"
        )
    return stalled(room, now, stalled_s, memory.driver_oom_window_s)


def stalled(room: DriverRoom, now: float, stalled_s: float | None, window_s: float) -> Found | None:
    """A load without progress for the window, with a line within it: the evidence of a stall, or None."""
    if stalled_s is None or stalled_s < window_s or not room.recent(now, window_s):
        return None
    return Found(Evidence.STALL, f"the load has made no progress for {stalled_s:.0f} s (memory.driver_oom_window_s {window_s:g})")


def stall_deadline(room: DriverRoom, last_progress: float, window_s: float) -> float | None:
    """When a load without progress since `last_progress` becomes a stall with a line still within the window; None when
    the last line will be out of the window by then."""
    if not room.times or last_progress > room.times[-1]:
        return None
    return last_progress + window_s


def not_answering(room: DriverRoom, now: float, detail: str, window_s: float) -> Found | None:
    """An engine found hung or dead with a line within the window: the evidence, or None (the line is not its cause)."""
    if not room.recent(now, window_s):
        return None
    return Found(Evidence.NOT_ANSWERING, f"vLLM's engine no longer answers ({detail})")


def calm(room: DriverRoom, now: float, mem_available: int | None, loading: bool, memory: MemorySection) -> str:
    """Why a line without evidence is only told: the numbers that were looked at."""
    count = sum(1 for t in room.times if now - t < memory.driver_oom_window_s)
    lines = "1 such line" if count == 1 else f"{count} such lines"
    mem = f"MemAvailable {gib(mem_available)}" if mem_available is not None else "MemAvailable unreadable"
    doing = "the load progressing" if loading else "vLLM serving"
    return (
        f"{lines} within {memory.driver_oom_window_s:g} s, {mem}, {doing}: no sign of trouble with it, vLLM keeps running "
        "(it is stopped for a burst of memory.driver_oom_burst lines, MemAvailable below memory.headroom_gib, "
        "a stalled load or an engine that stops answering)"
    )
