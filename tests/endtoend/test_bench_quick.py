"""The quick benchmark as a test: readiness latency and forwarding throughput must stay within their bounds.

It runs `python -m bench --quick` as a real process (the real `gb10d run`,
the stand-in, a flood child, `cat`, a plain Python forwarder), so it takes
about a minute. The bounds are relative to baselines measured in the same
run, plus generous absolute floors, as stated in docs/BENCHMARKS.md; a
failure prints the bench's table. Forwarding is bounded by gb10d's CPU time
per line against the plain forwarder's, which a loaded machine hardly moves
(its lines/s moves by 2x), with a margin of 2x below what gb10d measures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_quick_benchmark_holds_readiness_and_forwarding_bounds(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=270,
    )
    written = tmp_path / "quick.json"
    # The bench writes its results last, whether the bounds held or not (then it exits 1).
    assert written.exists(), f"quick benchmark broke (exit {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    results = json.loads(written.read_text())
    assert {c["check"] for c in results["checks"]} >= {
        "readiness median (s)",
        "readiness median vs 1 s poll median (s)",
        "forwarding lines/s (lines)",
        "forwarding vs plain Python forwarder (lines)",
    }
    failed = [f"{c['check']} = {c['value']} (bound {c['bound']})" for c in results["checks"] if not c["ok"]]
    assert not failed, f"bounds not held: {failed}\n{run.stdout}"
