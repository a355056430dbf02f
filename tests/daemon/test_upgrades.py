"""Upgrades that prove themselves: a changed vLLM program is a candidate until it serves.

The real `gb10d run` supervises gb10d.sim in one venv; a reload points it at
another. A candidate that fails its start gives way to the last good
program with the settings that served under it, and is kept as rejected; a
candidate that serves becomes the good one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gb10d.sim import make_venv
from harness import Daemon, NotifySocket, Setup, wait_until

pytestmark = pytest.mark.slow

# What a venv whose vLLM is missing or half installed prints: the console script cannot import it.
IMPORT_FAILURE = """Traceback (most recent call last):
  File "{venv}/bin/vllm", line 5, in <module>
    from vllm.entrypoints.cli.main import main
ModuleNotFoundError: No module named 'vllm'
"""


def broken_venv(path: Path) -> Path:
    """A venv whose `vllm` cannot import vLLM, as after a failed `pip install -U vllm`."""
    (path / "bin").mkdir(parents=True)
    script = path / "bin" / "vllm"
    script.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{IMPORT_FAILURE.format(venv=path)}EOF\nexit 1\n")
    script.chmod(0o755)
    return path


def record(setup: Setup) -> dict[str, dict[str, str]]:
    path = setup.root / "lib" / "state.programs.toml"
    return tomllib.loads(path.read_text()) if path.exists() else {}


def good_is(setup: Setup, venv: Path, version: str) -> None:
    """Kept right after READY=1: wait for the record to name it."""
    wait_until(lambda: record(setup).get("good", {}).get("path") == str(venv), what=f"{venv} recorded as the good program")
    assert record(setup)["good"]["vllm_version"] == version


def started(daemon: Daemon, since: int = 0) -> list[str]:
    """gb10d's start lines from the `since`-th journal line on."""
    return [line for line in daemon.lines[since:] if re.match(r"<\d>gb10d: started vLLM as pid", line)]


def gb10d(*words: str) -> str:
    """A gb10d command as the operator runs it; its stdout (status exits 0 while running, 3 once stopped)."""
    out = subprocess.run([sys.executable, "-m", "gb10d", *words], capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 3), out.stderr
    return out.stdout


def reload_with(daemon: Daemon, setup: Setup, venv: Path, version: str) -> int:
    """Point the config at `venv` (a stand-in playing `version`) and SIGHUP gb10d; returns where its journal stood."""
    since = len(daemon.lines)
    setup.extra["vllm.venv"] = str(venv)
    setup.sim_env["GB10D_SIM_VERSION"] = version
    setup.write_config()
    os.kill(daemon.proc.pid, signal.SIGHUP)
    return since


def test_a_failed_candidate_goes_back_to_the_good_venv_and_a_working_one_becomes_good(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    setup = Setup(tmp_path, sim_env={"GB10D_SIM_VERSION": "0.33.0"})
    good = setup.venv
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    notify.wait_for(lambda m: m.get("READY") == "1", 90)
    daemon.wait_line(r"vLLM is ready after .*vLLM version 0\.33\.0")
    good_is(setup, good, "0.33.0")

    # A candidate whose vLLM cannot import: one journal line, and the good venv serves again.
    broken = broken_venv(tmp_path / "vllm-broken")
    since = reload_with(daemon, setup, broken, "0.34.0")
    line = daemon.wait_line(r"gb10d: the candidate .* failed its start: .*; going back to the last good .*", since=since).string
    assert f"the candidate {broken} (vLLM of unknown version) failed its start" in line
    assert "ModuleNotFoundError: No module named 'vllm'" in line
    assert f"going back to the last good {good} (vLLM 0.33.0) with the settings that served under it" in line
    daemon.wait_line(r"gb10d: vLLM is ready after .*; vLLM version 0\.33\.0$", since=since)
    notify.wait_for(lambda m: m.get("READY") == "1" and notify.count("RELOADING", "1") == 1 and notify.count("READY", "1") == 2)
    attempts = started(daemon, since)
    assert len(attempts) == 2, attempts
    assert f"{broken}/bin/vllm serve" in attempts[0] and f"{good}/bin/vllm serve" in attempts[1], attempts
    assert sum("going back to the last good" in entry for entry in daemon.own_lines()) == 1
    rejected = record(setup)["rejected"]
    assert rejected["path"] == str(broken) and "ModuleNotFoundError" in rejected["failure"]
    assert record(setup)["good"]["path"] == str(good)

    status = gb10d("status", "--config", str(setup.config))
    assert re.search(rf"Good program: {re.escape(str(good))} \(vLLM 0\.33\.0\), served ", status), status
    assert re.search(rf"Rejected: {re.escape(str(broken))} \(vLLM of unknown version\) failed its start .*ModuleNotFoundError", status), status

    # The same candidate again is refused until the operator says it is fixed.
    since = reload_with(daemon, setup, broken, "0.34.0")
    daemon.wait_line(rf"gb10d: config not applied: it runs the candidate {re.escape(str(broken))} .*gb10d forget --candidate", since=since)
    assert not started(daemon, since)

    # A candidate that serves becomes the good one.
    fixed = tmp_path / "vllm-new"
    make_venv(fixed)
    since = reload_with(daemon, setup, fixed, "0.34.0")
    daemon.wait_line(rf"gb10d: the candidate {re.escape(str(fixed))} \(vLLM 0\.34\.0\) served: it is the good program from now on", since=since)
    daemon.wait_line(r"vLLM is ready after .*vLLM version 0\.34\.0$", since=since)
    good_is(setup, fixed, "0.34.0")
    assert daemon.stop() == 0

    # The operator fixed the broken one: `gb10d forget --candidate` re-arms it.
    assert f"forgot the rejection of {broken}" in gb10d("forget", "--candidate", "--config", str(setup.config))
    assert "rejected" not in record(setup)
