"""The simulated `VLLM::EngineCore` process: loading, the memory checks, and generation.

It runs in a child forked by the API server, in the same process group,
with no parent-death signal: if the API server dies, this process keeps
running (and, in the story it tells, keeps its memory) until someone kills
it, exactly like vLLM issue #55510. It talks to the API server over one
AF_UNIX stream socket carrying JSON lines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import select
import signal
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from . import texts
from .output import STDERR, Bar, Console
from .settings import GIB, SettingsError, SimSettings

# Simulated durations in seconds at GB10D_SIM_SPEED=1, shaped after a 27B
# FP8 model on GB10 (REFERENCE §8): minutes in all, most of it in the shards.
SPAWN_S = 10.0
DISTRIBUTED_INIT_S = 2.0
RUNNER_SETUP_S = 1.0
SHARD_S = 12.0
MODEL_SETTLE_S = 1.0
DYNAMO_S = 8.0
COMPILE_RANGE_S = 14.0
PROFILE_S = 1.0
KV_SETUP_S = 1.0
GRAPH_CAPTURE_S = 0.08  # per captured batch size
ENGINE_FINISH_S = 1.0
TOKENS_PER_S = 8.0
PREFILL_TOKENS_PER_S = 2000.0

CAPTURE_SIZES = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
DEFAULT_WEIGHTS_GIB = 27.32
DEFAULT_MAX_MODEL_LEN = 262144
KV_BYTES_PER_TOKEN = 65536
ACTIVATION_GIB = 2.48
GRAPH_GIB = 0.61
BLOCK_SIZE = 16
READ_CHUNK = 64 * 1024

_PR_SET_NAME = 15


@dataclass(frozen=True)
class ModelFacts:
    """What the simulated checkpoint looks like."""

    name: str
    architecture: str
    weights_gib: float
    shard_files: tuple[Path, ...]
    shards: int
    max_model_len: int
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN


def describe_model(model: str, max_model_len: int | None, shards_override: int | None) -> ModelFacts:
    """The checkpoint: a real local folder's *.safetensors if there are any, else a 27B FP8 of 6 shards."""
    folder = Path(model)
    files: tuple[Path, ...] = ()
    architecture = "Qwen3ForCausalLM"
    try:
        if folder.is_dir():
            files = tuple(sorted(folder.glob("*.safetensors")))
            config = folder / "config.json"
            if config.is_file():
                names = json.loads(config.read_text(encoding="utf-8")).get("architectures") or [architecture]
                architecture = str(names[0])
    except (OSError, ValueError):
        files = ()
    weights = sum(f.stat().st_size for f in files) / GIB if files else DEFAULT_WEIGHTS_GIB
    shards = shards_override or len(files) or 6
    effective_len = DEFAULT_MAX_MODEL_LEN if max_model_len in (None, -1) else int(max_model_len)
    return ModelFacts(model, architecture, round(weights, 2), files, shards, effective_len)


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


