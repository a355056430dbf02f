"""Where a vLLM start stands: explicit phases, progress counts, and the STATUS= text for systemd.

Pure: `advance(state, event, now)` folds one parsed event into a new
`StartupState`, with `now` (monotonic seconds) passed in, and says whether the
event counted as *progress*. The lifecycle core extends systemd's start
timeout only on progress and calls a load stalled when progress stops, so what counts
is decided here, once: a shard or download advancing, a new phase, compile,
KV-cache and weight lines, and growth in the bytes vLLM's processes read or
wrote (`note_io`), and before a container starts, each step of its image's
pull (`note_pull`). Periodic stats and failure lines are not progress.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from ..base.image import PullProgress
from ..vllm.events import (
    ArgsSeen,
    CompileProgressed,
    DownloadProgressed,
    EngineInitialized,
    Event,
    GraphsProgressed,
    KvCacheSized,
    LoadStarted,
    ServerStarting,
    ShardsProgressed,
    ShutdownStarted,
    StartupCompleted,
    VersionSeen,
    WeightsLoaded,
)


class Phase(str, Enum):
    """A start's phases in order; the values are the names STATUS=, metrics and `gb10d status` show."""

    PULLING = "pulling"  # a container image, before the first start of a sequence
    PREFLIGHT = "preflight"
    SPAWNING = "spawning"
    DOWNLOADING = "downloading"
    LOADING_WEIGHTS = "loading_weights"
    COMPILING = "compiling"
    KV_CACHE = "kv_cache"
    CAPTURING_GRAPHS = "capturing_graphs"
    STARTING_SERVER = "starting_server"
    WARMING_UP = "warming_up"
    READY = "ready"
    STOPPING = "stopping"
    EXITED = "exited"


_ORDER = {phase: index for index, phase in enumerate(Phase)}
# Phases in which vLLM's own lines move the phase; before and after, the lifecycle core does (`enter`).
_EVENT_DRIVEN = frozenset(
    {Phase.PREFLIGHT, Phase.SPAWNING, Phase.DOWNLOADING, Phase.LOADING_WEIGHTS, Phase.COMPILING,
     Phase.KV_CACHE, Phase.CAPTURING_GRAPHS, Phase.STARTING_SERVER}
)


@dataclass(frozen=True)
class StartupState:
    """Everything known about the current start's progress.

    `progressed` tells whether the latest `advance`/`enter`/`note_io` counted
    as progress; `last_progress_at` is the monotonic time of the latest one.
    `load_pass` counts 0->N passes of the shard bar: the MTP drafter loads the
    checkpoint a second time, which is progress, not a regression.
    """

    phase: Phase = Phase.PREFLIGHT
    phase_since: float | None = None
    last_progress_at: float | None = None
    progressed: bool = False
    shards_done: int = 0
    shards_total: int = 0
    load_pass: int = 0
    eager: bool = False
    graphs_done: int = 0
    graphs_total: int = 0
    download_done: float = 0.0
    download_total: float | None = None
    download_description: str = ""
    server_started: bool = False
    io_bytes: int = 0
    pull: PullProgress | None = None


def start(now: float) -> StartupState:
    """A fresh state for a new attempt, in preflight."""
    return StartupState(phase=Phase.PREFLIGHT, phase_since=now, last_progress_at=now, progressed=True)


def enter(state: StartupState, phase: Phase, now: float) -> StartupState:
    """Move to a phase the lifecycle core decides (spawning, warming_up, ready, stopping, exited); progress if new."""
    if phase == state.phase:
        return replace(state, progressed=False)
    return replace(state, phase=phase, phase_since=now, last_progress_at=now, progressed=True)


def note_io(state: StartupState, io_bytes: int, now: float) -> StartupState:
    """Fold in the total bytes read+written by vLLM's process tree; growth is progress (a silent load still reads).

    A smaller total (a process of the tree exited) is remembered without
    counting, so growth from there is seen again.
    """
    if io_bytes > state.io_bytes:
        return replace(state, io_bytes=io_bytes, last_progress_at=now, progressed=True)
    return replace(state, io_bytes=io_bytes, progressed=False)


def note_pull(state: StartupState, progress: PullProgress, now: float) -> StartupState:
    """Fold in a step of the image's pull: the engine reports one only when a layer moved, so each is progress."""
    return replace(state, phase=Phase.PULLING, pull=progress, last_progress_at=now, progressed=True,
                   phase_since=state.phase_since if state.phase is Phase.PULLING else now)


def _to(state: StartupState, phase: Phase, now: float, progressed: bool = True, back: bool = False,
        **changes: object) -> StartupState:
    """`state` with `changes`, moved to `phase`.

    Phases only move forward (lines may come out of order), unless `back`:
    a second shard pass or a download really does put vLLM back there.
    """
    new_phase = state.phase
    if state.phase in _EVENT_DRIVEN and (_ORDER[phase] > _ORDER[state.phase] or back):
        new_phase = phase
    moved = new_phase != state.phase
    progress = progressed or moved
    return replace(
        state,
        phase=new_phase,
        phase_since=now if moved else state.phase_since,
        last_progress_at=now if progress else state.last_progress_at,
        progressed=progress,
        **changes,  # type: ignore[arg-type]
    )


