"""The learned-settings file (`[daemon] learned_file`): reading, atomic writing and removing it.

What the file means is decided in `gb10d.core.learned`; here it is only read and
written. `load` never raises (a bad file is a `problem`, and gb10d starts
from the config's values); `save` and `forget` raise only
`LearnedFileError`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..base.config import LOAD_STRATEGIES
from ..base.errors import Gb10dError
from ..core.learned import LearnedEntry, LearnedState, learned_values
from ..machine.files import write_atomically

# Readable by operators checking what gb10d learned: nothing in it is secret.
LEARNED_FILE_MODE = 0o644
PERMISSION_HINT = "run as root or as the gb10d user"


class LearnedFileError(Gb10dError):
    """The learned-settings file could not be written or removed."""


class _StoredEntry(BaseModel):
    """`[learned]` as written by `save`; anything else in the file is a reason to ignore it."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    load_strategy: str | None = None
    max_model_len: int | str | None = None
    env: dict[str, str] | None = None
    without: list[str] | None = None
    flags: list[str] | None = None
    learned_at: str
    reason: str
    fingerprint: str
    learned_for: dict[str, Any] = Field(alias="for")

    @field_validator("load_strategy")
    @classmethod
    def _known_strategy(cls, value: str | None) -> str | None:
        if value is not None and value not in LOAD_STRATEGIES:
            raise ValueError(f"must be one of {', '.join(LOAD_STRATEGIES)} (got {value!r})")
        return value


def _to_toml(entry: LearnedEntry | None) -> dict[str, Any]:
    if entry is None:
        return {}
    values = learned_values(entry)
    if "env" in values:
        values["env"] = dict(values["env"])
    for name in ("without", "flags"):
        if name in values:
            values[name] = list(values[name])
    table = values | {"learned_at": entry.learned_at, "reason": entry.reason, "fingerprint": entry.fingerprint, "for": dict(entry.learned_for)}
    return {"learned": table}


def load(path: Path) -> LearnedState:
    """What the file says was learned; a missing file is empty, a bad one is empty with a one-line `problem`."""
    ignoring = "ignoring it and starting from the config's values"
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return LearnedState()
    except OSError as exc:
        return LearnedState(problem=f"cannot read the learned settings {path}: {exc.strerror or exc}; {ignoring}")
    except UnicodeDecodeError:
        return LearnedState(problem=f"the learned settings {path} are not UTF-8 text; {ignoring} (gb10d forget removes the file)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        return LearnedState(problem=f"the learned settings {path} are not valid TOML ({exc}); {ignoring} (gb10d forget removes the file)")
    if "learned" not in data:
        return LearnedState()
    try:
        stored = _StoredEntry.model_validate(data["learned"])
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(["learned", *(str(p) for p in first["loc"])])
        return LearnedState(problem=f"the learned settings {path} are damaged ({where}: {first['msg']}); {ignoring} (gb10d forget removes the file)")
    fields = stored.model_dump()
    fields["env"] = tuple(fields["env"].items()) if fields["env"] is not None else None
    for name in ("without", "flags"):
        fields[name] = tuple(fields[name]) if fields[name] is not None else None
    return LearnedState(LearnedEntry(**fields))


def save(path: Path, state: LearnedState) -> None:
    """Replace the file atomically (temporary file in the same directory, fsync, rename), creating the directory."""
    data = tomli_w.dumps(_to_toml(state.entry)).encode("utf-8")
    try:
        # The rename must survive a power cut too, or the next boot relearns through a failed start.
        write_atomically(path, data, LEARNED_FILE_MODE, sync_directory=True)
    except OSError as exc:
        raise LearnedFileError(_cannot("save the learned settings to", path, exc)) from None


def forget(path: Path) -> bool:
    """Remove the file; False when there was none. Raises LearnedFileError when it cannot be removed."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise LearnedFileError(_cannot("remove", path, exc)) from None
    return True


def start_times_file(learned_file: Path) -> Path:
    """Where the phases of the last complete start are kept: beside the learned settings (`state.toml` ->
    `state.starts.toml`), apart from them so that `gb10d forget` leaves the estimate alone."""
    return learned_file.with_name(f"{learned_file.stem}.starts.toml")


def load_start_times(path: Path, fingerprint: str) -> dict[str, float]:
    """Seconds per phase of the last complete start of the config with this fingerprint; empty when there was none,
    the config changed since (its phases would mislead), or the file cannot be read (the estimate is only a help)."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    last = data.get("last_start")
    if not isinstance(last, dict) or last.get("fingerprint") != fingerprint or not isinstance(last.get("phases"), dict):
        return {}
    return {k: float(v) for k, v in last["phases"].items() if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0}


def save_start_times(path: Path, fingerprint: str, phases: dict[str, float], at: str) -> None:
    """Keep the phases of the start that just reached ready, for the next start's estimate."""
    table = {"last_start": {"fingerprint": fingerprint, "finished_at": at, "phases": {k: round(v, 3) for k, v in phases.items()}}}
    try:
        write_atomically(path, tomli_w.dumps(table).encode("utf-8"), LEARNED_FILE_MODE)
    except OSError as exc:
        raise LearnedFileError(_cannot("save the start's phase times to", path, exc)) from None


def _cannot(action: str, path: Path, exc: OSError) -> str:
    hint = f"; {PERMISSION_HINT}" if isinstance(exc, PermissionError) else ""
    return f"cannot {action} {path}: {exc.strerror or exc}{hint}"
