"""`gb10d diagnose`: what happened in a pasted vLLM log, and which gb10d.toml key to change.

Pure: `diagnose(text)` takes the whole log as people paste it (`pasted`
reads journalctl, docker, compose and kubectl output and their damage into
clean lines) and returns a `Diagnosis` (`diagnosis`). The verdict is about
the latest start in the input (`starts` tells the starts apart and finds
the failure that ended the latest); a failure gets its verdict from
`verdicts`, and a start that did not fail is judged here: ready, still
loading, stalled, or ended inside an error.
"""

from __future__ import annotations

from typing import Any

from ...vllm import failures
from ...vllm.events import (
    Event,
    ServerStarting,
    SpecDecodingLogged,
    StartupCompleted,
    StatsLogged,
    VersionSeen,
    WeightsLoaded,
)
from ..phases import Phase, StartupState, advance
from .diagnosis import Diagnosis
from .pasted import read_lines
from .starts import Attempt, deciding_failure, split_attempts, stop_index
from .verdicts import failure_verdict, killed_verdict


def diagnose(text: str, stall_timeout_s: float = 300.0) -> Diagnosis:
    """The verdict about the latest start in `text`, its facts and the advice."""
    lines = read_lines(text)
    attempts, times, every = split_attempts(lines)
    attempt = attempts[-1]
    facts: dict[str, Any] = {}
    version = next((e.version for e in reversed(every) if isinstance(e, VersionSeen)), None)
    if version:
        facts["vllm_version"] = version
    _stats_facts(every, facts)

    state = StartupState(phase=Phase.SPAWNING)
    progress_index: int | None = None
    for index, event in attempt.events:
        state = advance(state, event, float(index))
        if state.progressed:
            progress_index = index
    failure = deciding_failure(attempt, progress_index)
    if failure is not None:
        weights = next((e.gib for e in reversed(every) if isinstance(e, WeightsLoaded) and e.gib), None)
        return failure_verdict(failure, attempt, facts, weights)

    if attempt.killed:
        return killed_verdict(attempt, facts)
    if any(isinstance(e, (StartupCompleted, ServerStarting)) for _, e in attempt.events):
        url = next((e.url for _, e in attempt.events if isinstance(e, ServerStarting)), None)
        where = f" on {url}" if url else ""
        return Diagnosis("ready", facts, "vLLM started and serves; nothing to change.", f"vLLM is serving{where}.")
    stopped = stop_index(attempt)
    if (attempt.error_at is not None and (progress_index is None or attempt.error_at > progress_index)
            and (stopped is None or stopped < (progress_index or 0))):
        # A traceback or an error after the last progress ended the start, even if its last line is missing.
        return Diagnosis(
            failures.VERDICT_CRASH.name, facts,
            "The lines above the end of the log say what broke (the exception's own line is missing); if they name "
            "a flag or a value, change that in vllm.args of gb10d.toml (gb10d print-command shows the full command).",
            "vLLM failed after its last progress; the log ends inside the error.",
        )
    if not attempt.events:
        return Diagnosis(
            "unknown", facts,
            "Found no vLLM startup in the input; pass the whole log, e.g. journalctl -u gb10d -b --no-pager.",
            "No vLLM startup lines found.",
        )
    return _still_starting(state, attempt, _quiet_seconds(times, progress_index, attempt.first_line), facts, stall_timeout_s)


def _still_starting(state: StartupState, attempt: Attempt, quiet_s: float | None, facts: dict[str, Any],
                    stall_timeout_s: float) -> Diagnosis:
    """A start that neither failed nor served: stalled in loading when it has been quiet too long, else still loading."""
    if state.shards_total:
        facts["shards_loaded"] = state.shards_done
        facts["shards_total"] = state.shards_total
    loading_phase = state.phase in (Phase.SPAWNING, Phase.DOWNLOADING, Phase.LOADING_WEIGHTS)
    stalled = attempt.gb10d_stall or (quiet_s is not None and quiet_s > stall_timeout_s)
    if stalled and loading_phase and not (state.shards_total and state.shards_done >= state.shards_total):
        where = f" at shard {state.shards_done}/{state.shards_total}" if state.shards_total else ""
        how_long = f" for {quiet_s:.0f} s" if quiet_s is not None else ""
        if state.eager:
            advice_text = ("Loading stalls even with the eager strategy: check the model's disk (dmesg, iostat) and "
                           'MemAvailable, or try vllm.args.safetensors_load_strategy = "prefetch" in gb10d.toml.')
        else:
            advice_text = ('Set vllm.args.safetensors_load_strategy = "eager" in gb10d.toml (reads each shard into memory '
                           "instead of mmap, which avoids this stall on GB10); gb10d's startup.load_strategy_ladder does "
                           "this on the next attempt.")
        return Diagnosis(
            failures.VERDICT_SHARD_STALL.name, facts, advice_text,
            f"Weight loading made no progress{how_long}{where} (stall timeout {stall_timeout_s:g} s).",
        )
    where = f" ({state.shards_done}/{state.shards_total} shards)" if state.phase is Phase.LOADING_WEIGHTS and state.shards_total else ""
    return Diagnosis(
        "loading", facts,
        f"Nothing failed yet; vLLM is still starting. If it stays silent longer than startup.stall_timeout_s "
        f"({stall_timeout_s:g} s), set vllm.args.safetensors_load_strategy = \"eager\".",
        f"The latest start is in phase {state.phase.value}{where}"
        + (f", last progress {quiet_s:.0f} s before the log ends." if quiet_s is not None else "."),
    )


def _quiet_seconds(times: list[float | None], progress_index: int | None, first_line: int) -> float | None:
    """Seconds from the last progress to the last line, when timestamps show it; None when they cannot."""
    last = next((t for t in reversed(times[first_line:]) if t is not None), None)
    if last is None or progress_index is None:
        return None
    # A progress line without its own time (a bar) happened no earlier than the
    # next timed line: take that, so a stall is only claimed on evidence.
    at = next((t for t in times[progress_index:] if t is not None), None)
    return None if at is None else max(last - at, 0.0)


def _stats_facts(events: list[Event], facts: dict[str, Any]) -> None:
    stats = next((e for e in reversed(events) if isinstance(e, StatsLogged)), None)
    if stats is not None:
        facts["generation_tokens_per_second"] = stats.generation_tokens_per_s
    spec = next((e for e in reversed(events) if isinstance(e, SpecDecodingLogged)), None)
    if spec is not None:
        facts["mean_acceptance_length"] = spec.mean_acceptance_length
        if spec.acceptance_rate_percent is not None:
            facts["acceptance_rate_percent"] = spec.acceptance_rate_percent
