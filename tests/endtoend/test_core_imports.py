"""The layering holds: import-linter's contracts (pyproject.toml, [tool.importlinter]) are kept.

The decisions import no I/O library and none of the shell, and gb10d.sim
imports nothing of gb10d; indirect imports count. lint-imports reads the
import graph without importing anything, so this runs in the fast loop.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The contract that holds the core modules to it; its source modules are the core.
CORE_CONTRACT = "core-no-io"


def test_every_import_keeps_the_layering_contracts() -> None:
    # The entry point of the `lint-imports` script, run by this interpreter: the one whose gb10d is under test.
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]
    result = subprocess.run(
        [*command, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        pytest.fail(result.stdout + result.stderr, pytrace=False)


def test_the_design_map_lists_every_core_module_as_core() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    sources = next(contract for contract in contracts if contract["id"] == CORE_CONTRACT)["source_modules"]
    design = design_section("Module map")
    for module in modules_of(sources):
        name = module.removeprefix("gb10d.")
        assert f"| `{name}` | core" in design, name


def modules_of(sources: list[str]) -> list[str]:
    """The contract's source modules, a package (the decisions' gb10d.core, say) standing for every module in it."""
    modules = []
    for source in sources:
        folder = ROOT.joinpath(*source.split("."))
        if folder.is_dir():
            modules += [f"{source}.{path.stem}" for path in sorted(folder.glob("*.py")) if path.stem != "__init__"]
        else:
            modules.append(source)
    return modules


def design_section(title: str) -> str:
    """One `## ` section of docs/DESIGN.md: a module named elsewhere in it (in a feature's row, say) is no map row."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_design_map_is_the_tree_every_module_has_its_row() -> None:
    design = design_section("Module map")
    missing = [
        name for path in sorted((ROOT / "gb10d").rglob("*.py")) if path.stem not in ("__init__", "__main__")
        if f"| `{(name := '.'.join(path.relative_to(ROOT / 'gb10d').with_suffix('').parts))}` |" not in design
    ]
    assert missing == [], f"docs/DESIGN.md's module map has no row for {missing}"


def test_every_module_a_feature_names_in_design_md_is_in_the_tree() -> None:
    # The table of features across the layers names modules by hand: a module moved or renamed must take its rows along.
    rows = [line.split(" | ") for line in design_section("Features across the layers").splitlines() if line.startswith("| ")]
    named = [name for cells in rows[2:] for name in re.findall(r"`([a-z_.]+)`", cells[2])]
    assert named, "no module found in the features table"
    missing = [
        name for name in named
        if not (ROOT / "gb10d" / Path(*name.split("."))).with_suffix(".py").is_file() and not (ROOT / "gb10d" / Path(*name.split("."))).is_dir()
    ]
    assert missing == [], f"docs/DESIGN.md's features table names modules that are not in gb10d: {missing}"
