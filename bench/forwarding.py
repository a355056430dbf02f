"""Item 4: how many lines per second gb10d forwards, against `cat` on the same pipe, and whether the child waits.

The child is `bench/flood.py`, run by the real `gb10d run` as its
`[vllm] executable`, so the lines take gb10d's real path (pipe, LineFramer,
BarCollapser, Classifier, EventScanner, Journal, stdout pipe). The flood
exits after its last line; gb10d then sees a crash and, with
`restart.max_attempts = 1`, gives up, which is fine: the clock stops when
the flood's marker line arrives on gb10d's stdout. Throughput is the flood's
physical lines divided by the time from the child's first write (stamped by
the child on the shared monotonic clock) to that arrival.

Baselines on the same content: the flood piped through `cat` (the cheapest
possible forwarder on the same kind of pipe) and the flood writing straight
to /dev/null (the child's own speed, nothing downstream). The child's
slowdown is its own write time through gb10d divided by its write time to
/dev/null: 1.0 means it never waited on gb10d.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .flood import END_MARKER
from .lab import Deployment, Gb10d, Workspace, summary

FLOOD = Path(__file__).with_name("flood.py")


def _wrapper(directory: Path) -> Path:
    """An executable `vllm` that runs the flood with this interpreter (gb10d appends `serve ...`)."""
    path = directory / "vllm"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FLOOD}"\n')
    path.chmod(0o755)
    return path


def _drain_until_marker(fd: int) -> tuple[float | None, int]:
    """Read `fd` in big chunks until the flood's marker arrives; (arrival time, newlines read)."""
    newlines = 0
    tail = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None, newlines
        newlines += chunk.count(b"\n")
        if END_MARKER in tail + chunk:  # the marker may straddle two reads
            return time.monotonic(), newlines
        tail = chunk[-len(END_MARKER):]


def _flood_env(lines: int, mode: str, report: Path) -> dict[str, str]:
    return {"GB10D_FLOOD_LINES": str(lines), "GB10D_FLOOD_MODE": mode, "GB10D_FLOOD_REPORT": str(report)}


def _child(report: Path) -> dict[str, float]:
    data: dict[str, float] = json.loads(report.read_text())
    return data


def through_gb10d(ws: Workspace, lines: int, mode: str) -> dict[str, Any]:
    """One flood through the real `gb10d run`."""
    d = ws.scratch("fwd-gb10d")
    report = d / "flood.json"
    dep = Deployment(d, None, executable=_wrapper(d), sim_env=_flood_env(lines, mode, report),
                     overrides={"restart.max_attempts": 1, "memory.preflight": False})
    read_fd, write_fd = os.pipe()
    gb = Gb10d(dep, None, stdout=write_fd)
    os.close(write_fd)
    try:
        arrived, newlines = _drain_until_marker(read_fd)
    finally:
        gb.close()
        os.close(read_fd)
    if arrived is None:
        raise RuntimeError("gb10d's output ended before the flood's last line arrived")
    child = _child(report)
    return {"lines_per_s": lines / (arrived - child["start"]), "seconds": arrived - child["start"],
            "child_write_s": child["end"] - child["start"], "forwarded_lines": newlines, "bytes": child["bytes"]}


def through_cat(ws: Workspace, lines: int, mode: str) -> dict[str, Any]:
    """The same flood piped through `cat`, read the same way."""
    d = ws.scratch("fwd-cat")
    report = d / "flood.json"
    env = {**os.environ, **_flood_env(lines, mode, report)}
    flood = subprocess.Popen([sys.executable, str(FLOOD)], stdout=subprocess.PIPE, env=env)
    assert flood.stdout is not None
    cat = subprocess.Popen(["cat"], stdin=flood.stdout, stdout=subprocess.PIPE)
    flood.stdout.close()
    assert cat.stdout is not None
    try:
        arrived, newlines = _drain_until_marker(cat.stdout.fileno())
    finally:
        flood.wait(30)
        cat.stdout.close()
        cat.wait(30)
    if arrived is None:
        raise RuntimeError("cat's output ended before the flood's last line arrived")
    child = _child(report)
    return {"lines_per_s": lines / (arrived - child["start"]), "seconds": arrived - child["start"],
            "child_write_s": child["end"] - child["start"], "forwarded_lines": newlines, "bytes": child["bytes"]}


def to_devnull(ws: Workspace, lines: int, mode: str) -> dict[str, Any]:
    """The flood with nothing downstream: how fast the child writes on its own."""
    d = ws.scratch("fwd-null")
    report = d / "flood.json"
    env = {**os.environ, **_flood_env(lines, mode, report)}
    with open(os.devnull, "wb") as null:
        subprocess.run([sys.executable, str(FLOOD)], stdout=null, env=env, check=True, timeout=120)
    child = _child(report)
    return {"child_write_s": child["end"] - child["start"]}


def run(ws: Workspace, quick: bool) -> dict[str, Any]:
    """Every consumer, interleaved per repeat so that drifting machine load hits all alike."""
    lines = 100_000 if quick else 200_000
    repeats = 3 if quick else 5
    modes = ["lines"] if quick else ["lines", "chunks"]
    result: dict[str, Any] = {"lines": lines, "repeats": repeats, "modes": {}}
    for mode in modes:
        samples: dict[str, list[dict[str, Any]]] = {"gb10d": [], "cat": [], "devnull": []}
        for _ in range(repeats):
            samples["devnull"].append(to_devnull(ws, lines, mode))
            samples["cat"].append(through_cat(ws, lines, mode))
            samples["gb10d"].append(through_gb10d(ws, lines, mode))
        null_write = summary([s["child_write_s"] for s in samples["devnull"]])["median"]
        entry: dict[str, Any] = {"child_write_s": {k: summary([s["child_write_s"] for s in v]) for k, v in samples.items()}}
        for name in ("gb10d", "cat"):
            entry[name] = {
                "lines_per_s": summary([s["lines_per_s"] for s in samples[name]]),
                "forwarded_lines": samples[name][-1]["forwarded_lines"],
                "child_slowdown": summary([s["child_write_s"] / null_write for s in samples[name]]) if null_write else None,
            }
        entry["bytes"] = samples["cat"][-1]["bytes"]
        g, c = entry["gb10d"]["lines_per_s"]["median"], entry["cat"]["lines_per_s"]["median"]
        entry["gb10d_vs_cat"] = g / c if c else None
        result["modes"][mode] = entry
    return result
