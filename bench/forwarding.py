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

Two diagnostics in the full run: the same components driven in-process from
a real pipe (the ceiling of the forwarding path without the supervisor
loop), and how long gb10d stays busy with the flood's parsed events after
its last line went out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from gb10d.machine.journal import Journal
from gb10d.machine.procs import cpu_seconds
from gb10d.vllm.logparse import BarCollapser, Classifier, EventScanner, LineFramer

from .flood import END_MARKER
from .lab import Deployment, Gb10d, Workspace, summary, wait_until

FLOOD = Path(__file__).with_name("flood.py")


def _wrapper(directory: Path) -> Path:
    """An executable `vllm` that runs the flood with this interpreter (gb10d appends `serve ...`)."""
    path = directory / "vllm"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FLOOD}"\n')
    path.chmod(0o755)
    return path


def _drain_until_marker(fd: int, on_first: Callable[[], None] | None = None) -> tuple[float | None, int]:
    """Read `fd` in big chunks until the flood's marker arrives; (arrival time, newlines read).

    `on_first` runs when the first chunk arrives.
    """
    newlines = 0
    tail = b""
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None, newlines
        if on_first is not None and newlines == 0:
            on_first()
        newlines += chunk.count(b"\n")
        if END_MARKER in tail + chunk:  # the marker may straddle two reads
            return time.monotonic(), newlines
        tail = chunk[-len(END_MARKER):]


def _flood_env(lines: int, mode: str, report: Path) -> dict[str, str]:
    return {"GB10D_FLOOD_LINES": str(lines), "GB10D_FLOOD_MODE": mode, "GB10D_FLOOD_REPORT": str(report)}


def _child(report: Path) -> dict[str, float]:
    """The child's own figures; it writes them (atomically) just after its last line, so allow a moment."""
    if wait_until(report.exists, 10) is None:
        raise RuntimeError("the flood child wrote no report")
    data: dict[str, float] = json.loads(report.read_text())
    return data


def _delivered(report: Path, arrived: float | None, newlines: int, consumer: str) -> dict[str, Any]:
    """Throughput from the child's first write to the arrival of its last line, and the child's own write time."""
    if arrived is None:
        raise RuntimeError(f"{consumer}'s output ended before the flood's last line arrived")
    child = _child(report)
    return {"lines_per_s": child["lines"] / (arrived - child["start"]), "seconds": arrived - child["start"],
            "child_write_s": child["end"] - child["start"], "forwarded_lines": newlines, "bytes": child["bytes"]}


def through_gb10d(ws: Workspace, lines: int, mode: str) -> dict[str, Any]:
    """One flood through the real `gb10d run`."""
    d = ws.scratch("fwd-gb10d")
    report = d / "flood.json"
    dep = Deployment(d, None, executable=_wrapper(d), sim_env=_flood_env(lines, mode, report),
                     overrides={"restart.max_attempts": 1, "memory.preflight": False})
    read_fd, write_fd = os.pipe()
    with Gb10d(dep, notify=False, stdout=write_fd) as gb:
        os.close(write_fd)
        # gb10d's own lines come first, before the flood's: its CPU from then on is the forwarding's, not its start's.
        started: list[float] = []
        try:
            arrived, newlines = _drain_until_marker(read_fd, lambda: started.append(cpu_seconds(gb.pid)))
            used = cpu_seconds(gb.pid) - started[0] if started else None
        finally:
            os.close(read_fd)
    return {**_delivered(report, arrived, newlines, "gb10d"), "cpu_s": used}


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
    return _delivered(report, arrived, newlines, "cat")


# The least a forwarder in Python does that gives each line its journal priority: decode it, read its level
# with one regex, write it with its `<N>` prefix. It runs on the same interpreter as gb10d, so the ratio of
# the two is the machine-independent measure of gb10d's own cost per line (cat's speed is the writer's).
PLAIN_FORWARDER = r"""
import re, sys
level = re.compile(r"(?:\([^)]*\) )*(DEBUG|INFO|WARNING|ERROR|CRITICAL)[ :]")
priority = {"DEBUG": 7, "INFO": 6, "WARNING": 4, "ERROR": 3, "CRITICAL": 2}
write = sys.stdout.write
for text in sys.stdin:
    m = level.match(text)
    write(f"<{priority[m.group(1)] if m else 6}>{text}")
"""


def through_python(ws: Workspace, lines: int, mode: str) -> dict[str, Any]:
    """The same flood through `PLAIN_FORWARDER`, read the same way."""
    d = ws.scratch("fwd-python")
    report = d / "flood.json"
    env = {**os.environ, **_flood_env(lines, mode, report)}
    flood = subprocess.Popen([sys.executable, str(FLOOD)], stdout=subprocess.PIPE, env=env)
    assert flood.stdout is not None
    forwarder = subprocess.Popen([sys.executable, "-c", PLAIN_FORWARDER], stdin=flood.stdout, stdout=subprocess.PIPE)
    flood.stdout.close()
    assert forwarder.stdout is not None
    try:
        arrived, newlines = _drain_until_marker(forwarder.stdout.fileno())
        used = cpu_seconds(forwarder.pid)  # with its start, a few hundredths of a second
    finally:
        flood.wait(30)
        forwarder.stdout.close()
        forwarder.wait(30)
    return {**_delivered(report, arrived, newlines, "the plain Python forwarder"), "cpu_s": used}


