"""What the supervisor loop is told: every fact that reaches it through its one queue.

Signal handlers, the config watcher, the pipe readers, the child's exit, the
probes and the Ray cluster watcher each report past-tense facts; nothing
but the loop acts on them. A fact about an attempt carries the attempt's
*serial*, never its budget number (the budget restarts at 1 after vLLM
served a good while), so a dead attempt's late fact is never taken for its
successor's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from ..base.image import PullProgress
from ..vllm.events import DriverOutOfMemory, Event, GpuXid
from .cluster import View

REFUSED = "connection refused"
# vLLM's 503 for a request its admission limits refuse (--max-num-queued-reqs, --max-num-queued-tokens): busy, not dead.
ADMISSION_REFUSED = "refused by vLLM's request queue limit"


@dataclass(frozen=True)
class ProbeResult:
    """What one HTTP probe of vLLM saw: a status (None if no answer), why, how long it took."""

    status: int | None
    reason: str
    seconds: float
    models: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def refused(self) -> bool:
        return self.status is None and self.reason == REFUSED


# --- daemon-wide facts ---------------------------------------------------------


@dataclass(frozen=True)
class Stop:
    """SIGTERM or SIGINT arrived."""

    signame: str


@dataclass(frozen=True)
class Reload:
    """SIGHUP arrived (systemctl reload)."""


@dataclass(frozen=True)
class Edited:
    """The config file or a drop-in changed on disk (a burst of writes, debounced)."""


@dataclass(frozen=True)
class ParkAsked:
    """The front asked, over the control socket, to park the idle instance (on_demand.park = "sleep")."""


@dataclass(frozen=True)
class WakeAsked:
    """The front asked, over the control socket, to wake the parked instance for a request."""


@dataclass(frozen=True)
class RestartAsked:
    """The operator asked, over the control socket (the front's page), to restart vLLM: a new start, not a failure."""


@dataclass(frozen=True)
class SleptUnasked:
    """The liveness watch of attempt `attempt` found vLLM asleep without gb10d having asked it to sleep: wake it."""

    attempt: int


@dataclass(frozen=True)
class KernelSaid:
    """The kernel logged a message of the NVIDIA driver's: it ran out of memory, or an Xid error."""

    event: DriverOutOfMemory | GpuXid


@dataclass(frozen=True)
class ClusterSeen:
    """The Ray cluster's node table changed, or cannot be read."""

    view: View


# --- facts about one attempt -----------------------------------------------------


@dataclass(frozen=True)
class Parsed:
    """A fact parsed from vLLM's output."""

    attempt: int
    event: Event


@dataclass(frozen=True)
class DriverLine:
    """The NVIDIA driver's out-of-memory line while an attempt runs, with MemAvailable in bytes read when it came
    (None: unreadable)."""

    attempt: int
    event: DriverOutOfMemory
    mem_available: int | None = None


@dataclass(frozen=True)
class ExitSeen:
    """vLLM's main process exited; its last words may still be in the pipes."""

    attempt: int
    status: int


@dataclass(frozen=True)
class Exited:
    """vLLM's output is read to the end after its exit (or given up on: an orphan may hold the pipes)."""

    attempt: int
    status: int


class ProbeKind(enum.Enum):
    HEALTHY = "healthy"  # /health answered 200 before ready: start the readiness checks
    WARMING = "warming"  # /health and /v1/models passed; the warm-up completion is running
    READY = "ready"  # every readiness check passed
    NOT_READY = "not_ready"  # a readiness check failed for a reason no wait can fix
    WRONG_NAME = "wrong_name"  # /v1/models does not list the served name clients use
    DEAD = "dead"  # while serving: /health 503, or nothing listens any more
    HUNG = "hung"  # while serving: the engine answers /health but generates nothing
    ASLEEP = "asleep"  # while serving: vLLM sleeps, and gb10d did not put it to sleep


@dataclass(frozen=True)
class Probed:
    """An HTTP probe's conclusion; `label` is a liveness verdict's metrics label (hung, probe_timeout, health)."""

    attempt: int
    kind: ProbeKind
    detail: str = ""
    label: str = ""


@dataclass(frozen=True)
class Pulled:
    """The pull of the container image moved (a layer's bytes, a layer done); before the start it belongs to."""

    attempt: int
    progress: PullProgress


@dataclass(frozen=True)
class PullEnded:
    """The image is there (pulled, or present already), or the pull failed: the fetch's task is done."""

    attempt: int


@dataclass(frozen=True)
class Tick:
    """A deadline of the attempt passed; `io_bytes` is vLLM's I/O total sampled just now (None: unreadable)."""

    io_bytes: int | None


Fact = Union[Stop, Reload, Edited, ParkAsked, WakeAsked, RestartAsked, SleptUnasked, KernelSaid, ClusterSeen, Parsed, DriverLine, ExitSeen, Exited, Probed, Pulled, PullEnded]
AttemptFact = Union[Parsed, DriverLine, ExitSeen, Exited, Probed, Pulled, Tick]
