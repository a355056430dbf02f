"""The state file written (by the Reporter) and read (by `gb10d status`, the front); its schema is `gb10d.core.statefile`."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.statefile import STATE_FILE_MODE, StateRecord
from .files import write_atomically


def write_state(path: Path, state: StateRecord) -> None:
    """Replace the state file atomically with `state` as JSON, creating its directory if missing.

    Raises OSError (or ValueError for values JSON cannot hold) and leaves the
    previous file in place; logging that is the caller's job.
    """
    data = json.dumps(state.to_json(), indent=1, sort_keys=True, allow_nan=False).encode("utf-8") + b"\n"
    write_atomically(path, data, STATE_FILE_MODE)


def read_state(path: Path) -> StateRecord | None:
    """The state in `path`, or None when there is none (missing, empty or not a JSON object).

    Other OSErrors (permission denied, a directory in its place) propagate,
    because "cannot read" is not the same answer as "not running".
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        state = json.loads(data)
    except ValueError:  # includes bytes that are not UTF-8
        return None
    return StateRecord.from_json(state) if isinstance(state, dict) else None
