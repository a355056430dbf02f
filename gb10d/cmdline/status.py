"""`gb10d status`: what the running daemon is doing, read from its state file; `--all`: every instance of the machine.

The exit status follows `systemctl status` and LSB: 0 running, 3 not
running (no state file, its pid gone, or the state says stopped or failed),
4 when the state file cannot be read at all. `--all` reads the memory
ledger the instances share instead (without one, the state files beside
the config's, or for the front's config those of its instances): 0 when
any instance runs, 3 when none does, 4 when neither can be read. Rendering is pure (state, now and whether the pid lives go
in, text comes out); only the `show_*` functions touch the file system and
the process table.
"""

from __future__ import annotations

import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ..base.config import Config, MemorySection
from ..base.configload import load_config, load_front, tables_of
from ..base.errors import EXIT_NOT_RUNNING, EXIT_OK, EXIT_STATUS_UNKNOWN, Gb10dError
from ..base.frontconfig import FrontSection
from ..base.units import duration, gib
from ..core import budget, eta, programs
from ..core.budget import Reservation, Stage
from ..core.memory import MemInfo
from ..core.programs import Programs
from ..core.statefile import StateRecord, not_running_reason
from ..machine import programsfile
from ..machine.ledger import read_ledger
from ..machine.memory import read_meminfo
from ..machine.procs import pid_alive
from ..machine.statefile import read_state

DEFAULT_STATE_FILE = Path("/run/gb10d/state.json")



def status_config(config_path: Path, named: bool) -> Config | None:
    """The config whose state file and ledger status reads; None for a default config that does not load.

    A file the user named (`--config`, $GB10D_CONFIG) must load: its error,
    exit 78, is the answer, since falling back would show another
    instance's status as this one's. The default config that does not load
    is no reason to refuse a status: the daemon may be running from an
    earlier, valid version of it.
    """
    try:
        return load_config(config_path)
    except Gb10dError:
        if named:
            raise
        return None


def state_file_path(explicit: str | None, config: Config | None) -> Path:
    """The state file to read: `--state-file`, else the config's `[daemon] state_file`, else the default."""
    if explicit:
        return Path(explicit)
    return config.daemon.state_file if config is not None else DEFAULT_STATE_FILE


def front_state_file(config_path: Path) -> Path | None:
    """Where the config's front writes its queues ([front] state_file); the default when its [front] does not load, and
    None for a config without [front] (or one that cannot be read): no front of its own to show."""
    try:
        if "front" not in tables_of(config_path):
            return None
    except Gb10dError:
        return None
    try:
        return load_front(config_path).state_file
    except Gb10dError:
        return FrontSection().state_file


# --- rendering ---------------------------------------------------------------


def _when(at: float, now: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(at))
    return f"{stamp}; {duration(now - at)} ago"


def _phase_line(state: StateRecord) -> str | None:
    progress = state.progress
    # The count matters while loading; afterwards "66/66" only repeats the phase.
    if state.phase == "loading_weights" and progress is not None and progress.shards_total:
        done, total = progress.shards_done, progress.shards_total
        return f"{state.phase}, {done}/{total} shards ({100 * done // total}%)"
    return state.phase


def _memory_line(state: StateRecord, now: float) -> str | None:
    """/proc/meminfo as gb10d measured it before the attempt started: a snapshot, said to be one, never current."""
    m = state.memory
    if m is None:
        return None
    when = f"{duration(now - state.memory_at)} ago" if state.memory_at is not None else "at an unknown time"
    return (
        f"{gib(m.total_bytes, 1)} total, {gib(m.available_bytes, 1)} available, {gib(m.free_bytes, 1)} free, "
        f"{gib(m.cached_bytes, 1)} page cache (measured {when}, before the attempt started; free -g shows it now)"
    )


def _cluster_rows(state: StateRecord) -> list[tuple[str, str | None]]:
    """One machine of a pair: its role and link, and the machines the head's Ray cluster lists."""
    cluster = state.cluster
    if cluster is None:
        return []
    wanted, head = cluster.nodes_wanted, cluster.head_address
    line = f"{cluster.role} of a {wanted}-machine Ray cluster" if wanted else cluster.role
    if cluster.role != "head" and head:
        line += f" headed by {head}"
    if cluster.node_ip:
        line += f"; this machine is {cluster.node_ip}" + (f" on {cluster.interface}" if cluster.interface else "")
    up = ", ".join(f"{n.ip} (head)" if n.head else n.ip for n in cluster.nodes)
    machines = cluster.error or f"{len(cluster.nodes)}{f' of {wanted}' if wanted else ''} with a GPU up" + (f": {up}" if up else "")
    return [("Cluster", line), ("Machines", machines)]


