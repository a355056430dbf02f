"""The starts in a pasted log, and the failure that ended the latest.

A new banner, a new `non-default args` line, a new API-server pid, an
argparse `usage:` line or gb10d's own `started vLLM` line begins a new
attempt once the current one has shown anything beyond its banner. Within
an attempt, what fails after a stop was asked for is the stop, and the most
telling failure explains the ones printed after it. Apart from the reading
(the paste's shapes) and the verdicts (the words for each failure): this is
the order of what vLLM printed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from ...base.levels import PRIORITY_ERR
from ...vllm import failures as failure_kinds
from ...vllm.events import (
    ArgsSeen,
    BadArgument,
    CudaOutOfMemory,
    DriverOutOfMemory,
    EngineDied,
    EngineStartFailed,
    Event,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    GpuXid,
    HiddenInitFailure,
    InternalPortInUse,
    IpcRemoved,
    KvCacheInsufficient,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    PtxasArchUnsupported,
    RdmaRegistrationFailed,
    ShutdownStarted,
    UnsupportedBuild,
    VersionSeen,
)
from ...vllm.kernel import xid_meaning
from ...vllm.logparse import Classifier, EventScanner, Kind
from .pasted import Line, line_times, logging_prefix

VLLM_DEFAULT_UTILIZATION = 0.92

_API_TAGS = ("APIServer", "MainProcess")
_START_WORDS = re.compile(r"^(?:vLLM (?:API )?server version|non-default args:|usage: vllm)|started vLLM as pid")
_ARGS_UTIL = re.compile(r"'gpu_memory_utilization': ([\d.]+)")
_ARGS_PORT = re.compile(r"'port': (\d+)")
_ARGS_MODEL = re.compile(r"'model(?:_tag)?': '([^']+)'")
_ARGS_MAX_LEN = re.compile(r"'max_model_len': (\d+)")
_GB10D_STALL = re.compile(r"no loading progress for (\d+) s")
# SIGKILL from outside, told by a shell, systemd or the kernel (on GB10 almost always the OOM killer).
_KILLED = re.compile(
    r"(?:^|: )Killed\s*$|\d+ Killed\s|^\[\d+\][+-]?\s+Killed\s|status=9/KILL|killed by the OOM killer"
    r"|Out of memory: Killed process"
)


@dataclass
class Attempt:
    """What one start printed, in order."""

    events: list[tuple[int, Event]] = field(default_factory=list)
    first_line: int = 0
    api_pid: int | None = None
    substantive: bool = False
    args: str = ""
    gb10d_stall: bool = False
    killed: bool = False
    error_at: int | None = None  # the last traceback or ERROR line

    @property
    def model(self) -> str | None:
        """The model as `non-default args` names it."""
        found = _ARGS_MODEL.search(self.args)
        return found.group(1) if found else None

    @property
    def port(self) -> int | None:
        """The API port as `non-default args` names it."""
        found = _ARGS_PORT.search(self.args)
        return int(found.group(1)) if found else None

    @property
    def max_model_len(self) -> int | None:
        """max_model_len as `non-default args` names it."""
        found = _ARGS_MAX_LEN.search(self.args)
        return int(found.group(1)) if found else None

    def utilization(self) -> float | None:
        """The start's gpu_memory_utilization: from `non-default args`, else vLLM's default where it has a fixed one."""
        found = _ARGS_UTIL.search(self.args)
        if found:
            return float(found.group(1))
        version = next((e.version for _, e in self.events if isinstance(e, VersionSeen)), "")
        # Not listed means the default: 0.92 up to 0.33; 0.34 resolves its own (extensible KV cache).
        if self.args and version and not version.startswith("0.34"):
            return VLLM_DEFAULT_UTILIZATION
        return None


def split_attempts(lines: list[Line]) -> tuple[list[Attempt], list[float | None], list[Event]]:
    """The attempts in `lines` in order, one time per line, and every event of the whole log."""
    prefix = logging_prefix(lines)
    classifier = Classifier(prefix)
    scanner = EventScanner(prefix, wrapped=True)
    attempts = [Attempt()]
    stamps: list[str | None] = []
    every: list[Event] = []
    for index, line in enumerate(lines):
        record = classifier.classify(line.text)
        stamps.append(record.ts)
        current = attempts[-1]
        message = record.message
        # The ASCII-logo banner's first line (the logo is drawn with full blocks).
        starts = _START_WORDS.search(message) is not None or (record.kind is Kind.VLLM and "\u2588" in message)
        new_api = record.tag in _API_TAGS and record.pid is not None and current.api_pid not in (None, record.pid)
        if (starts or new_api) and current.substantive:
            current = Attempt(first_line=index)
            attempts.append(current)
        if record.tag in _API_TAGS and record.pid is not None and current.api_pid is None:
            current.api_pid = record.pid
        if _GB10D_STALL.search(message):
            current.gb10d_stall = True
        if "ill" in message and _KILLED.search(message):
            current.killed = True
        if record.kind is Kind.TRACEBACK or (record.kind is Kind.VLLM and record.priority <= PRIORITY_ERR):
            current.error_at = index
        for event in scanner.feed_message(record.message):
            _add(current, index, event)
            every.append(event)
    for event in scanner.flush():
        _add(attempts[-1], len(lines) - 1, event)
        every.append(event)
    return attempts, line_times(lines, stamps), every


def _add(attempt: Attempt, index: int, event: Event) -> None:
    attempt.events.append((index, event))
    if isinstance(event, ArgsSeen):
        attempt.args = event.text
    elif not isinstance(event, VersionSeen):
        attempt.substantive = True


def _serious_xid(e: Failure) -> bool:
    return isinstance(e, GpuXid) and xid_meaning(e.xid).serious


def _declared(event: Failure) -> bool:
    """A failure of a kind that brings its own advice (`failures.FailureKind.advice`): it names its cause."""
    kind = failure_kinds.for_event(event)
    return kind is not None and bool(kind.advice)


# What decides the verdict when a start shows several failures, most telling first: the
# platform's own failures explain the vLLM errors they cause, a specific failure explains
# the wrappers printed after it, and vLLM 0.23's bare `Failed core proc(s): {}` counts only
# when nothing else was printed. A kind declared with its own advice names its cause. The
# driver's out-of-memory line is logged by healthy starts on GB10 too (driveroom.py): it
# explains an engine's death, never an error vLLM named itself.
_RANKS: tuple[Callable[[Failure], bool], ...] = (
    _serious_xid,
    lambda e: isinstance(e, UnsupportedBuild),
    lambda e: isinstance(e, PtxasArchUnsupported),
    lambda e: isinstance(e, RdmaRegistrationFailed),
    lambda e: isinstance(e, IpcRemoved) and e.confirmed,
    lambda e: isinstance(e, FreeMemoryShort),
    lambda e: isinstance(e, (KvCacheInsufficient, NoKvCacheMemory)),
    lambda e: isinstance(e, CudaOutOfMemory),
    lambda e: isinstance(e, (PortInUse, InternalPortInUse)),
    lambda e: isinstance(e, (ModelNotFound, ModelGated)),
    lambda e: isinstance(e, BadArgument),
    _declared,
    lambda e: isinstance(e, DriverOutOfMemory),
    lambda e: isinstance(e, EngineDied),
    lambda e: isinstance(e, (IpcRemoved, GpuXid)),
    lambda e: isinstance(e, ExceptionRaised) or (isinstance(e, EngineStartFailed) and not isinstance(e, HiddenInitFailure)),
    lambda e: isinstance(e, HiddenInitFailure),
)
# Exceptions that mean someone stopped vLLM, not that it broke.
STOP_EXCEPTIONS = ("KeyboardInterrupt", "SystemExit", "CancelledError")


def _generic(event: Failure) -> bool:
    """A failure that wraps or hints at another rather than naming a cause of its own."""
    return (isinstance(event, (ExceptionRaised, EngineStartFailed, EngineDied, DriverOutOfMemory))
            or (isinstance(event, IpcRemoved) and not event.confirmed) or (isinstance(event, GpuXid) and not _serious_xid(event)))


def _passing(event: Failure) -> bool:
    """A failure line a start can go on after (a caught exception's traceback, a warning): it ends nothing by itself."""
    return (isinstance(event, (ExceptionRaised, DriverOutOfMemory)) or (isinstance(event, IpcRemoved) and not event.confirmed)
            or (isinstance(event, GpuXid) and not _serious_xid(event)))


def deciding_failure(attempt: Attempt, progress_index: int | None) -> Failure | None:
    """The failure that ended the start, or None.

    What fails after a stop was asked for (the engine "exiting unexpectedly"
    on SIGTERM, KeyboardInterrupt tracebacks) is the stop, not a fault; a
    generic error the start went on after did not end it. A paste of errors
    alone (no startup lines) gets the verdict of the last failure that names
    a cause; otherwise the most telling failure of the start decides.
    """
    stop_at = stop_index(attempt)
    failures = [
        (i, e) for i, e in attempt.events
        if isinstance(e, Failure) and (stop_at is None or i < stop_at)
        and not (isinstance(e, ExceptionRaised) and e.exc_type.split(".")[-1] in STOP_EXCEPTIONS)
        and not (_passing(e) and progress_index is not None and progress_index >= i)
    ]
    if progress_index is None:
        specific = [e for _, e in failures if not _generic(e)]
        if specific:
            return specific[-1]
    for rank in _RANKS:
        found = [e for _, e in failures if rank(e)]
        if found:
            return _best(found)
    return None


def stop_index(attempt: Attempt) -> int | None:
    """Where someone asked vLLM to stop (a shutdown line, or a KeyboardInterrupt or SystemExit), if anywhere."""
    return next((i for i, e in attempt.events if isinstance(e, ShutdownStarted)
                 or (isinstance(e, ExceptionRaised) and e.exc_type.split(".")[-1] in STOP_EXCEPTIONS)), None)


def _best(found: list[Failure]) -> Failure:
    """The most informative of several events of one kind (a joined message has the numbers)."""
    def score(event: Failure) -> int:
        return sum(value not in (None, "", False) for value in vars(event).values())
    return max(reversed(found), key=score)
