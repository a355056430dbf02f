"""Replays of a real vLLM supervised by gb10d on a GPU (tests/gpu/run-real-vllm.sh, docs/REAL_VLLM.md).

The fixtures are each start's complete stdout and stderr as the real vLLM
printed them (installation paths normalised), plus gb10d's own journal and
sd_notify messages from that run: vLLM 0.23.0 on an H200 and 0.26.0 on an
H100. Parser and decision core must read them as the live supervisor did:
every phase, no false failure, the right cause and the right next setting.

real-vllm-0.26.0-upgrade holds gb10d's journal of a reload from the 0.26.0
venv to a candidate venv whose vLLM cannot import, and back;
real-vllm-0.23.0-to-0.26.0-upgrade the same from a 0.23.0 venv, then a
reload to the 0.26.0 venv, a candidate that served and became the good one.

real-vllm-0.23.0-ray holds one start with `--distributed-executor-backend ray`
(tests/gpu/run-real-vllm-ray.sh): vLLM 0.23's default Ray executor (V2) runs
the model in a `RayWorkerProc` actor whose lines reach the EngineCore's
stderr and stdout through Ray, behind a chain of three tags.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import pytest

from config_support import make_config
from gb10d.base.command import Tunables
from gb10d.core.phases import Phase, advance, start
from gb10d.core.policy import Cause, History, Retry, classify, describe, next_attempt
from gb10d.machine import programsfile
from gb10d.vllm.events import EngineDied, Event, Failure, FreeMemoryShort, RayWorkerLost, StartupCompleted
from gb10d.vllm.logparse import Classifier, EventScanner, Kind, LineFramer

FIXTURES = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0-gb10d"
RAY_FIXTURES = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0-ray"
UPGRADE_FIXTURES = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.26.0-upgrade"
HEALTHY_STARTS = ["2-ready-then-api-server-killed", "3-ready-then-engine-killed", "4-ready-then-sigterm"]


@dataclass(frozen=True)
class RealRun:
    """One run of tests/gpu/real_vllm.py: its fixtures, the free-memory error it provoked and the utilization that fitted."""

    fixtures: Path
    short: FreeMemoryShort
    fitting: float


# Another process held 100 GiB of the H200 and 40 GiB of the H100; the config asked for 0.9 each time.
RUNS = {
    "0.23.0": RealRun(FIXTURES, FreeMemoryShort(free_gib=38.77, total_gib=139.8, requested_utilization=0.9, requested_gib=125.82, device="cuda:0"), 0.27),
    "0.26.0": RealRun(
        Path(__file__).parent.parent / "fixtures" / "real-vllm-0.26.0-gb10d",
        FreeMemoryShort(free_gib=38.15, total_gib=79.18, requested_utilization=0.9, requested_gib=71.26, device="cuda:0"), 0.46,
    ),
}


@dataclass
class Replay:
    events: list[Event] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    priorities: dict[str, int] = field(default_factory=dict)


def replay(name: str, fixtures: Path = FIXTURES) -> Replay:
    """Both streams of one start through framing, classification, event scanning and phase tracking.

    The capture kept stdout and stderr apart, so each is replayed on its own
    and the phases are checked as the union of those both streams reached.
    """
    result = Replay()
    for stream in ("stdout", "stderr"):
        framer, classifier, scanner = LineFramer(), Classifier(), EventScanner()
        state = start(0.0)
        for line in framer.feed((fixtures / f"{name}.{stream}").read_bytes()) + framer.flush():
            record = classifier.classify(line.text)
            result.priorities[line.text] = record.priority
            if record.kind is Kind.RAW and line.text.strip() and not re.fullmatch(r"(?:\(\w+ pid=\d+\) )+", line.text):
                result.raw.append(line.text)
            for event in scanner.feed(line.text):
                result.events.append(event)
                state = advance(state, event, 0.0)
                if state.phase not in result.phases:
                    result.phases.append(state.phase)
        result.events.extend(scanner.flush())
    return result


# As in the live runs: what another process left of the GPU leaves room for less than the GB10 default minimum.
config = partial(make_config, {
    "vllm": {"executable": "/opt/vllm/bin/vllm", "model": "/srv/models/tiny-llama", "gpu_memory_utilization": 0.9},
    "memory": {"min_gpu_memory_utilization": 0.1},
})


@pytest.mark.parametrize("version", RUNS)
@pytest.mark.parametrize("name", HEALTHY_STARTS)
def test_real_healthy_start_passes_every_phase_without_a_false_failure(name: str, version: str) -> None:
    r = replay(name, RUNS[version].fixtures)
    for phase in (Phase.LOADING_WEIGHTS, Phase.COMPILING, Phase.KV_CACHE, Phase.CAPTURING_GRAPHS, Phase.STARTING_SERVER):
        assert phase in r.phases, (phase, r.phases)
    assert any(isinstance(e, StartupCompleted) for e in r.events)
    failures = [e for e in r.events if isinstance(e, Failure)]
    if name == "3-ready-then-engine-killed":
        assert [type(f) for f in failures] == [EngineDied]
    else:
        assert failures == []


@pytest.mark.parametrize("version", RUNS)
@pytest.mark.parametrize("name", HEALTHY_STARTS + ["1-free-memory-failure"])
def test_every_real_line_is_classified(name: str, version: str) -> None:
    """Only torch's own glog-style lines are 'raw' text, and they still get a level."""
    r = replay(name, RUNS[version].fixtures)
    assert all(re.match(r"^(\[rank\d+\]:)?\[W\d{4} ", line) for line in r.raw), r.raw
    assert all(r.priorities[line] == 4 for line in r.raw)


