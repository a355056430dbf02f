"""The state file, rewritten as the daemon's situation changes.

Each change is written at once, except the steps of a start within a phase
(shards loaded), which are written at most once every WRITE_EVERY_S (each
write fsyncs), the latest one always last; decisions said between two
changes reach the file within WRITE_EVERY_S, a burst of them in one write.
A file that cannot be written is said once and tried again every
STATE_RETRY_S until it can: the front and `gb10d status` read it, and a
state that changed while it could not be written (ready, say) may not
change again for days.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Protocol

from ..base.levels import PRIORITY_INFO, PRIORITY_WARNING
from ..core.phases import Phase
from ..core.statefile import WRITE_EVERY_S, StateRecord, write_delay
from ..machine.statefile import write_state

# How often a state file that could not be written is tried again.
STATE_RETRY_S = 1.0


class Say(Protocol):
    def __call__(self, kind: str, message: str, priority: int = ..., **fields: object) -> None: ...


class StateWriter:
    """Writes `record()` to `path()`: now, throttled for a start's steps, soon for decisions, again after a failure."""

    def __init__(self, path: Callable[[], Path], record: Callable[[], StateRecord], say: Say) -> None:
        self._path = path  # asked at each write: a reload may move the file
        self._record = record
        self._say = say
        self._written_phase: Phase | None = None
        self._written_at = 0.0
        self._deferred: asyncio.TimerHandle | None = None
        self._decisions_write: asyncio.TimerHandle | None = None
        self._warned = False
        self._retry: asyncio.TimerHandle | None = None

    def write(self) -> None:
        """Rewrite the state file now; a failure to write is said once, never raised, and tried again."""
        path = self._path()
        try:
            write_state(path, self._record())
        except OSError as exc:
            if not self._warned:
                self._warned = True
                self._say(
                    "state_file_unwritable",
                    f"cannot write the state file {path}: {exc.strerror or exc}; gb10d status and the front see an old "
                    f"state until it can be written (trying again every {STATE_RETRY_S:g} s; set daemon.state_file)",
                    PRIORITY_WARNING,
                )
            self._write_later()
            return
        if self._warned:
            self._warned = False
            self._say("state_file_unwritable", f"wrote the state file {path} again", PRIORITY_INFO)

    def new_start(self) -> None:
        """A new start's first phase is written at once."""
        self.cancel_deferred()
        self._written_phase = None

    def phase(self, phase: Phase, now: float, again: Callable[[], None]) -> None:
        """The start moved within `phase` (monotonic `now`): written now, or `again` is called once it may be."""
        self.cancel_deferred()
        wait = write_delay(phase is not self._written_phase, now - self._written_at)
        if wait <= 0:
            self._written_phase, self._written_at = phase, now
            self.write()
        else:
            self._deferred = asyncio.get_running_loop().call_later(wait, again)

    def soon(self) -> None:
        """A decision said between two writes of the state file reaches it within WRITE_EVERY_S (one write for a
        burst of them), so that the front's page shows it without waiting for the next change of state."""
        if self._decisions_write is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # said outside the event loop (at the end of gb10d): the last write carries it
        self._decisions_write = loop.call_later(WRITE_EVERY_S, self._write_decisions)

    def cancel_deferred(self) -> None:
        """A later change is written in its own right: a start's step held back must not overwrite it."""
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None

    def close(self) -> None:
        self.cancel_deferred()
        if self._decisions_write is not None:
            self._decisions_write.cancel()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def _write_decisions(self) -> None:
        self._decisions_write = None
        self.write()

    def _write_later(self) -> None:
        if self._retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not supervising (a give-up on the way out): the next start writes it
        self._retry = loop.call_later(STATE_RETRY_S, self._write_again)

    def _write_again(self) -> None:
        self._retry = None
        self.write()