def _header(state: StateRecord | None, alive: bool, now: float) -> str:
    reason = not_running_reason(state, alive)
    if state is None:
        return "gb10d is not running (no state file)"
    name = state.state.value if state.state is not None else "unknown"
    if reason is None:
        return f"gb10d is running: {name}"
    when = f", last update {duration(now - state.updated_at)} ago" if state.updated_at is not None else ""
    return f"gb10d is not running ({reason}; last state: {name}{when})"


def programs_of(config: Config | None) -> Programs:
    """The record of vLLM programs beside the config's learned settings; empty without a config."""
    return programsfile.load(programs.programs_file(config.daemon.learned_file)) if config is not None else programs.NONE


def _program_rows(record: Programs) -> list[tuple[str, str | None]]:
    rows: list[tuple[str, str | None]] = []
    if record.good is not None:
        rows.append(("Good program", f"{record.good.describe()}, served {record.good_at}" if record.good_at else record.good.describe()))
    if record.rejected is not None:
        r = record.rejected
        rows.append(("Rejected", f"{r.program.describe()} failed its start {r.at}: {r.failure}"))
        rows.append(("", "once it is fixed: gb10d forget --candidate"))
    return rows


def render(state: StateRecord | None, now: float, alive: bool, record: Programs = programs.NONE) -> str:
    """The human summary, like `systemctl status`: one aligned `Label: value` line per known fact.

    Odd fields were left out when the file was read, so a state file from
    another gb10d version still gives whatever it can.
    """
    lines = [_header(state, alive, now)]
    if state is None:
        return lines[0] + "\n"
    rows: list[tuple[str, str | None]] = []
    if state.started_at is not None:
        rows.append(("Started", _when(state.started_at, now)))
    running = not_running_reason(state, alive) is None
    if state.ready_at is not None and running:
        rows.append(("Ready", f"since {_when(state.ready_at, now)}"))
    rows.append(("Phase", _phase_line(state)))
    left = eta.of_state(state, now) if running else None
    if left is not None:
        rows.append(("Time left", left))
    names = state.served_names
    if state.model is not None:
        rows.append(("Model", f"{state.model} (served as {', '.join(names)})" if names else state.model))
    rows.append(("URL", state.url))
    rows.extend(_cluster_rows(state))
    if state.attempt is not None:
        rows.append(("Attempt", f"{state.attempt} of {state.max_attempts}" if state.max_attempts else str(state.attempt)))
    if state.gpu_memory_utilization is not None:
        strategy = f", load strategy {state.load_strategy}" if state.load_strategy else ""
        rows.append(("GPU memory", f"gpu_memory_utilization {state.gpu_memory_utilization:g}{strategy}"))
    if state.image is not None:
        rows.append(("Image", f"{state.image} ({state.image_digest})" if state.image_digest else state.image))
    if state.container is not None:
        rows.append(("Container", f"{state.container} ({state.engine})" if state.engine else state.container))
    rows.append(("Memory", _memory_line(state, now)))
    if state.instance is not None:
        reserved = f": {gib(state.reservation_bytes, 1)} reserved" if state.reservation_bytes is not None else ""
        rows.append(("Ledger", f"{state.instance}{reserved} in the machine's memory ledger (gb10d status --all shows every instance)"))
    if state.waiting_for:
        rows.append(("Waiting for", ", ".join(state.waiting_for)))
    rows.append(("Host", state.host))
    if state.pid is not None:
        started = f"{state.engine} run" if state.engine else "vLLM"  # in a container, gb10d's child is the engine's client
        rows.append(("PID", f"{state.pid} (gb10d)" + (f", {state.vllm_pid} ({started})" if state.vllm_pid is not None else "")))
    failure = state.last_failure
    if failure is not None:
        rows.append(("Last failure", f"{failure.cause}, {duration(now - failure.at)} ago"))
        rows.append(("", failure.message))
        rows.append(("Action", failure.action))
    rows.extend(_program_rows(record))
    rows.append(("Status", state.status_text))
    rows.append(("Metrics", state.metrics_url))
    shown = [(label, value) for label, value in rows if value is not None]
    width = max((len(label) for label, _ in shown), default=0)
    lines.extend(f"{label.rjust(width)}{':' if label else ' '} {value}" for label, value in shown)
    return "\n".join(lines) + "\n"


def as_json(state: StateRecord | None, path: Path, alive: bool) -> dict[str, Any]:
    """One JSON object for scripts: the state as written, plus `running`, `state_file` and, when not running, `reason`."""
    reason = not_running_reason(state, alive)
    result: dict[str, Any] = state.to_json() if state is not None else {}
    result["running"] = reason is None
    result["state_file"] = str(path)
    if reason is not None:
        result["reason"] = reason
    return result


