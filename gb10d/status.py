"""`gb10d status`: what the running daemon is doing, read from its state file.

The exit status follows `systemctl status` and LSB: 0 running, 3 not
running (no state file, its pid gone, or the state says stopped or failed),
4 when the state file cannot be read at all. Rendering is pure (state, now
and whether the pid lives go in, text comes out); only `show_status`
touches the file system and the process table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from .config import load_config
from .errors import Gb10dError
from .statefile import read_state

EXIT_RUNNING = 0
EXIT_NOT_RUNNING = 3
EXIT_UNKNOWN = 4

DEFAULT_STATE_FILE = Path("/run/gb10d/state.json")

# A daemon in these states has finished, even if its pid lingers a moment.
_FINAL_STATES = frozenset({"stopped", "failed"})

_GIB = 1 << 30


def state_file_path(explicit: str | None, config_path: Path | None) -> Path:
    """The state file to read: `--state-file`, else the config's `[daemon] state_file`, else the default.

    A config that does not load is no reason to refuse a status: the daemon
    may be running from an earlier, valid version of it.
    """
    if explicit:
        return Path(explicit)
    try:
        return load_config(config_path).daemon.state_file
    except Gb10dError:
        return DEFAULT_STATE_FILE


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (owned by anyone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def not_running_reason(state: Mapping[str, Any] | None, alive: bool) -> str | None:
    """Why the daemon counts as not running, or None when it runs (its pid lives, no final state)."""
    if state is None:
        return "no state file"
    if not alive:
        return f"pid {_int(state, 'pid')} has exited" if _int(state, "pid") is not None else "state file names no pid"
    if state.get("state") in _FINAL_STATES:
        return f"state is {state['state']}"
    return None


# --- rendering ---------------------------------------------------------------


def _num(state: Mapping[str, Any], key: str) -> float | None:
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(state: Mapping[str, Any], key: str) -> int | None:
    value = state.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(state: Mapping[str, Any], key: str) -> str | None:
    value = state.get(key)
    return value if isinstance(value, str) and value else None


def _table(state: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = state.get(key)
    return value if isinstance(value, Mapping) else {}


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


def _when(at: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(at))
    return f"{stamp}; {duration(now - at)} ago"


def _gib(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return f"{value / _GIB:.1f} GiB"


def _phase_line(state: Mapping[str, Any]) -> str | None:
    phase = _text(state, "phase")
    if phase is None:
        return None
    progress = _table(state, "progress")
    done, total = _int(progress, "shards_done"), _int(progress, "shards_total")
    # The count matters while loading; afterwards "66/66" only repeats the phase.
    if phase == "loading_weights" and done is not None and total:
        return f"{phase}, {done}/{total} shards ({100 * done // total}%)"
    return phase


def _memory_line(state: Mapping[str, Any]) -> str | None:
    memory = _table(state, "memory")
    parts = [
        f"{figure} {label}"
        for key, label in (
            ("total_bytes", "total"),
            ("available_bytes", "available"),
            ("free_bytes", "free"),
            ("cached_bytes", "page cache"),
        )
        if (figure := _gib(memory.get(key))) is not None
    ]
    return ", ".join(parts) or None


def _cluster_rows(state: Mapping[str, Any]) -> list[tuple[str, str | None]]:
    """One machine of a pair: its role and link, and the machines the head's Ray cluster lists."""
    cluster = _table(state, "cluster")
    role = _text(cluster, "role")
    if role is None:
        return []
    wanted, head = _int(cluster, "nodes_wanted"), _text(cluster, "head_address")
    me, interface = _text(cluster, "node_ip"), _text(cluster, "interface")
    line = f"{role} of a {wanted}-machine Ray cluster" if wanted else role
    if role != "head" and head:
        line += f" headed by {head}"
    if me:
        line += f"; this machine is {me}" + (f" on {interface}" if interface else "")
    listed = cluster.get("nodes")
    nodes = [n for n in listed if isinstance(n, Mapping)] if isinstance(listed, list) else []
    up = ", ".join(f"{_text(n, 'ip')} (head)" if n.get("head") is True else str(_text(n, "ip")) for n in nodes)
    machines = _text(cluster, "error") or f"{len(nodes)}{f' of {wanted}' if wanted else ''} with a GPU up" + (f": {up}" if up else "")
    return [("Cluster", line), ("Machines", machines)]


