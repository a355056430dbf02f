"""The daemon's state has one owner: the Reporter changes its `Situation`, and no other module does.

Read from the source, as the layering is: a module that assigned a field of
the Reporter or of its situation, or called a method that changes the
situation, would make the state file, STATUS= and the journal disagree
(one of them not told), which no single run would show.
"""

from __future__ import annotations

import ast
from pathlib import Path

from gb10d.daemon.state import Situation

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "gb10d" / "daemon" / "reporter.py"
# What the rest of the daemon may read of the situation; every other public name of it changes it.
READS = {"state", "ready_at", "status_text", "tunables", "baseline", "waiting", "doing", "serving_text", "phase_seconds", "record"}


def changing_methods() -> set[str]:
    return {name for name in vars(Situation) if not name.startswith("_")} - READS


def outside_writes(path: Path) -> list[str]:
    """`x.reporter.f = ...`, `reporter.f = ...`, `....situation.f = ...` and `....situation.change(...)` in `path`."""
    tree = ast.parse(path.read_text())
    changing = changing_methods()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in (t for whole in targets for t in (whole.elts if isinstance(whole, ast.Tuple) else [whole])):
            if isinstance(target, ast.Attribute) and _names(target.value) & {"reporter", "situation"}:
                found.append((node.lineno, f"{path.name}:{node.lineno} assigns {ast.unparse(target)}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in changing:
            if "situation" in _names(node.func.value):
                found.append((node.lineno, f"{path.name}:{node.lineno} calls {ast.unparse(node.func)}"))
    return [text for _, text in sorted(found)]


def _names(node: ast.expr) -> set[str]:
    """The last name of an attribute chain (`self.reporter` -> reporter) or the name itself."""
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Name):
        return {node.id}
    return set()


def test_the_situation_lists_what_it_shows_and_what_changes_it() -> None:
    # The read list above names only what exists: a rename must not turn a changing method into a read.
    assert READS <= set(vars(Situation)), READS - set(vars(Situation))
    assert {"enter", "began_attempt", "became_ready", "attempt_ended"} <= changing_methods()


def test_no_module_but_the_reporter_changes_the_daemons_state() -> None:
    modules = [path for path in sorted((ROOT / "gb10d").rglob("*.py")) if path != OWNER and path.name != "state.py"]
    found = [write for path in modules for write in outside_writes(path)]
    assert found == [], "the Reporter alone changes the daemon's state; tell it instead:\n" + "\n".join(found)


def test_the_check_sees_an_outside_write(tmp_path: Path) -> None:
    module = tmp_path / "pair.py"
    module.write_text("def f(self):\n    self.reporter.state = 1\n    self.reporter.situation.enter(2)\n    reporter.image, x = 3, 4\n")
    assert outside_writes(module) == [
        "pair.py:2 assigns self.reporter.state",
        "pair.py:3 calls self.reporter.situation.enter",
        "pair.py:4 assigns reporter.image",
    ]
