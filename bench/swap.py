"""A model swap on the stand-in, phase by phase, as the front makes it: park by stop and start, against sleep and wake.

Run: `python -m bench.swap` (about a minute); writes bench/results/swap.json and prints a Markdown table.

Two `gb10d run` instances (A and B) of the default 27 GiB stand-in model, each with a meminfo file of its own, at
GB10D_SIM_SPEED 0.05 (every simulated duration a twentieth of the stand-in's GB10-shaped one, sleep and wake
included). A swap parks A and brings B up over their control sockets, as the front does: `park` to A until A's
state file says parked (on_demand.park = "stop": vLLM stopped and its memory back) or asleep ("sleep": level 2,
its memory back), then `wake` to B until B's state says serving: a whole start (ready after a real completion)
for "stop", the wake and gb10d's check generation for "sleep".
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gb10d.base.units import GIB
from gb10d.daemon.control import ask
from gb10d.machine.memory import read_meminfo
from gb10d.machine.statefile import read_state
from gb10d.vllm.sleepmode import control_path

from .lab import Deployment, Gb10d, Workspace, standalone, wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "swap.json"
SPEED = "0.05"
ROUNDS = 3


def _deployment(ws: Workspace, name: str, park: str) -> Deployment:
    overrides: dict[str, Any] = {"on_demand": {"park": park, "idle_timeout_s": 3600.0}}
    return Deployment(ws.scratch(name), ws.venv, sim_env={"GB10D_SIM_SPEED": SPEED}, utilization=0.45, overrides=overrides)


# What the state file says once a park is over, per on_demand.park.
PARKED_STATE = {"stop": "parked", "sleep": "asleep"}


def _state(deployment: Deployment) -> str | None:
    record = read_state(deployment.dir / "state.json")
    return record.state.value if record is not None and record.state is not None else None


def _wait_state(deployment: Deployment, state: str, timeout: float = 120.0) -> float:
    at = wait_until(lambda: _state(deployment) == state, timeout, 0.005)
    if at is None:
        raise RuntimeError(f"{deployment.dir.name} never reached {state} (now {_state(deployment)})")
    return at


async def _ask(deployment: Deployment, command: str) -> None:
    answer = await ask(control_path(deployment.dir / "state.json"), command)
    if answer != "ok":
        raise RuntimeError(f"{deployment.dir.name}'s gb10d answered {answer!r} to {command}")


def _park_and_wake(park: str, parked: Deployment, awake: Deployment) -> dict[str, float]:
    before = read_meminfo(awake.meminfo).available
    started = time.monotonic()
    asyncio.run(_ask(awake, "park"))
    gone = _wait_state(awake, PARKED_STATE[park])
    freed = read_meminfo(awake.meminfo).available - before
    asyncio.run(_ask(parked, "wake"))
    serving = _wait_state(parked, "serving")
    return {"park_s": gone - started, "freed_gib": freed / GIB, "wake_s": serving - gone, "total_s": serving - started}


def _swaps(ws: Workspace, park: str, count: int) -> list[dict[str, float]]:
    """`count` swaps back and forth between A (brought up first) and B (parked)."""
    a, b = _deployment(ws, f"{park}-a", park), _deployment(ws, f"{park}-b", park)
    with Gb10d(a) as first, Gb10d(b) as second:
        first.wait_ready()
        second.wait_ready()
        for deployment in (a, b):  # a sleeping instance starts serving; a stopping one starts parked
            if _state(deployment) != PARKED_STATE[park]:
                asyncio.run(_ask(deployment, "park"))
                _wait_state(deployment, PARKED_STATE[park])
        asyncio.run(_ask(a, "wake"))
        _wait_state(a, "serving")
        return [_park_and_wake(park, *((b, a) if index % 2 == 0 else (a, b))) for index in range(count)]


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    count = 2 if quick else ROUNDS * 2
    return {"speed": float(SPEED), "stop_and_start": _swaps(ws, "stop", count), "sleep_and_wake": _swaps(ws, "sleep", count)}


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def markdown(result: dict[str, Any]) -> str:
    stop, sleep = result["stop_and_start"], result["sleep_and_wake"]
    lines = [
        f"Stand-in at GB10D_SIM_SPEED {result['speed']:g}, medians of {len(stop)} swaps each way:",
        "",
        "| swap | A's memory back (s) | B serving after that (s) | whole swap (s) |",
        "|---|---|---|---|",
        f"| park A by stop, start B | {_median(stop, 'park_s'):.2f} | {_median(stop, 'wake_s'):.2f} | {_median(stop, 'total_s'):.2f} |",
        f"| park A by sleep, wake B | {_median(sleep, 'park_s'):.2f} | {_median(sleep, 'wake_s'):.2f} | {_median(sleep, 'total_s'):.2f} |",
        "",
        f"A's sleep gave back {_median(sleep, 'freed_gib'):.1f} GiB (of its 0.45 x 121.69 GiB share, 1.66 GiB kept).",
    ]
    return "\n".join(lines)


def main() -> int:
    return standalone(run, markdown, RESULTS, sys.argv)


if __name__ == "__main__":
    sys.exit(main())
