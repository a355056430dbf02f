"""Item 3: how soon gb10d notices a stalled shard load, and whether slow but advancing loads are left alone.

Time is scaled: the stand-in runs at GB10D_SIM_SPEED 0.05 (one wall second
is 20 simulated seconds) and `startup.stall_timeout_s` is 3 s of wall time,
i.e. 60 simulated seconds. A stall is `stall_at=2`: the loader prints the
bar up to shard 2 of 4, then neither prints nor reads again (the retry with
the `eager` strategy then loads normally). The detection latency is from the
arrival of the last shard-bar line to the arrival of gb10d's
`stall_detected` line, both on the bench's clock; its excess over the
timeout is overhead in real seconds, not scaled ones.

Slow loads take 1 to 120 simulated seconds per shard (0.05 to 6 s of wall
time, the longest twice the stall timeout) while really reading their files,
as a loader on slow storage does; any `stall_detected` there is a false alarm.
"""

from __future__ import annotations

from typing import Any

from .lab import Deployment, Gb10d, Workspace, summary

SPEED = 0.05
STALL_TIMEOUT_S = 3.0
BAR = r"Loading safetensors checkpoint shards.*Completed \|"
STALL = r"gb10d: no loading progress"


def _deployment(ws: Workspace, scenario: str, shards: int) -> Deployment:
    return Deployment(ws.scratch("stall"), ws.venv,
                      sim_env={"GB10D_SIM_SPEED": str(SPEED), "GB10D_SIM_SCENARIO": scenario, "GB10D_SIM_SHARDS": str(shards)},
                      overrides={"startup.stall_timeout_s": STALL_TIMEOUT_S, "startup.warmup": False})


def stalled(ws: Workspace) -> dict[str, Any]:
    """One stalled load: the detection latency, and whether gb10d's retry then served."""
    dep = _deployment(ws, "stall_at=2", 4)
    with Gb10d(dep) as gb:
        assert gb.notify is not None and gb.out is not None
        alarm = gb.wait_line(STALL, 60)
        if alarm is None:
            raise RuntimeError("gb10d never reported the stall:\n" + gb.tail())
        bars = [at for at, line in gb.out.lines[: alarm[2]] if "Completed |" in line]
        ready = gb.notify.wait_for("READY", "1", 60)
        return {"latency_s": alarm[0] - bars[-1], "over_timeout_s": alarm[0] - bars[-1] - STALL_TIMEOUT_S,
                "recovered": ready is not None}


def slow(ws: Workspace, shard_sim_s: float) -> dict[str, Any]:
    """One slow but advancing load; a false alarm is any stall_detected before READY=1."""
    dep = _deployment(ws, f"slow_shards={shard_sim_s:g}", 4)
    with Gb10d(dep) as gb:
        assert gb.notify is not None and gb.out is not None
        ready = gb.notify.wait_for("READY", "1", 120)
        alarms = len(gb.out.find(STALL))
        return {"shard_sim_s": shard_sim_s, "shard_wall_s": shard_sim_s * SPEED, "ready": ready is not None,
                "false_alarms": alarms, "ready_s": None if ready is None else ready - gb.started_at}


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """Stalls repeated for a spread; slow loads from 1 s to twice the stall timeout per shard."""
    stalls = [stalled(ws) for _ in range(1 if quick else 3)]
    loads = [slow(ws, s) for s in ((10.0,) if quick else (1.0, 10.0, 30.0, 60.0, 120.0))]
    return {
        "sim_speed": SPEED,
        "stall_timeout_s": STALL_TIMEOUT_S,
        "stall_timeout_sim_s": STALL_TIMEOUT_S / SPEED,
        "stalls": stalls,
        "latency_s": summary([s["latency_s"] for s in stalls]),
        "over_timeout_s": summary([s["over_timeout_s"] for s in stalls]),
        "slow_loads": loads,
        "false_alarms": sum(s["false_alarms"] for s in loads),
    }
