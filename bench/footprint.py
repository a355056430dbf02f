"""Item 5: gb10d's memory and CPU while vLLM serves, idle and busy, extrapolated per hour.

gb10d is read from outside, as an operator would: VmRSS and VmHWM from
/proc/PID/status, CPU time from /proc/PID/task/*/schedstat (nanoseconds,
every thread; /proc/PID/stat's ticks are too coarse for an idle daemon).

Two ways of getting an hour's worth:

- scaled: every periodic activity runs 20x faster (stand-in at
  GB10D_SIM_SPEED 0.05, so a stats line every 0.5 s instead of 10 s;
  gb10d's `liveness.health_interval_s` 0.5 s instead of 10 s; in the busy
  period one completion request every 0.25 s and a scrape of gb10d's
  metrics endpoint every 0.75 s instead of 15 s). CPU per simulated hour is
  the CPU used divided by the simulated time. Every periodic cost is counted
  20 times per wall second, so this is the precise figure.
- real time (full run only): gb10d with its default intervals, left alone
  for 60 s while vLLM serves idle, multiplied by 60.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from gb10d.machine.procs import PROC, kib, status_fields

from .lab import Deployment, Gb10d, Workspace, free_port, http_status

SCALE = 0.05
SETTLE_S = 3.0  # after READY=1: the start's own work (state file, first probes) is not part of either period


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid` so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of `pid`, in KiB."""
    fields = status_fields(PROC / str(pid))
    return {name: kib(fields, name) or 0 for name in ("VmRSS", "VmHWM")}


class Load:
    """The busy period's traffic on a thread: completions against vLLM and scrapes of gb10d's metrics."""

    def __init__(self, vllm_port: int, metrics_port: int, request_every_s: float, scrape_every_s: float) -> None:
        self.requests = self.scrapes = 0
        self._stop = threading.Event()
        self._args = (vllm_port, metrics_port, request_every_s, scrape_every_s)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import http.client
        import json

        vllm_port, metrics_port, request_every_s, scrape_every_s = self._args
        next_request = next_scrape = time.monotonic()
        body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 16})
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_request:
                conn = http.client.HTTPConnection("127.0.0.1", vllm_port, timeout=10)
                try:
                    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                    conn.getresponse().read()
                    self.requests += 1
                except OSError:
                    pass
                finally:
                    conn.close()
                next_request += request_every_s
            if now >= next_scrape:
                if http_status(metrics_port, "/metrics") == 200:
                    self.scrapes += 1
                next_scrape += scrape_every_s
            self._stop.wait(max(0.0, min(next_request, next_scrape) - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


def _period(pid: int, wall_s: float) -> dict[str, float]:
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(wall_s)
    return {"cpu_s": cpu_seconds(pid) - before, "wall_s": time.monotonic() - t0}


def scaled(ws: Workspace, period_s: float) -> dict[str, Any]:
    """Idle, then busy, with every interval scaled by SCALE; CPU per simulated hour."""
    metrics_port = free_port()
    dep = Deployment(ws.scratch("footprint"), ws.venv, sim_env={"GB10D_SIM_SPEED": str(SCALE)},
                     overrides={"startup.warmup": False, "metrics.listen": f"127.0.0.1:{metrics_port}",
                                "liveness.health_interval_s": 10.0 * SCALE})
    with Gb10d(dep) as gb:
        assert gb.out is not None
        gb.wait_ready(60)
        time.sleep(SETTLE_S)
        idle = _period(gb.pid, period_s)
        lines_before = len(gb.out.lines)
        load = Load(dep.port, metrics_port, 5.0 * SCALE, 15.0 * SCALE)
        busy = _period(gb.pid, period_s)
        load.stop()
        forwarded = len(gb.out.lines) - lines_before
        mem = memory_kib(gb.pid)
    result: dict[str, Any] = {"scale": SCALE, "rss_kib": mem["VmRSS"], "peak_rss_kib": mem["VmHWM"]}
    for name, p, extra in (("idle", idle, {}), ("busy", busy, {"requests": load.requests, "scrapes": load.scrapes, "lines_forwarded": forwarded})):
        simulated_s = p["wall_s"] / SCALE
        result[name] = {**p, **extra, "simulated_s": simulated_s, "cpu_s_per_hour": p["cpu_s"] / simulated_s * 3600}
    return result


def real_time(ws: Workspace, period_s: float) -> dict[str, Any]:
    """gb10d with its default intervals, idle for `period_s` of real time."""
    dep = Deployment(ws.scratch("footprint-rt"), ws.venv, sim_env={"GB10D_SIM_SPEED": str(SCALE)},
                     overrides={"startup.warmup": False})
    with Gb10d(dep) as gb:
        gb.wait_ready(60)
        time.sleep(SETTLE_S)
        idle = _period(gb.pid, period_s)
        mem = memory_kib(gb.pid)
    return {**idle, "cpu_s_per_hour": idle["cpu_s"] / idle["wall_s"] * 3600, "rss_kib": mem["VmRSS"], "peak_rss_kib": mem["VmHWM"]}


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """The scaled idle and busy periods, and (full run) the real-time idle check."""
    result = {"scaled": scaled(ws, 5.0 if quick else 20.0)}
    if not quick:
        result["real_time_idle"] = real_time(ws, 60.0)
    return result
