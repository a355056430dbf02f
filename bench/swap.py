"""A model swap on the stand-in, phase by phase: stop-and-start against sleep-and-wake (on_demand.park = "sleep").

Run: `python -m bench.swap` (about a minute); writes bench/results/swap.json and prints a Markdown table.

Two `gb10d run` instances (A and B) of the default 27 GiB stand-in model, each with a meminfo file of its own, at
GB10D_SIM_SPEED 0.05 (every simulated duration a twentieth of the stand-in's GB10-shaped one, sleep and wake
included). A swap parks A and brings B up, as the front does:

- stop-and-start: SIGTERM to A's gb10d, until A's memory is back in its meminfo, then `gb10d run` B until READY=1;
- sleep-and-wake: `park` to A's control socket until A's state file says asleep (its memory back), then `wake` to
  B's (asleep since its start) until B's state says serving, which includes gb10d's check generation.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gb10d.daemon.control import ask
from gb10d.core.memory import GIB, read_meminfo
from gb10d.vllm.sleepmode import control_path
from gb10d.core.statefile import read_state

from .lab import standalone, Deployment, Gb10d, Workspace, wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "swap.json"
SPEED = "0.05"
ROUNDS = 3


def _deployment(ws: Workspace, name: str, sleeps: bool) -> Deployment:
    overrides: dict[str, Any] = {"on_demand": {"park": "sleep", "idle_timeout_s": 3600.0}} if sleeps else {}
    return Deployment(ws.scratch(name), ws.venv, sim_env={"GB10D_SIM_SPEED": SPEED}, utilization=0.45, overrides=overrides)


def _state(deployment: Deployment) -> str | None:
    record = read_state(deployment.dir / "state.json")
    return record.state.value if record is not None and record.state is not None else None


def _wait_state(deployment: Deployment, state: str, timeout: float = 120.0) -> float:
    at = wait_until(lambda: _state(deployment) == state, timeout, 0.005)
    if at is None:
        raise RuntimeError(f"{deployment.dir.name} never reached {state} (now {_state(deployment)})")
    return at


def _stop_and_start(ws: Workspace) -> dict[str, float]:
    a, b = _deployment(ws, "stop-a", False), _deployment(ws, "stop-b", False)
    idle = read_meminfo(a.meminfo).available
    first = Gb10d(a)
    first.wait_ready()
    started = time.monotonic()
    first.terminate()
    back = wait_until(lambda: read_meminfo(a.meminfo).available >= idle, 60, 0.005)
    assert back is not None, "A's memory never came back"
    with Gb10d(b) as second:
        ready = second.wait_ready()
    first.close()
    return {"memory_back_s": back - started, "start_s": ready - back, "total_s": ready - started}


async def _ask(deployment: Deployment, command: str) -> None:
    answer = await ask(control_path(deployment.dir / "state.json"), command)
    if answer != "ok":
        raise RuntimeError(f"{deployment.dir.name}'s gb10d answered {answer!r} to {command}")


def _sleep_and_wake(parked: Deployment, awake: Deployment) -> dict[str, float]:
    before = read_meminfo(awake.meminfo).available
    started = time.monotonic()
    asyncio.run(_ask(awake, "park"))
    asleep = _wait_state(awake, "asleep")
    freed = read_meminfo(awake.meminfo).available - before
    asyncio.run(_ask(parked, "wake"))
    serving = _wait_state(parked, "serving")
    return {"park_s": asleep - started, "freed_gib": freed / GIB, "wake_s": serving - asleep, "total_s": serving - started}


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    rounds = 1 if quick else ROUNDS
    stops = [_stop_and_start(ws) for _ in range(rounds)]
    a, b = _deployment(ws, "sleep-a", True), _deployment(ws, "sleep-b", True)
    with Gb10d(a) as first, Gb10d(b) as second:
        first.wait_ready()
        second.wait_ready()
        asyncio.run(_ask(b, "park"))  # B starts parked: the first swap brings it up
        _wait_state(b, "asleep")
        sleeps = []
        for index in range(rounds * 2):
            awake, parked = (a, b) if index % 2 == 0 else (b, a)
            sleeps.append(_sleep_and_wake(parked, awake))
    return {"speed": float(SPEED), "stop_and_start": stops, "sleep_and_wake": sleeps}


def _median(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def markdown(result: dict[str, Any]) -> str:
    stop, sleep = result["stop_and_start"], result["sleep_and_wake"]
    lines = [
        f"Stand-in at GB10D_SIM_SPEED {result['speed']:g}, medians of {len(stop)} stop-and-start and {len(sleep)} sleep-and-wake swaps:",
        "",
        "| swap | A's memory back (s) | B serving after that (s) | whole swap (s) |",
        "|---|---|---|---|",
        f"| stop A, start B | {_median(stop, 'memory_back_s'):.2f} | {_median(stop, 'start_s'):.2f} | {_median(stop, 'total_s'):.2f} |",
        f"| sleep A, wake B | {_median(sleep, 'park_s'):.2f} | {_median(sleep, 'wake_s'):.2f} | {_median(sleep, 'total_s'):.2f} |",
        "",
        f"A's sleep gave back {_median(sleep, 'freed_gib'):.1f} GiB (of its 0.45 x 121.69 GiB share, 1.66 GiB kept).",
    ]
    return "\n".join(lines)


def main() -> int:
    return standalone(run, markdown, RESULTS, sys.argv)


if __name__ == "__main__":
    sys.exit(main())