def _header(state: Mapping[str, Any] | None, alive: bool, now: float) -> str:
    reason = not_running_reason(state, alive)
    if state is None:
        return "gb10d is not running (no state file)"
    name = _text(state, "state") or "unknown"
    if reason is None:
        return f"gb10d is running: {name}"
    updated = _num(state, "updated_at")
    when = f", last update {duration(now - updated)} ago" if updated is not None else ""
    return f"gb10d is not running ({reason}; last state: {name}{when})"


def render(state: Mapping[str, Any] | None, now: float, alive: bool) -> str:
    """The human summary, like `systemctl status`: one aligned `Label: value` line per known fact.

    Missing or odd fields are skipped rather than failing, so a state file
    from another gb10d version still gives whatever it can.
    """
    lines = [_header(state, alive, now)]
    if state is None:
        return lines[0] + "\n"
    rows: list[tuple[str, str | None]] = []
    started, ready = _num(state, "started_at"), _num(state, "ready_at")
    if started is not None:
        rows.append(("Started", _when(started, now)))
    if ready is not None:
        rows.append(("Ready", f"since {_when(ready, now)}"))
    rows.append(("Phase", _phase_line(state)))
    model = _text(state, "model")
    served = state.get("served_names")
    names = [n for n in served if isinstance(n, str)] if isinstance(served, list) else []
    if model is not None:
        rows.append(("Model", f"{model} (served as {', '.join(names)})" if names else model))
    rows.append(("URL", _text(state, "url")))
    rows.extend(_cluster_rows(state))
    attempt, max_attempts = _int(state, "attempt"), _int(state, "max_attempts")
    if attempt is not None:
        rows.append(("Attempt", f"{attempt} of {max_attempts}" if max_attempts else str(attempt)))
    utilization = _num(state, "gpu_memory_utilization")
    if utilization is not None:
        strategy = _text(state, "load_strategy")
        rows.append(
            ("GPU memory", f"gpu_memory_utilization {utilization:g}" + (f", load strategy {strategy}" if strategy else ""))
        )
    rows.append(("Memory", _memory_line(state)))
    pid, vllm_pid = _int(state, "pid"), _int(state, "vllm_pid")
    if pid is not None:
        rows.append(("PID", f"{pid} (gb10d)" + (f", {vllm_pid} (vLLM)" if vllm_pid is not None else "")))
    failure = _table(state, "last_failure")
    if failure:
        cause = _text(failure, "cause") or "unknown"
        at = _num(failure, "at")
        rows.append(("Last failure", cause + (f", {duration(now - at)} ago" if at is not None else "")))
        rows.append(("", _text(failure, "message")))
        rows.append(("Action", _text(failure, "action")))
    rows.append(("Status", _text(state, "status_text")))
    rows.append(("Metrics", _text(state, "metrics_url")))
    shown = [(label, value) for label, value in rows if value is not None]
    width = max((len(label) for label, _ in shown), default=0)
    lines.extend(f"{label.rjust(width)}{':' if label else ' '} {value}" for label, value in shown)
    return "\n".join(lines) + "\n"


def as_json(state: Mapping[str, Any] | None, path: Path, alive: bool) -> dict[str, Any]:
    """One JSON object for scripts: the state as written, plus `running`, `state_file` and, when not running, `reason`."""
    reason = not_running_reason(state, alive)
    result: dict[str, Any] = dict(state or {})
    result["running"] = reason is None
    result["state_file"] = str(path)
    if reason is not None:
        result["reason"] = reason
    return result


# --- the command ----------------------------------------------------------------


def show_status(path: Path, json_output: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Print the daemon's status from the state file at `path`; return the exit status."""
    try:
        state = read_state(path)
    except OSError as exc:
        message = f"cannot read the state file {path}: {exc.strerror or exc}"
        if json_output:
            out.write(json.dumps({"running": None, "state_file": str(path), "error": message}) + "\n")
        else:
            err.write(f"gb10d: {message}\n")
        return EXIT_UNKNOWN
    pid = _int(state, "pid") if state is not None else None
    alive = pid is not None and pid_alive(pid)
    if json_output:
        out.write(json.dumps(as_json(state, path, alive), indent=2, sort_keys=True) + "\n")
    else:
        out.write(render(state, time.time(), alive))
    return EXIT_RUNNING if not_running_reason(state, alive) is None else EXIT_NOT_RUNNING
