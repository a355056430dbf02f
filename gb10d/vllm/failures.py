"""Every failure kind gb10d tells apart, declared once: how it shows, what it is called, how it is told.

One entry per kind (`FailureKind`) holds everything that names it: the
event `logparse` yields for it, the cause `policy` decides (whose value is
the metrics label of `gb10d_restarts_total` and the journal's GB10D_CAUSE),
the journal event that tells of it (its GB10D_EVENT, its MESSAGE_ID and its
entry in packaging/gb10d.catalog), its `gb10d diagnose` verdict and the
operator's fix where it needs no value of the start. `policy`, `journal`,
`metrics`, `diagnose` and the parser read this table, and nothing else lists
the kinds; docs/DESIGN.md says how to add one.

`Cause` is the table, in the order `policy.classify` looks for a cause: a
more specific failure before the generic wrapper printed after it. Kinds
without an event are gb10d's own findings (a stall, a hang, a timeout).

Pure. The patterns of the kinds older than this table stay in `logparse`
(messages that arrive in pieces, vLLM's own wording per release) and in
`known` (GB10's platform failures); the parser reads a kind's own `pattern`
beside them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from .events import (
    BadArgument,
    CudaOutOfMemory,
    DriverOutOfMemory,
    EngineDied,
    Failure,
    FreeMemoryShort,
    HiddenInitFailure,
    InternalPortInUse,
    IpcRemoved,
    KvCacheInsufficient,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    ProgramNotRun,
    PtxasArchUnsupported,
    RayWorkerLost,
    RdmaRegistrationFailed,
    UnsupportedBuild,
)
from .known import ISSUES

_CATALOG_HEADERS = "Defined-By: gb10d\nSupport: man:gb10d(8)"


@dataclass(frozen=True)
class JournalEvent:
    """One of gb10d's journal events that tell of a failure: its GB10D_EVENT, its MESSAGE_ID (fixed forever:
    dashboards, alerts and the catalog key on it), and the subject and text `journalctl -x` shows from the catalog."""

    kind: str
    message_id: str
    subject: str
    body: str

    def catalog_entry(self) -> str:
        """The entry as packaging/gb10d.catalog writes it."""
        return f"-- {self.message_id}\nSubject: {self.subject}\n{_CATALOG_HEADERS}\n\n{self.body}\n"


@dataclass(frozen=True)
class Verdict:
    """A verdict of `gb10d diagnose` and what it means, for its --help."""

    name: str
    help: str


@dataclass(frozen=True)
class Pattern:
    """How a failure shows in one message of vLLM's: plain substrings checked first (the parser runs on every
    line), then `recognise`, which builds the event or answers None."""

    needles: tuple[str, ...]
    recognise: Callable[[str], Failure | None]


@dataclass(frozen=True)
class FailureKind:
    """One failure kind: its name, how it is told, how it shows, what diagnose calls it, and whether a retry can mend it.

    `value` is the cause's word: the metrics label, GB10D_CAUSE, the state file's last failure. `event` is the
    parsed failure that shows it (a subclass counts), None for gb10d's own findings. `verdict` is diagnose's name
    for it (None: diagnose does not judge it). `gives_up`: no retry can mend it, so gb10d stops at once (exit 78)
    and it is no restart label. `advice` and `meaning` are the operator's fix and the few words for it where they
    need no value of the start; empty where `core.advice` builds them (or the known-issues table gives them).
    """

    value: str
    journal: JournalEvent
    event: type[Failure] | None = None
    verdict: Verdict | None = None
    gives_up: bool = False
    advice: str = ""
    meaning: str = ""
    pattern: Pattern | None = None


# --- the journal events that tell of failures ----------------------------------------------------------------------

EVENT_FREE_MEMORY_RETRY = JournalEvent(
    "free_memory_retry",
    "fe029b905b53406489ece35b5cb58b84",
    "Not enough free memory for vLLM; retrying with a lower utilization",
    "vLLM refused to start because the free memory it saw was less than\n"
    "gpu_memory_utilization times the total. On GB10 the GPU shares the system's\n"
    "128 GB, and the page cache (for example the model files just read) counts as\n"
    "used. gb10d restarts vLLM with a gpu_memory_utilization that fits the memory\n"
    "free now (the message gives the value), down to [memory]\n"
    "min_gpu_memory_utilization.\n"
    "\n"
    "If this happens on every start, stop other memory users, or set a lower\n"
    "[vllm] gpu_memory_utilization in /etc/gb10d.toml.",
)
EVENT_LOAD_STRATEGY_CHANGED = JournalEvent(
    "load_strategy_changed",
    "67390dda31324b039c70a5b2a297e5bd",
    "vLLM weight load strategy changed",
    "After a stalled or failed load, gb10d changed how vLLM loads the checkpoint\n"
    "for the next attempt (the message names the old and new strategy). If the new\n"
    "strategy works, gb10d may remember it in /var/lib/gb10d so later starts use it\n"
    "at once; /etc/gb10d.toml is never rewritten.",
)
EVENT_CUDA_OOM = JournalEvent(
    "cuda_oom",
    "6fbdabd1140d4b6ab6440bda68b048ca",
    "vLLM ran out of CUDA memory",
    "vLLM failed with \"CUDA out of memory\" (the message says during which phase and\n"
    "how much it tried to allocate): the model, activations and CUDA graphs did\n"
    "not fit in the memory vLLM was given, or other processes took memory. Lower [vllm] gpu_memory_utilization or max_model_len, use a quantized\n"
    "model, or stop other processes that use memory.",
)
EVENT_KV_CACHE_INSUFFICIENT = JournalEvent(
    "kv_cache_insufficient",
    "ffbbd83cf70e4fe2a1c52bea3c57ba54",
    "KV cache too small for max_model_len",
    "After loading the weights, vLLM found that the memory left for the KV cache\n"
    "cannot hold a single request of max_model_len tokens. The message gives the\n"
    "needed and available GiB, and vLLM's estimate of the largest max_model_len\n"
    "that fits. Lower [vllm] max_model_len, or raise gpu_memory_utilization if\n"
    "memory allows, in /etc/gb10d.toml.\n"
    "\n"
    "With vLLM 0.34's extensible KV cache, sized from the memory free after the\n"
    "load (where GB10 counts the page cache as used), gb10d first restarts once\n"
    "with --no-enable-extensible-kv-cache, so that the cache comes out of\n"
    "gpu_memory_utilization; the message says so.",
)
EVENT_ENGINE_DEAD = JournalEvent(
    "engine_dead",
    "c9376a33bde846c4a10f76c6f29e46da",
    "vLLM's engine core died",
    "The vLLM API server reported that its engine core process is dead, so it can\n"
    "no longer answer requests even though its port may still be open. gb10d\n"
    "stops the whole vLLM process group and starts it again: at once if vLLM had\n"
    "served for [restart] reset_after_s or longer, otherwise after a back-off and\n"
    "counted as a failed start, so an engine that dies soon after every start is\n"
    "given up on. Look at the error lines before this entry for the engine's own\n"
    "cause.",
)
EVENT_ENGINE_HUNG = JournalEvent(
    "engine_hung",
    "ae55414584b743ffb71fa0729cea318b",
    "vLLM's engine is hung",
    "vLLM stopped answering gb10d's probes, or had requests running without making\n"
    "any progress, for longer than the [liveness] limits. gb10d restarts it. If\n"
    "this repeats under heavy load, raise [liveness] probe_timeout_s or\n"
    "progress_timeout_s in /etc/gb10d.toml.",
)
EVENT_CONFIG_ERROR = JournalEvent(
    "config_error",
    "7aba519ec3b34d2bb38149b25e2c0e1d",
    "vLLM cannot start with this configuration",
    "vLLM stopped because of its configuration, not because of a passing\n"
    "condition: the port is already in use, the model does not exist or is gated,\n"
    "or an argument (such as a parser name) is invalid. Restarting will not help,\n"
    "so gb10d does not retry. Fix the setting named in the message in\n"
    "/etc/gb10d.toml, check it with `gb10d check-config`, then run\n"
    "`systemctl restart gb10d`.",
)
EVENT_CRASHED = JournalEvent(
    "crashed",
    "7f957b4dbce94de8906134f4744afe6e",
    "vLLM exited unexpectedly",
    "vLLM exited while gb10d had not asked it to stop. The message gives the exit\n"
    "status or signal and the phase. A SIGKILL usually means the kernel's\n"
    "out-of-memory killer: on GB10 the CPU and GPU share memory, so lower\n"
    "gpu_memory_utilization or max_model_len. The lines vLLM printed just before\n"
    "(journalctl -u gb10d -p warning) show the cause. gb10d restarts it within\n"
    "the limits of [restart].",
)
EVENT_IMAGE_PULL = JournalEvent(
    "image_pull",
    "a89ed8e9b5114c1f96939f95c3bc19d0",
    "gb10d pulls the image vLLM runs from",
    "The image in vllm.image is not present (or container.pull = \"always\"), so\n"
    "gb10d pulls it through the container engine before starting vLLM. STATUS=\n"
    "and `gb10d status` show how far the pull has come, and each step of it\n"
    "counts as progress: a pull that moves nothing for startup.stall_timeout_s\n"
    "is cancelled and tried again. A pull that cannot succeed (an unknown tag,\n"
    "refused credentials, an unreachable registry) stops gb10d with what to do.",
)
EVENT_DRIVER_OOM = JournalEvent(
    "driver_oom",
    "37fe2f3266a34f259795e9a6fc87221f",
    "The NVIDIA driver ran out of memory",
    "The kernel logged the NVIDIA driver's NV_ERR_NO_MEMORY. Healthy starts on\n"
    "GB10 log one such line, and a host at rest dozens a day: alone, it is told\n"
    "(a warning) and counted (gb10d_driver_oom_lines_total), and vLLM serves on.\n"
    "Under sustained pressure a freeze of the whole machine can follow, with no\n"
    "OOM kill and nothing in pstore. So gb10d stops vLLM when evidence comes\n"
    "with the line, and names it: a burst (memory.driver_oom_burst lines within\n"
    "memory.driver_oom_window_s), MemAvailable below memory.headroom_gib, a\n"
    "start that makes no progress for the window after it, or an engine that\n"
    "stops answering within it. It starts vLLM again only with a lower gpu_memory_utilization,\n"
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False and without\n"
    "--enable-flashinfer-autotune (the reported workaround), which it learns.\n"
    "If it happens again, gb10d gives up with exit status 76.",
)
EVENT_PTXAS_SM121A = JournalEvent(
    "ptxas_sm121a",
    "5800808d9ab14290ad4a847d50e17813",
    "Triton's bundled ptxas does not know sm_121a",
    "Triton compiles kernels with the ptxas it bundles, which is older than\n"
    "GB10's GPU. When a CUDA toolkit's ptxas that knows sm_121a is installed,\n"
    "gb10d starts vLLM again once with TRITON_PTXAS_PATH pointing at it and\n"
    "keeps that setting for later starts. Without one it does not retry:\n"
    "install the CUDA 13 toolkit, or set vllm.env.TRITON_PTXAS_PATH.",
)
EVENT_UNSUPPORTED_BUILD = JournalEvent(
    "unsupported_build",
    "d14965f215204b49929f8d856a1d6287",
    "The vLLM or PyTorch build cannot run on this GPU",
    "vLLM or PyTorch has no kernels for GB10's GPU (sm_121): no retry can help,\n"
    "so gb10d exits with status 78 and systemd does not restart it. Install the\n"
    "CUDA 13 aarch64 builds of PyTorch and vLLM in the venv, or run NVIDIA's\n"
    "vLLM image.",
)
EVENT_NCCL_KHO = JournalEvent(
    "nccl_kho",
    "f99475afd80941859cab1b4ed3315341",
    "NCCL cannot register RDMA memory",
    "NCCL failed in ibv_reg_mr: the kexec-handover regression of some\n"
    "7.0.0-10xx-nvidia kernels. No retry can help; boot with kho=off.",
)
EVENT_IPC_REMOVED = JournalEvent(
    "ipc_removed",
    "8b9d65696cf540c88f01a1130f622502",
    "vLLM's semaphores or shared memory were removed under it",
    "systemd-logind removes a regular user's IPC objects when that user's last\n"
    "session ends (RemoveIPC=yes), and vLLM's multiprocessing then fails. Run\n"
    "the service as its system user, set RemoveIPC=no in logind.conf, or keep\n"
    "the user lingering (loginctl enable-linger USER).",
)


# --- diagnose's verdicts for failures, in the order its --help lists them --------------------------------------------

VERDICT_SHARD_STALL = Verdict("shard_stall", "weight loading stopped making progress")
VERDICT_FREE_MEMORY = Verdict("free_memory", "too little free memory for gpu_memory_utilization at start")
VERDICT_CUDA_OOM = Verdict("cuda_oom", "CUDA ran out of memory (loading, profiling, CUDA graphs or serving)")
VERDICT_KV_CACHE = Verdict("kv_cache_insufficient", "the KV cache cannot hold one request of max_model_len, or there is no memory for it")
VERDICT_PORT_IN_USE = Verdict("port_in_use", "the API port, or a port of vLLM's internal sockets, is taken")
VERDICT_MODEL_NOT_FOUND = Verdict(
    "model_not_found", "the model is not a local directory or a reachable (or permitted) Hugging Face repository"
)
VERDICT_BAD_ARGUMENT = Verdict("bad_argument", "vLLM rejected a flag or its value")
VERDICT_ENGINE_DEAD = Verdict("engine_dead", "vLLM's engine process died")
VERDICT_PLATFORM = {issue.name: Verdict(issue.name, issue.title) for issue in ISSUES}  # GB10's own, from the known-issues table
VERDICT_CRASH = Verdict("crash", "vLLM failed in another way (the error is named)")
VERDICTS: tuple[Verdict, ...] = (
    VERDICT_SHARD_STALL, VERDICT_FREE_MEMORY, VERDICT_CUDA_OOM, VERDICT_KV_CACHE, VERDICT_PORT_IN_USE, VERDICT_MODEL_NOT_FOUND,
    VERDICT_BAD_ARGUMENT, VERDICT_ENGINE_DEAD, *VERDICT_PLATFORM.values(), VERDICT_CRASH,
)


# --- the failure kinds ------------------------------------------------------------------------------------------------


class Cause:
    """The failure kinds, in the order `policy.classify` looks for them; `Cause.IPC_REMOVED` is a `FailureKind`."""

    NO_PROGRAM = FailureKind("image_without_vllm", EVENT_CONFIG_ERROR, ProgramNotRun, VERDICT_CRASH, gives_up=True)
    FREE_MEMORY = FailureKind("free_memory", EVENT_FREE_MEMORY_RETRY, FreeMemoryShort, VERDICT_FREE_MEMORY)
    KV_CACHE = FailureKind("kv_cache", EVENT_KV_CACHE_INSUFFICIENT, KvCacheInsufficient, VERDICT_KV_CACHE)
    NO_KV_MEMORY = FailureKind("no_kv_memory", EVENT_KV_CACHE_INSUFFICIENT, NoKvCacheMemory, VERDICT_KV_CACHE)
    CUDA_OOM = FailureKind("cuda_oom", EVENT_CUDA_OOM, CudaOutOfMemory, VERDICT_CUDA_OOM)
    UNSUPPORTED_BUILD = FailureKind(
        "unsupported_build", EVENT_UNSUPPORTED_BUILD, UnsupportedBuild, VERDICT_PLATFORM["unsupported_build"], gives_up=True
    )
    PTXAS = FailureKind("ptxas_sm121a", EVENT_PTXAS_SM121A, PtxasArchUnsupported, VERDICT_PLATFORM["ptxas_sm121a"])
    DRIVER_OOM = FailureKind("driver_oom", EVENT_DRIVER_OOM, DriverOutOfMemory, VERDICT_PLATFORM["driver_oom"])
    NCCL_KHO = FailureKind("nccl_kho", EVENT_NCCL_KHO, RdmaRegistrationFailed, VERDICT_PLATFORM["nccl_kho"], gives_up=True)
    PORT_IN_USE = FailureKind("port_in_use", EVENT_CONFIG_ERROR, PortInUse, VERDICT_PORT_IN_USE, gives_up=True)
    # One of vLLM's own sockets (ZMQ, torch.distributed) found its port taken: another vLLM may still be leaving.
    INTERNAL_PORT = FailureKind("internal_port_in_use", EVENT_CRASHED, InternalPortInUse, VERDICT_PORT_IN_USE)
    MODEL_GATED = FailureKind("model_gated", EVENT_CONFIG_ERROR, ModelGated, VERDICT_MODEL_NOT_FOUND, gives_up=True)
    MODEL_NOT_FOUND = FailureKind("model_not_found", EVENT_CONFIG_ERROR, ModelNotFound, VERDICT_MODEL_NOT_FOUND, gives_up=True)
    BAD_ARGUMENT = FailureKind("bad_argument", EVENT_CONFIG_ERROR, BadArgument, VERDICT_BAD_ARGUMENT, gives_up=True)
    # One of vLLM's Ray workers died; on a pair, its machine may have left. Before ENGINE_DEAD: it is one.
    WORKER_LOST = FailureKind("ray_worker_lost", EVENT_ENGINE_DEAD, RayWorkerLost, VERDICT_ENGINE_DEAD)
    ENGINE_DEAD = FailureKind("engine_dead", EVENT_ENGINE_DEAD, EngineDied, VERDICT_ENGINE_DEAD)
    IPC_REMOVED = FailureKind("ipc_removed", EVENT_IPC_REMOVED, IpcRemoved, VERDICT_PLATFORM["ipc_removed"])
    # vLLM 0.23's `Failed core proc(s): {}` is a cause only when nothing before it said more.
    HIDDEN_INIT = FailureKind("hidden_init_failure", EVENT_CRASHED, HiddenInitFailure, VERDICT_PLATFORM["hidden_init_failure"])
    # gb10d's own findings.
    STALL = FailureKind("stall", EVENT_LOAD_STRATEGY_CHANGED, verdict=VERDICT_SHARD_STALL)
    ENGINE_HUNG = FailureKind("engine_hung", EVENT_ENGINE_HUNG)
    START_TIMEOUT = FailureKind("start_timeout", EVENT_CRASHED)
    SERVED_NAME = FailureKind("served_name_mismatch", EVENT_CONFIG_ERROR, gives_up=True)
    PULL_STALLED = FailureKind("pull_stalled", EVENT_IMAGE_PULL)  # the image's pull made no progress for startup.stall_timeout_s
    # What is left: the exception vLLM's output names, else its exit.
    CRASH = FailureKind("crash", EVENT_CRASHED, verdict=VERDICT_CRASH)


KINDS: tuple[FailureKind, ...] = tuple(kind for kind in vars(Cause).values() if isinstance(kind, FailureKind))
_PATTERNED = tuple(kind for kind in KINDS if kind.pattern is not None)
NEEDLES = tuple(needle for kind in _PATTERNED if kind.pattern is not None for needle in kind.pattern.needles)
_taught: tuple[FailureKind, ...] = ()
TAUGHT_NEEDLES: tuple[str, ...] = ()  # those of the kinds taught since: the parser's gate, built from NEEDLES, lacks them


def kinds() -> tuple[FailureKind, ...]:
    """Every failure kind: the table's, then those taught since (`teaching`)."""
    return KINDS + _taught


