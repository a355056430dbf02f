"""Item 6: from SIGTERM to no process left, gb10d against the stand-in's own drain.

Both start the same serving stand-in (GB10D_SIM_SPEED 0.01, so its engine
stop wait is scaled like every other delay). For gb10d, SIGTERM goes to
gb10d and the clock stops when gb10d has exited and no process of vLLM's
group is left (the moment vLLM's group is gone is recorded too). For the baseline, SIGTERM goes straight to the stand-in's API
server (what `systemctl stop` does to a unit running `vllm serve`) and the
clock stops when its group is empty and the leader reaped. The difference
is what gb10d's stop ladder adds to vLLM's own shutdown.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from gb10d.launch.process import group_alive

from .lab import Deployment, Gb10d, Sim, Workspace, summary, wait_until

SPEED = 0.01


def through_gb10d(ws: Workspace) -> tuple[float, float]:
    """(vLLM's group gone, gb10d exited too), seconds after SIGTERM to gb10d."""
    dep = Deployment(ws.scratch("stop-gb10d"), ws.venv, sim_env={"GB10D_SIM_SPEED": str(SPEED)}, overrides={"startup.warmup": False})
    with Gb10d(dep) as gb:
        gb.wait_ready(60)
        pgid = gb.vllm_pgids()[-1]
        sent = time.monotonic()
        gb.terminate()
        vllm_gone = wait_until(lambda: not group_alive(pgid), 60)
        gone = wait_until(lambda: gb.proc.poll() is not None and not group_alive(pgid), 60)
        if gone is None or vllm_gone is None:
            raise RuntimeError("gb10d or vLLM still running 60 s after SIGTERM")
        return vllm_gone - sent, gone - sent


def sim_alone(ws: Workspace) -> float:
    """Seconds from SIGTERM to the stand-in's API server until its group is gone."""
    dep = Deployment(ws.scratch("stop-sim"), ws.venv, sim_env={"GB10D_SIM_SPEED": str(SPEED)})
    sim = Sim(dep.vllm_argv(), dep.vllm_env)
    try:
        if sim.out.wait_line(r"Application startup complete\.", 60) is None:
            raise RuntimeError("the stand-in did not start")
        sent = time.monotonic()
        os.kill(sim.pgid, signal.SIGTERM)
        gone = wait_until(lambda: sim.proc.poll() is not None and not group_alive(sim.pgid), 60)
        if gone is None:
            raise RuntimeError("the stand-in still running 60 s after SIGTERM")
        return gone - sent
    finally:
        sim.close()


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """Alternating repeats of both, so load drift hits them alike."""
    repeats = 2 if quick else 5
    gb10d_s: list[float] = []
    vllm_s: list[float] = []
    alone_s: list[float] = []
    for _ in range(repeats):
        alone_s.append(sim_alone(ws))
        vllm_gone, gone = through_gb10d(ws)
        vllm_s.append(vllm_gone)
        gb10d_s.append(gone)
    g, a = summary(gb10d_s), summary(alone_s)
    return {"sim_speed": SPEED, "gb10d": g, "gb10d_vllm_gone": summary(vllm_s), "vllm_alone": a,
            "added_s": (g["median"] or 0) - (a["median"] or 0)}
