"""One GPU's share of the startup: vLLM's Worker.init_device() and load_model().

The same object runs inside the EngineCore for a single GPU (as vLLM's
UniProcExecutor runs its one worker in-process) and inside a Ray actor per
GPU in Ray mode (ray_executor.py), so both print the same lines from the same
code. A failure is raised, not printed as the end of the process: where the
worker runs decides how vLLM shows it (the EngineCore's failed-to-start
sequence, or a worker-side ERROR record and a RayTaskError in the driver).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from . import hub, texts
from .args import extensible_kv_cache, resolved_utilization
from .memory import Hold
from .model import ModelFacts
from .output import Bar, Console
from .settings import GIB, Memory, SimSettings

# Simulated durations in seconds at GB10D_SIM_SPEED=1 (see engine.py).
DISTRIBUTED_INIT_S = 2.0
RUNNER_SETUP_S = 1.0
SHARD_S = 12.0
MODEL_SETTLE_S = 1.0
READ_CHUNK = 64 * 1024


class WorkerFailure(Exception):
    """A worker's start failed: the kind of failure (a key of texts.WORKER_FRAMES) and the traceback's last line.

    It crosses Ray's pickling as its two arguments.
    """

    def __init__(self, kind: str, final: str) -> None:
        super().__init__(kind, final)
        self.kind = kind
        self.final = final


@dataclass(frozen=True)
class RankInfo:
    """Where one worker stands in the parallel layout (tensor-parallel ranks vary fastest, as in vLLM)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    tensor_parallel_size: int = 1
    init_method: str = "tcp://127.0.0.1:40000"


def init_method(ip: str, driver_pid: int) -> str:
    """distributed_init_method: the driver's IP and a port that differs between runs."""
    return f"tcp://{ip}:{40000 + driver_pid % 20000}"


def cuda_oom_message(memory: Memory, tried_gib: float) -> str:
    """PyTorch's CUDA out-of-memory message on a machine with this memory."""
    total = memory.total_bytes / GIB
    return texts.cuda_oom_message(tried_gib, total, min(1.02, total), total - 1.02 - 8.4)


def hang_forever() -> NoReturn:
    """No output, no I/O, no exit: what a stuck loader or a deadlocked engine looks like."""
    while True:
        signal.pause()