@contextmanager
def teaching(kind: FailureKind) -> Iterator[FailureKind]:
    """A kind known to every consumer while the block runs (a test's new kind; the table is where one belongs)."""
    global _taught, TAUGHT_NEEDLES
    before = (_taught, TAUGHT_NEEDLES)
    _taught = (*_taught, kind)
    TAUGHT_NEEDLES = (*TAUGHT_NEEDLES, *(kind.pattern.needles if kind.pattern is not None else ()))
    try:
        yield kind
    finally:
        _taught, TAUGHT_NEEDLES = before


def match(msg: str) -> list[Failure]:
    """The events of the kinds with a pattern of their own in one message (usually none)."""
    found: list[Failure] = []
    for kind in (*_PATTERNED, *_taught):
        if kind.pattern is not None and any(needle in msg for needle in kind.pattern.needles):
            event = kind.pattern.recognise(msg)
            if event is not None:
                found.append(event)
    return found


def for_event(event: Failure) -> FailureKind | None:
    """The kind a parsed failure shows, the most specific first; None for a failure no kind names (a crash)."""
    return next((kind for kind in kinds() if kind.event is not None and isinstance(event, kind.event)), None)


def journal_events() -> dict[str, JournalEvent]:
    """Each journal event that tells of a failure, by its GB10D_EVENT."""
    return {kind.journal.kind: kind.journal for kind in kinds()}


def restart_labels() -> tuple[str, ...]:
    """The causes a restart can follow (the labels of gb10d_restarts_total and gb10d_start_attempts_total): those a retry may mend."""
    return tuple(kind.value for kind in kinds() if not kind.gives_up)
