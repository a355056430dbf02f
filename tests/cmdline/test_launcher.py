"""/usr/bin/gb10d, the package's launcher: a broken install says so once, in a way systemd does not retry."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_CONFIG

LAUNCHER = Path(__file__).resolve().parents[2] / "packaging" / "gb10d-launcher"
SYSTEM_PYTHON = Path("/usr/bin/python3")


@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="no /usr/bin/python3, the launcher's interpreter")
@pytest.mark.skipif(os.path.exists("/usr/lib/gb10d/site-packages"), reason="gb10d is installed here: its tree loads")
def test_a_tree_that_does_not_import_exits_78_with_one_line_and_how_to_reinstall() -> None:
    # Here /usr/lib/gb10d does not exist, as after a dpkg that failed half-way; a vendored
    # extension module missing or built for another CPU fails the same import.
    result = subprocess.run([SYSTEM_PYTHON, "-I", LAUNCHER, "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (EXIT_CONFIG, "")
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("gb10d: the installed package does not load with this python3 3.")
    assert result.stderr.endswith("; reinstall it: sudo apt-get install --reinstall gb10d\n")
    assert len(result.stderr.splitlines()) == 1
