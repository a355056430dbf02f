"""The functional core stays pure: importing any core module pulls in no httpx, watchdog or asyncio."""

from __future__ import annotations

import subprocess
import sys

import pytest

# The modules docs/DESIGN.md lists as core (those marked "core + tiny shell" included).
CORE = (
    "errors", "levels", "config", "command", "importscript", "events", "logparse", "phases", "facts", "lifecycle",
    "outcome", "policy", "memory", "budget", "devices", "liveness", "reload", "learned", "statefile", "status", "cluster",
    "interfaces", "diagnose", "known", "kernel", "advice", "migrate", "access", "hfcache", "host", "front.core", "sleepmode",
)
SHELL_LIBRARIES = ("httpx", "watchdog", "asyncio")


@pytest.mark.slow
@pytest.mark.parametrize("module", CORE)
def test_a_core_module_imports_no_io_library(module: str) -> None:
    # A fresh interpreter: what this test process already imported must not hide an import.
    script = f"import sys, gb10d.{module}; print(','.join(m for m in {SHELL_LIBRARIES!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"gb10d.{module} imports {result.stdout.strip()}"


def test_the_design_map_lists_every_core_module_as_core() -> None:
    from pathlib import Path

    design = (Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md").read_text()
    for module in CORE:
        assert f"| `{module}` | core" in design, module