@pytest.mark.parametrize("version", RUNS)
def test_real_free_memory_error_gives_the_fitting_utilization(version: str) -> None:
    run = RUNS[version]
    r = replay("1-free-memory-failure", run.fixtures)
    failures = [e for e in r.events if isinstance(e, Failure)]
    short = [e for e in failures if isinstance(e, FreeMemoryShort)]
    assert short[0] == run.short
    outcome = classify(failures, 1, was_ready=False)
    assert outcome.cause is Cause.FREE_MEMORY
    decision = next_attempt(outcome, Tunables(0.9), History(1), config())
    assert isinstance(decision, Retry)
    assert decision.tunables.gpu_memory_utilization == run.fitting  # floor((free - 1) / total, 2), what the live run used


@pytest.mark.parametrize("version", RUNS)
def test_real_engine_death_while_serving_is_classified_as_engine_dead(version: str) -> None:
    failures = [e for e in replay("3-ready-then-engine-killed", RUNS[version].fixtures).events if isinstance(e, Failure)]
    assert classify(failures, 0, was_ready=True).cause is Cause.ENGINE_DEAD


@pytest.mark.parametrize("version", RUNS)
def test_the_real_run_sent_ready_only_after_health_and_models_and_recovered_every_failure(version: str) -> None:
    fixtures = RUNS[version].fixtures
    journal = (fixtures / "gb10d-journal.txt").read_text()
    own = [line.split(" ", 1)[1] for line in journal.splitlines() if " <" in line and "gb10d: " in line]
    ready = [line for line in own if "vLLM is ready after" in line]
    assert len(ready) == 3
    assert all("/health 200, /v1/models lists tiny" in line for line in ready)
    latencies = [int(m.group(1)) for line in ready if (m := re.search(r"READY=1 (\d+) ms after", line))]
    assert latencies and max(latencies) < 1000
    notify = json.loads((fixtures / "notify.json").read_text())
    assert sum(1 for m in notify if m.get("READY") == "1") == 3
    assert notify[-1].get("STOPPING") == "1" or any(m.get("STOPPING") == "1" for m in notify)


# --- the Ray backend -----------------------------------------------------------------


