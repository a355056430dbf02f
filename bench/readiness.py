"""Item 1: from `Application startup complete.` to READY=1, against the polling loops people use today.

gb10d: each start runs the real `gb10d run` (with `startup.warmup = false`,
so it checks what a poller checks: /health and the served model) with the
stand-in as vLLM and a real NOTIFY_SOCKET owned by the bench. The latency is
from the moment gb10d's forwarded `Application startup complete.` line
reaches the bench to the moment the READY=1 datagram does, both stamped on
the bench's monotonic clock. gb10d's own figure from its journal line is
kept next to it.

Baselines: loops `GET; if 200: done; else sleep(interval)` run for real, as
llama-swap (1 s, /health), GPUStack (3 s, /health) and the DGX Spark
playbook's curl loop (10 s, /v1/models) do, against the stand-in started
directly (so no poller's request warms the server for gb10d's, or the other
way round), timed from the stand-in's own startup line on the same clock. A
poller's delay depends on where its ticks fall relative to the line, and a
real loop starts whenever its unit starts, so its phase is arbitrary. Each
start therefore runs ten loops per interval with phases spread evenly over
the interval; whatever the startup time, their delays cover the interval
evenly, so a few starts show the true distribution instead of one lucky or
unlucky phase. The analytic median, interval / 2, is reported next to the
measurement. A tight 5 ms loop on /v1/models (full run) shows the floor:
how long the stand-in itself takes to answer its first requests.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from .lab import Deployment, Gb10d, Sim, Workspace, http_status, summary

STARTUP_LINE = r"Application startup complete\."
SPEED = 0.01  # the stand-in's startup takes about two seconds of wall time
OWN_FIGURE = r"READY=1 (\d+) ms after"
PER_LOOP = 10


@dataclass(frozen=True)
class PollLoop:
    """A readiness loop as other tools write it."""

    name: str
    interval_s: float
    path: str


# Not a tool people use: the quickest loop there is, showing how much of any latency is the stand-in's own answer time.
FLOOR = PollLoop("tight 5 ms loop (floor)", 0.005, "/v1/models")

POLLERS = (
    PollLoop("poll 1 s (llama-swap)", 1.0, "/health"),
    PollLoop("poll 3 s (GPUStack)", 3.0, "/health"),
    PollLoop("poll 10 s (DGX Spark playbook curl loop)", 10.0, "/v1/models"),
)


class Poller:
    """One baseline loop on its own thread; `ok_at` is when it first got a 200."""

    def __init__(self, loop: PollLoop, port: int, phase_s: float, give_up_at: float) -> None:
        self.loop = loop
        self.ok_at: float | None = None
        self._port = port
        self._phase_s = phase_s
        self._give_up_at = give_up_at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._stop.wait(self._phase_s):
            return
        while time.monotonic() < self._give_up_at:
            if http_status(self._port, self.loop.path) == 200:
                self.ok_at = time.monotonic()
                return
            if self._stop.wait(self.loop.interval_s):
                return

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def gb10d_start(ws: Workspace, warmup: bool) -> dict[str, Any]:
    """One gb10d start: seconds from the forwarded startup line to READY=1, and gb10d's own figure."""
    dep = Deployment(ws.scratch("ready"), ws.venv, sim_env={"GB10D_SIM_SPEED": str(SPEED)}, overrides={"startup.warmup": warmup})
    with Gb10d(dep) as gb:
        line = gb.wait_line(STARTUP_LINE, 60)
        ready_at = gb.wait_ready(60)
        if line is None:
            raise RuntimeError("gb10d forwarded no startup line:\n" + gb.tail())
        said = gb.wait_line(OWN_FIGURE, 5)
        own = re.search(OWN_FIGURE, said[1]) if said else None
        return {"gb10d": ready_at - line[0], "gb10d_own_ms": int(own.group(1)) if own else None,
                "startup_s": line[0] - gb.started_at}


def poller_start(ws: Workspace, loops: list[PollLoop], per_loop: int) -> dict[str, list[float]]:
    """One start of the stand-in alone with `per_loop` pollers per loop, phases spread evenly; their delays."""
    dep = Deployment(ws.scratch("poll"), ws.venv, sim_env={"GB10D_SIM_SPEED": str(SPEED)})
    started = time.monotonic()
    pollers = [Poller(loop, dep.port, k / per_loop * loop.interval_s, started + 120) for loop in loops for k in range(per_loop)]
    sim = Sim(dep.vllm_argv(), dep.vllm_env)
    try:
        line = sim.out.wait_line(STARTUP_LINE, 60)
        if line is None:
            raise RuntimeError("the stand-in did not start:\n" + sim.out.tail())
        for p in pollers:
            p.join(p.loop.interval_s + 10)
        delays: dict[str, list[float]] = {loop.name: [] for loop in loops}
        for p in pollers:
            if p.ok_at is not None:
                delays[p.loop.name].append(p.ok_at - line[0])
        return delays
    finally:
        for p in pollers:
            p.stop()
        sim.close()


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """gb10d's starts, the pollers' starts, and (full run) the warm-up variant and the floor."""
    repeats, poll_starts = (5, 2) if quick else (7, 3)
    loops = list(POLLERS[:1] if quick else POLLERS)
    samples = [gb10d_start(ws, False) for _ in range(repeats)]
    delays: dict[str, list[float]] = {loop.name: [] for loop in loops}
    for _ in range(poll_starts):
        for name, values in poller_start(ws, loops, PER_LOOP).items():
            delays[name] += values
    result: dict[str, Any] = {"repeats": repeats, "poll_starts": poll_starts, "pollers_per_loop": PER_LOOP,
                              "sim_speed": SPEED, "samples": samples}
    result["gb10d"] = summary([s["gb10d"] for s in samples])
    result["gb10d_own_ms"] = summary([s["gb10d_own_ms"] for s in samples if s["gb10d_own_ms"] is not None])
    result["baselines"] = {}
    for loop in loops:
        measured = summary(delays[loop.name])
        result["baselines"][loop.name] = {
            "interval_s": loop.interval_s,
            "path": loop.path,
            "measured": measured,
            "missed": poll_starts * PER_LOOP - len(delays[loop.name]),
            "model_median_s": loop.interval_s / 2,
            "ratio_to_gb10d": (measured["median"] or 0) / result["gb10d"]["median"],
        }
    if not quick:
        warm = [gb10d_start(ws, True) for _ in range(3)]
        result["warmup"] = {"samples": warm, "gb10d": summary([s["gb10d"] for s in warm])}
        floor = [d for _ in range(3) for d in poller_start(ws, [FLOOR], 1)[FLOOR.name]]
        result["floor"] = summary(floor)
    return result
