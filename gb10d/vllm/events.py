"""Facts gb10d learns from vLLM's output, as past-tense frozen dataclasses.

`logparse.parse_line` turns one logical line of vLLM output into at most a
few of these; `phases`, `policy`, `diagnose`, `metrics` and the supervisor
consume them. They carry numbers exactly as vLLM printed them (GiB as
floats, counts as ints), never derived judgements.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    """Base of every parsed fact."""


# --- startup progress -------------------------------------------------------


@dataclass(frozen=True)
class VersionSeen(Event):
    """vLLM printed its version (banner or `Initializing a V1 LLM engine (vX)`)."""

    version: str


@dataclass(frozen=True)
class ArgsSeen(Event):
    """The `non-default args: {...}` line (raw repr, for diagnose)."""

    text: str


@dataclass(frozen=True)
class DownloadProgressed(Event):
    """A Hugging Face download bar advanced (per file, bytes when known)."""

    done: float
    total: float | None
    description: str = ""


@dataclass(frozen=True)
class LoadStarted(Event):
    """Weight loading began (`Starting to load model`, `Loading model from scratch`, filesystem line)."""


@dataclass(frozen=True)
class ShardsProgressed(Event):
    """The safetensors shard bar shows `done` of `total` files."""

    done: int
    total: int
    eager: bool = False


@dataclass(frozen=True)
class WeightsLoaded(Event):
    """`Loading weights took S seconds` or `Model loading took G GiB ...`."""

    seconds: float | None = None
    gib: float | None = None


@dataclass(frozen=True)
class CompileProgressed(Event):
    """A torch.compile line (bytecode transform, compiling a range, cache hit, total)."""

    finished: bool = False
    seconds: float | None = None


@dataclass(frozen=True)
class KvCacheSized(Event):
    """`Available KV cache memory: G GiB` and/or `... KV cache size: N tokens`."""

    available_gib: float | None = None
    tokens: int | None = None
    max_concurrency: float | None = None


@dataclass(frozen=True)
class GraphsProgressed(Event):
    """A CUDA graph capture bar advanced, or `Graph capturing finished` (then `finished`, counts 0)."""

    done: int = 0
    total: int = 0
    finished: bool = False
    gib: float | None = None


@dataclass(frozen=True)
class EngineInitialized(Event):
    """`init engine (profile, create kv cache, warmup model) took S s`."""

    seconds: float


@dataclass(frozen=True)
class ServerStarting(Event):
    """`Starting vLLM server on URL` (the API server is about to serve)."""

    url: str


@dataclass(frozen=True)
class TasksSupported(Event):
    """`Supported tasks: ['generate']` (a tuple when the engine runs in-process): what the model serves, hence
    which routes vLLM opens (`['embed', 'token_embed']` for an embedding model, which answers 404 to completions)."""

    tasks: tuple[str, ...]


@dataclass(frozen=True)
class StartupCompleted(Event):
    """uvicorn's `Application startup complete.`: /health can answer within moments."""


# --- failures ---------------------------------------------------------------


@dataclass(frozen=True)
class Failure(Event):
    """Base of the events that explain why a start or a running server failed.

    `node` is the Ray node address of a remote worker that printed it (a pair of machines), else None.
    """

    node: str | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class FreeMemoryShort(Failure):
    """vLLM's startup check: free memory below gpu_memory_utilization of total."""

    free_gib: float
    total_gib: float
    requested_utilization: float
    requested_gib: float
    device: str = "cuda:0"


@dataclass(frozen=True)
class CudaOutOfMemory(Failure):
    """`CUDA out of memory. Tried to allocate X GiB` (or MiB); phase tells where."""

    tried_gib: float | None = None
    during_load: bool = False


@dataclass(frozen=True)
class KvCacheInsufficient(Failure):
    """The KV cache cannot hold one request of max_model_len."""

    max_model_len: int
    needed_gib: float | None  # None: the V0 engine's wording (before 0.8) counts tokens, not GiB
    available_gib: float | None
    estimated_max_model_len: int | None = None
    extensible: bool = False  # vLLM 0.34's extensible KV cache, sized from what was free after the load, was too small


@dataclass(frozen=True)
class NoKvCacheMemory(Failure):
    """`No available memory for the cache blocks.`"""

    extensible: bool = False  # vLLM 0.34's extensible KV cache: nothing was free after the load


@dataclass(frozen=True)
class PortInUse(Failure):
    """The API port is taken: vLLM's `OSError: [Errno 98] Address already in use`, or uvicorn's bind error."""

    port: int | None = None


@dataclass(frozen=True)
class InternalPortInUse(Failure):
    """A port of vLLM's own internal sockets is taken (ZMQ, torch.distributed's store), not the API port.

    `address` is the socket's address as printed (`tcp://127.0.0.1:29500`), empty when the text gave none.
    """

    port: int | None = None
    address: str = ""


