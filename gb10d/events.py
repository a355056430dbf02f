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


@dataclass(frozen=True)
class NoKvCacheMemory(Failure):
    """`No available memory for the cache blocks.`"""


@dataclass(frozen=True)
class PortInUse(Failure):
    """`OSError: [Errno 98] Address already in use`."""

    port: int | None = None


@dataclass(frozen=True)
class ModelNotFound(Failure):
    """The model is neither a local folder nor a valid Hugging Face repository."""

    model: str


@dataclass(frozen=True)
class ModelGated(Failure):
    """The repository is gated and the token (if any) has no access."""

    model: str | None = None


@dataclass(frozen=True)
class BadArgument(Failure):
    """vLLM rejected its command line: unknown flag, bad parser name, bad value."""

    message: str


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
