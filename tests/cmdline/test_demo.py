"""`gb10d demo`, the README's first command: the real supervisor recovering from a simulated GB10 failure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gb10d.daemon.lab import Gb10d
from harness import NotifySocket

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


def test_demo_output_has_no_journald_priority_and_says_the_value_that_worked_was_kept() -> None:
    result = subprocess.run([sys.executable, "-m", "gb10d", "demo", "free-memory"], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "journal | gb10d: free memory 103.45 of 121.69 GiB" in result.stdout
    assert not re.search(r"<\d>", result.stdout), result.stdout
    assert ("gb10d kept the value that worked, gpu_memory_utilization 0.84, in its learned file (daemon.learned_file): "
            "its next start begins with it.") in result.stdout


def test_demo_keep_leaves_a_config_that_gb10d_run_serves_at_once_with_the_value_kept(tmp_path: Path) -> None:
    kept = tmp_path / "sim"
    result = subprocess.run([sys.executable, "-m", "gb10d", "demo", "free-memory", "--keep", str(kept)],
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"gb10d run --config {kept}/gb10d.toml" in result.stdout
    assert f"in {kept}/learned.toml: its next start begins with it (gb10d forget --config {kept}/gb10d.toml undoes that)" in result.stdout
    with NotifySocket() as notify:
        with Gb10d(kept / "gb10d.toml", notify) as gb10d:
            ready = notify.wait_for(lambda m: m.get("READY") == "1", 120)
            assert "attempt 1" in ready["STATUS"] and "gpu_memory_utilization=0.84" in ready["STATUS"], ready
            gb10d.terminate()
            assert gb10d.wait_exit(60) == 0


def test_demo_keep_never_writes_into_a_directory_with_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine\n")
    result = subprocess.run([sys.executable, "-m", "gb10d", "demo", "--keep", str(tmp_path)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1 and "is not an empty directory" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


# --- the README's quick start, as an operator meets it ---------------------------------------------------------

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    return README[start:README.index("\n## ", start + 1)]


def test_the_quick_start_installs_gb10d_alone_and_says_how_to_try_run_and_read_the_man_page() -> None:
    quick = section("Quick start")
    first = next(line.strip() for line in quick.splitlines() if line.startswith("    "))
    assert first == "python3 -m venv .venv && .venv/bin/pip install . && .venv/bin/gb10d demo"
    assert ".venv/bin/gb10d demo --keep ~/gb10d-sim" in quick and "gb10d run --config ~/gb10d-sim/gb10d.toml" in quick
    assert "python -m gb10d.sim make-venv DIR" in quick
    assert "man ./docs/gb10d.8" in quick and (Path(__file__).resolve().parents[2] / "docs" / "gb10d.8").is_file()


def test_the_developers_material_comes_after_the_operators() -> None:
    development = README.index("\n## Development\n")
    for operator in ("Install", "Coming from a start.sh", "Configuration", "Running under systemd", "Troubleshooting", "Metrics"):
        assert README.index(f"\n## {operator}\n") < development, operator
    assert README.index("bash .ci/run") > development and README.index("[test]") > development


def test_the_demo_needs_none_of_the_test_tools() -> None:
    # As after `pip install .`: Ray, pytest, mypy and ruff come only with the test extra.
    blocker = (
        "import sys, runpy\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('ray', 'pytest', 'mypy', 'ruff'):\n"
        "            raise ImportError(f'{name} is not installed')\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['gb10d', 'demo', 'healthy']\n"
        "runpy.run_module('gb10d', run_name='__main__')\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "systemd <- READY=1" in result.stdout
