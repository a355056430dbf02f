"""GB10 unified-memory arithmetic.

On GB10 the GPU has no memory of its own: vLLM's startup check compares
`gpu_memory_utilization * total` with CUDA's free memory, which equals the
kernel's MemFree, so the page cache (often the model files themselves)
counts as used. The pure functions here decide whether a utilization fits,
what the next one should be, and whether memory came back after vLLM
exited, from figures already read: `gb10d.machine.memory` reads them and
evicts the page cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..base.errors import MemInfoError
from ..base.units import GIB, gib


@dataclass(frozen=True)
class MemInfo:
    """The /proc/meminfo figures gb10d decides with, in bytes."""

    total: int
    free: int
    available: int
    cached: int

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    @property
    def free_gib(self) -> float:
        return self.free / GIB

    @property
    def available_gib(self) -> float:
        return self.available / GIB

    @property
    def cached_gib(self) -> float:
        return self.cached / GIB

    def summary(self) -> str:
        """`MemTotal 121.69 GiB, MemFree 95.20 GiB, MemAvailable 110.10 GiB, Cached 14.30 GiB`."""
        return (
            f"MemTotal {self.total_gib:.2f} GiB, MemFree {self.free_gib:.2f} GiB, "
            f"MemAvailable {self.available_gib:.2f} GiB, Cached {self.cached_gib:.2f} GiB"
        )

    def less(self, reserved: int) -> MemInfo:
        """The figures once `reserved` bytes more are taken: what a start may use beside other starts."""
        return MemInfo(self.total, max(self.free - reserved, 0), max(self.available - reserved, 0), self.cached)


@dataclass(frozen=True)
class Neighbours:
    """The other gb10d instances of this machine, as the free-memory arithmetic needs them (budget.neighbours).

    `reserved`: bytes their starts have reserved that /proc/meminfo does not
    show as used yet, which no lowered utilization may take; `named`: who
    they all are and their shares (waiters hold none), for messages.
    """

    reserved: int = 0
    reserved_by: str = ""  # whose starts: `gb10d@a and gb10d@b`
    named: str = ""

    def less(self) -> str:
        """` less 49.68 GiB reserved by the starts of gb10d@a`, or nothing."""
        return f" less {gib(self.reserved)} reserved by the starts of {self.reserved_by}" if self.reserved else ""

    def beside(self) -> str:
        """`; other gb10d instances here: gb10d@a (...)`, or nothing."""
        return f"; other gb10d instances here: {self.named}" if self.named else ""


# No other instance: a single gb10d on the machine, or a decision that does not concern them.
ALONE = Neighbours()


def meminfo_fields(text: str) -> dict[str, int]:
    """Every figure of /proc/meminfo text (`MemTotal:  127535208 kB` lines), in bytes."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            fields[name.strip()] = int(parts[0]) * scale
    return fields


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo text: the figures gb10d decides with; MemInfoError when one is missing."""
    fields = meminfo_fields(text)
    missing = [k for k in ("MemTotal", "MemFree", "MemAvailable") if k not in fields]
    if missing:
        raise MemInfoError(f"meminfo lacks {', '.join(missing)}")
    return MemInfo(
        total=fields["MemTotal"],
        free=fields["MemFree"],
        available=fields["MemAvailable"],
        cached=fields.get("Cached", 0),
    )


def floor2(value: float) -> float:
    """Round down to two decimals, robust to binary float noise (0.83 stays 0.83)."""
    return math.floor(value * 100 + 1e-6) / 100


def fitting_utilization(free_gib: float, total_gib: float, headroom_gib: float) -> float:
    """The largest two-decimal utilization whose share of total fits in free minus headroom."""
    if total_gib <= 0:
        return 0.0
    return max(0.0, floor2((free_gib - headroom_gib) / total_gib))


def fits(utilization: float, free_bytes: int, total_bytes: int, headroom_gib: float) -> bool:
    """Whether vLLM's check `free >= ceil(total * u)` passes with headroom to spare."""
    return math.ceil(total_bytes * utilization) <= free_bytes - headroom_gib * GIB


@dataclass(frozen=True)
class Preflight:
    """What to do before launching: start with `utilization`, maybe after evicting page cache."""

    utilization: float
    evict: bool
    reason: str


@dataclass(frozen=True)
class PreflightRefused:
    """Even the lowest allowed utilization cannot fit; starting would only fail."""

    reason: str


