"""The simulated `VLLM::EngineCore` process: loading, the memory checks, and generation.

It runs in a child forked by the API server, in the same process group,
with no parent-death signal: if the API server dies, this process keeps
running (and, in the story it tells, keeps its memory) until someone kills
it, exactly like vLLM issue #55510. It talks to the API server over one
AF_UNIX stream socket carrying JSON lines.

The per-GPU steps (device init with the free-memory check, weight loading)
go through an executor as in vLLM: UniProcExecutor runs the one GpuWorker in
this process; with `--distributed-executor-backend ray` RayExecutor runs one
per rank in Ray actors (ray_executor.py) and this process is the Ray driver.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NoReturn, Protocol, Sequence

from . import memory, texts
from .args import extensible_kv_cache, resolved_utilization
from .memory import Hold
from .model import ModelFacts
from .output import STDERR, STDOUT, Bar, Console, ConsoleStream
from .settings import GIB, SettingsError, SimSettings
from .sleep import SleepMode
from .worker import GpuWorker, RankInfo, WorkerFailure, cuda_oom_message, hang_forever, init_method

# Simulated durations in seconds at GB10D_SIM_SPEED=1, shaped after a 27B
# FP8 model on GB10 (REFERENCE §8): minutes in all, most of it in the shards
# (the per-GPU ones are in worker.py).
SPAWN_S = 10.0
DYNAMO_S = 8.0
COMPILE_RANGE_S = 14.0
PROFILE_S = 1.0
KV_SETUP_S = 1.0
GRAPH_CAPTURE_S = 0.08  # per captured batch size
ENGINE_FINISH_S = 1.0
TOKENS_PER_S = 8.0
PREFILL_TOKENS_PER_S = 2000.0

CAPTURE_SIZES = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
ACTIVATION_GIB = 2.48
GRAPH_GIB = 0.61
BLOCK_SIZE = 16

_PR_SET_NAME = 15


def set_process_title(title: str) -> None:
    """Name this process like vLLM's setproctitle does: comm (15 bytes) and, where allowed, the cmdline."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        return
    try:
        # /proc/PID/stat fields 48 and 49 bound the argv area; writing our own
        # memory there is what setproctitle does, without the C extension.
        stat = Path("/proc/self/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        start, end = int(fields[45]), int(fields[46])
        payload = title.encode()[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(payload + b"\0" * (end - start - len(payload)))
    except (OSError, ValueError, IndexError):
        pass


@dataclass
class _Request:
    rid: str
    max_tokens: int
    ready_at: float
    produced: int = 0


@dataclass
class _Speculation:
    """Deterministic draft acceptance: position p is accepted at rate 0.85 * 0.7**p."""

    k: int
    credit: list[float] = field(default_factory=list)

    def step(self) -> list[int]:
        if not self.credit:
            self.credit = [0.0] * self.k
        accepted: list[int] = []
        for position in range(self.k):
            self.credit[position] += 0.85 * 0.7**position
            if self.credit[position] >= 1 and len(accepted) == position:
                self.credit[position] -= 1
                accepted.append(1)
            else:
                accepted.append(0)
        return accepted


class EngineFailure(Exception):
    """The EngineCore cannot go on: the frames and last line of the traceback vLLM would print."""

    def __init__(self, frames: Sequence[texts.Frame], final: str) -> None:
        super().__init__(final)
        self.frames = list(frames)
        self.final = final


class Executor(Protocol):
    """What the EngineCore needs of vLLM's executor: run a worker method on every rank, and watch the ranks."""

    @property
    def health_interval_s(self) -> float | None:
        """How often check_health() is due while serving; None: never."""
        ...

    def collective_rpc(self, method: str) -> None:
        """Run a GpuWorker method on every rank; raises EngineFailure."""

    def check_health(self) -> None:
        """Raise EngineFailure if a rank has gone."""

    def shutdown(self) -> None:
        """Let go of the workers before a graceful exit."""


class UniProcExecutor:
    """vLLM's UniProcExecutor: the one worker is part of the EngineCore, so there is nothing to watch or let go."""

    health_interval_s = None

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker

    def collective_rpc(self, method: str) -> None:
        try:
            getattr(self.worker, method)()
        except WorkerFailure as failure:
            raise EngineFailure(texts.ENGINE_FRAMES[failure.kind], failure.final) from None

    def check_health(self) -> None:
        """Never due (health_interval_s is None): the worker cannot die without this process."""

    def shutdown(self) -> None:
        """Nothing to let go: the worker ends with this process."""


class EngineCore:
    """One EngineCore run: the startup story, then the busy loop."""

    def __init__(self, settings: SimSettings, args: argparse.Namespace, model: ModelFacts, conn: socket.socket) -> None:
        self.settings = settings
        self.args = args
        self.model = model
        self.conn = conn
        self.console = Console(settings.style, "EngineCore")
        self.ray = args.distributed_executor_backend == "ray"
        # Without Ray the sim stays one GPU whatever the parallel sizes say.
        world_size = args.tensor_parallel_size * args.pipeline_parallel_size if self.ray else 1
        self.rank_model = model.per_rank(world_size)
        self.enforce_eager = bool(args.enforce_eager)
        self.executor: Executor  # made at the start of run()
        self._wakeup = -1  # read end of the signal wakeup pipe, once serving
        spec = args.speculative_config if isinstance(args.speculative_config, dict) else None
        self.spec = _Speculation(int(spec.get("num_speculative_tokens", 1) or 1)) if spec else None
        self._buffer = b""
        # The simulated memory this process holds; with Ray the workers hold theirs, on their own machines.
        self.hold: Hold | None = None
        self.sleep_mode: SleepMode | None = None  # --enable-sleep-mode, once serving
        self._sleep_after: dict[str, object] | None = None  # a /sleep?mode=wait waiting for the requests in flight
        self.page_cache: Hold | None = None  # the page cache its load filled (scenario page_cache_gib)
        self.requests: dict[str, _Request] = {}  # those in flight, once serving
        self.stop_at: float | None = None  # once SIGTERM came: when the drain ends (--shutdown-timeout)

    # --- helpers -----------------------------------------------------------------

    def log(self, src: str, message: str, level: str = "INFO") -> None:
        self.console.log(level, src, message)

    def send(self, message: dict[str, object]) -> bool:
        """Tell the API server something; False once it is gone."""
        try:
            self.conn.sendall(json.dumps(message).encode() + b"\n")
            return True
        except OSError:
            return False

    def fail(self, kind: str, final: str) -> NoReturn:
        """Fail the start with the frames of texts.ENGINE_FRAMES[kind]."""
        self.fail_with(texts.ENGINE_FRAMES[kind], final)

    def fail_with(self, frames: Sequence[texts.Frame], final: str, fatal: bool = False) -> NoReturn:
        """End as run_engine_core does: ERROR record with traceback, `Process EngineCore:` dump, exit 1.

        `fatal`: the engine was serving (`EngineCore encountered a fatal
        error.`) rather than starting.
        """
        src, message = ("v1/engine/core.py:1022", "EngineCore encountered a fatal error.") if fatal else ("v1/engine/core.py:1020", "EngineCore failed to start.")
        self.log(src, message + "\n" + texts.traceback_text(frames, final), "ERROR")
        self.console.write(STDERR, "Process EngineCore:\n" + texts.traceback_text(texts.PROCESS_FRAMES + list(frames), final) + "\n")
        self.trap_memory()
        self.exit(1)

    def trap_memory(self) -> None:
        """leak_gib: only a process that holds GPU memory traps it; with Ray the workers do, for themselves."""
        if not self.ray:
            memory.trap(self.settings)

    def take_memory(self, total_bytes: int, kind: str) -> None:
        """Hold `total_bytes` of the simulated memory from now on; CUDA's out-of-memory failure (in `kind`'s
        frames) when MemAvailable does not have the increase, as when another process took it meanwhile."""
        if self.hold is None:
            return
        before = self.hold.held
        if self.hold.take(max(total_bytes, before)) is not None:
            self.oom(kind, (total_bytes - before) / GIB)

    def fill_page_cache(self) -> None:
        """page_cache_gib: the checkpoint's pages stay in the page cache after the load, which CUDA counts as used on GB10."""
        gib = self.settings.scenario.page_cache_gib
        if gib and self.hold is not None and self.settings.meminfo is not None:
            self.page_cache = Hold(self.settings.meminfo, page_cache=True)
            self.page_cache.take(int(gib * GIB))

    def exit(self, status: int) -> NoReturn:
        """End this process, its memory given back first, as the kernel does at any exit."""
        for held in (self.hold, self.page_cache):
            if held is not None:
                held.release()
        os._exit(status)

    def ptxas_fails(self) -> bool:
        """The ptxas scenario: Triton compiles with its bundled ptxas unless TRITON_PTXAS_PATH gives it a working one."""
        return self.settings.scenario.ptxas and triton_ptxas(self.settings.env) is None

    def fail_ptxas(self, compiling: bool) -> NoReturn:
        """Triton's make_cubin: the reproducer on stdout, then PTXASError (wrapped by Inductor while torch.compile runs)."""
        error = texts.ptxas_error(f"/tmp/tmp{os.getpid() % 10**8:08x}.ptx")
        self.console.write(STDOUT, texts.triton_reproducer(error))
        self.fail("compile" if compiling else "warmup", texts.ptxas_final(error, compiling))

    def _wake_oom(self, tried_gib: float) -> NoReturn:
        """A wake whose memory is gone: the serving engine dies of CUDA's out-of-memory error (vllm#50011 on GB10)."""
        self.fail_with(texts.ENGINE_FRAMES["kv_alloc"], f"torch.OutOfMemoryError: {cuda_oom_message(self.settings.memory(), round(tried_gib, 2))}", fatal=True)

    def oom(self, kind: str, tried_gib: float) -> NoReturn:
        self.fail(kind, f"torch.OutOfMemoryError: {cuda_oom_message(self.settings.memory(), tried_gib)}")

    # --- startup -----------------------------------------------------------------

    def run(self) -> NoReturn:
        """vLLM's EngineCore startup, phase by phase (REFERENCE §2), then serving until killed."""
        set_process_title("VLLM::EngineCore")
        if self.settings.meminfo is not None and self.settings.hold_memory and not self.ray:
            self.hold = Hold(self.settings.meminfo)
        self.settings.sleep(SPAWN_S)
        self.log("v1/engine/core.py:113", self._config_line())
        try:
            self.executor = self._make_executor()
            self.executor.collective_rpc("init_device")
            self.executor.collective_rpc("load_model")
        except EngineFailure as failure:
            self.fail_with(failure.frames, failure.final)
        self.fill_page_cache()
        if self.settings.scenario.hidden_init_failure:
            # vLLM 0.23: the engine dies before it can say why; the API server's `Failed core proc(s): {}` is all there is.
            self.trap_memory()
            self.exit(1)
        compile_s = 0.0 if self.enforce_eager else self.compile()
        self.settings.sleep(PROFILE_S)
        if self.settings.scenario.cuda_oom_during == "profile":
            self.oom("profile", 4.25)
        self.take_memory(int((self.rank_model.weights_gib + ACTIVATION_GIB) * GIB), "profile")
        if not self.enforce_eager:
            self.log("compilation/monitor.py:81", f"Initial profiling/warmup run took {PROFILE_S * 0.18:.2f} s")
        kv_tokens = self.size_kv_cache()
        graphs_s = 0.0 if self.enforce_eager else self.capture_graphs()
        if self.ptxas_fails():
            self.fail_ptxas(compiling=False)
        self.settings.sleep(ENGINE_FINISH_S)
        self.log("compilation/jit_monitor.py:54", "Kernel JIT monitor activated \u2014 Triton JIT compilations during inference will be logged as warnings.")
        total = PROFILE_S + KV_SETUP_S + ENGINE_FINISH_S + graphs_s + (0.0 if self.enforce_eager else DYNAMO_S + COMPILE_RANGE_S)
        if compile_s:
            self.log("v1/engine/core.py:306", f"init engine (profile, create kv cache, warmup model) took {total:.2f} s (compilation: {compile_s:.2f} s)")
        else:
            self.log("v1/engine/core.py:313", f"init engine (profile, create kv cache, warmup model) took {total:.2f} s")
        self.log("config/vllm.py:999", "Asynchronous scheduling is enabled.")
        self.log("config/kernel.py:270", "Final IR op priority after setting platform defaults: IrOpPriorityConfig(rms_norm=['native'], fused_add_rms_norm=['native'])")
        if self.args.enable_sleep_mode:
            self.sleep_mode = SleepMode(self.hold, self.rank_model.weights_gib, self.log, self.settings.sleep, self._wake_oom, self.settings.scenario.bad_wake)
        if not self.send({"t": "ready", "kv_tokens": kv_tokens}):
            hang_forever()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        # A signal may land on another thread (Ray's); its byte on the wakeup
        # fd ends the busy loop's select, so the handler runs at once.
        self._wakeup, wakeup_w = os.pipe()
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        self.busy_loop()

    def _make_executor(self) -> Executor:
        """The executor vLLM would pick: Ray's when asked for, else the single in-process worker."""
        if not self.ray:
            rank = RankInfo(init_method=init_method("127.0.0.1", os.getpid()))
            return UniProcExecutor(GpuWorker(self.settings, self.args, self.model, self.console, rank, self.hold))
        # decorate_logs(): Ray's logger and the worker lines Ray forwards write
        # to sys.stdout/sys.stderr; they must reach the fds as our lines do.
        stdout = ConsoleStream(self.console, STDOUT)
        sys.stdout, sys.stderr = stdout, ConsoleStream(self.console, STDERR)
        try:
            from .ray_executor import RayExecutor
        except ImportError as exc:
            raise EngineFailure(texts.RAY_ENGINE_FRAMES["import"], texts.ray_import_failed(str(exc))) from None
        return RayExecutor(self.args, self.model, self.log, stdout)

    def _config_line(self) -> str:
        a, m = self.args, self.model
        spec = json.dumps(a.speculative_config) if a.speculative_config else "None"
        mode = "<CompilationMode.NONE: 0>" if self.enforce_eager else "<CompilationMode.VLLM_COMPILE: 3>"
        graphs = "<CUDAGraphMode.NONE: 0>" if self.enforce_eager else "<CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>"
        served = (a.served_model_name or [m.name])[0]
        return (
            f"Initializing a V1 LLM engine (v{self.settings.version}) with config: model='{m.name}', "
            f"speculative_config={spec}, tokenizer='{a.tokenizer or m.name}', skip_tokenizer_init=False, "
            f"tokenizer_mode={a.tokenizer_mode}, revision=None, tokenizer_revision=None, trust_remote_code={a.trust_remote_code or False}, "
            f"dtype=torch.bfloat16, max_seq_len={m.max_model_len}, download_dir={a.download_dir!r}, load_format={a.load_format}, "
            f"tensor_parallel_size={a.tensor_parallel_size}, pipeline_parallel_size={a.pipeline_parallel_size}, "
            f"data_parallel_size={a.data_parallel_size}, disable_custom_all_reduce=False, quantization={a.quantization}, "
            f"enforce_eager={self.enforce_eager}, kv_cache_dtype={a.kv_cache_dtype}, device_config=cuda, seed={a.seed}, "
            f"served_model_name={served}, enable_prefix_caching={a.enable_prefix_caching is not False}, "
            f"enable_chunked_prefill=True, pooler_config=None, compilation_config={{'mode': {mode}, "
            f"'backend': 'inductor', 'cudagraph_mode': {graphs}, 'max_cudagraph_capture_size': 512}}"
        )

    def compile(self) -> float:
        """torch.compile's lines; returns the compile time it reports."""
        cache = os.environ.get("VLLM_CACHE_ROOT", os.path.expanduser("~/.cache/vllm"))
        if self.settings.minor >= 34:
            self.log("compilation/monitor.py:40", "Starting torch.compile")
        self.log("compilation/backends.py:1089", f"Using cache directory: {cache}/torch_compile_cache/a33744ddfd/rank_0_0/backbone for vLLM's torch.compile")
        self.settings.sleep(DYNAMO_S)
        self.log("compilation/backends.py:1148", f"Dynamo bytecode transform time: {DYNAMO_S * 0.38:.2f} s")
        if self.ptxas_fails():
            self.fail_ptxas(compiling=True)
        self.log("compilation/backends.py:378", "Cache the graph of compile range (1, 8192) for later use")
        self.settings.sleep(COMPILE_RANGE_S)
        self.log("compilation/backends.py:393", f"Compiling a graph for compile range (1, 8192) takes {COMPILE_RANGE_S * 0.52:.2f} s")
        total = DYNAMO_S * 0.38 + COMPILE_RANGE_S * 0.52 + 1.0
        self.log("compilation/monitor.py:53", f"torch.compile took {total:.2f} s in total")
        return total

    def size_kv_cache(self) -> int:
        """Available KV memory from the utilization budget; the KV failures of REFERENCE §3.2.

        0.34's extensible KV cache is sized from what is free once the model
        ran (what CUDA reports: MemFree on GB10, page cache counted as used),
        within the budget; so a start short of memory fails here, not at its
        start.
        """
        self.settings.sleep(KV_SETUP_S)
        minor = self.settings.minor
        utilization = resolved_utilization(self.args, minor)
        extensible = extensible_kv_cache(self.args, minor)
        budget = self.settings.memory().total_bytes * utilization
        if extensible:
            budget = min(budget, self.settings.memory().free_bytes + (self.hold.held if self.hold else 0))
        available = budget - (self.rank_model.weights_gib + ACTIVATION_GIB + (0 if self.enforce_eager else GRAPH_GIB)) * GIB
        self.log("v1/worker/gpu_worker.py:480", f"Available KV cache memory: {texts.format_gib(available)} GiB")
        hint = texts.kv_memory_hint(minor, extensible, utilization)
        if available <= 0:
            self.fail("no_blocks", "ValueError: " + texts.no_kv_blocks(minor, hint))
        per_token = self.rank_model.kv_bytes_per_token
        needed = self.model.max_model_len * per_token
        if self.settings.scenario.kv_insufficient:
            available = min(available, needed * 0.6)
        if needed > available:
            estimated = int(available // per_token) // BLOCK_SIZE * BLOCK_SIZE
            self.fail("kv", "ValueError: " + texts.kv_insufficient_error(self.model.max_model_len, needed / GIB, available / GIB, estimated, minor, hint))
        tokens = int(available // (per_token * BLOCK_SIZE)) * BLOCK_SIZE
        concurrency = tokens / self.model.max_model_len
        if minor >= 28:
            self.log("v1/core/kv_cache_utils.py:1744", f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for {self.model.max_model_len:,} tokens per request: {concurrency:.2f}x")
        else:
            self.log("v1/core/kv_cache_utils.py:1744", f"GPU KV cache size: {tokens:,} tokens")
            self.log("v1/core/kv_cache_utils.py:1745", f"Maximum concurrency for {self.model.max_model_len:,} tokens per request: {concurrency:.2f}x")
        # Allocating the cache takes the rest of the budget: the whole share is held from here on.
        self.take_memory(int(budget), "kv_alloc")
        return tokens

    def capture_graphs(self) -> float:
        """The two CUDA graph capture bars (default tqdm format) and the summary line."""
        oom = self.settings.scenario.cuda_oom_during == "graphs"
        for kind in ("PIECEWISE", "FULL"):
            bar = Bar(self.console, f"Capturing CUDA graphs ({kind})", len(CAPTURE_SIZES), shard_format=False)
            for index in range(len(CAPTURE_SIZES)):
                if oom and index == len(CAPTURE_SIZES) // 3:
                    self.console.write(STDERR, "\n")
                    self.oom("graphs", 0.5)
                self.settings.sleep(GRAPH_CAPTURE_S)
                bar.advance()
            bar.close()
        seconds = 2 * len(CAPTURE_SIZES) * GRAPH_CAPTURE_S
        self.log("v1/worker/gpu/model_runner.py:701", f"Graph capturing finished in {seconds:.0f} secs, took {GRAPH_GIB:.2f} GiB")
        return seconds

    # --- serving -----------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: object) -> None:
        """The shutdown begins: the requests in flight are aborted, or with --shutdown-timeout finished for up to
        that long (the busy loop ends it); a second SIGTERM (the API server's) changes nothing."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        timeout = self.args.shutdown_timeout
        self.log("v1/engine/core.py:1178", "[shutdown] EngineCore: trigger received signal=SIGTERM")
        self.log("v1/engine/core.py:1297", f"[shutdown] EngineCore: start mode={'drain' if timeout else 'abort'} timeout={timeout}s")
        if self.requests:
            word = f"draining in-flight requests count={len(self.requests)} timeout={timeout}s" if timeout else f"aborting in-flight requests count={len(self.requests)}"
            self.log("v1/engine/core.py:1310", f"[shutdown] EngineCore: {word}")
        if not timeout:
            self.requests.clear()
        self.stop_at = time.monotonic() + timeout

    def _teardown(self) -> NoReturn:
        self.log("v1/engine/core.py:1328", "[shutdown] EngineCore: request processing complete; starting resource teardown")
        self.log("v1/engine/core.py:1191", "[shutdown] EngineCore: exiting busy loop")
        self.executor.shutdown()
        self.exit(0)

    def _messages(self) -> list[dict[str, object]] | None:
        """Messages waiting on the socket; None when the API server has gone."""
        try:
            chunk = self.conn.recv(65536)
        except OSError:
            return None
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def busy_loop(self) -> NoReturn:
        """Schedule requests and emit tokens at the simulated decode rate, until told otherwise."""
        scenario = self.settings.scenario
        started = time.monotonic()
        hang_at = started + self.settings.delay(scenario.hang_after_s) if scenario.hang_after_s is not None else None
        die_at = started + self.settings.delay(scenario.engine_dies_after_s) if scenario.engine_dies_after_s is not None else None
        step_s = self.settings.delay(1 / TOKENS_PER_S)
        health_s = self.executor.health_interval_s
        health_at = started + health_s if health_s is not None else None
        requests = self.requests
        next_step = time.monotonic()
        while True:
            now = time.monotonic()
            if self.stop_at is not None and (not requests or now >= self.stop_at):
                self._teardown()
            if die_at is not None and now >= die_at:
                self.trap_memory()
                os.kill(os.getpid(), signal.SIGKILL)
            if hang_at is not None and now >= hang_at:
                hang_forever()
            if health_at is not None and health_s is not None and now >= health_at:
                health_at = now + health_s
                try:
                    self.executor.check_health()
                except EngineFailure as failure:
                    self.fail_with(failure.frames, failure.final, fatal=True)
            deadlines = [d for d in (hang_at, die_at, health_at, self.stop_at) if d is not None]
            if requests:
                deadlines.append(max(next_step, min(r.ready_at for r in requests.values())))
            timeout = max(min(deadlines) - now, 0) if deadlines else None
            readable, _, _ = select.select([self.conn.fileno(), self._wakeup], [], [], timeout)
            if self._wakeup in readable:
                os.read(self._wakeup, 512)
            if self.conn.fileno() in readable:
                messages = self._messages()
                if messages is None:
                    # The API server died; vLLM's EngineCore does not notice and stays.
                    hang_forever()
                for message in messages:
                    self._accept(message, requests)
            now = time.monotonic()
            asleep = self.sleep_mode is not None and self.sleep_mode.asleep
            if requests and now >= next_step and not asleep:  # a request sent while asleep waits for the wake
                next_step = now + step_s
                self._step(requests, now)
            if self._sleep_after is not None and not requests:
                self._control(self._sleep_after, requests)

    def _accept(self, message: dict[str, object], requests: dict[str, _Request]) -> None:
        rid = str(message.get("id"))
        if message.get("t") == "gen":
            prompt = int(message.get("prompt_tokens", 1))  # type: ignore[call-overload]
            ready_at = time.monotonic() + self.settings.delay(prompt / PREFILL_TOKENS_PER_S)
            requests[rid] = _Request(rid, int(message.get("max_tokens", 16)), ready_at)  # type: ignore[call-overload]
        elif message.get("t") == "abort":
            requests.pop(rid, None)
        elif message.get("t") in ("sleep", "wake_up", "rpc", "is_sleeping"):
            if message.get("t") == "sleep" and message.get("mode") == "wait" and requests:
                self.log("v1/engine/core.py:890", "Waiting for in-flight requests to complete before sleeping...")
                self._sleep_after = message
            else:
                self._control(message, requests)

    def _control(self, message: dict[str, object], requests: dict[str, _Request]) -> None:
        """The development endpoints' calls (REFERENCE §18); the answer names the call's id."""
        self._sleep_after = None
        kind, sleep = message.get("t"), self.sleep_mode
        answer: dict[str, object] = {"t": "done", "id": message.get("id")}
        if sleep is None and kind != "is_sleeping":
            answer["error"] = "Sleep mode is not enabled (--enable-sleep-mode)"
        elif kind == "sleep" and sleep is not None:
            for rid in list(requests):  # mode=abort: what is in flight ends now
                del requests[rid]
                self.send({"t": "tok", "id": rid, "n": 0, "fin": True, "spec": None})
            sleep.sleep(int(message.get("level", 1)))  # type: ignore[call-overload]
        elif kind == "wake_up" and sleep is not None:
            tags = message.get("tags")
            sleep.wake_up([str(t) for t in tags] if isinstance(tags, list) else None)
        elif kind == "rpc" and sleep is not None:
            if message.get("method") == "reload_weights":
                sleep.reload_weights()
                answer["results"] = [None]
            else:
                answer["error"] = f"AttributeError: 'GPUWorker' object has no attribute {message.get('method')!r}"
        answer["is_sleeping"] = bool(sleep and sleep.asleep)
        answer["level"] = sleep.state.level if sleep else 0
        self.send(answer)

    def _step(self, requests: dict[str, _Request], now: float) -> None:
        for request in list(requests.values()):
            if request.ready_at > now:
                continue
            accepted = self.spec.step() if self.spec else None
            count = min(1 + sum(accepted or []), request.max_tokens - request.produced)
            request.produced += count
            finished = request.produced >= request.max_tokens
            if finished:
                del requests[request.rid]
            empty = self.sleep_mode is not None and not self.sleep_mode.generates_text
            if not self.send({"t": "tok", "id": request.rid, "n": count, "fin": finished, "spec": accepted, "empty": empty}):
                hang_forever()


def triton_ptxas(env: Mapping[str, str]) -> str | None:
    """The working ptxas Triton would use, as its knobs pick it: TRITON_PTXAS_PATH when `PATH --version` runs and names a release.

    None means Triton's bundled ptxas, which is older than GB10's sm_121a.
    (Triton also falls back to the bundled one when the variable's program
    is missing or says no release.)
    """
    path = env.get("TRITON_PTXAS_PATH")
    if not path:
        return None
    try:
        said = subprocess.run([path, "--version"], capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path if re.search(rb"release \d+\.\d+", said) else None


def run_engine(settings: SimSettings, args: argparse.Namespace, model: ModelFacts, conn: socket.socket) -> NoReturn:
    """Entry point of the forked child."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if settings.scenario.ipc_removed:
        # The spawned child cannot open the semaphore its parent made: it dies before vLLM tags its streams.
        os.write(2, (texts.SEMAPHORE_GONE + "\n").encode())
        os._exit(1)
    try:
        EngineCore(settings, args, model, conn).run()
    except SettingsError as exc:
        # E.g. the meminfo file vanished between attempts: say so in one line.
        os.write(2, f"gb10d.sim: {exc}\n".encode())
        os._exit(2)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
