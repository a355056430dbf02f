"""An on-demand instance whose start finds too little free memory parks instead of giving up.

Behind the front, the memory an on-demand start needs is usually another on-demand model's: the front parks that one
to make room before it asks again. A give-up (exit 75) instead left the unit failed, its requests answered 503 until
systemd's Restart= (30 s later), and a restarted park = "sleep" instance, which starts vLLM at once, failed the same
way in a loop while the other model served (found by `python -m bench soak`). Both ways a start finds the memory
short are covered: gb10d's preflight refuses it, or vLLM's own free-memory check fails it down to the minimum share.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gb10d.daemon.control import ask
from gb10d.daemon.lab import write_meminfo
from gb10d.machine.statefile import read_state
from gb10d.vllm.sleepmode import control_path
from harness import Daemon, Setup, wait_until

pytestmark = pytest.mark.slow

TOTAL_GIB = 121.69


def state_of(setup: Setup) -> str | None:
    record = read_state(setup.state_file)
    return record.state.value if record is not None and record.state is not None else None


@pytest.mark.parametrize("short_for", ["preflight", "vllm"])
@pytest.mark.parametrize("park", ["stop", "sleep"])
def test_an_on_demand_start_short_of_memory_parks_and_starts_when_woken_once_memory_is_back(tmp_path: Path, park: str, short_for: str) -> None:
    # Shares of 0.4 x 121.69 GiB: 48.68 GiB, and 37.51 GiB with 1 GiB headroom at the minimum 0.3; 32 GiB is available.
    extra: dict[str, object] = {"on_demand": {"park": park, "idle_timeout_s": 600.0}}
    tight = tmp_path / "tight-meminfo"
    write_meminfo(tight, TOTAL_GIB, 30.0)
    if short_for == "vllm":
        extra["vllm.env.GB10D_SIM_MEMINFO"] = str(tight)  # gb10d's preflight sees room, vLLM's own check does not
    else:
        extra["memory.meminfo_path"] = str(tight)
        extra["vllm.env.GB10D_SIM_MEMINFO"] = str(tight)
    setup = Setup(tmp_path / "alpha", utilization=0.4, extra=extra)
    daemon = Daemon(setup, None)
    try:
        if park == "stop":
            wait_until(lambda: state_of(setup) == "parked", what="parked at the start")
            assert asyncio.run(ask(control_path(setup.state_file), "wake")) == "ok"
        daemon.wait_line(r"not starting vLLM now: parked until the front asks again \(it makes room first; \[on_demand\]\)")
        wait_until(lambda: state_of(setup) == "parked", what="parked after the start found no memory")
        assert daemon.proc.poll() is None, "gb10d gave up:\n" + daemon.tail()
        assert not [line for line in daemon.own_lines() if "giving up" in line], daemon.tail()
        write_meminfo(tight, TOTAL_GIB, 110.0)  # the other model parked: its memory is back
        assert asyncio.run(ask(control_path(setup.state_file), "wake")) == "ok"
        wait_until(lambda: state_of(setup) == "serving", what="serving once woken with the memory back")
        assert daemon.stop() == 0
    finally:
        daemon.kill_everything()