# --- the command ----------------------------------------------------------------


def _cannot(message: str, where: dict[str, str | None], json_output: bool, out: TextIO, err: TextIO, status: int = EXIT_STATUS_UNKNOWN) -> int:
    """No status to show: one JSON object saying why (running unknown), or one `gb10d:` line on stderr."""
    if json_output:
        out.write(json.dumps({"running": None, **where, "error": message}) + "\n")
    else:
        err.write(f"gb10d: {message}\n")
    return status


def show_status(
    path: Path, json_output: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr, record: Programs = programs.NONE
) -> int:
    """Print the daemon's status from the state file at `path` (and the `record` of vLLM programs); return the exit status."""
    try:
        state = read_state(path)
    except OSError as exc:
        return _cannot(f"cannot read the state file {path}: {exc.strerror or exc}", {"state_file": str(path)}, json_output, out, err)
    alive = state is not None and state.pid is not None and pid_alive(state.pid)
    if json_output:
        shown = as_json(state, path, alive)
        if record != programs.NONE:
            shown["programs"] = programs.as_json(record)
        out.write(json.dumps(shown, indent=2, sort_keys=True) + "\n")
    else:
        out.write(render(state, time.time(), alive, record))
    return EXIT_OK if not_running_reason(state, alive) is None else EXIT_NOT_RUNNING


# --- every instance of the machine -------------------------------------------------


def render_all(records: list[Reservation], mem: MemInfo | None, now: float, directory: Path) -> str:
    """`gb10d status --all`: one line per instance in the order they asked, then what memory is left.

    `now` is CLOCK_MONOTONIC, the clock of the records.
    """
    if not records:
        return f"no gb10d instance is running on this machine (memory ledger {directory})\n"
    header = ("INSTANCE", "STATE", "PHASE", "RESERVED", "REAL USE", "IN STATE", "WAITS FOR")
    rows = [
        (
            r.name,
            r.stage.value,
            r.phase or "-",
            gib(r.bytes),
            gib(r.real_use) if r.real_use is not None else "-",
            duration(now - r.since),
            ", ".join(r.waiting_for) if r.stage is Stage.WAITING else "",
        )
        for r in sorted(records, key=lambda r: r.queue_key)
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    count = f"{len(records)} gb10d instance{'s' if len(records) > 1 else ''}"
    lines = [f"{count} on this machine (memory ledger {directory})"]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in (header, *rows)]
    if mem is not None:
        starting = budget.pending(records)
        beside = f"; {gib(max(budget.left(records, mem), 0))} left for a start beside the reservations of the starts in progress" if starting else ""
        lines.append(
            f"Memory: {gib(mem.total)} total, {gib(mem.available)} available, {gib(mem.free)} free{beside}"
        )
    return "\n".join(lines) + "\n"


def all_as_json(records: list[Reservation], mem: MemInfo | None, now: float, directory: Path) -> dict[str, Any]:
    """The same for scripts: the records as kept, the memory figures, what is left, and whether any instance runs."""
    return {
        "ledger_dir": str(directory),
        "running": bool(records),
        "instances": [{**r.to_json(), "in_state_s": round(now - r.since, 3)} for r in sorted(records, key=lambda r: r.queue_key)],
        "memory": {"total_bytes": mem.total, "available_bytes": mem.available, "free_bytes": mem.free} if mem else None,
        "left_bytes": budget.left(records, mem) if mem else None,
    }


@dataclass(frozen=True)
class StateFiles:
    """Where `--all` finds the running instances when the ledger cannot tell: every *.json of a directory (beside the
    config's state file), or the given files (the front's instances, each in a run directory of its own)."""

    directory: Path | None = None
    files: tuple[Path, ...] = ()

    def describe(self) -> str:
        return f"in {self.directory}" if self.directory is not None else "of the front's instances"

    def paths(self) -> list[Path]:
        """The files to read; OSError when the directory cannot be listed."""
        if self.directory is None:
            return list(self.files)
        try:
            return sorted(path for path in self.directory.iterdir() if path.suffix == ".json")
        except FileNotFoundError:
            return []  # no gb10d ever ran here since boot

    def as_json(self) -> dict[str, Any]:
        return {"state_dir": str(self.directory)} if self.directory is not None else {"state_files": [str(f) for f in self.files]}


