"""What the front shows of itself to `gb10d status --all`: each model, its instance's state, and the requests held
for it, in a small JSON file (front.state_file) that the front rewrites when any of them changes.

Pure apart from the two file functions at the end; the front writes, `gb10d status --all` reads and renders.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ..base.units import duration
from ..machine.files import write_atomically


@dataclass(frozen=True)
class ModelQueue:
    """One model as the front sees it: its instance, that instance's state, and how many requests wait for it."""

    model: str
    instance: str
    state: str
    held: int
    # Wall-clock time since when requests have been held for it, while some are.
    held_since: float | None = None


@dataclass(frozen=True)
class FrontSnapshot:
    pid: int
    listen: str
    models: tuple[ModelQueue, ...]


def render(snapshot: FrontSnapshot, alive: bool, now: float, path: Path) -> str:
    """The front's lines of `gb10d status --all`: one per model, its state and its queue (`now`: wall clock)."""
    if not alive:
        return f"Front: not running (its last state, {path}, names pid {snapshot.pid})\n"
    header = ("MODEL", "INSTANCE", "STATE", "HELD", "HELD FOR")
    rows = [
        (m.model, m.instance, m.state, str(m.held), duration(now - m.held_since) if m.held and m.held_since is not None else "")
        for m in snapshot.models
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    lines = [f"Front on {snapshot.listen} (pid {snapshot.pid}), requests held per model:"]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    return "\n".join(lines) + "\n"


def as_json(snapshot: FrontSnapshot) -> dict[str, Any]:
    return asdict(snapshot)


_SNAPSHOT = TypeAdapter(FrontSnapshot)


def from_json(data: Any) -> FrontSnapshot | None:
    """The snapshot a front wrote, or None for anything else (a file half-understood is not shown)."""
    try:
        return _SNAPSHOT.validate_python(data)
    except ValidationError:
        return None


def write(path: Path, snapshot: FrontSnapshot) -> None:
    """Replace the file atomically, readable by the group gb10d (whose members run `gb10d status`)."""
    write_atomically(path, json.dumps(as_json(snapshot)).encode(), 0o640)


def read(path: Path) -> FrontSnapshot | None:
    """The front's last snapshot, or None when there is none (the front never ran, or systemd removed it on stop)."""
    try:
        return _SNAPSHOT.validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None

