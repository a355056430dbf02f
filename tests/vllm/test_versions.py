"""gb10d against each vLLM release it claims (0.27-0.34): the stand-in plays the release, gb10d recognises it.

Every release is started for real by `gb10d run` with the stand-in set to
that version: the lines gb10d keys on (KV cache, model loading, process
tags, failures) change between releases, and the one start that must keep
working everywhere is a start short of free memory. Up to 0.33 vLLM's own
check at the start fails it and gb10d lowers the utilization; 0.34 skips
that check (its extensible KV cache is sized from what is free after the
load) and becomes ready at once, with a smaller cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness import Daemon, NotifySocket, Setup

pytestmark = pytest.mark.slow

RELEASES = ("0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")


def run(setup: Setup, notify: NotifySocket, daemons: list[Daemon]) -> Daemon:
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    return daemon


def starts(daemon: Daemon) -> list[str]:
    return [line for line in daemon.own_lines() if "started vLLM as pid" in line]


@pytest.mark.parametrize("release", RELEASES)
def test_a_start_short_of_free_memory_ends_ready_on_every_release(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon], release: str
) -> None:
    # 0.92 of 121.69 GiB is 111.95 GiB but only 103.45 GiB are free; preflight off, so only vLLM can notice.
    setup = Setup(tmp_path, free_gib=103.45, utilization=0.92, extra={"memory.preflight": False}, sim_env={"GB10D_SIM_VERSION": release})
    daemon = run(setup, notify, daemons)
    notify.wait_for(lambda m: m.get("READY") == "1", 90.0)
    ready = daemon.wait_line(r"gb10d: vLLM is ready after .*; vLLM version (\S+)$")
    assert ready.group(1) == release
    if release == "0.34.0":
        assert len(starts(daemon)) == 1 and "--gpu-memory-utilization 0.92" in starts(daemon)[0]
        kv = daemon.wait_line(r"Available KV cache memory: ([\d.]+) GiB")
        assert float(kv.group(1)) < 103.45 - 1.0  # sized from what was free, not from 111.95 GiB
    else:
        daemon.wait_line(r"gb10d: free memory 103.45 of 121.69 GiB is below gpu_memory_utilization 0.92 \(111.95 GiB\); restarting with 0.84 ")
        assert len(starts(daemon)) == 2 and "--gpu-memory-utilization 0.84" in starts(daemon)[1]
    assert notify.count("READY", "1") == 1
    assert daemon.stop() == 0


def test_a_034_kv_cache_the_page_cache_starved_is_sized_from_the_budget_next_time(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    # The load leaves the checkpoint's pages in the page cache, which GB10 counts as used where vLLM 0.34 measures
    # what is free for its extensible KV cache: nothing is left for it. Sized from the budget, the cache gets its share.
    setup = Setup(tmp_path, sim_env={"GB10D_SIM_VERSION": "0.34.0", "GB10D_SIM_SCENARIO": "page_cache_gib=200"})
    daemon = run(setup, notify, daemons)
    notify.wait_for(lambda m: m.get("READY") == "1", 90.0)
    daemon.wait_line(r"No available memory for the cache blocks\. The KV cache gets what is left after the model and its activations")
    line = daemon.wait_line(r"gb10d: .*vLLM sized its extensible KV cache from the memory free after loading the model.*restarting with --no-enable-extensible-kv-cache")
    assert "(attempt 2/3)" in line.string
    assert len(starts(daemon)) == 2
    assert "--no-enable-extensible-kv-cache" not in starts(daemon)[0] and "--no-enable-extensible-kv-cache" in starts(daemon)[1]
    daemon.wait_line(r"GPU KV cache size: [\d,]+ tokens")
    assert daemon.stop() == 0
    # What served is learned: the next start of this config is sized from the budget at once.
    learned = (tmp_path / "lib" / "state.toml").read_text()
    assert re.search(r'flags = \[\s*"--no-enable-extensible-kv-cache",?\s*\]', learned), learned


def test_the_034_switch_is_never_passed_to_an_older_release(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    # 0.33 has no extensible KV cache: the same shortage is its familiar failure, and the flag would be refused.
    setup = Setup(tmp_path, scenario="kv_insufficient", sim_env={"GB10D_SIM_VERSION": "0.33.0"})
    daemon = run(setup, notify, daemons)
    assert daemon.wait_exit() != 0
    assert all("extensible" not in line for line in starts(daemon))
    assert not any("extensible" in line for line in daemon.own_lines()), json.dumps(daemon.own_lines(), indent=1)
