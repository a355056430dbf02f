"""phases: what each vLLM event does to a start's phase, its progress, and the STATUS= text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.core.phases import (
    Phase,
    StartupState,
    advance,
    describe,
    enter,
    note_io,
    start,
    status_text,
)
from gb10d.vllm.events import (
    ArgsSeen,
    CompileProgressed,
    CudaOutOfMemory,
    DownloadProgressed,
    EngineInitialized,
    Event,
    FreeMemoryShort,
    GraphsProgressed,
    KvCacheSized,
    LoadStarted,
    ServerStarting,
    ShardsProgressed,
    ShutdownStarted,
    StartupCompleted,
    StatsLogged,
    VersionSeen,
    WeightsLoaded,
)
from gb10d.vllm.logparse import LineFramer, parse_line

REAL = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0"


def run(events: list[Event], state: StartupState | None = None, t0: float = 100.0) -> StartupState:
    state = state or enter(start(t0 - 1), Phase.SPAWNING, t0)
    for i, event in enumerate(events):
        state = advance(state, event, t0 + i + 1)
    return state


def test_phase_values_are_the_names_everyone_shows() -> None:
    assert [p.value for p in Phase] == [
        "pulling", "preflight", "spawning", "downloading", "loading_weights", "compiling", "kv_cache", "capturing_graphs",
        "starting_server", "warming_up", "ready", "stopping", "exited",
    ]


@pytest.mark.parametrize(
    ("event", "phase"),
    [
        (VersionSeen("0.23.0"), Phase.SPAWNING),
        (ArgsSeen("{}"), Phase.SPAWNING),
        (DownloadProgressed(1e9, 5e9, "model-00001-of-00004.safetensors"), Phase.DOWNLOADING),
        (LoadStarted(), Phase.LOADING_WEIGHTS),
        (ShardsProgressed(0, 66), Phase.LOADING_WEIGHTS),
        (WeightsLoaded(seconds=3.0), Phase.LOADING_WEIGHTS),
        (CompileProgressed(False, 3.07), Phase.COMPILING),
        (KvCacheSized(available_gib=41.58), Phase.KV_CACHE),
        (GraphsProgressed(0, 51), Phase.CAPTURING_GRAPHS),
        (EngineInitialized(27.16), Phase.STARTING_SERVER),
        (ServerStarting("http://0.0.0.0:8000"), Phase.STARTING_SERVER),
        (StartupCompleted(), Phase.STARTING_SERVER),
    ],
)
def test_each_startup_line_moves_to_its_phase_and_counts_as_progress(event: Event, phase: Phase) -> None:
    state = run([event])
    assert state.phase is phase
    assert state.progressed and state.last_progress_at == 101.0


@pytest.mark.parametrize("event", [StatsLogged(1.0, 2.0, 0, 0), FreeMemoryShort(1.0, 2.0, 0.9, 1.8), CudaOutOfMemory(1.0)])
def test_stats_and_failures_are_not_progress(event: Event) -> None:
    before = run([ShardsProgressed(3, 66)])
    after = advance(before, event, 500.0)
    assert not after.progressed and after.last_progress_at == before.last_progress_at and after.phase is before.phase


def test_a_repeated_shard_state_is_not_progress_but_an_advance_is() -> None:
    state = run([ShardsProgressed(3, 66)])
    same = advance(state, ShardsProgressed(3, 66), 200.0)
    assert not same.progressed and same.last_progress_at == 101.0
    more = advance(same, ShardsProgressed(4, 66), 201.0)
    assert more.progressed and more.last_progress_at == 201.0 and more.shards_done == 4


def test_mtp_second_pass_is_progress_and_counted_as_pass_two() -> None:
    state = run([ShardsProgressed(n, 4) for n in range(5)] + [ShardsProgressed(0, 4)])
    assert state.progressed and state.load_pass == 2 and state.phase is Phase.LOADING_WEIGHTS
    assert describe(state) == "loading weights 0/4 (0%), pass 2"


def test_a_second_shard_pass_after_compile_returns_to_loading() -> None:
    state = run([ShardsProgressed(4, 4), CompileProgressed(), ShardsProgressed(0, 4)])
    assert state.phase is Phase.LOADING_WEIGHTS and state.load_pass == 2


def test_phases_never_move_backwards_on_reordered_lines() -> None:
    state = run([KvCacheSized(available_gib=1.0), CompileProgressed(), LoadStarted()])
    assert state.phase is Phase.KV_CACHE and state.progressed


def test_download_progress_is_progress_and_ends_when_shards_start() -> None:
    state = run([DownloadProgressed(1e9, 5e9, "a"), DownloadProgressed(1e9, 5e9, "a")])
    assert state.phase is Phase.DOWNLOADING and not state.progressed
    state = advance(state, DownloadProgressed(2e9, 5e9, "a"), 300.0)
    assert state.progressed and state.last_progress_at == 300.0
    state = advance(state, ShardsProgressed(0, 4), 301.0)
    assert state.phase is Phase.LOADING_WEIGHTS
    state = advance(state, DownloadProgressed(1, 2, "other"), 302.0)
    assert state.phase is Phase.LOADING_WEIGHTS


def test_graph_capture_finished_completes_the_count() -> None:
    state = run([GraphsProgressed(22, 51), GraphsProgressed(finished=True, gib=0.16)])
    assert (state.graphs_done, state.graphs_total) == (51, 51)


def test_lines_after_ready_do_not_change_the_phase() -> None:
    state = enter(run([StartupCompleted()]), Phase.READY, 400.0)
    assert advance(state, CompileProgressed(), 401.0).phase is Phase.READY
    assert advance(state, ShutdownStarted(), 402.0).phase is Phase.STOPPING


def test_supervisor_phases_are_entered_explicitly_and_count_once() -> None:
    state = enter(run([StartupCompleted()]), Phase.WARMING_UP, 400.0)
    assert state.phase is Phase.WARMING_UP and state.progressed
    again = enter(state, Phase.WARMING_UP, 500.0)
    assert not again.progressed and again.last_progress_at == 400.0


def test_io_growth_is_progress_and_a_shrinking_total_is_rebased() -> None:
    state = note_io(run([ShardsProgressed(0, 66)]), 1000, 200.0)
    assert state.progressed and state.last_progress_at == 200.0
    assert not note_io(state, 1000, 250.0).progressed
    lower = note_io(state, 10, 260.0)
    assert not lower.progressed and note_io(lower, 20, 270.0).last_progress_at == 270.0


@pytest.mark.parametrize(
    ("events", "text"),
    [
        ([], "starting vllm, attempt 2/5, gpu_memory_utilization=0.83"),
        ([ShardsProgressed(33, 66)], "loading weights 33/66 (50%), attempt 2/5, gpu_memory_utilization=0.83"),
        ([ShardsProgressed(3, 66, eager=True)], "loading weights 3/66 (4%), eager, attempt 2/5, gpu_memory_utilization=0.83"),
        ([DownloadProgressed(2.23e9, 4.95e9, "model-00001-of-00066.safetensors")],
         "downloading model-00001-of-00066.safetensors 2.2 GB/5.0 GB (45%), attempt 2/5, gpu_memory_utilization=0.83"),
        ([DownloadProgressed(9, 75, "Fetching 75 files")], "downloading Fetching 75 files 9/75 (12%), attempt 2/5, gpu_memory_utilization=0.83"),
        ([DownloadProgressed(2.23e9, None, "model")], "downloading model 2.2 GB, attempt 2/5, gpu_memory_utilization=0.83"),
        ([CompileProgressed()], "compiling (torch.compile), attempt 2/5, gpu_memory_utilization=0.83"),
        ([GraphsProgressed(22, 51)], "capturing CUDA graphs 22/51 (43%), attempt 2/5, gpu_memory_utilization=0.83"),
    ],
)
def test_status_text_says_phase_progress_attempt_and_utilization(events: list[Event], text: str) -> None:
    assert status_text(run(events), 2, 5, 0.83) == text


def test_status_text_is_ascii_even_for_odd_file_names() -> None:
    state = run([DownloadProgressed(1e9, 5e9, "modèle—1.safetensors")])
    assert status_text(state, 1, 5, 0.9).isascii()


def interleaved_real_start() -> list[str]:
    """The recorded healthy start with stderr's bars put back where they were printed (after the line named)."""
    def lines(name: str) -> list[str]:
        framer = LineFramer()
        return [line.text for line in framer.feed((REAL / name).read_bytes()) + framer.flush()]

    out, err = lines("healthy.stdout"), lines("healthy.stderr")
    anchors = {"Auto-prefetch is disabled": "checkpoint shards", "Maximum concurrency for": "Capturing CUDA graphs",
               "Route: /v1/completions/render": "INFO:     "}
    merged: list[str] = []
    for text in out:
        merged.append(text)
        for anchor, wanted in anchors.items():
            if anchor in text:
                merged.extend(e for e in err if wanted in e and "Shutting down" not in e and "shutdown" not in e)
    return merged


def test_the_real_healthy_start_walks_through_the_phases_in_order() -> None:
    state = enter(start(0.0), Phase.SPAWNING, 0.0)
    seen = [state.phase]
    for second, text in enumerate(interleaved_real_start()):
        for event in parse_line(text):
            state = advance(state, event, float(second))
            if state.phase is not seen[-1]:
                seen.append(state.phase)
    assert seen == [Phase.SPAWNING, Phase.LOADING_WEIGHTS, Phase.COMPILING, Phase.KV_CACHE, Phase.CAPTURING_GRAPHS,
                    Phase.STARTING_SERVER, Phase.STOPPING]
    assert state.server_started and (state.shards_done, state.shards_total) == (6, 6)
    assert (state.graphs_done, state.graphs_total) == (51, 51)