def preflight(
    requested: float,
    mem: MemInfo,
    headroom_gib: float,
    min_utilization: float,
    evicted_already: bool,
    can_evict: bool,
    neighbours: Neighbours = ALONE,
) -> Preflight | PreflightRefused:
    """Decide the utilization to launch with so vLLM's free-memory check passes first time.

    vLLM compares against MemFree. When the request fits MemAvailable but not
    MemFree the difference is page cache, quite possibly the model's own
    files: evict that first (once), then decide again on fresh numbers. What
    other instances' starts reserved is never offered to this one: it is
    taken off both figures first.
    """
    whole, mem = mem, mem.less(neighbours.reserved)
    less = neighbours.less()
    want_gib = requested * mem.total_gib
    if fits(requested, mem.free, mem.total, headroom_gib):
        return Preflight(requested, False, f"{want_gib:.2f} GiB fits in MemFree {whole.free_gib:.2f} GiB{less}")
    if can_evict and not evicted_already and fits(requested, mem.available, mem.total, headroom_gib):
        return Preflight(
            requested,
            True,
            f"gpu_memory_utilization {requested:g} ({want_gib:.2f} GiB) fits MemAvailable {whole.available_gib:.2f} GiB "
            f"but not MemFree {whole.free_gib:.2f} GiB{less} (page cache {mem.cached_gib:.2f} GiB counts as used on GB10); "
            "evicting the model's page cache first",
        )
    lowered = min(fitting_utilization(mem.free_gib, mem.total_gib, headroom_gib), floor2(requested))
    if lowered < min_utilization:
        return PreflightRefused(
            f"only {whole.free_gib:.2f} of {mem.total_gib:.2f} GiB is free{less} ({whole.summary()}); "
            f"even the minimum gpu_memory_utilization {min_utilization:g} would not fit with {headroom_gib:g} GiB headroom"
            f"{neighbours.beside()}"
        )
    return Preflight(
        lowered,
        False,
        f"gpu_memory_utilization {requested:g} ({want_gib:.2f} GiB) does not fit in MemFree {whole.free_gib:.2f} GiB "
        f"of {mem.total_gib:.2f} GiB{less}; starting with {lowered:g} ({lowered * mem.total_gib:.2f} GiB) instead"
        f"{neighbours.beside()}",
    )


# Blocks of this size or larger count as the large free memory that loads need (a huge page on 4 KiB pages).
LARGE_BLOCK = 2 * 2**20
# Below this share of free memory in large blocks, memory is fragmented (and only if this much is free at all).
FRAGMENTED_SHARE = 0.1
FRAGMENTED_MIN_FREE = 4 * GIB


@dataclass(frozen=True)
class Fragmentation:
    """Free memory by block size, from /proc/buddyinfo: all of it, and what lies in blocks of LARGE_BLOCK or more."""

    free: int
    large: int

    @property
    def fragmented(self) -> bool:
        return self.free >= FRAGMENTED_MIN_FREE and self.large < self.free * FRAGMENTED_SHARE

    def describe(self) -> str:
        return (
            f"unified memory is fragmented: {gib(self.free)} free, but only {gib(self.large)} of it in blocks "
            f"of {LARGE_BLOCK // 2**20} MiB or more (/proc/buddyinfo); after long uptimes loads stall or fail like this until "
            "a reboot: reboot recommended"
        )


def parse_buddyinfo(text: str, page_size: int) -> Fragmentation:
    """`Node 0, zone   Normal   4096   2048 ...`: free blocks of order 0, 1, ... (2**order pages each), every zone summed."""
    free = large = 0
    for line in text.splitlines():
        _, _, counts = line.partition("zone")
        words = counts.split()[1:]  # the zone's name first
        for order, word in enumerate(words):
            if word.isdigit():
                size = page_size << order
                free += int(word) * size
                large += int(word) * size if size >= LARGE_BLOCK else 0
    return Fragmentation(free, large)


def memory_returned(baseline: MemInfo, now: MemInfo, tolerance_gib: float) -> bool:
    """Whether MemAvailable is back near its value before vLLM started."""
    return now.available >= baseline.available - tolerance_gib * GIB


@dataclass(frozen=True)
class MemoryNotReturned:
    """MemAvailable still short of its value before vLLM started when memory.recovery_timeout_s ran out.

    No vLLM process is left by then, so a retry would only fail the same way: the daemon gives up.
    """

    now: MemInfo
    baseline: MemInfo
    taken: int  # what other instances' starts took meanwhile, not this vLLM's to give back
    missing: int

    def describe(self) -> str:
        others = f", less {gib(self.taken)} other gb10d instances' starts took meanwhile" if self.taken else ""
        return (
            f"memory was not returned after vLLM exited: MemAvailable is {self.now.available_gib:.2f} GiB, "
            f"was {self.baseline.available_gib:.2f} GiB before it started{others} ({gib(self.missing)} missing) "
            "and no vLLM process is left"
        )


def memory_return(
    baseline: MemInfo, taken: int, now: MemInfo | None, tolerance_gib: float, waited_s: float, timeout_s: float
) -> bool | MemoryNotReturned:
    """After vLLM exited: True when its memory is back (or cannot be read: the checks are off), False to look
    again, MemoryNotReturned once `timeout_s` has passed without it.

    `taken` is what other instances' starts took since this vLLM started: memory that is not its to give back.
    """
    expected = baseline.less(taken)
    if now is None or memory_returned(expected, now, tolerance_gib):
        return True
    if waited_s < timeout_s:
        return False
    return MemoryNotReturned(now, baseline, taken, expected.available - now.available)