@dataclass(frozen=True)
class ModelNotFound(Failure):
    """The model is neither a local folder nor a valid Hugging Face repository.

    `model` is empty when the text did not name it; `unreachable` means the
    Hub could not be reached and the model is not in the local cache.
    """

    model: str
    unreachable: bool = False


@dataclass(frozen=True)
class ModelGated(Failure):
    """The repository is gated and the token (if any) has no access."""

    model: str | None = None


@dataclass(frozen=True)
class BadArgument(Failure):
    """vLLM rejected its command line: unknown flag, bad parser name, bad value.

    `flag` and `value` are the option and the value it refused, when the text names them.
    """

    message: str
    flag: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class EngineDied(Failure):
    """The engine core is dead (`EngineDeadError`, `engine core exited unexpectedly`)."""

    message: str = ""


@dataclass(frozen=True)
class RayWorkerLost(EngineDied):
    """A Ray worker of the engine is gone (`ActorDiedError`, `RayActorError`, V2's `RayWorkerProc rank=[N] died unexpectedly`).

    The engine is dead, and the worker's machine may have left the cluster.
    """


@dataclass(frozen=True)
class EngineStartFailed(Failure):
    """`Engine core initialization failed` / `EngineCore failed to start.`: a wrapper, see the lines before."""


@dataclass(frozen=True)
class HiddenInitFailure(EngineStartFailed):
    """vLLM 0.23's `Engine core initialization failed. ... Failed core proc(s): {}`.

    A root cause only when no failure came before it in the same start:
    0.23 can end an engine start with this line alone (0.24 prints the root
    cause). Consumers decide that from the failures they saw before it.
    """


@dataclass(frozen=True)
class ProgramNotRun(Failure):
    """A container's init could not run vLLM's program (`[FATAL tini (7)] exec vllm failed: No such file or directory`).

    Docker's init (tini) names the program, podman's (catatonit) does not;
    `reason` is the system's error text. The image has no usable `vllm`.
    """

    program: str | None
    reason: str


# --- GB10 platform failures (the known-issues table, `known.ISSUES`) ----------


@dataclass(frozen=True)
class PlatformFailure(Failure):
    """Base of the failures of GB10's platform (builds, Triton, the driver, the kernel, IPC).

    `detail` is the text that showed it, for the journal.
    """

    detail: str = field(default="", kw_only=True)


@dataclass(frozen=True)
class PtxasArchUnsupported(PlatformFailure):
    """Triton's bundled ptxas does not know the GPU's architecture (`Value 'sm_121a' is not defined for option 'gpu-name'`)."""

    arch: str = "sm_121a"


@dataclass(frozen=True)
class UnsupportedBuild(PlatformFailure):
    """The vLLM or PyTorch build has no kernels for this GPU (`no kernel image is available`, `cudaErrorUnsupportedPtxVersion`)."""


@dataclass(frozen=True)
class IpcRemoved(PlatformFailure):
    """vLLM's semaphores or shared memory were removed under it (logind's RemoveIPC).

    `confirmed` is false for the shared-memory broadcast timeout, which a
    process that hangs or compiles for long also causes.
    """

    confirmed: bool = True


@dataclass(frozen=True)
class RdmaRegistrationFailed(PlatformFailure):
    """NCCL could not register memory with the RDMA device (`ibv_reg_mr_iova2 failed with error Cannot allocate memory`)."""


@dataclass(frozen=True)
class DriverOutOfMemory(PlatformFailure):
    """The kernel's NVIDIA driver ran out of memory (`NVRM: ... Out of memory [NV_ERR_NO_MEMORY]`); a host freeze may follow."""


@dataclass(frozen=True)
class GpuXid(PlatformFailure):
    """The NVIDIA driver reported an Xid error (`NVRM: Xid (PCI:0000:01:00): 79, ...`); `kernel.xid_meaning` explains it."""

    xid: int = 0
    pci: str = ""


@dataclass(frozen=True)
class ExceptionRaised(Failure):
    """The last line of a traceback, `ExcType: message`, that no specific event explains."""

    exc_type: str
    message: str


# --- steady state -----------------------------------------------------------


@dataclass(frozen=True)
class StatsLogged(Event):
    """A periodic `Engine 000: Avg prompt throughput ...` line."""

    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    running: int
    waiting: int
    kv_cache_usage_percent: float | None = None
    prefix_cache_hit_percent: float | None = None
    engine: str = "000"


@dataclass(frozen=True)
class SpecDecodingLogged(Event):
    """A periodic `SpecDecoding metrics:` line."""

    mean_acceptance_length: float
    accepted_tokens_per_s: float
    drafted_tokens_per_s: float
    accepted: int
    drafted: int
    per_position: tuple[float, ...] = field(default_factory=tuple)
    acceptance_rate_percent: float | None = None


@dataclass(frozen=True)
class ShutdownStarted(Event):
    """A stop was asked for: `[shutdown] API server: shutdown triggered`, `EngineCore: trigger received signal=...`, uvicorn's `Shutting down`."""
