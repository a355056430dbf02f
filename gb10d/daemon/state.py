"""The daemon's situation: what it is doing and what it has seen, as `gb10d status`, the front and STATUS= show it.

One object holds it, and only its own named methods change it (`began_attempt`,
`became_ready`, `attempt_ended`, ...): the `Reporter` owns it, calls those
methods as things happen, and then has the journal, STATUS=, the metrics, the
ledger and the state file follow. Nothing else assigns to it; the rest of the
daemon reads it (`state`, `ready_at`, `doing()`) or tells the Reporter.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import replace

from ..base.command import Tunables
from ..base.config import Config, VllmSection
from ..base.image import PreparedImage
from ..core.eta import PhaseClock, estimate
from ..core.memory import MemInfo
from ..core.phases import Phase, StartupState
from ..core.statefile import DECISIONS_KEPT, ClusterRecord, DaemonState, Decision, LastFailure, Memory, Progress, StateRecord
from ..machine.ledger import Booking

# The states in which a vLLM of this instance has served and runs, awake or asleep (or is being parked by sleep).
SERVES = frozenset({DaemonState.SERVING, DaemonState.PARKING, DaemonState.ASLEEP, DaemonState.WAKING})


class Situation:
    """What the daemon is doing (`state`), the attempt in progress, and what it has seen; `record()` is all of it."""

    def __init__(self) -> None:
        self._state = DaemonState.STARTING
        self._started_at = time.time()
        self._ready_at: float | None = None
        self._last_failure: LastFailure | None = None
        self._cluster: ClusterRecord | None = None
        self._host: str | None = None  # this machine's kernel, driver and CMA, for `gb10d status`
        self._waiting_for: tuple[str, ...] = ()  # while the start waits for other instances: who, with their shares
        self._image: PreparedImage | None = None  # the container image the current starts run, for `gb10d status`
        self._status_text = ""
        # The attempt in progress (number 0 and None between attempts).
        self._number = 0
        self._startup: StartupState | None = None
        self._tunables: Tunables | None = None
        self._pid: int | None = None
        self._baseline: MemInfo | None = None
        self._baseline_at: float | None = None
        # Seconds per phase of this config's last complete start (the keeper loads them), and this start's so far.
        self._last_start: dict[str, float] = {}
        self._clock = PhaseClock()
        self._attempt_began = time.monotonic()
        # The latest decisions, written with the state file for the front's page.
        self._decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)

    # --- what the rest of the daemon reads ------------------------------------------

    @property
    def state(self) -> DaemonState:
        return self._state

    @property
    def ready_at(self) -> float | None:
        return self._ready_at

    @property
    def status_text(self) -> str:
        return self._status_text

    @property
    def tunables(self) -> Tunables | None:
        return self._tunables

    @property
    def baseline(self) -> MemInfo | None:
        return self._baseline

    @property
    def waiting(self) -> bool:
        """Whether the start waits for other instances' starts."""
        return bool(self._waiting_for)

    def phase_seconds(self, now: float) -> dict[str, float]:
        """Each phase's seconds in the start that just reached ready (monotonic `now`)."""
        return self._clock.until(now)

    def doing(self) -> str:
        """What the daemon is doing between attempts, for `received SIGTERM while ...; stopping`."""
        if self._startup is not None and self._startup.phase is Phase.PULLING:
            return "pulling the image"
        return {
            DaemonState.WAITING: "waiting for the Ray cluster",
            DaemonState.JOINING: "waiting to join the Ray cluster",
            DaemonState.WAITING_FOR_MEMORY: "waiting for memory",
            DaemonState.SERVING: "serving",
            DaemonState.PARKED: "parked",
        }.get(self._state, "waiting to restart")

    def serving_text(self, v: VllmSection) -> str:
        """The STATUS= line while vLLM serves."""
        utilization = self._tunables.gpu_memory_utilization if self._tunables else v.gpu_memory_utilization
        return f"serving {v.served_names[0]} on {v.host}:{v.port} (attempt {self._number}, gpu_memory_utilization={utilization:g})"

    # --- how it changes ----------------------------------------------------------------

    def enter(self, state: DaemonState) -> bool:
        """The daemon is in `state` now; True when it no longer serves: the phase and progress of the start that
        served are history then, and the state file must not show them as the current start's (a hold reason
        `restarting: ready 4/4`)."""
        left = self._state in SERVES and state not in SERVES
        if left:
            self._startup = None
        self._state = state
        return left

    def says(self, text: str) -> None:
        """STATUS= and the state file say `text` from now on."""
        self._status_text = text

    def decided(self, decision: Decision) -> None:
        self._decisions.append(decision)

    def failed(self, cause: str, message: str, action: str) -> None:
        """The latest failure, for `gb10d status` (shown until the next one)."""
        self._last_failure = LastFailure(cause, message, action, time.time())

    def host_known(self, summary: str) -> None:
        self._host = summary

    def runs_image(self, image: PreparedImage | None) -> None:
        self._image = image

    def cluster_seen(self, cluster: ClusterRecord) -> None:
        self._cluster = cluster

    def waits_for(self, shares: tuple[str, ...]) -> None:
        """The start waits for these instances' starts (each with its share); () once admitted."""
        self._waiting_for = shares

    def start_times(self, phases: dict[str, float]) -> None:
        """The seconds per phase of this config's last complete start, for the next start's estimate."""
        self._last_start = phases

    def began_attempt(self, number: int, tunables: Tunables, pid: int, baseline: MemInfo | None) -> None:
        self._number, self._tunables, self._pid, self._baseline = number, tunables, pid, baseline
        self._baseline_at = time.time() if baseline is not None else None
        self._clock, self._attempt_began = PhaseClock(), time.monotonic()
        self._startup = None  # this start's phases are its own
        self._state = DaemonState.STARTING if number == 1 else DaemonState.RESTARTING

    def moved(self, startup: StartupState, text: str, now: float) -> str:
        """The start is in `startup` at monotonic `now`; STATUS= says `text` with the estimate of what is left,
        which this returns."""
        self._clock = self._clock.moved(startup.phase.value, startup.phase_since if startup.phase_since is not None else now)
        progress = (startup.shards_done, startup.shards_total) if startup.phase is Phase.LOADING_WEIGHTS and startup.shards_total else None
        shown = f"{text}; {estimate(self._last_start, startup.phase.value, progress, now - self._attempt_began)}"
        self._startup, self._status_text = startup, shown
        return shown

    def became_ready(self, startup: StartupState, vllm: VllmSection) -> None:
        self._startup = startup
        self._state, self._ready_at = DaemonState.SERVING, time.time()
        self._status_text = self.serving_text(vllm)

    def joined(self, text: str) -> None:
        """The worker of a pair is part of the cluster."""
        self._state, self._ready_at, self._status_text = DaemonState.SERVING, time.time(), text

    def left_cluster(self) -> None:
        """The worker of a pair is no longer listed by the head: it waits to join again."""
        self._state, self._ready_at = DaemonState.JOINING, None

    def parked(self, text: str) -> None:
        self._state, self._status_text = DaemonState.PARKED, text

    def attempt_ended(self) -> None:
        """Nothing of the attempt is ready or up any more, and none of its phases is shown."""
        if self._state in SERVES and self._state is not DaemonState.PARKING:  # parking by stop ends parked, not restarting
            self.enter(DaemonState.RESTARTING)
        self._number, self._startup, self._tunables, self._pid, self._baseline = 0, None, None, None, None
        self._ready_at = None

    def stopping(self) -> None:
        self._state, self._status_text = DaemonState.STOPPING, "stopping"

    def stopped(self) -> None:
        self._state, self._status_text = DaemonState.STOPPED, "stopped"

    # --- the state file's record -------------------------------------------------------

    def record(self, config: Config, booking: Booking | None) -> StateRecord:
        """Everything `gb10d status` shows, as of now."""
        v = config.vllm
        startup, tunables, mem, image = self._startup, self._tunables, self._baseline, self._image
        running = self._number > 0
        record = StateRecord(
            pid=os.getpid(),
            started_at=self._started_at,
            updated_at=time.time(),
            state=self._state,
            phase=startup.phase.value if startup else None,  # between starts, no start has a phase
            progress=Progress(startup.shards_done, startup.shards_total) if startup and startup.shards_total else None,
            model=v.model,
            served_names=tuple(v.served_names),
            url=f"http://{v.host}:{v.port}",
            attempt=self._number,
            max_attempts=config.restart.max_attempts,
            gpu_memory_utilization=tunables.gpu_memory_utilization if tunables else v.gpu_memory_utilization,
            load_strategy=tunables.load_strategy if tunables else None,
            memory=Memory(mem.total, mem.available, mem.free, mem.cached) if mem else None,
            memory_at=self._baseline_at if mem else None,
            vllm_pid=self._pid,
            ready_at=self._ready_at if running else None,
            last_failure=self._last_failure,
            status_text=self._status_text,
            metrics_url=f"http://{config.metrics.listen}/metrics" if config.metrics.listen else None,
            cluster=self._cluster,
            host=self._host,
            instance=booking.name if booking else None,
            reservation_bytes=booking.record.bytes if booking and booking.record else None,
            waiting_for=self._waiting_for,
            image=image.info.reference if image else None,
            image_digest=image.info.identity if image else None,
            container=image.container or None if image else None,
            engine=image.engine or None if image else None,
            decisions=tuple(self._decisions),
            last_start=self._last_start,
        )
        if self._cluster is not None and self._cluster.role == "worker":
            # vLLM and its API run on the head: here there is only Ray, ready once joined.
            record = replace(record, ready_at=self._ready_at, url=None, phase=None, attempt=None, gpu_memory_utilization=None)
        return record