def test_a_real_ray_backed_start_passes_its_phases_from_the_ray_workers_lines() -> None:
    r = replay("ready-ray-v2", RAY_FIXTURES)
    for phase in (Phase.LOADING_WEIGHTS, Phase.KV_CACHE, Phase.STARTING_SERVER):
        assert phase in r.phases, (phase, r.phases)
    assert any(isinstance(e, StartupCompleted) for e in r.events)
    assert [e for e in r.events if isinstance(e, Failure)] == []


def test_every_line_of_the_real_ray_backed_start_is_classified_with_its_level() -> None:
    r = replay("ready-ray-v2", RAY_FIXTURES)
    # Left as raw text: Ray's own logger (its level still read) and torch's glog lines.
    assert all("\tINFO worker.py:" in line or "[W1203 " in line for line in r.raw), r.raw
    warning = next(line for line in r.priorities if "Missing `shared_worker_lock`" in line)
    assert r.priorities[warning] == 4
    worker = Classifier().classify(next(line for line in r.priorities if "Loading weights took" in line))
    assert (worker.kind, worker.tag, worker.pid, worker.level) == (Kind.VLLM, "Worker", 2100, "INFO")


def test_the_real_ray_backed_run_was_ready_only_after_health_models_and_a_completion() -> None:
    journal = (RAY_FIXTURES / "gb10d-journal.txt").read_text()
    (ready,) = [line for line in journal.splitlines() if "gb10d: vLLM is ready after" in line]
    assert "/health 200, /v1/models lists tiny, warm-up completion took" in ready
    notify = json.loads((RAY_FIXTURES / "notify.json").read_text())
    statuses = [m["STATUS"] for m in notify if "STATUS" in m]
    assert any(s.startswith("loading weights 0/6") for s in statuses) and any(s.startswith("allocating KV cache") for s in statuses)
    assert [m.get("READY") for m in notify if "READY" in m] == ["1"]


def test_a_real_v2_ray_worker_killed_while_serving_is_a_lost_ray_worker() -> None:
    failures = [e for e in replay("ready-then-worker-killed-ray-v2", RAY_FIXTURES).events if isinstance(e, Failure)]
    assert failures == [RayWorkerLost("RayWorkerProc rank=[0] died unexpectedly, shutting down executor.")]
    assert classify(failures, None, was_ready=True).cause is Cause.WORKER_LOST


def test_the_real_ray_backed_run_named_the_lost_worker_and_served_again() -> None:
    journal = (RAY_FIXTURES / "gb10d-journal-worker-killed.txt").read_text()
    own = [line.split(" ", 1)[1].strip() for line in journal.splitlines() if "gb10d: " in line]
    assert any("gb10d: ray_worker_lost: RayWorkerProc rank=[0] died unexpectedly" in line
               and "restarting with the same settings in 1 s (attempt 2/4)" in line for line in own), own
    assert len([line for line in own if "vLLM is ready after" in line]) == 2


# --- upgrades on the real releases -----------------------------------------------------------


@dataclass(frozen=True)
class UpgradeRun:
    """One run of tests/gpu/real_vllm_upgrade.py: its fixtures, the good venv and its release, and what came after."""

    fixtures: Path
    good: str
    version: str
    # READY=1, RELOADING=1 and STOPPING=1 in the order systemd saw them
    sequence: tuple[str, ...]


UPGRADES = {
    # The 0.26.0 venv, a broken candidate, back; the same candidate again is refused (RELOADING=1, READY=1, nothing started).
    "0.26.0": UpgradeRun(UPGRADE_FIXTURES, "/opt/vllm-0.26.0", "0.26.0", ("READY", "RELOADING", "READY", "RELOADING", "READY", "STOPPING")),
    # The same from 0.23.0, then a reload to the 0.26.0 venv, which serves and is the good program from then on.
    "0.23.0-to-0.26.0": UpgradeRun(
        Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0-to-0.26.0-upgrade", "/opt/vllm-0.23.0", "0.23.0",
        ("READY", "RELOADING", "READY", "RELOADING", "READY", "RELOADING", "READY", "STOPPING"),
    ),
}


