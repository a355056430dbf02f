"""The record of the last known good vLLM program read and written, and a venv's distributions hashed.

What the record means is decided in `gb10d.core.programs`.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import tomli_w

from ..base.config import VllmSection
from ..core.programs import Program, Programs, as_json, from_toml, program_kind, program_path
from .files import write_atomically

# Readable by operators, as the learned settings are: `gb10d status` shows it, and nothing in it is secret.
PROGRAMS_FILE_MODE = 0o644


def packages_hash(venv: Path) -> str | None:
    """A short hash of the distributions installed in a venv (their dist-info names carry name and version)."""
    names = sorted(p.name for p in venv.glob("lib/python*/site-packages/*.dist-info"))
    if not names:
        return None
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def identify(vllm: VllmSection, version: str | None) -> Program:
    """The program a config runs, with the release it named and (for a venv) what is installed in it."""
    return Program(program_path(vllm), program_kind(vllm), version, packages_hash(vllm.venv) if vllm.venv is not None else None)


def load(path: Path) -> Programs:
    """The record; a missing or unreadable one is empty (nothing to go back to, nothing rejected)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return Programs()
    return from_toml(data)


def save(path: Path, programs: Programs) -> None:
    """Replace the record atomically and durably, as the learned settings beside it are; raises OSError."""
    write_atomically(path, tomli_w.dumps(as_json(programs)).encode("utf-8"), PROGRAMS_FILE_MODE, sync_directory=True)
