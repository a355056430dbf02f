"""`gb10d demo`, the README's first command: the real supervisor recovering from a simulated GB10 failure."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("free-memory", "gb10d: free memory 103.45 of 121.69 GiB is below gpu_memory_utilization 0.92 (111.95 GiB); restarting with 0.84"),
        ("preflight", "gb10d: preflight: gpu_memory_utilization 0.92"),
    ],
)
def test_demo_shows_the_recovery_ready_and_a_clean_stop(scenario: str, expected: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gb10d", "demo", scenario], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected in result.stdout
    assert "systemd <- READY=1 STATUS=serving Qwen3.6-27B-FP8-Agent" in result.stdout
    assert "A client request to the served name answers HTTP 200." in result.stdout
    assert "gb10d exited with status 0." in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
