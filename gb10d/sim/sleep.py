"""The EngineCore's sleep mode (`--enable-sleep-mode`), as vLLM 0.26's CuMemAllocator and executor behave on GB10.

- Level 1 copies the weights to host memory and discards the KV cache. On GB10 host memory is the GPU's: the
  simulated meminfo gets back only the KV cache, and the host copy stays held after the wake, until the process
  exits (measured: RSS +7.6 GiB for 6.54 GiB of weights, not returned).
- Level 2 discards everything but what the CUDA context and the allocator keep. Its wake must go weights, then
  `collective_rpc reload_weights`, then kv_cache: weights woken without the reload generate empty text.
- A wake takes its memory back; when MemAvailable no longer has it, the engine dies of CUDA's out-of-memory error,
  as vllm-project/vllm#50011 reports on GB10.
- The lines are vLLM's (REFERENCE §18): `CuMemAllocator: sleep freed ...`, `Sleep mode freed X GiB memory, Y GiB
  memory is still in use.`, `It took N seconds to fall asleep.`, `It took N seconds to wake up tags ...`, the
  harmless RotaryEmbedding warning and `Reloading and processing weights took N seconds`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from . import texts
from .memory import Hold
from .settings import GIB

# What the CUDA context, NCCL and the allocator's pools keep through a level-2 sleep (measured: 1.66 GiB).
KEPT_GIB = 1.66
# Simulated seconds, shaped after the measurement of a 6.5 GiB model (level-2 wake with reload 1.05-1.74 s,
# nearly all of it the reload from the page cache; falling asleep 4.6 s for 41 GiB).
SLEEP_S_PER_GIB = 0.11
WAKE_S_PER_GIB = 0.02
RELOAD_S_PER_GIB = 0.16


@dataclass
class SleepState:
    """What is asleep, what it gave back, and whether the weights in GPU memory are real."""

    level: int = 0
    sleeping: set[str] = field(default_factory=set)
    weights_valid: bool = True
    host_copy: int = 0  # bytes of the level-1 host copy of the weights (never given back)
    kv_bytes: int = 0  # what the KV cache and the rest held when it went to sleep
    weights_bytes: int = 0


Log = Callable[[str, str, str], None]
Fail = Callable[[float], None]


class SleepMode:
    """The engine's side of /sleep, /wake_up and collective_rpc reload_weights."""

    def __init__(self, hold: Hold | None, weights_gib: float, log: Log, pause: Callable[[float], None], oom: Fail, bad_wake: bool = False) -> None:
        self.hold = hold
        self.bad_wake = bad_wake  # the scenario: reload_weights answers and logs as usual, the weights stay garbage
        self.weights_bytes = int(weights_gib * GIB) // 1024 * 1024  # the meminfo file counts kB
        self.log = log
        self.pause = pause
        self.oom = oom
        self.state = SleepState()

    @property
    def asleep(self) -> bool:
        return bool(self.state.sleeping)

    @property
    def generates_text(self) -> bool:
        return self.state.weights_valid

    def _held(self) -> int:
        return self.hold.held if self.hold is not None else 0

    def _set(self, total: int) -> bool:
        """Hold `total` bytes; False when MemAvailable does not have the increase."""
        return self.hold is None or self.hold.take(max(total, 0)) is None

    def sleep(self, level: int) -> None:
        """Executor.sleep(level): no-op with a warning when already asleep (vLLM's behaviour)."""
        if self.asleep:
            self.log("v1/executor/abstract.py:320", "Executor is already sleeping.", "WARNING")
            return
        started = time.monotonic()
        held = self._held()
        weights = min(self.weights_bytes, held)
        kept = min(int(KEPT_GIB * GIB) // 1024 * 1024, held - weights)
        # Level 1 moves the weights to host memory, which on GB10 is the same memory: only the rest comes back.
        backed_up = weights if level == 1 else 0
        self.pause((held - kept) / GIB * SLEEP_S_PER_GIB)
        still = kept + backed_up
        self._set(still)
        self.state = SleepState(level, {"weights", "kv_cache"}, level == 1, backed_up, held - weights - kept, weights)
        freed = held - kept
        self.log(
            "device_allocator/cumem.py:260",
            f"CuMemAllocator: sleep freed {texts.format_gib(freed)} GiB memory in total, of which "
            f"{texts.format_gib(backed_up)} GiB is backed up in CPU and the rest {texts.format_gib(freed - backed_up)} GiB is discarded directly.",
            "INFO",
        )
        self.log("v1/worker/gpu_worker.py:221", f"Sleep mode freed {texts.format_gib(held - still)} GiB memory, {texts.format_gib(still)} GiB memory is still in use.", "INFO")
        self.log("v1/executor/abstract.py:327", f"It took {time.monotonic() - started:.6f} seconds to fall asleep.", "INFO")

    def wake_up(self, tags: list[str] | None) -> None:
        """Executor.wake_up(tags): each tag takes its memory back; CUDA's out-of-memory kills the engine when it is gone."""
        state = self.state
        if not self.asleep:
            self.log("v1/executor/abstract.py:333", "Executor is not sleeping.", "WARNING")
            return
        for tag in tags or []:
            if tag not in state.sleeping:
                self.log("v1/executor/abstract.py:338", f"Tag {tag} is not in sleeping tags {state.sleeping}", "WARNING")
                return
        started = time.monotonic()
        waking = set(tags) if tags else set(state.sleeping)
        wanted = self._held()
        if "weights" in waking:
            wanted += state.weights_bytes
            self.pause(state.weights_bytes / GIB * WAKE_S_PER_GIB)
        if "kv_cache" in waking:
            wanted += state.kv_bytes
        if not self._set(wanted):
            self.oom((wanted - self._held()) / GIB)
        if "weights" in waking and state.level == 1:
            state.weights_valid = True  # copied back from the host copy, which stays
        shown = "{" + ", ".join(repr(t) for t in sorted(waking)) + "}" if not tags else repr(tags)
        self.log("v1/executor/abstract.py:346", f"It took {time.monotonic() - started:.6f} seconds to wake up tags {shown}.", "INFO")
        state.sleeping -= waking
        if not state.sleeping:
            state.level = 0

    def reload_weights(self) -> None:
        """collective_rpc("reload_weights"): the weights read again from the checkpoint (the page cache)."""
        started = time.monotonic()
        self.log("model_executor/layers/rotary_embedding/base.py:148", "RotaryEmbedding: Failed to load weights", "WARNING")
        self.pause(self.weights_bytes / GIB * RELOAD_S_PER_GIB)
        self.state.weights_valid = not self.bad_wake
        self.log("v1/worker/gpu_model_runner.py:4312", f"Reloading and processing weights took {time.monotonic() - started:.2f} seconds", "INFO")