class GpuWorker:
    """The per-GPU startup steps, on the memory of the machine this process runs on."""

    def __init__(
        self, settings: SimSettings, args: argparse.Namespace, model: ModelFacts, console: Console, rank: RankInfo, hold: Hold | None = None
    ) -> None:
        self.settings = settings
        self.args = args
        self.model = model
        self.console = console
        self.rank = rank
        self.hold = hold  # the simulated memory this GPU's process holds, shown in GB10D_SIM_MEMINFO

    def log(self, src: str, message: str, level: str = "INFO") -> None:
        self.console.log(level, src, message)

    def init_device(self) -> None:
        """Join the process group, then request_memory(): free >= ceil(total * utilization), read at this moment
        (0.34 skips the check with its extensible KV cache, which is sized later from what is free then)."""
        r = self.rank
        self.settings.sleep(DISTRIBUTED_INIT_S)
        self.log("distributed/parallel_state.py:1568", f"world_size={r.world_size} rank={r.rank} local_rank={r.local_rank} distributed_init_method={r.init_method} backend=nccl")
        tp, pp = r.rank % r.tensor_parallel_size, r.rank // r.tensor_parallel_size
        self.log("distributed/parallel_state.py:1903", f"rank {r.rank} in world size {r.world_size} is assigned as DP rank 0, PP rank {pp}, PCP rank 0, TP rank {tp}, EP rank N/A, EPLB rank N/A")
        memory = self.settings.memory()
        utilization = resolved_utilization(self.args, self.settings.minor)
        requested = math.ceil(memory.total_bytes * utilization)
        if memory.free_bytes < requested and not extensible_kv_cache(self.args, self.settings.minor):
            message = texts.free_memory_error(memory.free_bytes, memory.total_bytes, utilization, requested, f"cuda:{r.local_rank}")
            raise WorkerFailure("free_memory", "ValueError: " + message)
        self.log("v1/worker/gpu_worker.py:303", "Using V2 Model Runner")

    def load_model(self) -> None:
        """The runner's lines, the checkpoint read shard by shard, and this rank's share of the weights."""
        self.settings.sleep(RUNNER_SETUP_S)
        self.log("v1/worker/gpu/model_runner.py:298", "Loading model from scratch...")
        self.log("platforms/cuda.py:378", "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'TRITON_ATTN', 'FLEX_ATTENTION'].")
        self.log("v1/attention/backends/flash_attn.py:636", "Using FlashAttention version 3")
        self.load_weights()
        load_s = self.model.shards * self._shard_s()
        self.log("model_executor/model_loader/default_loader.py:397", f"Loading weights took {load_s:.2f} seconds")
        if self.settings.scenario.no_kernel_image:
            # The first CUDA kernel after the weights: a build without kernels for this GPU stops here.
            raise WorkerFailure("post_load", texts.NO_KERNEL_IMAGE)
        self.settings.sleep(MODEL_SETTLE_S)
        memory_word = "GiB memory" if self.settings.minor >= 28 else "GiB"
        share = self.model.per_rank(self.rank.world_size).weights_gib
        self.log("v1/worker/gpu/model_runner.py:319", f"Model loading took {share} {memory_word} and {load_s + MODEL_SETTLE_S + RUNNER_SETUP_S:.6f} seconds")

    def _shard_s(self) -> float:
        slow = self.settings.scenario.slow_shards_s
        return SHARD_S if slow is None else slow

    def load_weights(self) -> None:
        """The download a cold cache needs, then the shard bar over N files (rank 0 only, as vLLM's tqdm), really reading bytes while each shard 'loads'."""
        if self.rank.rank == 0:
            took = hub.download_weights(self.console, self.settings, self.args, self.model.weights_gib, self.model.shards)
            if took is not None:
                self.log(*hub.weights_line(self.args.model, took))
        available = self.settings.memory().available_bytes / GIB
        self.log("model_executor/model_loader/weight_utils.py:922", f"Filesystem type for checkpoints: EXT4. Checkpoint size: {self.model.weights_gib:.2f} GiB. Available RAM: {available:.2f} GiB.")
        strategy = self.args.safetensors_load_strategy
        if strategy is None:
            self.log("model_executor/model_loader/weight_utils.py:945", "Auto-prefetch is disabled because the filesystem (EXT4) is not a recognized network FS (NFS/Lustre). If you want to force prefetching, start vLLM with --safetensors-load-strategy=prefetch.")
        elif strategy == "prefetch":
            self.log("model_executor/model_loader/weight_utils.py:860", "Prefetching checkpoint files into page cache started (in background, num_threads=8, block_size=16777216 bytes)")
        scenario = self.settings.scenario
        total = self.model.shards
        eager = strategy == "eager"
        desc = "Loading safetensors checkpoint shards" + (" (eager)" if eager else "")
        bar = Bar(self.console, desc, total, shard_format=True) if self.args.use_tqdm_on_load and self.rank.rank == 0 else None
        oom_at = (total + 1) // 2 if scenario.cuda_oom_during == "load" else None
        while self.settings.load_gate is not None and not self.settings.load_gate.exists():
            time.sleep(0.05)  # held by the test that runs the stand-in, until it opens the gate
        for index in range(total):
            if scenario.stall_at is not None and index >= scenario.stall_at and not eager:
                hang_forever()
            if oom_at is not None and index == oom_at:
                raise self._load_oom(1.71)
            self._read_while_waiting(index, self._shard_s())
            self._hold_weights(index + 1, total)
            if bar:
                bar.advance()
        if bar:
            bar.close()
        if strategy == "prefetch":
            self.log("model_executor/model_loader/weight_utils.py:884", f"Prefetching checkpoint files into page cache finished in {total * self._shard_s() * 0.4:.2f}s")

    def _hold_weights(self, done: int, total: int) -> None:
        """The shards read so far stay in memory; when MemAvailable does not have them, CUDA fails the load."""
        if self.hold is None:
            return
        wanted = int(self.model.weights_gib * GIB * done / total)
        before = self.hold.held
        if self.hold.take(wanted) is not None:
            raise self._load_oom((wanted - before) / GIB)

    def _load_oom(self, tried_gib: float) -> WorkerFailure:
        """The V1 runner's out-of-memory during the weights: its ERROR line now, the failure to raise."""
        message = cuda_oom_message(self.settings.memory(), round(tried_gib, 2))
        self.log("v1/worker/gpu_model_runner.py:2937", texts.load_oom_error(message), "ERROR")
        return WorkerFailure("load", f"torch.OutOfMemoryError: {message}")

    def _read_while_waiting(self, index: int, sim_seconds: float) -> None:
        """Spend one shard's time reading real bytes, so /proc/PID/io shows a live loader."""
        source = self.model.shard_files[index % len(self.model.shard_files)] if self.model.shard_files else Path(os.__file__)
        deadline = time.monotonic() + self.settings.delay(sim_seconds)
        try:
            fd = os.open(source, os.O_RDONLY)
        except OSError:
            self.settings.sleep(sim_seconds)
            return
        try:
            size = max(os.fstat(fd).st_size, 1)
            offset = 0
            while True:
                os.posix_fadvise(fd, offset, READ_CHUNK, os.POSIX_FADV_DONTNEED)
                data = os.pread(fd, READ_CHUNK, offset)
                offset = (offset + len(data)) % size if data else 0
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(left, 0.05))
        finally:
            os.close(fd)
