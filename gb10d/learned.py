"""Settings gb10d had to learn, kept across restarts in `[daemon] learned_file`.

When a start only succeeded after a correction (a lower
gpu_memory_utilization because free memory was short, another safetensors
load strategy after a stall, a shorter max_model_len), the next start should
begin from what worked instead of failing the same way after every reboot.
The file lives in gb10d's state directory (/var/lib/gb10d/state.toml by
default): gb10d never writes /etc/gb10d.toml, which dpkg owns as a conffile.

What was learned only holds for the config it was learned with, so each
entry carries a fingerprint of the settings that decide how much memory vLLM
needs and how it loads: the model, the served names, the program, the
requested gpu_memory_utilization, every `[vllm.args]` flag (max-model-len,
safetensors-load-strategy, kv-cache-dtype, speculative-config among them)
and extra_args. In short the command line as configured (the tuned values as
requested, not as last used), minus where vLLM listens and any API key.
Those settings are stored readably beside the hash, so a discarded entry
can name the keys that changed.

`learned_for`, `fingerprint`, `applicable`, `remember` and `merge` are pure.
`load` never raises (a bad file is a `problem`); `save` and `forget` raise
only `LearnedFileError`.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .command import REDACTED, Tunables, redact_setting
from .config import LOAD_STRATEGIES, Config, normalize_flag
from .errors import Gb10dError
from .reload import Change, canonical
from .statefile import write_atomically

# Readable by operators checking what gb10d learned: nothing in it is secret.
LEARNED_FILE_MODE = 0o644
PERMISSION_HINT = "run as root or as the gb10d user"
# The fields of Tunables that are learned, each on its own: None in an entry means "not learned".
TUNABLE_NAMES = ("gpu_memory_utilization", "load_strategy", "max_model_len")


class LearnedFileError(Gb10dError):
    """The learned-settings file could not be written or removed."""


@dataclass(frozen=True)
class LearnedEntry:
    """What worked, for which settings, when and why; a tunable left None was not learned (the config's value holds)."""

    fingerprint: str
    learned_for: Mapping[str, Any]
    learned_at: str
    reason: str
    gpu_memory_utilization: float | None = None
    load_strategy: str | None = None
    max_model_len: int | str | None = None

    def values(self) -> str:
        """`gpu_memory_utilization 0.85, safetensors-load-strategy prefetch`."""
        parts = []
        if self.gpu_memory_utilization is not None:
            parts.append(f"gpu_memory_utilization {self.gpu_memory_utilization:g}")
        if self.load_strategy is not None:
            parts.append(f"safetensors-load-strategy {self.load_strategy}")
        if self.max_model_len is not None:
            parts.append(f"max-model-len {self.max_model_len}")
        return ", ".join(parts)

    def describe(self) -> str:
        """The values with when and why they were learned, for the journal and `gb10d forget`."""
        return f"{self.values()} (learned {self.learned_at}: {self.reason})"


@dataclass(frozen=True)
class LearnedState:
    """The contents of the learned file; `problem` says why a file that exists was ignored."""

    entry: LearnedEntry | None = None
    problem: str | None = None


@dataclass(frozen=True)
class Applicability:
    """Whether a learned entry applies to a config, and the sentence saying why (empty when nothing was learned)."""

    entry: LearnedEntry | None
    reason: str = ""


# --- the core -------------------------------------------------------------------


def learned_for(config: Config) -> dict[str, Any]:
    """The settings a learned value depends on, by dotted config key (unset keys left out)."""
    v = config.vllm
    program_key = "vllm.venv" if v.venv is not None else "vllm.executable"
    basis: dict[str, Any] = {
        "vllm.model": v.model,
        "vllm.served_model_name": v.served_names,
        program_key: str(v.venv or v.executable),
        "vllm.gpu_memory_utilization": v.gpu_memory_utilization,
    }
    for key, value in sorted(v.args.items(), key=lambda item: normalize_flag(item[0])):
        dotted = f"vllm.args.{normalize_flag(key)}"
        # A secret (--api-key) has nothing to do with memory and must not be written to disk.
        if redact_setting(dotted, value) != REDACTED:
            basis[dotted] = value
    if v.extra_args:
        basis["vllm.extra_args"] = redact_setting("vllm.extra_args", v.extra_args)
    return basis


def fingerprint(config: Config) -> str:
    """A short hash of `learned_for(config)`: equal exactly when learned values carry over."""
    return hashlib.sha256(canonical(learned_for(config)).encode("utf-8")).hexdigest()[:16]


def applicable(state: LearnedState, config: Config) -> Applicability:
    """The learned entry if it was learned for this config; otherwise None and which keys changed since."""
    entry = state.entry
    if entry is None:
        return Applicability(None)
    if entry.fingerprint == fingerprint(config):
        return Applicability(entry, f"starting from the settings learned for this config: {entry.describe()}; gb10d forget discards them")
    now = learned_for(config)
    changed = [
        Change(key, entry.learned_for.get(key), now.get(key)).describe()
        for key in {**entry.learned_for, **now}
        if canonical(entry.learned_for.get(key)) != canonical(now.get(key))
    ]
    since = ", ".join(changed) if changed else "the fingerprint differs"
    return Applicability(
        None,
        f"discarding the settings learned {entry.learned_at} ({entry.values()}): the config changed since "
        f"({since}); starting from the config's values",
    )


def remember(config: Config, tunables: Tunables, reason: str, at: datetime) -> LearnedEntry | None:
    """An entry for the settings a start reached ready with, or None when they are just the config's own."""
    requested = Tunables.from_config(config.vllm)
    learned = {name: getattr(tunables, name) if getattr(tunables, name) != getattr(requested, name) else None for name in TUNABLE_NAMES}
    if all(value is None for value in learned.values()):
        return None
    return LearnedEntry(
        fingerprint=fingerprint(config),
        learned_for=learned_for(config),
        learned_at=at.isoformat(timespec="seconds"),
        reason=reason,
        **learned,
    )


def merge(tunables: Tunables, entry: LearnedEntry) -> Tunables:
    """The config's tunables with each learned value put in their place."""
    return tunables.with_(**_learned_values(entry))


def _learned_values(entry: LearnedEntry) -> dict[str, Any]:
    return {name: getattr(entry, name) for name in TUNABLE_NAMES if getattr(entry, name) is not None}


# --- the file ---------------------------------------------------------------------


class _StoredEntry(BaseModel):
    """`[learned]` as written by `save`; anything else in the file is a reason to ignore it."""

    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")

    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    load_strategy: str | None = None
    max_model_len: int | str | None = None
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
    table = _learned_values(entry) | {"learned_at": entry.learned_at, "reason": entry.reason, "fingerprint": entry.fingerprint, "for": dict(entry.learned_for)}
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
    return LearnedState(LearnedEntry(**stored.model_dump()))


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


def _cannot(action: str, path: Path, exc: OSError) -> str:
    hint = f"; {PERMISSION_HINT}" if isinstance(exc, PermissionError) else ""
    return f"cannot {action} {path}: {exc.strerror or exc}{hint}"
