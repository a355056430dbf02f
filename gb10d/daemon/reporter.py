"""What gb10d tells the world, from one place: journal decision lines, STATUS=, metrics, the ledger and the state file.

Everything observable about the daemon goes through a `Reporter`, so the
views can never disagree for long, and their order is decided here once.
The daemon's `Situation` (daemon/state.py) is the Reporter's alone: each
method here changes it through its named methods, then has the outputs
follow. When vLLM becomes ready, the state file, the metrics and the
journal say so before READY=1 goes out, so `systemctl start gb10d && gb10d
status` and a scrape right after READY both see "ready". The state file is
rewritten on every change (`StateWriter`: shard steps at most once a
second, the latest one always last). What the other gb10d instances of the
machine see of this one, its record in the memory ledger, follows the same
way: its phase, its progress (every EXTEND_TIMEOUT_USEC), serving, and
restarting once vLLM is gone; the admission itself is the preflight's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..base.command import Tunables
from ..base.config import Config
from ..base.image import PreparedImage
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..core import advice
from ..core.budget import Wait
from ..core.lifecycle import Action, DriverOomSeen, Extend, LivenessFailed, Observe, Say, ShowPhase, XidSeen, kernel_said
from ..core.memory import MemInfo
from ..core.phases import Phase, StartupState
from ..core.statefile import ClusterRecord, DaemonState, Decision
from ..machine.journal import Journal
from ..machine.notify import Notifier
from ..vllm.events import DriverOutOfMemory, Event, GpuXid
from .ledgerrecord import LedgerRecord
from .metrics import Metrics
from .state import SERVES, Situation
from .statewriter import StateWriter
from .voice import Voice

# sd_notify's STATUS= is one line that `systemctl status` shows; longer texts only clutter it.
STATUS_MAX = 200


class Reporter:
    """The single writer of gb10d's journal decisions, STATUS=, metrics, ledger record and state file.

    Callers tell it what happened, in their words (`restarting`, `woke`, `vllm_down`), and it knows which of the
    outlets hear of it. `situation` is what it has been told, to read; `ledger` follows this instance's record in
    the memory ledger once `booked`. `journal` stays public for one use: vLLM's own output, forwarded line by line
    on the attempt's hot path (Ray's goes through `forward`).
    """

    def __init__(self, config: Config, journal: Journal, notifier: Notifier, metrics: Metrics) -> None:
        self.config = config
        self.journal = journal
        self.notifier = notifier
        self.metrics = metrics
        self.situation = Situation()
        self._voice = Voice(lambda: self.config, journal)
        self.ledger = LedgerRecord(metrics, lambda: self.situation.waiting)
        self._file = StateWriter(lambda: self.config.daemon.state_file, lambda: self.situation.record(self.config, self.ledger.booking), self.say)

    # --- the journal -----------------------------------------------------

    def say(self, kind: str, message: str, priority: int = PRIORITY_INFO, **fields: object) -> None:
        """One decision line in the journal, with its event kind and `GB10D_*` fields."""
        self._voice.say(kind, message, priority, fields)
        self.situation.decided(Decision(time.time(), priority, kind, message))
        self._file.soon()

    def forward(self, lines: Sequence[tuple[str, int]]) -> None:
        """Lines of a child's own output (Ray's), each at its priority, in the journal at once."""
        self._voice.forward(lines)

    # --- STATUS= and the state file ------------------------------------------

    def status(self, text: str, state: DaemonState | None = None) -> None:
        """STATUS= and the state file say `text` (and the daemon is now in `state`, if given)."""
        if state is not None:
            self._enter(state)
        self.situation.says(text)
        self.notifier.status(text[:STATUS_MAX])
        self._file.write()

    def _enter(self, state: DaemonState) -> None:
        if self.situation.enter(state):
            self._file.cancel_deferred()

    def reload_begins(self) -> None:
        """systemd hears RELOADING=1: `systemctl reload` waits for the READY=1 that reload_ends sends."""
        self.notifier.reloading()

    def reload_ends(self) -> None:
        """READY=1 again, with what vLLM serves as STATUS=."""
        self.notifier.ready(self.situation.serving_text(self.config.vllm)[:STATUS_MAX])

    def extend(self, seconds: float) -> None:
        """Ask systemd for more start time on a sign of progress; instances that wait for this one see it too."""
        self.notifier.extend_timeout(seconds)
        self.ledger.progressed()

    def waiting_for_memory(self, wait: Wait) -> None:
        """The start waits for other instances' starts: STATUS=, the state file and the metrics say for whom."""
        self.situation.waits_for(tuple(b.share() for b in wait.blockers))
        self.ledger.metrics()
        self.status(wait.status, DaemonState.WAITING_FOR_MEMORY)

    def admitted(self) -> None:
        """The ledger let the start begin: it waits for nobody now."""
        self.situation.waits_for(())
        self.ledger.metrics()

    def host_known(self, summary: str) -> None:
        """This machine's kernel, driver and CMA, for `gb10d status` (written with the next change)."""
        self.situation.host_known(summary)

    def runs_image(self, image: PreparedImage | None) -> None:
        """The container image the starts run from now (None: no container), for `gb10d status`."""
        self.situation.runs_image(image)

    def start_times(self, phases: dict[str, float]) -> None:
        """This config's last complete start took these seconds per phase: the next start's estimate."""
        self.situation.start_times(phases)

    def restarting(self, reason: str) -> None:
        """A new start follows, for `reason` (gb10d_restarts_total{cause})."""
        self.metrics.restart(reason)

    def preflight_begins(self) -> None:
        """The memory check before a start is under way (gb10d_phase)."""
        self.metrics.set_phase(Phase.PREFLIGHT.value)

    def vllm_metrics_at(self, url: str) -> None:
        """The /metrics of vLLM at base `url` is appended to each scrape of gb10d's (metrics.proxy_vllm)."""
        self.metrics.set_vllm_target(url)

    def vllm_down(self) -> None:
        """No vLLM process answers any more (gb10d_vllm_up 0), before the attempt is over; if it served, gb10d
        restarts it now, and the state file says so at once."""
        self.metrics.set_vllm_up(False)
        if self.situation.state in SERVES:
            self._enter(DaemonState.RESTARTING)
            self._file.write()

    def woke(self, result: str, seconds: float | None = None) -> None:
        """A wake from sleep ended with `result` ("ok", or why it is not trusted), in `seconds` when it worked."""
        self.metrics.wake(result, seconds)

    def waits_for_cluster(self, state: DaemonState) -> None:
        """The link is found: the head waits for the cluster, a worker to join it (shown with the next write)."""
        self._enter(state)

    def cluster_seen(self, cluster: ClusterRecord, serving_nodes: int, waiting: str) -> None:
        """A new node table: the machines that serve (gb10d_cluster_nodes), and the state file; while the daemon
        waits for the cluster, STATUS= says `waiting`."""
        self.metrics.set_cluster_nodes(serving_nodes)
        self.situation.cluster_seen(cluster)
        if self.situation.state in (DaemonState.WAITING, DaemonState.JOINING):
            self.status(waiting)
        else:
            self._file.write()

    def attempt_started(self, number: int, tunables: Tunables, pid: int, baseline: MemInfo | None, reason: str) -> None:
        """A new attempt runs: the state file and the metrics describe it from now on."""
        self.situation.began_attempt(number, tunables, pid, baseline)
        self._file.new_start()  # its first phase is shown at once
        with self.metrics.batch():
            self.metrics.start_attempt(reason)
            self.metrics.set_utilization(tunables.gpu_memory_utilization, self.config.vllm.gpu_memory_utilization)
            self.metrics.set_vllm_up(True)
            self.ledger.metrics()  # the share as admitted, lowered if the free-memory check lowered it

    def phase(self, startup: StartupState, text: str) -> None:
        """The start moved: STATUS=, the phase and progress metrics, and (throttled) the state file."""
        now = time.monotonic()
        shown = self.situation.moved(startup, text, now)
        self.notifier.status(shown[:STATUS_MAX])
        self.ledger.phase(startup.phase.value)
        with self.metrics.batch():
            self.metrics.set_phase(startup.phase.value)
            if startup.shards_total:
                self.metrics.set_load_progress(startup.shards_done / startup.shards_total)
        self._file.phase(startup.phase, now, lambda: self.phase(startup, text))

    def ready(self, startup: StartupState, message: str, startup_s: float, number: int) -> None:
        """vLLM serves: the state file, the metrics and the journal say so first; READY=1 goes out last."""
        self.situation.became_ready(startup, self.config.vllm)
        baseline = self.situation.baseline
        self.ledger.serving(baseline.available if baseline else None, self.config.memory.meminfo_path)
        with self.metrics.batch():
            self.metrics.set_phase(Phase.READY.value)
            self.metrics.set_startup_seconds(startup_s)
            self.metrics.set_ready(True)
            if self.config.on_demand is not None:
                self.metrics.set_sleep_state(DaemonState.SERVING.value)  # a new vLLM is awake
        self._file.cancel_deferred()
        self._file.write()
        tunables = self.situation.tunables
        self.say(
            "ready",
            message,
            PRIORITY_INFO,
            attempt=number,
            startup_seconds=round(startup_s, 3),
            gpu_memory_utilization=tunables.gpu_memory_utilization if tunables else None,
        )
        self.notifier.ready(self.situation.status_text[:STATUS_MAX])

    def phase_seconds(self) -> dict[str, float]:
        """Each phase's seconds in the start that just reached ready."""
        return self.situation.phase_seconds(time.monotonic())

    def joined(self, text: str) -> None:
        """The worker of a pair is part of the cluster: the state file and the journal first, then READY=1."""
        self.situation.joined(text)
        self._file.write()
        self.say("cluster_joined", text, PRIORITY_INFO)
        self.notifier.ready(text[:STATUS_MAX])

    def left_cluster(self, text: str) -> None:
        """The worker of a pair is no longer listed by the head: the journal says why; it waits to join again."""
        self.situation.left_cluster()
        self.say("cluster_left", text, PRIORITY_WARNING)

    def sleep_state(self, state: DaemonState, text: str) -> None:
        """Parking, asleep, waking, or serving again: STATUS=, the state file, the metrics and the ledger's record say
        which. READY stays: gb10d and vLLM run, and the front wakes vLLM for the next request."""
        self.metrics.set_sleep_state(state.value)
        self.ledger.sleep_state(state, text)
        self.status(text, state)

    def parked(self, text: str, share: int, **fields: object) -> None:
        """vLLM is stopped until the front asks for it (on_demand.park = "stop"): the ledger's record reserves nothing,
        the state file, the metrics and the journal say parked, and READY=1 goes out last: gb10d is active for
        systemd, and vLLM starts on demand."""
        self.ledger.parked(self.config.vllm.gpu_memory_utilization, share)
        self.situation.parked(text)
        self.metrics.set_sleep_state(DaemonState.PARKED.value)
        self._file.write()
        self.say("parked_stopped", text, PRIORITY_INFO, **fields)
        self.notifier.ready(text[:STATUS_MAX])

    def failure(self, cause: str, message: str, action: str) -> None:
        """Remember the latest failure for `gb10d status` (shown until the next one)."""
        self.situation.failed(cause, message, action)

    def keeps_share(self) -> None:
        """vLLM is about to be stopped or killed and started again: the memory ledger reserves its share from now on,
        before /proc/meminfo shows its memory free (else another instance's start could be admitted into it)."""
        self.ledger.restarting()

    def attempt_over(self) -> None:
        """The attempt is gone: nothing of it is ready or up any more, and the state file shows none of its phases."""
        self._file.cancel_deferred()
        self.situation.attempt_ended()
        self.ledger.restarting()
        with self.metrics.batch():
            self.metrics.set_ready(False)
            self.metrics.set_vllm_up(False)
            if self.config.on_demand is not None:
                self.metrics.set_sleep_state("")  # no vLLM: neither awake nor asleep
        self._file.write()

    def stopping(self, what: str) -> None:
        """Shutdown begins: STOPPING=1 with what is being stopped; the state file says stopping."""
        self.notifier.stopping(what)
        self.situation.stopping()
        self._file.write()

    def stopped(self) -> None:
        """Everything is stopped: the state file says so (the process exits next)."""
        self.situation.stopped()
        self._file.write()

    def gave_up(self, reason: str, exit_status: int, told: bool = False) -> None:
        """gb10d stops trying: the journal says why (unless the failure's line just did), STATUS= and the state file say failed."""
        said = f"giving up with exit status {exit_status}: the line above says what to do" if told else reason
        self.say("gave_up", said, PRIORITY_ERR, exit_status=exit_status)
        self.status(advice.status_of_give_up(reason, STATUS_MAX), DaemonState.FAILED)

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
        self._voice.reconfigured()
        if moved:
            self.serve_metrics()

    def close(self) -> None:
        self._file.close()
        self.metrics.close()
        self._voice.close()
        self.notifier.close()
