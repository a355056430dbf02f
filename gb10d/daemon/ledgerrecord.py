"""This instance's record in the machine's memory ledger, as the daemon's situation moves.

What the other gb10d instances of the machine see of this one follows the
`Reporter` as the state file does: the phase of its start, its progress
(every EXTEND_TIMEOUT_USEC), serving (its memory in /proc/meminfo from
then on), asleep, parked, and restarting once vLLM is gone; the gauges of
its reservation follow the record. The admission itself is the
preflight's. Without a ledger (or before the daemon knows it runs vLLM)
every method does nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..core.budget import Stage
from ..core.statefile import DaemonState
from ..machine.ledger import Booking
from ..machine.memory import read_meminfo
from .metrics import Metrics


class LedgerRecord:
    """Keeps this instance's `Booking` in step with its starts, and the reservation's metrics with the record."""

    def __init__(self, metrics: Metrics, waiting: Callable[[], bool]) -> None:
        self._metrics = metrics
        self._waiting = waiting  # whether the start waits for other instances' starts (gb10d_memory_waiting)
        self.booking: Booking | None = None
        self._phase = ""

    def booked(self, booking: Booking | None) -> None:
        """vLLM runs here, with this record: it follows the starts from now on."""
        self.booking = booking

    def progressed(self) -> None:
        """A sign of progress: instances that wait for this one see it too."""
        if self.booking is not None:
            self.booking.progressed()

    def phase(self, phase: str) -> None:
        """The start is in `phase` (written only when it changes)."""
        if self.booking is not None and phase != self._phase:
            self._phase = phase
            self.booking.update(phase=phase)

    def serving(self, available_before: int | None, meminfo_path: Path) -> None:
        """vLLM serves: its memory shows in /proc/meminfo from now on; others stop counting its reservation."""
        if self.booking is not None:
            self.booking.serving(available_before, self._available_now(meminfo_path))
            self.metrics()

    def sleep_state(self, state: DaemonState, text: str) -> None:
        """Asleep, waking or serving again. A wake reserves its share until it is checked: another instance's start
        or wake must not count on the memory it is taking back, which /proc/meminfo shows only bit by bit."""
        if self.booking is not None:
            stage = {DaemonState.ASLEEP: Stage.ASLEEP, DaemonState.WAKING: Stage.WAKING}.get(state, Stage.SERVING)
            phase = "" if state is DaemonState.SERVING else text.partition(";")[0].removeprefix(f"{stage.value}: ")
            self.booking.update(stage=stage, phase=phase)

    def parked(self, utilization: float, share: int) -> None:
        """vLLM is stopped until the front asks for it: the record reserves nothing, and says what a start would need."""
        if self.booking is not None:
            self.booking.parked(utilization, share)
            self.metrics()

    def restarting(self) -> None:
        """vLLM is gone but its share stays reserved until the next start (or the end of gb10d)."""
        if self.booking is not None:
            self._phase = ""
            self.booking.update(stage=Stage.RESTARTING, phase="")

    def metrics(self) -> None:
        """The reservation as the record holds it now (gb10d_reservation_bytes and the rest)."""
        record = self.booking.record if self.booking else None
        if record is not None:
            self._metrics.set_reservation(record.name, record.bytes, record.real_use, self._waiting())

    def _available_now(self, meminfo_path: Path) -> int | None:
        """MemAvailable now, for what the start used; None when it cannot be read (the preflight said so already)."""
        try:
            mem = read_meminfo(meminfo_path)
        except (OSError, ValueError):
            return None
        self._metrics.set_memory(mem.total, mem.available, mem.free, mem.cached)
        return mem.available