def journal_entries(path: Path) -> list[str]:
    """A recorded journal's entries without their time stamps and priority prefixes."""
    return [re.sub(r"^\s*[\d.]+ (<\d>)?", "", line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", UPGRADES)
def test_a_real_candidate_venv_that_cannot_import_vllm_gives_way_to_the_real_good_venv_in_one_line(name: str) -> None:
    run = UPGRADES[name]
    entries = journal_entries(run.fixtures / "gb10d-journal.txt")
    begin = next(i for i, e in enumerate(entries) if e.startswith("gb10d: started vLLM as pid") and "/opt/vllm-broken/bin/vllm serve" in e)
    end = next(i for i, e in enumerate(entries) if "going back to the last good" in e)
    scanner = EventScanner()
    events = [event for entry in entries[begin + 1:end] for event in scanner.feed(entry)] + scanner.flush()
    outcome = classify([e for e in events if isinstance(e, Failure)], 1, was_ready=False)
    assert describe(outcome) == "crash: ModuleNotFoundError: No module named 'vllm'"
    (line,) = [e for e in entries if "going back to the last good" in e]
    assert line == (
        f"gb10d: the candidate /opt/vllm-broken (vLLM of unknown version) failed its start: {describe(outcome)}; "
        f"going back to the last good {run.good} (vLLM {run.version}) with the settings that served under it (attempt 2/4)"
    )
    ready = next(e for e in entries[end:] if e.startswith("gb10d: vLLM is ready after"))
    assert ready.endswith(f"; vLLM version {run.version}")
    assert f"{run.good}/bin/vllm serve" in next(e for e in entries[end:] if e.startswith("gb10d: started vLLM as pid"))
    notify = json.loads((run.fixtures / "notify.json").read_text())
    assert tuple(key for m in notify for key in ("READY", "RELOADING", "STOPPING") if key in m) == run.sequence


@pytest.mark.parametrize("name", UPGRADES)
def test_the_real_upgrade_kept_the_good_venv_and_the_rejected_candidate(name: str) -> None:
    record = programsfile.load(UPGRADES[name].fixtures / "programs.toml")
    assert record.good is not None and record.rejected is not None
    # After 0.23.0-to-0.26.0 the 0.26.0 venv is the good one: its package hash is the one the 0.26.0-only run recorded.
    assert (record.good.path, record.good.kind, record.good.vllm_version) == ("/opt/vllm-0.26.0", "venv", "0.26.0")
    only = programsfile.load(UPGRADE_FIXTURES / "programs.toml").good
    assert only is not None and record.good.packages == only.packages
    assert record.rejected.program.path == "/opt/vllm-broken" and record.rejected.program.vllm_version is None
    assert record.rejected.failure == "crash: ModuleNotFoundError: No module named 'vllm'"


def test_a_real_0_26_candidate_after_0_23_served_and_became_the_good_program() -> None:
    entries = journal_entries(UPGRADES["0.23.0-to-0.26.0"].fixtures / "gb10d-journal.txt")
    reload = next(i for i, e in enumerate(entries) if e.startswith('gb10d: 1 key changed: vllm.venv "/opt/vllm-0.23.0" -> "/opt/vllm-0.26.0"'))
    own = [e for e in entries[reload:] if e.startswith("gb10d: ")]
    assert own[1].startswith("gb10d: started vLLM as pid") and "(attempt 1/4," in own[1] and "/opt/vllm-0.26.0/bin/vllm serve" in own[1]
    assert own[2].startswith("gb10d: vLLM is ready after") and own[2].endswith("; vLLM version 0.26.0")
    assert own[3] == "gb10d: the candidate /opt/vllm-0.26.0 (vLLM 0.26.0) served: it is the good program from now on (before: /opt/vllm-0.23.0 (vLLM 0.23.0))"
