"""The state file: the daemon's current state as one JSON object, for `gb10d status`.

The supervisor rewrites it on every change; readers may look at any moment,
so a write either fully replaces the previous file or leaves it untouched,
never a half-written one. It lives under the runtime directory
(/run/gb10d/state.json by default), so it disappears at reboot with the
daemon it describes.

Fields the supervisor writes: pid, started_at, updated_at, state (starting,
serving, restarting, stopping, stopped, failed, reloading), phase, progress
({shards_done, shards_total} or null), model, served_names, url, attempt,
max_attempts, gpu_memory_utilization, load_strategy, memory ({total_bytes,
available_bytes, free_bytes, cached_bytes} or null), vllm_pid, ready_at,
last_failure ({cause, message, action, at} or null), status_text,
metrics_url. Times are Unix seconds.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Readable by operators who are not in the gb10d group: nothing in it is secret.
STATE_FILE_MODE = 0o644


def write_atomically(path: Path, data: bytes, mode: int, sync_directory: bool = False) -> None:
    """Replace `path` with `data` so that readers see the old file or the new one, never a part.

    Writes a temporary file in the same directory (created if missing),
    fsyncs it and renames it over `path`; with `sync_directory` the rename
    itself is made durable too. Raises OSError, leaving the old file and no
    temporary behind.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fchmod(tmp.fileno(), mode)
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        # The rename did not happen: the temporary must not linger beside the real file.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    if sync_directory:
        directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def write_state(path: Path, state: Mapping[str, Any]) -> None:
    """Replace the state file atomically with `state` as JSON, creating its directory if missing.

    Raises OSError (or TypeError for values JSON cannot hold) and leaves the
    previous file in place; logging that is the caller's job.
    """
    data = json.dumps(state, indent=1, sort_keys=True, allow_nan=False).encode("utf-8") + b"\n"
    write_atomically(path, data, STATE_FILE_MODE)


def read_state(path: Path) -> dict[str, Any] | None:
    """The state object in `path`, or None when there is none (missing, empty or not a JSON object).

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
    return state if isinstance(state, dict) else None
