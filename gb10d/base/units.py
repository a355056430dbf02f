"""Spans and sizes as operators read them in `gb10d status`, the journal and the front's queues."""

from __future__ import annotations

GIB = 1 << 30


def gib(value: float, places: int = 2) -> str:
    """A size in bytes as GiB with its unit: `12.34 GiB` (`places` decimals)."""
    return f"{value / GIB:.{places}f} GiB"


def duration(seconds: float) -> str:
    """A span the way systemd prints it: `3s`, `5min 12s`, `2h 3min`, `4 days 1h`."""
    s = max(int(seconds), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days} day{'s' if days > 1 else ''} {hours}h"
    if hours:
        return f"{hours}h {minutes}min"
    if minutes:
        return f"{minutes}min {s}s"
    return f"{s}s"
