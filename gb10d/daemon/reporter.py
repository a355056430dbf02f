"""What gb10d tells the world, from one place: journal decision lines, STATUS=, metrics and the state file.

Everything observable about the daemon goes through a `Reporter`, so the
four views can never disagree for long, and their order is decided here
once: when vLLM becomes ready, the state file, the metrics and the journal
say so before READY=1 goes out, so `systemctl start gb10d && gb10d status`
and a scrape right after READY both see "ready". The state file is
rewritten on every change, shard steps at most once a second (each write
fsyncs), the latest one always last. What the other gb10d instances of the
machine see of this one, its record in the memory ledger, follows the same
way: its phase, its progress (every EXTEND_TIMEOUT_USEC), serving, and
restarting once vLLM is gone; the admission itself is the preflight's.
"""

from __future__ import annotations

import asyncio
from collections import deque
import os
import time
from dataclasses import replace

from ..core import advice
from .alerting import AlertSender
from ..core.budget import Stage, Wait
from ..base.command import Tunables, read_env_file
from ..base.config import Config
from ..base.errors import ConfigError
from ..vllm.events import DriverOutOfMemory, Event, GpuXid
from ..base.image import PreparedImage
from ..machine.journal import Journal
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..core.lifecycle import Action, DriverOomSeen, Extend, LivenessFailed, Observe, Say, ShowPhase, XidSeen, kernel_said
from ..machine.ledger import Booking
from ..core.memory import MemInfo
from ..machine.memory import read_meminfo
from .metrics import Metrics
from ..machine.notify import Notifier
from ..core.eta import PhaseClock, estimate
from ..core.phases import Phase, StartupState
from ..core.statefile import DECISIONS_KEPT, ClusterRecord, DaemonState, Decision, LastFailure, Memory, Progress, StateRecord, WRITE_EVERY_S, write_delay
from ..machine.statefile import write_state

# sd_notify's STATUS= is one line that `systemctl status` shows; longer texts only clutter it.
STATUS_MAX = 200
# How often a state file that could not be written is tried again.
STATE_RETRY_S = 1.0
# How long queued alerts get to go out when gb10d exits (a give-up's alert is sent then).
ALERTS_CLOSE_S = 10.0
# The states in which a vLLM of this instance has served and runs, awake or asleep (or is being parked by sleep).
SERVES = frozenset({DaemonState.SERVING, DaemonState.PARKING, DaemonState.ASLEEP, DaemonState.WAKING})


