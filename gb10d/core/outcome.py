"""How an attempt ended: failed with a cause, reloaded, a machine of the pair lost, or stopped.

Only a failure is vLLM's fault and spends the restart budget; the other
endings are the operator's doing (a reload, a stop) or the cluster's (a
machine left), and each leads the supervisor somewhere else. They are
different types so that no code can mistake one for a failure.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Union

from ..vllm.events import Failure
from ..vllm.failures import Cause as Cause  # the causes are the failure kinds, declared once there
from ..vllm.failures import FailureKind


@dataclass(frozen=True)
class Failed:
    """vLLM failed: it exited, stalled, timed out, or its engine died or hung."""

    cause: FailureKind  # one of `Cause`, the failure kinds
    failure: Failure | None = None
    exit_status: int | None = None
    was_ready: bool = False
    detail: str = ""
    served_s: float = 0.0  # how long it served before it failed (0 if it never became ready)


@dataclass(frozen=True)
class Reloaded:
    """The operator changed what vLLM runs with; vLLM was stopped to start with the new settings."""

    changes: str


@dataclass(frozen=True)
class WakeFailed:
    """A wake from sleep could not be trusted (no memory for it, or its check generation failed); vLLM was stopped
    to start cold."""

    why: str


@dataclass(frozen=True)
class Parked:
    """The front asked to park an instance that parks by stop (on_demand.park = "stop"); vLLM was stopped cleanly,
    which is no failure: gb10d waits parked until the front asks for it again."""

    serving_s: float


@dataclass(frozen=True)
class NodeLost:
    """A machine of the Ray pair left; not vLLM's failure, so it starts again uncounted once the cluster is whole."""

    why: str
    was_ready: bool = False


@dataclass(frozen=True)
class Stopped:
    """A stop signal came; the supervisor runs its stop ladder and exits."""

    signame: str


Ended = Union[Failed, Reloaded, WakeFailed, Parked, NodeLost, Stopped]


def describe_exit(status: int | None) -> str:
    """`exited with status 1` / `was killed by SIGKILL (out of memory? ...)`, for the journal."""
    if status is None:
        return "is still running"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        hint = " (out of memory? see journalctl -k)" if -status == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {status}"
