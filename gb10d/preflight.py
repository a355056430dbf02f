"""Before each start and after each end of vLLM: the GPU devices, free memory, memory given back.

Before a start, vLLM's own checks would fail late and obscurely, so gb10d
checks first: that the NVIDIA devices open under the unit's device policy
(`devices`), and that the utilization fits the free memory, evicting the
model's page cache or lowering the utilization when it does not (the
arithmetic is `memory.preflight`). After vLLM exits, the memory gate waits
(bounded) until MemAvailable is back, and gives up with "reboot needed"
when it is not: on GB10 a crashed engine can keep its memory, and retrying
would only fail again.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Awaitable, Callable

from . import shm
from .command import Tunables, model_on_host
from .config import Config
from .devices import check_gpu_access
from .host import HostFacts, read_host_facts, warnings
from .errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_MEMORY_NOT_RETURNED, GiveUp
from .levels import PRIORITY_INFO, PRIORITY_WARNING
from .memory import MemInfo, PreflightRefused, evict_page_cache, memory_returned, preflight, read_meminfo, safetensors_files
from .notify import unit_name
from .phases import Phase
from .reporter import Reporter

# /proc/meminfo offers no change notification: while memory comes back, it is looked at this often.
MEMORY_POLL_S = 0.5

# Waits that a stop signal may cut short: True when it did.
Pause = Callable[[float], Awaitable[bool]]


class Preflight:
    """The checks around each start of vLLM; each reads the config in force when it runs."""

    def __init__(self, config: Callable[[], Config], env: Callable[[], dict[str, str]], reporter: Reporter) -> None:
        self._config = config
        self._env = env
        self.reporter = reporter

    def gpu(self) -> None:
        """Refuse to start (as a config error) when the unit's device policy denies the NVIDIA devices.

        vLLM in a container gets the GPU from the engine, outside this unit's
        device policy: gb10d itself opens no device then.
        """
        if self._config().vllm.image is not None:
            return
        problem = check_gpu_access(unit_name())
        if problem is not None:
            raise GiveUp(problem, EXIT_CONFIG)

    def host(self) -> HostFacts:
        """This machine's kernel, driver, CMA figures and CUDA toolkit ptxas: told once, kept for `gb10d status`,
        and checked against the combinations known to fail."""
        facts = read_host_facts(self._config().memory.meminfo_path, self._env())
        self.reporter.host = facts.summary()
        self.reporter.say("host", f"this machine: {facts.summary()}", PRIORITY_INFO)
        for warning in warnings(facts):
            self.reporter.say("host_warning", warning, PRIORITY_WARNING)
        return facts

    def clear_shm(self) -> None:
        """Remove what dead vLLM processes left in /dev/shm; only called while no process of this instance lives."""
        removed = shm.remove(shm.leftovers(shm.scan(), os.geteuid(), shm.in_use()))
        if removed:
            self.reporter.say("shm_removed", shm.describe(removed), PRIORITY_INFO, bytes_freed=sum(s.size for s in removed))

    def meminfo(self) -> MemInfo | None:
        """/proc/meminfo now (also for the metrics), or None when it cannot be read (checks skipped)."""
        path = self._config().memory.meminfo_path
        try:
            mem = read_meminfo(path)
        except (OSError, ValueError) as exc:
            self.reporter.say("preflight_lowered", f"cannot read {path}: {exc}; memory checks skipped", PRIORITY_WARNING)
            return None
        self.reporter.memory(mem)
        return mem

    def fit(self, tunables: Tunables) -> tuple[Tunables, str]:
        """Lower the utilization (or evict the model's page cache) so vLLM's free-memory check passes first time.

        Returns the settings to start with and, when they were lowered, why
        (the correction the learned-settings file keeps).
        """
        config = self._config()
        m = config.memory
        if not m.preflight:
            return tunables, ""
        self.reporter.metrics.set_phase(Phase.PREFLIGHT.value)
        evicted = False
        while True:
            mem = self.meminfo()
            if mem is None:
                return tunables, ""
            located = model_on_host(config, self._env()) if m.evict_page_cache else None
            files = safetensors_files(*located) if located is not None else []
            decision = preflight(tunables.gpu_memory_utilization, mem, m.headroom_gib, m.min_gpu_memory_utilization, evicted, bool(files))
            if isinstance(decision, PreflightRefused):
                raise GiveUp(f"preflight: {decision.reason}; {top_memory_users()}", EXIT_GAVE_UP)
            if decision.evict:
                covered = evict_page_cache(files)
                self.reporter.say(
                    "page_cache_evicted",
                    f"preflight: {decision.reason}; dropped the page cache of {len(files)} files ({covered / 2**30:.2f} GiB)",
                    PRIORITY_INFO,
                    mem_free_bytes=mem.free,
                    mem_available_bytes=mem.available,
                )
                evicted = True
                continue
            if decision.utilization == tunables.gpu_memory_utilization:
                return tunables, ""
            self.reporter.say(
                "preflight_lowered",
                f"preflight: {decision.reason} ({mem.summary()})",
                PRIORITY_WARNING,
                gpu_memory_utilization=decision.utilization,
                mem_free_bytes=mem.free,
                mem_available_bytes=mem.available,
            )
            return tunables.with_(gpu_memory_utilization=decision.utilization), f"preflight: {decision.reason}"

    async def memory_back(self, baseline: MemInfo | None, pause: Pause) -> bool:
        """After vLLM exits, wait (bounded) until MemAvailable is back; True if a stop came meanwhile.

        Raises GiveUp when memory stays missing: retrying would only fail again.
        """
        if baseline is None:
            return False
        m = self._config().memory
        deadline = time.monotonic() + m.recovery_timeout_s
        while True:
            now_mem = self.meminfo()
            if now_mem is None or memory_returned(baseline, now_mem, m.recovery_tolerance_gib):
                return False
            if time.monotonic() >= deadline:
                lost = (baseline.available - now_mem.available) / 2**30
                raise GiveUp(
                    f"memory was not returned after vLLM exited: MemAvailable is {now_mem.available_gib:.2f} GiB, "
                    f"was {baseline.available_gib:.2f} GiB before it started ({lost:.2f} GiB missing) and no vLLM "
                    f"process is left; not retrying. A reboot may be needed ({top_memory_users()})",
                    EXIT_MEMORY_NOT_RETURNED,
                )
            if await pause(MEMORY_POLL_S):
                return True


def top_memory_users(count: int = 3) -> str:
    """The largest processes by resident memory, for messages about memory that is not free."""
    users: list[tuple[int, int, str]] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = fields.get("VmRSS", "0 kB").split()
        if rss and rss[0].isdigit():
            users.append((int(rss[0]) * 1024, int(entry), fields.get("Name", "?").strip()))
    users.sort(reverse=True)
    shown = ", ".join(f"{name} (pid {pid}) {rss / 2**30:.1f} GiB" for rss, pid, name in users[:count])
    return f"largest processes: {shown}" if shown else "no process information available"