def show_all(
    memory: MemorySection, states: Path | StateFiles, json_output: bool = False, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
    front: Path | None = None,
) -> int:
    """Print every gb10d instance of the machine, then the front's queue per model (`front`: its state file, given
    when the config has a [front] table); return the exit status (that of the instances).

    The instances come from the memory ledger. Without a ledger (off in the
    config, or its directory missing), or with an empty one while an
    instance runs alone outside it (it could not use the ledger: one warning
    in its journal), the state files tell instead, and the answer says so:
    an instance that runs must never be reported as absent. `states` says
    which: the config's state file (those beside it), or StateFiles.
    """
    from ..front import snapshot

    places = states if isinstance(states, StateFiles) else StateFiles(directory=states.parent)
    if front is None:
        return _show_instances(memory, places, json_output, out, err)
    queues = snapshot.read(front)
    alive = queues is not None and pid_alive(queues.pid)
    shown = io.StringIO()
    status = _show_instances(memory, places, json_output, shown, err)
    if json_output:
        answer = json.loads(shown.getvalue() or "{}")
        answer["front"] = {**snapshot.as_json(queues), "running": alive} if queues is not None else {"running": False, "state_file": str(front)}
        out.write(json.dumps(answer, indent=2, sort_keys=True) + "\n")
    elif queues is not None:
        out.write(shown.getvalue() + snapshot.render(queues, alive, time.time(), front))
    else:
        out.write(shown.getvalue() + f"Front: not running (no state file {front}); systemctl status gb10d-front says why\n")
    return status


def _show_instances(memory: MemorySection, places: StateFiles, json_output: bool, out: TextIO, err: TextIO) -> int:
    """The instances part of show_all."""
    directory = memory.ledger_path
    if directory is None:
        why = 'the memory ledger is off in this config (memory.ledger_dir = "")'
        return show_state_files(why, places, json_output, out, err)
    try:
        records = read_ledger(directory)
    except FileNotFoundError:
        why = f"the memory ledger {directory} does not exist (the package creates it at boot: systemd-tmpfiles --create)"
        return show_state_files(why, places, json_output, out, err)
    except OSError as exc:
        message = f"cannot read the memory ledger {directory}: {exc.strerror or exc} (members of the group gb10d and root may)"
        return _cannot(message, {"ledger_dir": str(directory)}, json_output, out, err)
    if not records:
        try:
            alone = _running_states(places)
        except OSError:
            alone = []  # the ledger's answer stands
        if alone:
            return _print_state_files(f"no instance is in the memory ledger {directory}", places, alone, json_output, out)
    try:
        mem: MemInfo | None = read_meminfo(memory.meminfo_path)
    except (OSError, ValueError):
        mem = None
    now = time.monotonic()
    if json_output:
        out.write(json.dumps(all_as_json(records, mem, now, directory), indent=2, sort_keys=True) + "\n")
    else:
        out.write(render_all(records, mem, now, directory))
    return EXIT_OK if records else EXIT_NOT_RUNNING


def _running_states(places: StateFiles) -> list[tuple[Path, StateRecord]]:
    """The state files whose daemon runs, by path; OSError when their directory cannot be listed."""
    found = []
    for path in places.paths():
        try:
            state = read_state(path)
        except OSError:
            continue  # another user's, or gone meanwhile: the instances gb10d can see are still told
        alive = state is not None and state.pid is not None and pid_alive(state.pid)
        if state is not None and not_running_reason(state, alive) is None:
            found.append((path, state))
    return found


def render_state_files(why: str, places: StateFiles, found: list[tuple[Path, StateRecord]]) -> str:
    """`--all` without the ledger's answer: the honest reason, then each running instance its state file shows."""
    if not found:
        return f"{why}; no state file {places.describe()} names a running gb10d\n"
    lines = [f"{why}; the state files {places.describe()} name {len(found)} running:"]
    for path, state in found:
        name = state.state.value if state.state is not None else "unknown"
        model = f" {state.model}" if state.model else ""
        lines.append(f"  {path}: {name}{model}, pid {state.pid}")
    return "\n".join(lines) + "\n"


def _print_state_files(why: str, places: StateFiles, found: list[tuple[Path, StateRecord]], json_output: bool, out: TextIO) -> int:
    if json_output:
        instances = [{**state.to_json(), "state_file": str(path)} for path, state in found]
        answer = {"ledger": why, **places.as_json(), "running": bool(found), "instances": instances}
        out.write(json.dumps(answer, indent=2, sort_keys=True) + "\n")
    else:
        out.write(render_state_files(why, places, found))
    return EXIT_OK if found else EXIT_NOT_RUNNING


def show_state_files(why: str, places: StateFiles, json_output: bool, out: TextIO, err: TextIO) -> int:
    """Print the running instances the state files show; return the exit status."""
    try:
        found = _running_states(places)
    except OSError as exc:
        message = f"{why}, and the state files {places.describe()} cannot be listed: {exc.strerror or exc}"
        return _cannot(message, places.as_json(), json_output, out, err)
    return _print_state_files(why, places, found, json_output, out)
