"""Before each start and after each end of vLLM: the GPU devices, free memory, memory given back.

Before a start, vLLM's own checks would fail late and obscurely, so gb10d
checks first: that the NVIDIA devices open under the unit's device policy
(`devices`); that this start's share fits beside the starts of the other
gb10d instances of the machine, waiting for them while it does not (the
decision is `budget.admit`, the records are the `ledger`'s); and that the
utilization fits the free memory they leave, evicting the model's page
cache or lowering the utilization when it does not (the arithmetic is
`memory.preflight`). After vLLM exits, the memory gate waits (bounded)
until MemAvailable is back, and gives up with "reboot needed" when it is
not: on GB10 a crashed engine can keep its memory, and retrying would only
fail again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Awaitable, Callable, Sequence

from ..base.command import Tunables, model_on_host
from ..base.config import Config
from ..base.errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_MEMORY_NOT_RETURNED, GiveUp, SpawnError
from ..base.levels import PRIORITY_INFO, PRIORITY_WARNING
from ..base.units import gib
from ..core import budget
from ..core.budget import Admit, Refuse, Reservation, Stage
from ..core.host import HostFacts, warnings
from ..core.lifecycle import start_time_asked
from ..core.memory import MemInfo, MemoryNotReturned, PreflightRefused, memory_return, parse_buddyinfo, preflight
from ..launch.runtime import Launcher
from ..machine import shm
from ..machine.devices import check_gpu_access
from ..machine.host import read_host_facts
from ..machine.ledger import Booking
from ..machine.memory import evict_page_cache, read_meminfo, safetensors_files, share_warning_for
from ..machine.procs import kib, processes, status_fields
from ..machine.service import unit_name
from .keeper import ConfigKeeper
from .reporter import Reporter

# /proc/meminfo offers no change notification: while memory comes back, it is looked at this often.
MEMORY_POLL_S = 0.5
# While a start waits for other instances' starts, the ledger and /proc/meminfo are read again this often.
LEDGER_POLL_S = 1.0

# Waits that a stop signal may cut short: True when it did.
Pause = Callable[[float], Awaitable[bool]]


class Preflight:
    """The checks around each start of vLLM; each reads the config in force when it runs."""

    def __init__(self, keeper: ConfigKeeper, reporter: Reporter, booking: Booking | None = None) -> None:
        self.keeper = keeper  # the config in force, read at each use
        self.reporter = reporter
        self.booking = booking  # this instance's record in the machine's memory ledger, if it has one

    def gpu(self) -> None:
        """Refuse to start (as a config error) when the unit's device policy denies the NVIDIA devices.

        vLLM in a container gets the GPU from the engine, outside this unit's
        device policy: gb10d itself opens no device then.
        """
        if self.keeper.config.vllm.image is not None:
            return
        problem = check_gpu_access(unit_name())
        if problem is not None:
            raise GiveUp(problem, EXIT_CONFIG)

    def host(self) -> HostFacts:
        """This machine's kernel, driver, CMA figures and CUDA toolkit ptxas: told once, kept for `gb10d status`,
        and checked against the combinations known to fail."""
        facts = read_host_facts(self.keeper.config.memory.meminfo_path, self.keeper.env())
        self.reporter.host_known(facts.summary())
        self.reporter.say("host", f"this machine: {facts.summary()}", PRIORITY_INFO)
        for warning in warnings(facts):
            self.reporter.say("host_warning", warning, PRIORITY_WARNING)
        return facts

    async def clear_leftovers(self, launcher: Launcher, number: int) -> None:
        """Remove what a dead gb10d left under this config, before start `number`'s memory is counted; only called
        while no process of this instance lives.

        A container whose gb10d was SIGKILLed still holds vLLM's port, its
        name and all its memory: measured first, that memory would make the
        free-memory check lower or refuse the start that replaces it. Its
        shared-memory segments are stale only once it is gone.
        """
        try:
            container = await launcher.clear_leftovers()
        except SpawnError as exc:
            raise GiveUp(str(exc), exc.exit_status) from None
        if container is not None:
            self.reporter.say("container_removed", container, PRIORITY_WARNING, attempt=number)
        removed = shm.remove(shm.leftovers(shm.scan(), os.geteuid(), shm.in_use()))
        if removed:
            self.reporter.say("shm_removed", shm.describe(removed), PRIORITY_INFO, bytes_freed=sum(s.size for s in removed))

    def meminfo(self) -> MemInfo | None:
        """/proc/meminfo now (also for the metrics), or None when it cannot be read (checks skipped)."""
        path = self.keeper.config.memory.meminfo_path
        try:
            mem = read_meminfo(path)
        except (OSError, ValueError) as exc:
            self.reporter.say("preflight_lowered", f"cannot read {path}: {exc}; memory checks skipped", PRIORITY_WARNING)
            return None
        self.reporter.memory(mem)
        return mem

    async def admit(self, tunables: Tunables, restarting: bool, pause: Pause) -> tuple[Reservation, ...] | None:
        """Take this start's share in the machine's memory ledger, waiting while other instances' starts leave no room.

        Returns the other instances as the admission saw them (`fit` leaves
        their reservations alone), or None when a stop came while waiting.
        While it waits, STATUS= names whom for, and systemd's start timeout
        is extended whenever one of them makes progress. Raises GiveUp when
        memory.when_full is "fail" and the share does not fit.
        """
        if self.booking is None:
            return ()
        began = time.monotonic()
        waited: tuple[str, ...] = ()
        seen: dict[str, float] = {}
        shown = ""
        while True:
            config = self.keeper.config  # a reload while it waits applies at once
            m = config.memory
            mem = self.meminfo()
            if mem is None:
                return ()
            utilization = tunables.gpu_memory_utilization
            share = budget.share_bytes(utilization, mem.total, m.headroom_gib)
            stage = Stage.RESTARTING if restarting else Stage.STARTING
            decision = self.booking.decide(utilization, share, stage, mem, m.when_full)
            if isinstance(decision, Refuse):
                raise GiveUp(decision.message, EXIT_GAVE_UP)
            if isinstance(decision, Admit):
                self.reporter.admitted()
                if waited:
                    self.reporter.say(
                        "memory_admitted", f"{decision.message}; waited {time.monotonic() - began:.0f} s for {', '.join(waited)}", PRIORITY_INFO
                    )
                elif budget.pending(decision.others):
                    self.reporter.say("memory_admitted", decision.message, PRIORITY_INFO)
                return decision.others
            names = tuple(b.name for b in decision.blockers)
            if names != waited:
                waited = names
                self.reporter.say("memory_wait", decision.message, PRIORITY_INFO, reservation_bytes=share, waiting_for=", ".join(names))
            if decision.status != shown:
                shown = decision.status
                self.reporter.waiting_for_memory(decision)
            moved, seen = budget.progressed(seen, decision.blockers)
            if moved:
                self.reporter.extend(start_time_asked(config))
            if await pause(LEDGER_POLL_S):
                return None

    def fit(self, tunables: Tunables, others: Sequence[Reservation] = ()) -> Tunables:
        """Lower the utilization (or evict the model's page cache) so vLLM's free-memory check passes first time.

        What the starts of `others` reserved is never counted as free. The settings to start with come back;
        lowered ones say why (`Tunables.why`, the correction the learned-settings file keeps).
        """
        config = self.keeper.config
        m = config.memory
        if not m.preflight:
            return tunables
        self.reporter.preflight_begins()
        self._tell_fragmentation(m.buddyinfo_path)
        around = budget.neighbours(others)
        evicted = False
        while True:
            mem = self.meminfo()
            if mem is None:
                return tunables
            located = model_on_host(config, self.keeper.env()) if m.evict_page_cache else None
            files = safetensors_files(*located) if located is not None else []
            decision = preflight(
                tunables.gpu_memory_utilization, mem, m.headroom_gib, m.min_gpu_memory_utilization, evicted, bool(files), around
            )
            if isinstance(decision, PreflightRefused):
                raise GiveUp(f"preflight: {decision.reason}; {top_memory_users()}", EXIT_GAVE_UP)
            if decision.evict:
                covered = evict_page_cache(files)
                self.reporter.say(
                    "page_cache_evicted",
                    f"preflight: {decision.reason}; dropped the page cache of {len(files)} files ({gib(covered)})",
                    PRIORITY_INFO,
                    mem_free_bytes=mem.free,
                    mem_available_bytes=mem.available,
                )
                evicted = True
                continue
            self._warn_share(config, decision.utilization, mem)
            if decision.utilization == tunables.gpu_memory_utilization:
                return tunables
            self.reporter.say(
                "preflight_lowered",
                f"preflight: {decision.reason} ({mem.summary()})",
                PRIORITY_WARNING,
                gpu_memory_utilization=decision.utilization,
                mem_free_bytes=mem.free,
                mem_available_bytes=mem.available,
            )
            if self.booking is not None:
                # A smaller share leaves more room to the others at once.
                self.booking.update(utilization=decision.utilization, bytes=budget.share_bytes(decision.utilization, mem.total, m.headroom_gib))
            return tunables.with_(gpu_memory_utilization=decision.utilization, why=f"preflight: {decision.reason}")

    def _warn_share(self, config: Config, utilization: float, mem: MemInfo) -> None:
        """Warn, without refusing, when the share cannot hold the weights plus one max_model_len sequence's KV cache."""
        warning = share_warning_for(config, self.keeper.env(), utilization, mem.total)
        if warning is not None:
            self.reporter.say("share_too_small", f"preflight: {warning}", PRIORITY_WARNING, gpu_memory_utilization=utilization)

    def _tell_fragmentation(self, path: Path) -> None:
        """Say when free memory lies only in small blocks: a reboot is the fix, which gb10d leaves to the operator."""
        try:
            found = parse_buddyinfo(path.read_text(encoding="ascii", errors="replace"), os.sysconf("SC_PAGE_SIZE"))
        except OSError:
            return
        if found.fragmented:
            self.reporter.say("memory_fragmented", f"preflight: {found.describe()}", PRIORITY_WARNING)

    def others(self) -> tuple[Reservation, ...]:
        """The other instances of the machine's memory ledger now (none without a ledger)."""
        return tuple(self.booking.others()) if self.booking is not None else ()

    async def memory_back(self, baseline: MemInfo | None, pause: Pause) -> bool:
        """After vLLM exits, wait (bounded) until MemAvailable is back; True if a stop came meanwhile.

        Raises GiveUp when memory stays missing: retrying would only fail again.
        """
        if baseline is None:
            return False
        m = self.keeper.config.memory
        started = time.monotonic()
        while True:
            taken = budget.taken_since(self.booking.admitted_beside, self.booking.others()) if self.booking is not None else 0
            verdict = memory_return(baseline, taken, self.meminfo(), m.recovery_tolerance_gib, time.monotonic() - started, m.recovery_timeout_s)
            if verdict is True:
                return False
            if isinstance(verdict, MemoryNotReturned):
                raise GiveUp(f"{verdict.describe()}; not retrying. A reboot may be needed ({top_memory_users()})", EXIT_MEMORY_NOT_RETURNED)
            if await pause(MEMORY_POLL_S):
                return True


def top_memory_users(count: int = 3) -> str:
    """The largest processes by resident memory, for messages about memory that is not free."""
    users: list[tuple[int, int, str]] = []
    for pid, directory in processes():
        try:
            fields = status_fields(directory)
        except OSError:
            continue
        rss = kib(fields, "VmRSS")
        if rss is not None:
            users.append((rss * 1024, pid, fields.get("Name", "?")))
    users.sort(reverse=True)
    shown = ", ".join(f"{name} (pid {pid}) {gib(rss, 1)}" for rss, pid, name in users[:count])
    return f"largest processes: {shown}" if shown else "no process information available"
