"""The state file: the daemon's current state as one JSON object, for `gb10d status`.

The Reporter rewrites it on every change; readers may look at any moment,
so a write either fully replaces the previous file or leaves it untouched,
never a half-written one. It lives under the runtime directory
(/run/gb10d/state.json by default), so it disappears at reboot with the
daemon it describes.

`StateRecord` is its one schema, shared by the writer (the Reporter) and
the reader (`gb10d status`). Reading is tolerant: a field
that is missing or of another type (a file from another gb10d version) is
left out, never a reason to fail; pydantic reads each field by the type it
is declared with (`core.tolerant`). Times are Unix seconds. Writing and
reading the file is `gb10d.machine.statefile`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Annotated, Any

from pydantic import BeforeValidator, Strict, TypeAdapter

from .tolerant import Name, Names, Number, Whole, otherwise, readable

# Readable by operators who are not in the gb10d group: nothing in it is secret.
STATE_FILE_MODE = 0o644
# Progress within a phase (shard steps) is written at most this often: each write fsyncs.
WRITE_EVERY_S = 1.0
# A new phase is written at once, but not more often than this: output that moves back and forth between
# phases (a second shard pass, then graphs, again and again) must not cost an fsync per line.
PHASE_WRITE_GAP_S = 0.1


def write_delay(phase_changed: bool, since_last_write_s: float) -> float:
    """How long to wait before writing the state file: what is left of PHASE_WRITE_GAP_S for a new phase
    (nothing, normally), else what is left of WRITE_EVERY_S."""
    return max(0.0, (PHASE_WRITE_GAP_S if phase_changed else WRITE_EVERY_S) - since_last_write_s)


class DaemonState(str, Enum):
    """What the daemon as a whole is doing; the value is what `gb10d status` shows."""

    STARTING = "starting"
    RESTARTING = "restarting"
    SERVING = "serving"
    WAITING_FOR_LINK = "waiting for the link"
    WAITING = "waiting"  # the head of a pair, for the other machine
    WAITING_FOR_MEMORY = "waiting for memory"  # for the starts of other gb10d instances of this machine
    JOINING = "joining"  # the worker of a pair, until the head lists it
    PARKING = "parking"  # on_demand: vLLM is falling asleep, or stopping (park = "stop")
    ASLEEP = "asleep"  # vLLM runs, asleep; the front wakes it for the next request
    WAKING = "waking"
    PARKED = "parked"  # on_demand.park = "stop": vLLM is not running; the front starts it for the first request
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        """The daemon has finished, even if its pid lingers a moment."""
        return self in (DaemonState.STOPPED, DaemonState.FAILED)


def _seconds(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {}
    return {k: float(v) for k, v in value.items() if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)}


# The fields of a state file from any gb10d version: one that is missing or of another type reads as None.
_OR_NONE = otherwise(None)
_Int = Annotated[Whole | None, _OR_NONE]
_Num = Annotated[Number | None, _OR_NONE]
_Text = Annotated[Name | None, _OR_NONE]


@dataclass(frozen=True)
class Progress:
    shards_done: Whole
    shards_total: Whole


@dataclass(frozen=True)
class Memory:
    """/proc/meminfo as it was when the attempt started, in bytes."""

    total_bytes: Whole
    available_bytes: Whole
    free_bytes: Whole
    cached_bytes: Whole


@dataclass(frozen=True)
class LastFailure:
    cause: Name
    message: Name
    action: Name
    at: Number


@dataclass(frozen=True)
class Decision:
    """One of the daemon's recent journal decisions (`Reporter.say`), for the front's page."""

    at: Number
    priority: Whole
    event: Name  # the journal's GB10D_EVENT
    message: Name


# The state file keeps this many of the latest decisions.
DECISIONS_KEPT = 50


@dataclass(frozen=True)
class NodeRecord:
    """A machine of the pair's Ray cluster that is up with a GPU."""

    ip: Name
    head: Annotated[bool, Strict(), otherwise(False)] = False
    gpus: Annotated[Number, otherwise(0.0)] = 0.0


@dataclass(frozen=True)
class ClusterRecord:
    """This machine's part in a pair, and what the head's node table lists."""

    role: Name
    head_address: Annotated[Name, otherwise("")] = ""
    node_ip: Annotated[Name, otherwise("")] = ""
    interface: Annotated[Name, otherwise("")] = ""
    nodes_wanted: _Int = None
    error: _Text = None
    nodes: Annotated[tuple[NodeRecord, ...], readable(NodeRecord)] = ()


@dataclass(frozen=True)
class StateRecord:
    """Everything `gb10d status` shows; None where it does not apply or is not known."""

    pid: _Int = None
    started_at: _Num = None
    updated_at: _Num = None
    state: Annotated[DaemonState | None, _OR_NONE] = None
    phase: _Text = None
    progress: Annotated[Progress | None, _OR_NONE] = None
    model: _Text = None
    served_names: Names = ()
    url: _Text = None
    attempt: _Int = None
    max_attempts: _Int = None
    gpu_memory_utilization: _Num = None
    load_strategy: _Text = None
    memory: Annotated[Memory | None, _OR_NONE] = None
    memory_at: _Num = None  # when `memory` was measured (wall clock)
    vllm_pid: _Int = None
    ready_at: _Num = None
    last_failure: Annotated[LastFailure | None, _OR_NONE] = None
    status_text: _Text = None
    metrics_url: _Text = None
    cluster: Annotated[ClusterRecord | None, _OR_NONE] = None
    host: _Text = None  # kernel, NVIDIA driver, CMA figures
    instance: _Text = None  # the name in the machine's memory ledger
    reservation_bytes: _Int = None  # this instance's share in it
    waiting_for: Names = ()  # while waiting for memory: the instances waited for, with their shares
    # vLLM from a container image: the reference, the image it named when started (registry digest, else local id),
    # and the container's name and engine.
    image: _Text = None
    image_digest: _Text = None
    container: _Text = None
    engine: _Text = None
    # The latest decisions the daemon's journal told (at most DECISIONS_KEPT, oldest first).
    decisions: Annotated[tuple[Decision, ...], readable(Decision)] = ()
    # Seconds per phase of the last complete start of this config (the learned file), for the time-left estimate.
    last_start: Annotated[Mapping[str, float], BeforeValidator(_seconds)] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)  # fields of another gb10d version, passed through

    def to_json(self) -> dict[str, Any]:
        """The JSON object, with every field (None as null)."""
        data = asdict(self)
        extra = data.pop("extra")
        data["state"] = self.state.value if self.state is not None else None
        data["served_names"] = list(self.served_names)
        data["waiting_for"] = list(self.waiting_for)
        data["decisions"] = [asdict(d) for d in self.decisions]
        data["last_start"] = dict(self.last_start)
        if self.cluster is not None:
            data["cluster"]["nodes"] = [asdict(node) for node in self.cluster.nodes]
        return {**extra, **data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StateRecord:
        """Read an object as written by any gb10d version: odd or missing fields become None."""
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        extra = {k: v for k, v in data.items() if k not in known}
        record: StateRecord = _RECORD.validate_python({k: v for k, v in data.items() if k in known})
        return record if not extra else replace(record, extra=extra)


def not_running_reason(state: StateRecord | None, alive: bool) -> str | None:
    """Why the daemon counts as not running, or None when it runs (its pid lives, no final state)."""
    if state is None:
        return "no state file"
    if not alive:
        return f"pid {state.pid} has exited" if state.pid is not None else "state file names no pid"
    if state.state is not None and state.state.final:
        return f"state is {state.state.value}"
    return None


_RECORD = TypeAdapter(StateRecord)