class Reporter:
    """The single writer of gb10d's journal decisions, STATUS=, metrics and state file.

    Callers tell it what happened, in their words (`restarting`, `woke`, `vllm_down`), and it knows which of the
    four outlets hear of it. `journal` stays public for one use: vLLM's and Ray's own output, forwarded line by line.
    """

    def __init__(self, config: Config, journal: Journal, notifier: Notifier, metrics: Metrics) -> None:
        self.config = config
        self.journal = journal
        self.notifier = notifier
        self.metrics = metrics
        self.state = DaemonState.STARTING
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.last_failure: LastFailure | None = None
        self.cluster: ClusterRecord | None = None
        self.host: str | None = None  # this machine's kernel, driver and CMA, for `gb10d status`
        self.booking: Booking | None = None  # this instance's record in the machine's memory ledger, if there is one
        self.waiting_for: tuple[str, ...] = ()  # while the start waits for other instances: who, with their shares
        self.image: PreparedImage | None = None  # the container image the current starts run, for `gb10d status`
        self.status_text = ""
        # What the state file shows of the attempt in progress (None between attempts).
        self._number = 0
        self._startup: StartupState | None = None
        self._tunables: Tunables | None = None
        self._pid: int | None = None
        self._baseline: MemInfo | None = None
        self._baseline_at: float | None = None
        self._written_phase: Phase | None = None
        self._written_at = 0.0
        self._deferred: asyncio.TimerHandle | None = None
        self._state_warned = False
        self._state_retry: asyncio.TimerHandle | None = None
        self.alerts = AlertSender(config.alerts, config.vllm.served_names[0], self._alert_environment, self._alert_dropped)
        self._booked_phase = ""
        # Seconds per phase of this config's last complete start (the keeper loads them), and this start's so far.
        self.last_start: dict[str, float] = {}
        self._clock = PhaseClock()
        self._attempt_began = time.monotonic()
        # The latest decisions, written with the state file for the front's page.
        self.decisions: deque[Decision] = deque(maxlen=DECISIONS_KEPT)
        self._decisions_write: asyncio.TimerHandle | None = None

    # --- the journal -----------------------------------------------------

    def say(self, kind: str, message: str, priority: int = PRIORITY_INFO, **fields: object) -> None:
        """One decision line in the journal, with its event kind and `GB10D_*` fields."""
        self.journal.event(kind, message, priority, **fields)
        self.alerts.journaled(kind, message, fields)
        self.decisions.append(Decision(time.time(), priority, kind, message))
        self._write_decisions_soon()

    def _write_decisions_soon(self) -> None:
        """A decision said between two writes of the state file reaches it within WRITE_EVERY_S (one write for a
        burst of them), so that the front's page shows it without waiting for the next change of state."""
        if self._decisions_write is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # said outside the event loop (at the end of gb10d): the last write carries it
        self._decisions_write = loop.call_later(WRITE_EVERY_S, self._write_decisions)

    def _write_decisions(self) -> None:
        self._decisions_write = None
        self.write()

    # --- STATUS= and the state file ------------------------------------------

    def status(self, text: str, state: DaemonState | None = None) -> None:
        """STATUS= and the state file say `text` (and the daemon is now in `state`, if given)."""
        if state is not None:
            self._enter(state)
        self.status_text = text
        self.notifier.status(text[:STATUS_MAX])
        self.write()

    def _enter(self, state: DaemonState) -> None:
        """The daemon is in `state` now; once it no longer serves, the phase and progress of the start that served
        are history: the state file must not show them as the current start's (a hold reason `restarting: ready 4/4`)."""
        if self.state in SERVES and state not in SERVES:
            self._startup = None
            self._cancel_deferred()
        self.state = state

    def reload_begins(self) -> None:
        """systemd hears RELOADING=1: `systemctl reload` waits for the READY=1 that reload_ends sends."""
        self.notifier.reloading()

    def reload_ends(self) -> None:
        """READY=1 again, with what vLLM serves as STATUS=."""
        self.notifier.ready(self.serving_text()[:STATUS_MAX])

    def extend(self, seconds: float) -> None:
        """Ask systemd for more start time on a sign of progress; instances that wait for this one see it too."""
        self.notifier.extend_timeout(seconds)
        if self.booking is not None:
            self.booking.progressed()

    def waiting_for_memory(self, wait: Wait) -> None:
        """The start waits for other instances' starts: STATUS=, the state file and the metrics say for whom."""
        self.waiting_for = tuple(b.share() for b in wait.blockers)
        self._ledger_metrics()
        self.status(wait.status, DaemonState.WAITING_FOR_MEMORY)

    def admitted(self) -> None:
        """The ledger let the start begin: it waits for nobody now."""
        self.waiting_for = ()
        self._ledger_metrics()

    def restarting(self, reason: str) -> None:
        """A new start follows, for `reason` (gb10d_restarts_total{cause})."""
        self.metrics.restart(reason)

    def preflight_begins(self) -> None:
        """The memory check before a start is under way (gb10d_phase)."""
        self.metrics.set_phase(Phase.PREFLIGHT.value)

    def vllm_metrics_at(self, url: str) -> None:
        """vLLM's own /metrics at `url` is appended to each scrape of gb10d's (metrics.proxy_vllm)."""
        self.metrics.set_vllm_target(url)

    def vllm_down(self) -> None:
        """No vLLM process answers any more (gb10d_vllm_up 0), before the attempt is over; if it served, gb10d
        restarts it now, and the state file says so at once."""
        self.metrics.set_vllm_up(False)
        if self.state in SERVES:
            self._enter(DaemonState.RESTARTING)
            self.write()

    def woke(self, result: str, seconds: float | None = None) -> None:
        """A wake from sleep ended with `result` ("ok", or why it is not trusted), in `seconds` when it worked."""
        self.metrics.wake(result, seconds)

    def cluster_nodes(self, count: int) -> None:
        """The machines of the pair that serve now (gb10d_cluster_nodes)."""
        self.metrics.set_cluster_nodes(count)

    def attempt_started(self, number: int, tunables: Tunables, pid: int, baseline: MemInfo | None, reason: str) -> None:
        """A new attempt runs: the state file and the metrics describe it from now on."""
        self._number, self._tunables, self._pid, self._baseline = number, tunables, pid, baseline
        self._baseline_at = time.time() if baseline is not None else None
        self._clock, self._attempt_began = PhaseClock(), time.monotonic()
        self._cancel_deferred()
        self._startup, self._written_phase = None, None  # this start's phases are its own; the first is shown at once
        self.state = DaemonState.STARTING if number == 1 else DaemonState.RESTARTING
        with self.metrics.batch():
            self.metrics.start_attempt(reason)
            self.metrics.set_utilization(tunables.gpu_memory_utilization, self.config.vllm.gpu_memory_utilization)
            self.metrics.set_vllm_up(True)
            self._ledger_metrics()  # the share as admitted, lowered if the free-memory check lowered it

    def phase(self, startup: StartupState, text: str) -> None:
        """The start moved: STATUS=, the phase and progress metrics, and (throttled) the state file."""
        self._startup = startup
        now = time.monotonic()
        self._clock = self._clock.moved(startup.phase.value, startup.phase_since if startup.phase_since is not None else now)
        progress = (startup.shards_done, startup.shards_total) if startup.phase is Phase.LOADING_WEIGHTS and startup.shards_total else None
        shown = f"{text}; {estimate(self.last_start, startup.phase.value, progress, now - self._attempt_began)}"
        self.status_text = shown
        self.notifier.status(shown[:STATUS_MAX])
        if self.booking is not None and startup.phase.value != self._booked_phase:
            self._booked_phase = startup.phase.value
            self.booking.update(phase=self._booked_phase)
        with self.metrics.batch():
            self.metrics.set_phase(startup.phase.value)
            if startup.shards_total:
                self.metrics.set_load_progress(startup.shards_done / startup.shards_total)
        self._cancel_deferred()
        wait = write_delay(startup.phase is not self._written_phase, now - self._written_at)
        if wait <= 0:
            self._written_phase, self._written_at = startup.phase, now
            self.write()
        else:
            self._deferred = asyncio.get_running_loop().call_later(wait, self.phase, startup, text)

    def ready(self, startup: StartupState, message: str, startup_s: float, number: int) -> None:
        """vLLM serves: the state file, the metrics and the journal say so first; READY=1 goes out last."""
        self._startup = startup
        self.state, self.ready_at = DaemonState.SERVING, time.time()
        self.status_text = self.serving_text()
        if self.booking is not None:
            # Its memory shows in /proc/meminfo from now on; others stop counting its reservation.
            self.booking.serving(self._baseline.available if self._baseline else None, self._available_now())
            self._ledger_metrics()
        with self.metrics.batch():
            self.metrics.set_phase(Phase.READY.value)
            self.metrics.set_startup_seconds(startup_s)
            self.metrics.set_ready(True)
            if self.config.on_demand is not None:
                self.metrics.set_sleep_state(DaemonState.SERVING.value)  # a new vLLM is awake
        self._cancel_deferred()
        self.write()
        tunables = self._tunables
        self.say(
            "ready",
            message,
            PRIORITY_INFO,
            attempt=number,
            startup_seconds=round(startup_s, 3),
            gpu_memory_utilization=tunables.gpu_memory_utilization if tunables else None,
        )
        self.notifier.ready(self.status_text[:STATUS_MAX])

    def phase_seconds(self) -> dict[str, float]:
        """Each phase's seconds in the start that just reached ready."""
        return self._clock.until(time.monotonic())

    def joined(self, text: str) -> None:
        """The worker of a pair is part of the cluster: the state file and the journal first, then READY=1."""
        self.state, self.ready_at, self.status_text = DaemonState.SERVING, time.time(), text
        self.write()
        self.say("cluster_joined", text, PRIORITY_INFO)
        self.notifier.ready(text[:STATUS_MAX])

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
        }.get(self.state, "waiting to restart")

    def serving_text(self) -> str:
        """The STATUS= line while vLLM serves."""
        v = self.config.vllm
        utilization = self._tunables.gpu_memory_utilization if self._tunables else v.gpu_memory_utilization
        return f"serving {v.served_names[0]} on {v.host}:{v.port} (attempt {self._number}, gpu_memory_utilization={utilization:g})"

    def sleep_state(self, state: DaemonState, text: str) -> None:
        """Parking, asleep, waking, or serving again: STATUS=, the state file, the metrics and the ledger's record say
        which. READY stays: gb10d and vLLM run, and the front wakes vLLM for the next request."""
        self.metrics.set_sleep_state(state.value)
        if self.booking is not None:
            # A wake reserves its share until it is checked: another instance's start or wake must not count on the
            # memory it is taking back, which /proc/meminfo shows only bit by bit.
            stage = {DaemonState.ASLEEP: Stage.ASLEEP, DaemonState.WAKING: Stage.WAKING}.get(state, Stage.SERVING)
            phase = "" if state is DaemonState.SERVING else text.partition(";")[0].removeprefix(f"{stage.value}: ")
            self.booking.update(stage=stage, phase=phase)
        self.status(text, state)

    def parked(self, text: str, share: int, **fields: object) -> None:
        """vLLM is stopped until the front asks for it (on_demand.park = "stop"): the ledger's record reserves nothing,
        the state file, the metrics and the journal say parked, and READY=1 goes out last: gb10d is active for
        systemd, and vLLM starts on demand."""
        if self.booking is not None:
            self.booking.parked(self.config.vllm.gpu_memory_utilization, share)
            self._ledger_metrics()
        self.state, self.status_text = DaemonState.PARKED, text
        self.metrics.set_sleep_state(DaemonState.PARKED.value)
        self.write()
        self.say("parked_stopped", text, PRIORITY_INFO, **fields)
        self.notifier.ready(text[:STATUS_MAX])

    def failure(self, cause: str, message: str, action: str) -> None:
        """Remember the latest failure for `gb10d status` (shown until the next one)."""
        self.last_failure = LastFailure(cause, message, action, time.time())

    def attempt_over(self) -> None:
        """The attempt is gone: nothing of it is ready or up any more, and the state file shows none of its phases."""
        self._cancel_deferred()
        if self.state in SERVES and self.state is not DaemonState.PARKING:  # parking by stop ends parked, not restarting
            self._enter(DaemonState.RESTARTING)
        self._number, self._startup, self._tunables, self._pid, self._baseline = 0, None, None, None, None
        self.ready_at = None
        if self.booking is not None:
            # vLLM is gone but its share stays reserved until the next start (or the end of gb10d).
            self._booked_phase = ""
            self.booking.update(stage=Stage.RESTARTING, phase="")
        with self.metrics.batch():
            self.metrics.set_ready(False)
            self.metrics.set_vllm_up(False)
            if self.config.on_demand is not None:
                self.metrics.set_sleep_state("")  # no vLLM: neither awake nor asleep
        self.write()

    def stopping(self, what: str) -> None:
        """Shutdown begins: STOPPING=1 with what is being stopped; the state file says stopping."""
        self.notifier.stopping(what)
        self.state, self.status_text = DaemonState.STOPPING, "stopping"
        self.write()

    def stopped(self) -> None:
        """Everything is stopped: the state file says so (the process exits next)."""
        self.state, self.status_text = DaemonState.STOPPED, "stopped"
        self.write()

    def gave_up(self, reason: str, exit_status: int, told: bool = False) -> None:
        """gb10d stops trying: the journal says why (unless the failure's line just did), STATUS= and the state file say failed."""
        said = f"giving up with exit status {exit_status}: the line above says what to do" if told else reason
        self.say("gave_up", said, PRIORITY_ERR, exit_status=exit_status)
        self.status(advice.status_of_give_up(reason, STATUS_MAX), DaemonState.FAILED)

    def write(self) -> None:
        """Rewrite the state file now; a failure to write is reported once, never raised, and the write is tried
        again every STATE_RETRY_S until it succeeds: the front and `gb10d status` read the file, and a state that
        changed while it could not be written (ready, say) may not change again for days."""
        path = self.config.daemon.state_file
        try:
            write_state(path, self.record())
        except OSError as exc:
            if not self._state_warned:
                self._state_warned = True
                self.say(
                    "state_file_unwritable",
                    f"cannot write the state file {path}: {exc.strerror or exc}; gb10d status and the front see an old "
                    f"state until it can be written (trying again every {STATE_RETRY_S:g} s; set daemon.state_file)",
                    PRIORITY_WARNING,
                )
            self._write_later()
            return
        if self._state_warned:
            self._state_warned = False
            self.say("state_file_unwritable", f"wrote the state file {path} again", PRIORITY_INFO)

    def _write_later(self) -> None:
        if self._state_retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not supervising (a give-up on the way out): the next start writes it
        self._state_retry = loop.call_later(STATE_RETRY_S, self._write_again)

    def _write_again(self) -> None:
        self._state_retry = None
        self.write()

    def record(self) -> StateRecord:
        """Everything `gb10d status` shows, as of now."""
        v = self.config.vllm
        startup, tunables, mem = self._startup, self._tunables, self._baseline
        running = self._number > 0
        record = StateRecord(
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=time.time(),
            state=self.state,
            phase=startup.phase.value if startup else None,  # between starts, no start has a phase
            progress=Progress(startup.shards_done, startup.shards_total) if startup and startup.shards_total else None,
            model=v.model,
            served_names=tuple(v.served_names),
            url=f"http://{v.host}:{v.port}",
            attempt=self._number,
            max_attempts=self.config.restart.max_attempts,
            gpu_memory_utilization=tunables.gpu_memory_utilization if tunables else v.gpu_memory_utilization,
            load_strategy=tunables.load_strategy if tunables else None,
            memory=Memory(mem.total, mem.available, mem.free, mem.cached) if mem else None,
            memory_at=self._baseline_at if mem else None,
            vllm_pid=self._pid,
            ready_at=self.ready_at if running else None,
            last_failure=self.last_failure,
            status_text=self.status_text,
            metrics_url=f"http://{self.config.metrics.listen}/metrics" if self.config.metrics.listen else None,
            cluster=self.cluster,
            host=self.host,
            instance=self.booking.name if self.booking else None,
            reservation_bytes=self.booking.record.bytes if self.booking and self.booking.record else None,
            waiting_for=self.waiting_for,
            image=self.image.info.reference if self.image else None,
            image_digest=self.image.info.identity if self.image else None,
            container=self.image.container or None if self.image else None,
            engine=self.image.engine or None if self.image else None,
            decisions=tuple(self.decisions),
            last_start=self.last_start,
        )
        if self.cluster is not None and self.cluster.role == "worker":
            # vLLM and its API run on the head: here there is only Ray, ready once joined.
            record = replace(record, ready_at=self.ready_at, url=None, phase=None, attempt=None, gpu_memory_utilization=None)
        return record

    def kernel(self, event: DriverOutOfMemory | GpuXid) -> None:
        """A driver message of the kernel's while no vLLM runs: told and counted, nothing to stop."""
        for action in kernel_said(event):
            self.tell(action, None)

    def tell(self, action: Action, startup: StartupState | None) -> bool:
        """Carry out an action of the lifecycle core that only reports (extend the start timeout, show the phase,
        a journal line, a metric); False for the others, which the caller carries out."""
        if isinstance(action, Extend):
            self.extend(action.seconds)
        elif isinstance(action, ShowPhase) and startup is not None:
            self.phase(startup, action.text)
        elif isinstance(action, Say):
            self.say(action.kind, action.message, action.priority, **dict(action.fields))
        elif isinstance(action, Observe):
            self.observe(action.event)
        elif isinstance(action, LivenessFailed):
            self.metrics.liveness_failure(action.label)
        elif isinstance(action, XidSeen):
            self.metrics.xid(action.xid)
        elif isinstance(action, DriverOomSeen):
            self.metrics.driver_oom_line(action.evidence)
        else:
            return False
        return True

    # --- metrics ------------------------------------------------------------

    def observe(self, event: Event) -> None:
        """A periodic stats line of vLLM's."""
        self.metrics.observe(event)

    def memory(self, mem: MemInfo) -> None:
        self.metrics.set_memory(mem.total, mem.available, mem.free, mem.cached)

    def _ledger_metrics(self) -> None:
        record = self.booking.record if self.booking else None
        if record is not None:
            self.metrics.set_reservation(record.name, record.bytes, record.real_use, bool(self.waiting_for))

    def _available_now(self) -> int | None:
        """MemAvailable now, for what the start used; None when it cannot be read (the preflight said so already)."""
        try:
            mem = read_meminfo(self.config.memory.meminfo_path)
        except (OSError, ValueError):
            return None
        self.memory(mem)
        return mem.available

    def serve_metrics(self) -> None:
        """Listen for scrapes where the config says; a failure to listen is a warning, not a reason to stop."""
        self.metrics.close()
        address = self.config.metrics.address
        if address is None:
            return
        try:
            self.metrics.serve(*address)
        except OSError as exc:
            self.say(
                "metrics_unavailable",
                f"cannot listen for metrics on {self.config.metrics.listen}: {exc.strerror or exc}; metrics disabled (set metrics.listen)",
                PRIORITY_WARNING,
            )

    def reconfigured(self, config: Config) -> None:
        """A reload applied: later reports use the new config; the metrics listener moves if it changed."""
        moved = config.metrics.listen != self.config.metrics.listen
        self.config = config
        self.alerts.section = config.alerts
        if moved:
            self.serve_metrics()

    def close(self) -> None:
        self._cancel_deferred()
        if self._decisions_write is not None:
            self._decisions_write.cancel()
        if self._state_retry is not None:
            self._state_retry.cancel()
            self._state_retry = None
        self.metrics.close()
        self.alerts.close(ALERTS_CLOSE_S)
        self.journal.flush()
        self.notifier.close()

    def _alert_environment(self) -> dict[str, str]:
        """Where ${NAME} in a webhook comes from: gb10d's environment, then vllm.env_file."""
        env_file = self.config.vllm.env_file
        try:
            return {**os.environ, **(read_env_file(env_file) if env_file else {})}
        except ConfigError:
            return dict(os.environ)

    def _alert_dropped(self, text: str) -> None:
        self.journal.event("alert_dropped", text, PRIORITY_WARNING)

    def _cancel_deferred(self) -> None:
        if self._deferred is not None:
            self._deferred.cancel()
            self._deferred = None
