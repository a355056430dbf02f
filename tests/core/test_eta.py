"""A start's time left: the phases of the model's last complete start make the estimate that STATUS=, `gb10d status`
and the front's page show (`about 14 min left (the last start took 31 min)`); a first start says it has none.

The arithmetic is a table; the end-to-end test starts a sim model twice and reads the second start's STATUS= and
`gb10d status` while its weights load.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gb10d.core.eta import NO_ESTIMATE, PhaseClock, estimate, of_state
from gb10d.core.statefile import DaemonState, Progress, StateRecord
from gb10d.daemon.lab import wait_until
from gb10d.daemon.learnedfile import load_start_times, save_start_times, start_times_file
from gb10d.machine.statefile import read_state
from harness import Daemon, NotifySocket, Setup

# A 31-minute start, mostly loading weights, as a large model's on a GB10.
LAST = {"preflight": 5.0, "spawning": 55.0, "loading_weights": 1200.0, "compiling": 300.0, "kv_cache": 60.0,
        "capturing_graphs": 180.0, "starting_server": 20.0, "warming_up": 40.0}


@pytest.mark.parametrize(("phase", "progress", "elapsed_s", "said"), [
    ("spawning", None, 20.0, "about 31 min left (the last start took 31 min)"),
    ("loading_weights", (33, 66), 660.0, "about 20 min left (the last start took 31 min)"),
    ("loading_weights", (66, 66), 1300.0, "about 10 min left (the last start took 31 min)"),
    # Without a shard count: what the last start had spent by this phase's end, less the time spent so far.
    ("compiling", None, 1260.0, "about 10 min left (the last start took 31 min)"),
    ("warming_up", None, 1855.0, "about 5 s left (the last start took 31 min)"),
    ("warming_up", None, 2500.0, "taking longer than the last start (31 min)"),
    # A phase the last start did not go through (a cold cache's download) leaves what the rest took.
    ("downloading", None, 10.0, "about 30 min left (the last start took 31 min)"),
])
def test_the_time_left_is_the_rest_of_this_phase_and_every_later_phase_as_long_as_last_time(
    phase: str, progress: tuple[int, int] | None, elapsed_s: float, said: str,
) -> None:
    assert estimate(LAST, phase, progress, elapsed_s) == said


def test_a_first_start_says_it_has_no_estimate() -> None:
    assert estimate({}, "loading_weights", (3, 66), 40.0) == NO_ESTIMATE == "no estimate yet: this is its first start"


def test_the_phase_clock_adds_each_phase_once_even_when_told_again_and_counts_the_last_up_to_now() -> None:
    clock = PhaseClock().moved("spawning", 100.0).moved("spawning", 104.0).moved("loading_weights", 110.0)
    clock = clock.moved("compiling", 150.0).moved("loading_weights", 160.0)  # a second pass over the shards (MTP)
    assert clock.until(175.0) == {"spawning": 10.0, "loading_weights": 55.0, "compiling": 10.0}


def test_a_state_file_shows_an_estimate_only_while_a_start_is_in_progress() -> None:
    starting = StateRecord(state=DaemonState.STARTING, phase="loading_weights", progress=Progress(33, 66), memory_at=1000.0, last_start=LAST)
    assert of_state(starting, 1660.0) == "about 20 min left (the last start took 31 min)"
    assert of_state(StateRecord(state=DaemonState.SERVING, phase="ready", last_start=LAST), 1660.0) is None


def test_the_phases_are_kept_per_config_and_another_config_gets_none(tmp_path: Path) -> None:
    path = start_times_file(tmp_path / "lib" / "state.toml")
    assert path.name == "state.starts.toml"
    assert load_start_times(path, "abc") == {}
    save_start_times(path, "abc", LAST, "2026-12-07T10:00:00+00:00")
    assert load_start_times(path, "abc") == LAST
    assert load_start_times(path, "another") == {}
    path.write_text("not [toml")
    assert load_start_times(path, "abc") == {}


def gb10d_status(setup: Setup) -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "gb10d", "status", "--config", str(setup.config)], capture_output=True, text=True, timeout=60).stdout
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*([A-Z][\w ]*?):\s+(.*)$", out, re.M)}


@pytest.mark.slow
def test_a_second_start_of_the_same_model_estimates_its_time_left_from_the_first(tmp_path: Path, notify: NotifySocket) -> None:
    setup = Setup(tmp_path, scenario="slow_shards=30")
    first = Daemon(setup, notify)
    try:
        notify.wait_for(lambda m: m.get("READY") == "1", 120)
        assert any(NO_ESTIMATE in s for s in notify.statuses()), notify.statuses()
    finally:
        first.stop()
        first.kill_everything()
    kept = tomllib.loads(start_times_file(setup.root / "lib" / "state.toml").read_text())["last_start"]["phases"]
    assert kept["loading_weights"] >= 6 * 0.3 * 0.9, kept  # six shards of 0.3 s each

    # The second start stops at shard 3 of 6 (the stall timeout far away): half its weights are still to load.
    setup.scenario = "stall_at=3"
    setup.extra = {"startup.stall_timeout_s": 300.0}
    setup.write_config()
    since = len(notify.keys())
    second = Daemon(setup, notify)
    try:
        status = notify.wait_for(lambda m: "loading weights 3/6" in m.get("STATUS", ""), 120, since=since)["STATUS"]
        assert re.search(r"; about \d+ s left \(the last start took \d+ s\)$", status), status
        assert wait_until(lambda: (r := read_state(setup.state_file)) is not None and r.progress is not None and r.progress.shards_done == 3, 60)
        left = gb10d_status(setup)["Time left"]
        assert re.fullmatch(r"about \d+ s left \(the last start took \d+ s\)", left), left
    finally:
        second.stop()
        second.kill_everything()