def advance(state: StartupState, event: Event, now: float) -> StartupState:
    """The state after `event`, with `progressed` saying whether it counts as progress."""
    if isinstance(event, ShardsProgressed):
        changed = (event.done, event.total) != (state.shards_done, state.shards_total)
        load_pass = state.load_pass
        if load_pass == 0 or (changed and event.done < state.shards_done):
            load_pass += 1
        return _to(state, Phase.LOADING_WEIGHTS, now, changed, back=True, shards_done=event.done,
                   shards_total=event.total, load_pass=load_pass, eager=event.eager)
    if isinstance(event, DownloadProgressed):
        changed = (event.done, event.total, event.description) != (
            state.download_done, state.download_total, state.download_description)
        # Weights are fetched before the shard bar starts; a bar after that is some other file.
        downloading = state.shards_total == 0 and _ORDER[state.phase] <= _ORDER[Phase.LOADING_WEIGHTS]
        return _to(state, Phase.DOWNLOADING if downloading else state.phase, now, changed, back=downloading,
                   download_done=event.done, download_total=event.total, download_description=event.description)
    if isinstance(event, (LoadStarted, WeightsLoaded)):
        return _to(state, Phase.LOADING_WEIGHTS, now)
    if isinstance(event, CompileProgressed):
        return _to(state, Phase.COMPILING, now)
    if isinstance(event, KvCacheSized):
        return _to(state, Phase.KV_CACHE, now)
    if isinstance(event, GraphsProgressed):
        if event.finished:
            return _to(state, Phase.CAPTURING_GRAPHS, now, graphs_done=state.graphs_total)
        changed = (event.done, event.total) != (state.graphs_done, state.graphs_total)
        return _to(state, Phase.CAPTURING_GRAPHS, now, changed, graphs_done=event.done, graphs_total=event.total)
    if isinstance(event, (EngineInitialized, ServerStarting)):
        return _to(state, Phase.STARTING_SERVER, now)
    if isinstance(event, StartupCompleted):
        return _to(state, Phase.STARTING_SERVER, now, server_started=True)
    if isinstance(event, (VersionSeen, ArgsSeen)):
        return _to(state, Phase.SPAWNING, now)
    if isinstance(event, ShutdownStarted) and state.phase not in (Phase.STOPPING, Phase.EXITED):
        return replace(state, phase=Phase.STOPPING, phase_since=now, progressed=False)
    return replace(state, progressed=False) if state.progressed else state


def _percent(done: float, total: float) -> str:
    return f"{int(done * 100 // total)}%" if total > 0 else "?%"


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f}"


def _ascii(text: str) -> str:
    # sd_notify texts must be Latin-1 (the sdnotify package drops others silently); keep to ASCII.
    return text.encode("ascii", "replace").decode("ascii")


def describe(state: StartupState) -> str:
    """The phase and its progress in words, e.g. `loading weights 33/66 (50%)`."""
    phase = state.phase
    if phase == Phase.PULLING and state.pull is not None:
        return state.pull.describe()
    if phase == Phase.DOWNLOADING:
        what = state.download_description or "model"
        if state.download_total:
            is_bytes = state.download_total >= 1e4
            done = _size(state.download_done) if is_bytes else f"{state.download_done:.0f}"
            total = _size(state.download_total) if is_bytes else f"{state.download_total:.0f}"
            return f"downloading {what} {done}/{total} ({_percent(state.download_done, state.download_total)})"
        return f"downloading {what} {_size(state.download_done)}" if state.download_done else f"downloading {what}"
    if phase == Phase.LOADING_WEIGHTS:
        if state.shards_total:
            text = f"loading weights {state.shards_done}/{state.shards_total} ({_percent(state.shards_done, state.shards_total)})"
            if state.load_pass > 1:
                text += f", pass {state.load_pass}"
            return text + (", eager" if state.eager else "")
        return "loading weights"
    if phase == Phase.CAPTURING_GRAPHS and state.graphs_total:
        return f"capturing CUDA graphs {state.graphs_done}/{state.graphs_total} ({_percent(state.graphs_done, state.graphs_total)})"
    return _WORDS[phase]


_WORDS = {
    Phase.PULLING: "pulling the image",
    Phase.PREFLIGHT: "preflight checks",
    Phase.SPAWNING: "starting vllm",
    Phase.DOWNLOADING: "downloading model",
    Phase.LOADING_WEIGHTS: "loading weights",
    Phase.COMPILING: "compiling (torch.compile)",
    Phase.KV_CACHE: "allocating KV cache",
    Phase.CAPTURING_GRAPHS: "capturing CUDA graphs",
    Phase.STARTING_SERVER: "starting API server",
    Phase.WARMING_UP: "warming up",
    Phase.READY: "serving",
    Phase.STOPPING: "stopping",
    Phase.EXITED: "exited",
}


def status_text(state: StartupState, attempt: int, max_attempts: int, utilization: float) -> str:
    """The ASCII STATUS= text, e.g. `loading weights 33/66 (50%), attempt 2/5, gpu_memory_utilization=0.83`.

    A pull says nothing of the utilization: the settings of the start are decided once the image is known.
    """
    if state.phase is Phase.PULLING:
        return _ascii(f"{describe(state)}, attempt {attempt}/{max_attempts}")
    return _ascii(f"{describe(state)}, attempt {attempt}/{max_attempts}, gpu_memory_utilization={utilization:g}")
