"""Item 2: recovering from vLLM's free-memory check over a grid of GB10-like memory states.

The stand-in fails exactly like vLLM (`Free memory on device ... on startup
is less than desired GPU memory utilization`, exit 1) when
`utilization * MemTotal > MemFree`, reading a meminfo file the bench writes
for each cell; gb10d reads the same file. Four ways of running the same
`vllm serve` command are compared per cell:

- (a) systemd `Restart=on-failure` as a hand-written unit has it: rerun the
  same command after `RestartSec` (100 ms) until the start limit
  (`StartLimitBurst=5` in `StartLimitIntervalSec=10`) stops it;
- (b) a wrapper that lowers `--gpu-memory-utilization` by a fixed 0.05 after
  each failure (down to 0.30);
- (c) gb10d with `memory.preflight = false` (it learns from the failure line);
- (d) gb10d with preflight (it reads meminfo before the first start).

A failed start is a `vllm serve` run that exited before serving. Time to
ready is from the first start to the `Application startup complete.` line
of the run that serves (for gb10d: the forwarded line; READY=1 is given too).
"""

from __future__ import annotations

import itertools
import re
import time
from typing import Any

from .lab import GB10_TOTAL_GIB, Deployment, Gb10d, Sim, Workspace, summary

SPEED = 0.01
STARTUP_LINE = r"Application startup complete\."
FREE_GIB = (95.0, 100.0, 105.0, 110.0, 115.0)
REQUESTED = (0.80, 0.85, 0.90, 0.95)
START_LIMIT_BURST, START_LIMIT_INTERVAL_S, RESTART_SEC = 5, 10.0, 0.1
STEP, FLOOR = 0.05, 0.30


def _sim_once(dep: Deployment, utilization: float) -> tuple[bool, float]:
    """Run the command once, as a unit's ExecStart would; (served, when the startup line came or it exited)."""
    sim = Sim(dep.vllm_argv(utilization), dep.vllm_env)
    try:
        line = sim.out.wait_line(STARTUP_LINE, 60)
        if line is not None:
            return True, line[0]
        sim.proc.wait(10)
        return False, time.monotonic()
    finally:
        sim.close()


def systemd_restart(dep: Deployment) -> dict[str, Any]:
    """(a): the same command again and again until the start limit."""
    started = time.monotonic()
    starts: list[float] = []
    while True:
        now = time.monotonic()
        starts = [t for t in starts if now - t < START_LIMIT_INTERVAL_S]
        if len(starts) >= START_LIMIT_BURST:
            return {"failed_starts": len(starts), "ready_s": None, "gave_up": "start limit hit"}
        starts.append(now)
        served, at = _sim_once(dep, dep.utilization)
        if served:
            return {"failed_starts": len(starts) - 1, "ready_s": at - started}
        time.sleep(RESTART_SEC)


def step_down(dep: Deployment) -> dict[str, Any]:
    """(b): lower the utilization by a fixed step after each failure."""
    started = time.monotonic()
    utilization, failures = dep.utilization, 0
    while utilization >= FLOOR - 1e-9:
        served, at = _sim_once(dep, utilization)
        if served:
            return {"failed_starts": failures, "ready_s": at - started, "utilization": round(utilization, 2)}
        failures += 1
        utilization -= STEP
    return {"failed_starts": failures, "ready_s": None, "gave_up": f"below {FLOOR}"}


def gb10d(ws: Workspace, free_gib: float, requested: float, preflight: bool) -> dict[str, Any]:
    """(c) and (d): the real `gb10d run`, counting the vLLM starts it logs."""
    d = ws.scratch("mem-gb10d")
    dep = Deployment(d, ws.venv, free_gib=free_gib, utilization=requested,
                     sim_env={"GB10D_SIM_SPEED": str(SPEED)},
                     overrides={"memory.preflight": preflight, "startup.warmup": False})
    with Gb10d(dep) as gb:
        assert gb.notify is not None and gb.out is not None
        ready_at = gb.notify.wait_for("READY", "1", 90)
        starts = len(gb.vllm_pgids())
        if ready_at is None:
            return {"failed_starts": starts, "ready_s": None, "gave_up": "no READY=1"}
        line = gb.out.find(STARTUP_LINE)
        launches = gb.out.find(r"gb10d: started vLLM as pid")
        t0 = launches[0][0]
        served_with = re.search(r"gpu_memory_utilization ([\d.]+)\)", launches[-1][1])
        return {
            "failed_starts": starts - 1,
            "ready_s": line[-1][0] - t0 if line else None,
            "ready_notify_s": ready_at - t0,
            "utilization": float(served_with.group(1)) if served_with else None,
        }


def _baseline_deployment(ws: Workspace, free_gib: float, requested: float) -> Deployment:
    return Deployment(ws.scratch("mem-base"), ws.venv, free_gib=free_gib, utilization=requested,
                      sim_env={"GB10D_SIM_SPEED": str(SPEED)})


STRATEGIES = ("systemd Restart=", "fixed 0.05 step-down", "gb10d without preflight", "gb10d with preflight")


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """Every strategy on every cell; the table keeps per-cell numbers, the summary the worst case."""
    frees, requested = (FREE_GIB[::2], REQUESTED[::3]) if quick else (FREE_GIB, REQUESTED)
    cells: list[dict[str, Any]] = []
    for free, u in itertools.product(frees, requested):
        cell: dict[str, Any] = {"free_gib": free, "requested": u, "fits": u * GB10_TOTAL_GIB <= free}
        cell["systemd Restart="] = systemd_restart(_baseline_deployment(ws, free, u))
        cell["fixed 0.05 step-down"] = step_down(_baseline_deployment(ws, free, u))
        cell["gb10d without preflight"] = gb10d(ws, free, u, False)
        cell["gb10d with preflight"] = gb10d(ws, free, u, True)
        cells.append(cell)
    totals: dict[str, Any] = {}
    for name in STRATEGIES:
        runs = [c[name] for c in cells]
        totals[name] = {
            "max_failed_starts": max(r["failed_starts"] for r in runs),
            "total_failed_starts": sum(r["failed_starts"] for r in runs),
            "never_ready": sum(1 for r in runs if r["ready_s"] is None),
            "ready_s_when_short": summary([r["ready_s"] for c, r in zip(cells, runs) if not c["fits"] and r["ready_s"] is not None]),
        }
    return {"sim_speed": SPEED, "total_gib": GB10_TOTAL_GIB, "cells": cells, "totals": totals}
