"""The vLLM program that last served, and a changed one as a candidate that must prove itself.

Operators move to new vLLM releases often, and that is where a working
setup breaks. So a change of the program (another venv, executable or
image than the one that last served) is a candidate, not a fact: it must
reach ready (the checks before READY=1 include one real completion). If it
fails before it ever served, gb10d goes back to the last known good program
with the settings that served under it, and keeps the candidate's failure,
so the same candidate is not started again until the operator runs
`gb10d forget --candidate`. The record lives beside the learned settings
and survives reboots; a program is its path (or image) with the vLLM
release its banner named and, for a venv, a hash of its installed
distributions. Everything here is pure: `gb10d.machine.programsfile` reads
and writes the file and hashes a venv.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..base.config import Config, VllmSection


@dataclass(frozen=True)
class Program:
    """One vLLM program: where it is, which release it said it was, what its venv had installed."""

    path: str  # the venv, the executable or the image
    kind: str = "venv"  # which of them: the [vllm] key it is set with
    vllm_version: str | None = None
    packages: str | None = None  # a hash of the venv's installed distributions (names and versions)

    def describe(self) -> str:
        """`/opt/vllm-0.34 (vLLM 0.34.0)`."""
        return f"{self.path} (vLLM {self.vllm_version or 'of unknown version'})"


@dataclass(frozen=True)
class Rejected:
    """A candidate that failed before it served, and why."""

    program: Program
    failure: str
    at: str


@dataclass(frozen=True)
class Programs:
    """What the file says: the last known good program (and when it served), the rejected candidate."""

    good: Program | None = None
    good_at: str | None = None
    rejected: Rejected | None = None


# Nothing served yet, nothing rejected.
NONE = Programs()


def program_path(vllm: VllmSection) -> str:
    """What identifies the program a config runs: its venv, image or executable."""
    return str(vllm.venv or vllm.image or vllm.executable)


def program_kind(vllm: VllmSection) -> str:
    """The [vllm] key that names the program."""
    return "venv" if vllm.venv is not None else "image" if vllm.image is not None else "executable"


def is_candidate(config: Config, programs: Programs) -> bool:
    """Whether the config runs another program than the last known good one (none known: nothing to go back to)."""
    return programs.good is not None and program_path(config.vllm) != programs.good.path


def is_rejected(config: Config, programs: Programs) -> bool:
    """Whether the config runs the candidate that already failed (and was not forgotten since)."""
    return programs.rejected is not None and program_path(config.vllm) == programs.rejected.program.path


def fall_back(config: Config, good: Program) -> Config:
    """The config with the good program in place of the candidate, for a start after a restart of gb10d
    (the settings that served under it are not known then: the rest stays the config's)."""
    value: Path | str = good.path if good.kind == "image" else Path(good.path)
    fields: dict[str, Path | str | None] = {"venv": None, "image": None, "executable": None, good.kind: value}
    return config.model_copy(update={"vllm": config.vllm.model_copy(update=fields)})


def served(programs: Programs, program: Program, at: str) -> Programs:
    """The program served: it is the good one from now on, and a rejection of it is forgotten."""
    rejected = programs.rejected if programs.rejected is None or programs.rejected.program.path != program.path else None
    return Programs(good=program, good_at=at, rejected=rejected)


def reject(programs: Programs, candidate: Program, failure: str, at: str) -> Programs:
    """The candidate failed before it served."""
    return replace(programs, rejected=Rejected(candidate, failure, at))


def forget_candidate(programs: Programs) -> Programs:
    """`gb10d forget --candidate`: the operator fixed it; it may be tried again."""
    return replace(programs, rejected=None)


def programs_file(learned_file: Path) -> Path:
    """Where the record is kept: beside the learned settings (`state.toml` -> `state.programs.toml`)."""
    return learned_file.with_name(f"{learned_file.stem}.programs.toml")


def _program(table: Any) -> Program | None:
    if not isinstance(table, dict) or not isinstance(table.get("path"), str):
        return None
    kind, version, packages = table.get("kind"), table.get("vllm_version"), table.get("packages")
    return Program(
        table["path"], kind if kind in ("venv", "image", "executable") else "venv",
        version if isinstance(version, str) else None, packages if isinstance(packages, str) else None,
    )


def from_toml(data: Mapping[str, Any]) -> Programs:
    """The record from the file's tables; what does not read is left out (nothing to go back to, nothing rejected)."""
    good = data.get("good")
    rejected = data.get("rejected")
    rejected_program = _program(rejected)
    return Programs(
        good=_program(good),
        good_at=str(good.get("at", "")) if isinstance(good, dict) else None,
        rejected=Rejected(rejected_program, str(rejected.get("failure", "")), str(rejected.get("at", "")))
        if rejected_program is not None and isinstance(rejected, dict) else None,
    )


def _table(program: Program, **more: str | None) -> dict[str, str]:
    values = {"path": program.path, "kind": program.kind, "vllm_version": program.vllm_version, "packages": program.packages, **more}
    return {key: value for key, value in values.items() if value is not None}


def as_json(programs: Programs) -> dict[str, Any]:
    """The record as `gb10d status --json` shows it (the file's own tables)."""
    data: dict[str, Any] = {}
    if programs.good is not None:
        data["good"] = _table(programs.good, at=programs.good_at)
    if programs.rejected is not None:
        data["rejected"] = _table(programs.rejected.program, failure=programs.rejected.failure, at=programs.rejected.at)
    return data