class EngineCore:
    """One EngineCore run: the startup story, then the busy loop."""

    def __init__(self, settings: SimSettings, args: argparse.Namespace, model: ModelFacts, conn: socket.socket) -> None:
        self.settings = settings
        self.args = args
        self.model = model
        self.conn = conn
        self.console = Console(settings.style, "EngineCore")
        self.eager_load = args.safetensors_load_strategy == "eager"
        self.enforce_eager = bool(args.enforce_eager)
        spec = args.speculative_config if isinstance(args.speculative_config, dict) else None
        self.spec = _Speculation(int(spec.get("num_speculative_tokens", 1) or 1)) if spec else None
        self._buffer = b""

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
        """Fail the start as run_engine_core does: ERROR record with traceback, `Process EngineCore:` dump, exit 1."""
        frames = texts.ENGINE_FRAMES[kind]
        self.log("v1/engine/core.py:1020", "EngineCore failed to start.\n" + texts.traceback_text(frames, final), "ERROR")
        self.console.write(STDERR, "Process EngineCore:\n" + texts.traceback_text(texts.PROCESS_FRAMES + frames, final) + "\n")
        self.settings.trap_memory()
        os._exit(1)

    def oom(self, kind: str, tried_gib: float) -> NoReturn:
        memory = self.settings.memory()
        total = memory.total_bytes / GIB
        message = texts.cuda_oom_message(tried_gib, total, min(1.02, total), total - 1.02 - 8.4)
        if kind == "load":
            self.log("v1/worker/gpu_model_runner.py:2937", texts.load_oom_error(message), "ERROR")
        self.fail(kind, f"torch.OutOfMemoryError: {message}")

    @staticmethod
    def hang_forever() -> NoReturn:
        """No output, no I/O, no exit: what a stuck loader or a deadlocked engine looks like."""
        while True:
            signal.pause()

    # --- startup -----------------------------------------------------------------

    def run(self) -> NoReturn:
        """vLLM's EngineCore startup, phase by phase (REFERENCE §2), then serving until killed."""
        set_process_title("VLLM::EngineCore")
        self.settings.sleep(SPAWN_S)
        self.log("v1/engine/core.py:113", self._config_line())
        self.settings.sleep(DISTRIBUTED_INIT_S)
        port = 40000 + os.getpid() % 20000
        self.log("distributed/parallel_state.py:1568", f"world_size=1 rank=0 local_rank=0 distributed_init_method=tcp://127.0.0.1:{port} backend=nccl")
        self.log("distributed/parallel_state.py:1903", "rank 0 in world size 1 is assigned as DP rank 0, PP rank 0, PCP rank 0, TP rank 0, EP rank N/A, EPLB rank N/A")
        self.check_free_memory()
        self.log("v1/worker/gpu_worker.py:303", "Using V2 Model Runner")
        self.settings.sleep(RUNNER_SETUP_S)
        self.log("v1/worker/gpu/model_runner.py:298", "Loading model from scratch...")
        self.log("platforms/cuda.py:378", "Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', 'TRITON_ATTN', 'FLEX_ATTENTION'].")
        self.log("v1/attention/backends/flash_attn.py:636", "Using FlashAttention version 3")
        self.load_weights()
        load_s = self.model.shards * self._shard_s()
        self.log("model_executor/model_loader/default_loader.py:397", f"Loading weights took {load_s:.2f} seconds")
        self.settings.sleep(MODEL_SETTLE_S)
        memory_word = "GiB memory" if self.settings.minor >= 28 else "GiB"
        self.log("v1/worker/gpu/model_runner.py:319", f"Model loading took {self.model.weights_gib} {memory_word} and {load_s + MODEL_SETTLE_S + RUNNER_SETUP_S:.6f} seconds")
        compile_s = 0.0 if self.enforce_eager else self.compile()
        self.settings.sleep(PROFILE_S)
        if self.settings.scenario.cuda_oom_during == "profile":
            self.oom("profile", 4.25)
        if not self.enforce_eager:
            self.log("compilation/monitor.py:81", f"Initial profiling/warmup run took {PROFILE_S * 0.18:.2f} s")
        kv_tokens = self.size_kv_cache()
        graphs_s = 0.0 if self.enforce_eager else self.capture_graphs()
        self.settings.sleep(ENGINE_FINISH_S)
        self.log("compilation/jit_monitor.py:54", "Kernel JIT monitor activated \u2014 Triton JIT compilations during inference will be logged as warnings.")
        total = PROFILE_S + KV_SETUP_S + ENGINE_FINISH_S + graphs_s + (0.0 if self.enforce_eager else DYNAMO_S + COMPILE_RANGE_S)
        if compile_s:
            self.log("v1/engine/core.py:306", f"init engine (profile, create kv cache, warmup model) took {total:.2f} s (compilation: {compile_s:.2f} s)")
        else:
            self.log("v1/engine/core.py:313", f"init engine (profile, create kv cache, warmup model) took {total:.2f} s")
        self.log("config/vllm.py:999", "Asynchronous scheduling is enabled.")
        self.log("config/kernel.py:270", "Final IR op priority after setting platform defaults: IrOpPriorityConfig(rms_norm=['native'], fused_add_rms_norm=['native'])")
        if not self.send({"t": "ready", "kv_tokens": kv_tokens}):
            self.hang_forever()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.busy_loop()

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

    def check_free_memory(self) -> None:
        """request_memory(): fail unless free >= ceil(total * utilization), read at this moment."""
        memory = self.settings.memory()
        utilization = float(self.args.gpu_memory_utilization)
        requested = math.ceil(memory.total_bytes * utilization)
        if memory.free_bytes < requested:
            self.fail("free_memory", "ValueError: " + texts.free_memory_error(memory.free_bytes, memory.total_bytes, utilization, requested))

    def _shard_s(self) -> float:
        slow = self.settings.scenario.slow_shards_s
        return SHARD_S if slow is None else slow

    def load_weights(self) -> None:
        """The shard bar over N files, really reading bytes while each shard 'loads'."""
        available = self.settings.memory().available_bytes / GIB
        self.log("model_executor/model_loader/weight_utils.py:922", f"Filesystem type for checkpoints: EXT4. Checkpoint size: {self.model.weights_gib:.2f} GiB. Available RAM: {available:.2f} GiB.")
        strategy = self.args.safetensors_load_strategy
        if strategy is None:
            self.log("model_executor/model_loader/weight_utils.py:945", "Auto-prefetch is disabled because the filesystem (EXT4) is not a recognized network FS (NFS/Lustre). If you want to force prefetching, start vLLM with --safetensors-load-strategy=prefetch.")
        elif strategy == "prefetch":
            self.log("model_executor/model_loader/weight_utils.py:860", "Prefetching checkpoint files into page cache started (in background, num_threads=8, block_size=16777216 bytes)")
        scenario = self.settings.scenario
        total = self.model.shards
        desc = "Loading safetensors checkpoint shards" + (" (eager)" if self.eager_load else "")
        bar = Bar(self.console, desc, total, shard_format=True) if self.args.use_tqdm_on_load else None
        oom_at = (total + 1) // 2 if scenario.cuda_oom_during == "load" else None
        for index in range(total):
            if scenario.stall_at is not None and index >= scenario.stall_at and not self.eager_load:
                self.hang_forever()
            if oom_at is not None and index == oom_at:
                self.oom("load", 1.71)
            self._read_while_waiting(index, self._shard_s())
            if bar:
                bar.advance()
        if bar:
            bar.close()
        if strategy == "prefetch":
            self.log("model_executor/model_loader/weight_utils.py:884", f"Prefetching checkpoint files into page cache finished in {total * self._shard_s() * 0.4:.2f}s")

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

    def compile(self) -> float:
        """torch.compile's lines; returns the compile time it reports."""
        cache = os.environ.get("VLLM_CACHE_ROOT", os.path.expanduser("~/.cache/vllm"))
        self.log("compilation/backends.py:1089", f"Using cache directory: {cache}/torch_compile_cache/a33744ddfd/rank_0_0/backbone for vLLM's torch.compile")
        self.settings.sleep(DYNAMO_S)
        self.log("compilation/backends.py:1148", f"Dynamo bytecode transform time: {DYNAMO_S * 0.38:.2f} s")
        self.log("compilation/backends.py:378", "Cache the graph of compile range (1, 8192) for later use")
        self.settings.sleep(COMPILE_RANGE_S)
        self.log("compilation/backends.py:393", f"Compiling a graph for compile range (1, 8192) takes {COMPILE_RANGE_S * 0.52:.2f} s")
        total = DYNAMO_S * 0.38 + COMPILE_RANGE_S * 0.52 + 1.0
        self.log("compilation/monitor.py:53", f"torch.compile took {total:.2f} s in total")
        return total

    def size_kv_cache(self) -> int:
        """Available KV memory from the utilization budget; the KV failures of REFERENCE §3.2."""
        self.settings.sleep(KV_SETUP_S)
        memory = self.settings.memory()
        budget = memory.total_bytes * float(self.args.gpu_memory_utilization)
        available = budget - (self.model.weights_gib + ACTIVATION_GIB + (0 if self.enforce_eager else GRAPH_GIB)) * GIB
        self.log("v1/worker/gpu_worker.py:480", f"Available KV cache memory: {texts.format_gib(available)} GiB")
        if available <= 0:
            self.fail("no_blocks", "ValueError: " + texts.NO_KV_BLOCKS)
        per_token = self.model.kv_bytes_per_token
        needed = self.model.max_model_len * per_token
        if self.settings.scenario.kv_insufficient:
            available = min(available, needed * 0.6)
        if needed > available:
            estimated = int(available // per_token) // BLOCK_SIZE * BLOCK_SIZE
            self.fail("kv", "ValueError: " + texts.kv_insufficient_error(self.model.max_model_len, needed / GIB, available / GIB, estimated))
        tokens = int(available // (per_token * BLOCK_SIZE)) * BLOCK_SIZE
        concurrency = tokens / self.model.max_model_len
        if self.settings.minor >= 28:
            self.log("v1/core/kv_cache_utils.py:1744", f"GPU KV cache size: {tokens:,} tokens, Maximum concurrency for {self.model.max_model_len:,} tokens per request: {concurrency:.2f}x")
        else:
            self.log("v1/core/kv_cache_utils.py:1744", f"GPU KV cache size: {tokens:,} tokens")
            self.log("v1/core/kv_cache_utils.py:1745", f"Maximum concurrency for {self.model.max_model_len:,} tokens per request: {concurrency:.2f}x")
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
        for src, text in (
            ("v1/engine/core.py:1178", "[shutdown] EngineCore: trigger received signal=SIGTERM"),
            ("v1/engine/core.py:1297", "[shutdown] EngineCore: start mode=abort timeout=0s"),
            ("v1/engine/core.py:1328", "[shutdown] EngineCore: request processing complete; starting resource teardown"),
            ("v1/engine/core.py:1191", "[shutdown] EngineCore: exiting busy loop"),
        ):
            self.log(src, text)
        os._exit(0)

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
        requests: dict[str, _Request] = {}
        next_step = time.monotonic()
        while True:
            now = time.monotonic()
            if die_at is not None and now >= die_at:
                self.settings.trap_memory()
                os.kill(os.getpid(), signal.SIGKILL)
            if hang_at is not None and now >= hang_at:
                self.hang_forever()
            deadlines = [d for d in (hang_at, die_at) if d is not None]
            if requests:
                deadlines.append(max(next_step, min(r.ready_at for r in requests.values())))
            timeout = max(min(deadlines) - now, 0) if deadlines else None
            readable, _, _ = select.select([self.conn], [], [], timeout)
            if readable:
                messages = self._messages()
                if messages is None:
                    # The API server died; vLLM's EngineCore does not notice and stays.
                    self.hang_forever()
                for message in messages:
                    self._accept(message, requests)
            now = time.monotonic()
            if requests and now >= next_step:
                next_step = now + step_s
                self._step(requests, now)

    def _accept(self, message: dict[str, object], requests: dict[str, _Request]) -> None:
        rid = str(message.get("id"))
        if message.get("t") == "gen":
            prompt = int(message.get("prompt_tokens", 1))  # type: ignore[call-overload]
            ready_at = time.monotonic() + self.settings.delay(prompt / PREFILL_TOKENS_PER_S)
            requests[rid] = _Request(rid, int(message.get("max_tokens", 16)), ready_at)  # type: ignore[call-overload]
        elif message.get("t") == "abort":
            requests.pop(rid, None)

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
            if not self.send({"t": "tok", "id": request.rid, "n": count, "fin": finished, "spec": accepted}):
                self.hang_forever()


def run_engine(settings: SimSettings, args: argparse.Namespace, model: ModelFacts, conn: socket.socket) -> NoReturn:
    """Entry point of the forked child."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        EngineCore(settings, args, model, conn).run()
    except SettingsError as exc:
        # E.g. the meminfo file vanished between attempts: say so in one line.
        os.write(2, f"gb10d.sim: {exc}\n".encode())
        os._exit(2)
    except BaseException:  # noqa: BLE001 - a forked child must never return into the parent's code
        traceback.print_exc()
        os._exit(1)
