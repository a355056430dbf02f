"""The state file: the daemon's current state as one JSON object, for `gb10d status`.

The Reporter rewrites it on every change; readers may look at any moment,
so a write either fully replaces the previous file or leaves it untouched,
never a half-written one. It lives under the runtime directory
(/run/gb10d/state.json by default), so it disappears at reboot with the
daemon it describes.

`StateRecord` is its one schema, shared by the writer (the Reporter) and
the reader (`gb10d status`). Reading is tolerant: a field
that is missing or of another type (a file from another gb10d version) is
left out, never a reason to fail. Times are Unix seconds. Writing and
reading the file is `gb10d.machine.statefile`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

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


@dataclass(frozen=True)
class Progress:
    shards_done: int
    shards_total: int


@dataclass(frozen=True)
class Memory:
    """/proc/meminfo as it was when the attempt started, in bytes."""

    total_bytes: int
    available_bytes: int
    free_bytes: int
    cached_bytes: int


@dataclass(frozen=True)
class LastFailure:
    cause: str
    message: str
    action: str
    at: float


@dataclass(frozen=True)
class Decision:
    """One of the daemon's recent journal decisions (`Reporter.say`), for the front's page."""

    at: float
    priority: int
    event: str  # the journal's GB10D_EVENT
    message: str


# The state file keeps this many of the latest decisions.
DECISIONS_KEPT = 50


@dataclass(frozen=True)
class NodeRecord:
    """A machine of the pair's Ray cluster that is up with a GPU."""

    ip: str
    head: bool
    gpus: float


@dataclass(frozen=True)
class ClusterRecord:
    """This machine's part in a pair, and what the head's node table lists."""

    role: str
    head_address: str
    node_ip: str = ""
    interface: str = ""
    nodes_wanted: int | None = None
    error: str | None = None
    nodes: tuple[NodeRecord, ...] = ()


@dataclass(frozen=True)
class StateRecord:
    """Everything `gb10d status` shows; None where it does not apply or is not known."""

    pid: int | None = None
    started_at: float | None = None
    updated_at: float | None = None
    state: DaemonState | None = None
    phase: str | None = None
    progress: Progress | None = None
    model: str | None = None
    served_names: tuple[str, ...] = ()
    url: str | None = None
    attempt: int | None = None
    max_attempts: int | None = None
    gpu_memory_utilization: float | None = None
    load_strategy: str | None = None
    memory: Memory | None = None
    memory_at: float | None = None  # when `memory` was measured (wall clock)
    vllm_pid: int | None = None
    ready_at: float | None = None
    last_failure: LastFailure | None = None
    status_text: str | None = None
    metrics_url: str | None = None
    cluster: ClusterRecord | None = None
    host: str | None = None  # kernel, NVIDIA driver, CMA figures
    instance: str | None = None  # the name in the machine's memory ledger
    reservation_bytes: int | None = None  # this instance's share in it
    waiting_for: tuple[str, ...] = ()  # while waiting for memory: the instances waited for, with their shares
    # vLLM from a container image: the reference, the image it named when started (registry digest, else local id),
    # and the container's name and engine.
    image: str | None = None
    image_digest: str | None = None
    container: str | None = None
    engine: str | None = None
    # The latest decisions the daemon's journal told (at most DECISIONS_KEPT, oldest first).
    decisions: tuple[Decision, ...] = ()
    # Seconds per phase of the last complete start of this config (the learned file), for the time-left estimate.
    last_start: Mapping[str, float] = field(default_factory=dict)
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
        state = _text(data, "state")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        return cls(
            pid=_int(data, "pid"),
            started_at=_num(data, "started_at"),
            updated_at=_num(data, "updated_at"),
            state=DaemonState(state) if state in DaemonState._value2member_map_ else None,
            phase=_text(data, "phase"),
            progress=_record(Progress, data.get("progress"), shards_done=_int, shards_total=_int),
            model=_text(data, "model"),
            served_names=_texts(data, "served_names"),
            url=_text(data, "url"),
            attempt=_int(data, "attempt"),
            max_attempts=_int(data, "max_attempts"),
            gpu_memory_utilization=_num(data, "gpu_memory_utilization"),
            load_strategy=_text(data, "load_strategy"),
            memory=_record(Memory, data.get("memory"), total_bytes=_int, available_bytes=_int, free_bytes=_int, cached_bytes=_int),
            memory_at=_num(data, "memory_at"),
            vllm_pid=_int(data, "vllm_pid"),
            ready_at=_num(data, "ready_at"),
            last_failure=_record(LastFailure, data.get("last_failure"), cause=_text, message=_text, action=_text, at=_num),
            status_text=_text(data, "status_text"),
            metrics_url=_text(data, "metrics_url"),
            cluster=_cluster(data.get("cluster")),
            host=_text(data, "host"),
            instance=_text(data, "instance"),
            reservation_bytes=_int(data, "reservation_bytes"),
            waiting_for=_texts(data, "waiting_for"),
            image=_text(data, "image"),
            image_digest=_text(data, "image_digest"),
            container=_text(data, "container"),
            engine=_text(data, "engine"),
            decisions=_decisions(data.get("decisions")),
            last_start=_seconds(data.get("last_start")),
            extra={k: v for k, v in data.items() if k not in known},
        )


def not_running_reason(state: StateRecord | None, alive: bool) -> str | None:
    """Why the daemon counts as not running, or None when it runs (its pid lives, no final state)."""
    if state is None:
        return "no state file"
    if not alive:
        return f"pid {state.pid} has exited" if state.pid is not None else "state file names no pid"
    if state.state is not None and state.state.final:
        return f"state is {state.state.value}"
    return None


def _num(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) and value else None


def _texts(data: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = data.get(key)
    return tuple(n for n in value if isinstance(n, str)) if isinstance(value, list) else ()


def _record(kind: Any, value: Any, **readers: Any) -> Any:
    """`kind(**fields)` when `value` is an object whose every field reads; else None."""
    if not isinstance(value, Mapping):
        return None
    fields = {name: read(value, name) for name, read in readers.items()}
    return None if any(v is None for v in fields.values()) else kind(**fields)


def _decisions(value: Any) -> tuple[Decision, ...]:
    listed = value if isinstance(value, list) else []
    read = (_record(Decision, d, at=_num, priority=_int, event=_text, message=_text) for d in listed)
    return tuple(d for d in read if d is not None)


def _seconds(value: Any) -> dict[str, float]:
    if not isinstance(value, Mapping):
        return {}
    return {k: float(v) for k, v in value.items() if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _cluster(value: Any) -> ClusterRecord | None:
    if not isinstance(value, Mapping) or _text(value, "role") is None:
        return None
    listed = value.get("nodes")
    nodes = tuple(
        NodeRecord(ip, n.get("head") is True, _num(n, "gpus") or 0.0)
        for n in (listed if isinstance(listed, list) else [])
        if isinstance(n, Mapping) and (ip := _text(n, "ip")) is not None
    )
    return ClusterRecord(
        role=str(_text(value, "role")),
        head_address=_text(value, "head_address") or "",
        node_ip=_text(value, "node_ip") or "",
        interface=_text(value, "interface") or "",
        nodes_wanted=_int(value, "nodes_wanted"),
        error=_text(value, "error"),
        nodes=nodes,
    )