def components(ws: Workspace, lines: int, mode: str) -> dict[str, Any]:
    """gb10d's forwarding components alone, in this process, fed from the flood over a real pipe.

    The same chain as the supervisor's output handler (framing, bar
    collapsing, classification, the journal writer, event scanning), without
    the event loop and what the loop does with each event: the ceiling the
    forwarding path itself allows.
    """
    d = ws.scratch("fwd-inproc")
    report = d / "flood.json"
    env = {**os.environ, **_flood_env(lines, mode, report)}
    framer, collapser, classifier, scanner = LineFramer(), BarCollapser(), Classifier(), EventScanner()
    events = 0
    with open(os.devnull, "w") as null:
        journal = Journal(null, socket_path=None)
        flood = subprocess.Popen([sys.executable, str(FLOOD)], stdout=subprocess.PIPE, env=env)
        assert flood.stdout is not None
        fd = flood.stdout.fileno()
        while chunk := os.read(fd, 1 << 16):
            for line in framer.feed(chunk):
                if collapser.forward(line.text):
                    journal.vllm_line(line.text, classifier.classify(line.text).priority)
                events += len(scanner.feed(line.text))
            journal.flush()
        done = time.monotonic()
        flood.wait(30)
    child = _child(report)
    return {"lines_per_s": lines / (done - child["start"]), "events": events}


def backlog(ws: Workspace, lines: int) -> dict[str, Any]:
    """How long gb10d is still busy with the flood's events after its last line went out.

    gb10d handles each parsed event in its loop after forwarding the line;
    the flood's exit reaches the loop after them, and with max_attempts = 1
    gb10d exits right after handling it, so its exit marks an empty queue.
    """
    d = ws.scratch("fwd-backlog")
    report = d / "flood.json"
    dep = Deployment(d, None, executable=_wrapper(d), sim_env=_flood_env(lines, "chunks", report),
                     overrides={"restart.max_attempts": 1, "memory.preflight": False})
    with Gb10d(dep, notify=False) as gb:
        last = gb.wait_line(END_MARKER.decode(), 120)
        status = gb.wait_exit(300)
        exited = time.monotonic()
    if last is None or status is None:
        raise RuntimeError("gb10d did not forward the flood and exit")
    return {"lines": lines, "busy_after_last_line_s": exited - last[0], "exit_status": status}


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
        samples: dict[str, list[dict[str, Any]]] = {"gb10d": [], "cat": [], "python": [], "devnull": []}
        for _ in range(repeats):
            samples["devnull"].append(to_devnull(ws, lines, mode))
            samples["cat"].append(through_cat(ws, lines, mode))
            samples["python"].append(through_python(ws, lines, mode))
            samples["gb10d"].append(through_gb10d(ws, lines, mode))
        null_write = summary([s["child_write_s"] for s in samples["devnull"]])["median"]
        entry: dict[str, Any] = {"child_write_s": {k: summary([s["child_write_s"] for s in v]) for k, v in samples.items()}}
        for name in ("gb10d", "cat", "python"):
            entry[name] = {
                "lines_per_s": summary([s["lines_per_s"] for s in samples[name]]),
                "forwarded_lines": samples[name][-1]["forwarded_lines"],
                "child_slowdown": summary([s["child_write_s"] / null_write for s in samples[name]]) if null_write else None,
            }
        entry["bytes"] = samples["cat"][-1]["bytes"]
        g, c = entry["gb10d"]["lines_per_s"]["median"], entry["cat"]["lines_per_s"]["median"]
        entry["gb10d_vs_cat"] = g / c if c else None
        # CPU seconds for the same lines, per repeat, then the median: CPU time hardly moves with what else the
        # machine runs, where lines/s on a shared machine moves by 2x and more.
        entry["gb10d_cpu_s"] = summary([s["cpu_s"] for s in samples["gb10d"]])
        entry["python_cpu_s"] = summary([s["cpu_s"] for s in samples["python"]])
        entry["gb10d_vs_python"] = summary([b["cpu_s"] / a["cpu_s"] for a, b in zip(samples["gb10d"], samples["python"])])
        if not quick:
            entry["components_in_process"] = {"lines_per_s": summary([components(ws, lines, mode)["lines_per_s"] for _ in range(3)])}
        result["modes"][mode] = entry
    if not quick:
        result["backlog"] = backlog(ws, 20_000)
    return result
