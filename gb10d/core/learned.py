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
can name the keys that changed. For vLLM from a container image the image's
digest counts too: a tag that moved to another image since brings another
vLLM, and what the old one needed is not applied to it blindly.

Everything here is pure; reading and writing the file is `gb10d.daemon.learnedfile`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Mapping

from ..base.command import REDACTED, Tunables, redact_setting
from ..base.config import Config
from ..base.flags import normalize_flag
from .reload import Change, canonical

# The fields of Tunables that are learned, each on its own: None in an entry means "not learned".
TUNABLE_NAMES = ("gpu_memory_utilization", "load_strategy", "max_model_len", "env", "without", "flags")
# The basis key of the image a container ran: its registry digest, else its local id (`ImageInfo.identity`).
IMAGE_DIGEST = "image_digest"


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
    env: tuple[tuple[str, str], ...] | None = None
    without: tuple[str, ...] | None = None
    flags: tuple[str, ...] | None = None

    def values(self) -> str:
        """`gpu_memory_utilization 0.85, safetensors-load-strategy prefetch`."""
        parts = []
        if self.gpu_memory_utilization is not None:
            parts.append(f"gpu_memory_utilization {self.gpu_memory_utilization:g}")
        if self.load_strategy is not None:
            parts.append(f"safetensors-load-strategy {self.load_strategy}")
        if self.max_model_len is not None:
            parts.append(f"max-model-len {self.max_model_len}")
        parts.extend(f"{name}={value}" for name, value in self.env or ())
        parts.extend(f"without --{flag}" for flag in self.without or ())
        parts.extend(self.flags or ())
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


def learned_for(config: Config, image: str | None = None) -> dict[str, Any]:
    """The settings a learned value depends on, by dotted config key (unset keys left out), and the image's digest."""
    v = config.vllm
    program_key = "vllm.venv" if v.venv is not None else "vllm.image" if v.image is not None else "vllm.executable"
    basis: dict[str, Any] = {
        "vllm.model": v.model,
        "vllm.served_model_name": v.served_names,
        program_key: str(v.venv or v.image or v.executable),
        "vllm.gpu_memory_utilization": v.gpu_memory_utilization,
    }
    if image is not None:
        basis[IMAGE_DIGEST] = image
    for key, value in sorted(v.args.items(), key=lambda item: normalize_flag(item[0])):
        dotted = f"vllm.args.{normalize_flag(key)}"
        # A secret (--api-key) has nothing to do with memory and must not be written to disk.
        if redact_setting(dotted, value) != REDACTED:
            basis[dotted] = value
    if v.extra_args:
        basis["vllm.extra_args"] = redact_setting("vllm.extra_args", v.extra_args)
    return basis


def fingerprint(config: Config, image: str | None = None) -> str:
    """A short hash of `learned_for(config, image)`: equal exactly when learned values carry over."""
    return hashlib.sha256(canonical(learned_for(config, image)).encode("utf-8")).hexdigest()[:16]


def applicable(state: LearnedState, config: Config, image: str | None = None) -> Applicability:
    """The learned entry if it was learned for this config (and image); otherwise None and what changed since."""
    entry = state.entry
    if entry is None:
        return Applicability(None)
    if entry.fingerprint == fingerprint(config, image):
        return Applicability(entry, f"starting from the settings learned for this config: {entry.describe()}; gb10d forget discards them")
    now = learned_for(config, image)
    was = entry.learned_for.get(IMAGE_DIGEST)
    if was is not None and image is not None and was != image and {**entry.learned_for, IMAGE_DIGEST: image} == now:
        return Applicability(
            None,
            f"not applying the settings learned {entry.learned_at} ({entry.values()}): they were learned with the image "
            f"{config.vllm.image} as {was}, and it is now {image}, another vLLM; starting from the config's values "
            "(this image's start learns its own)",
        )
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


def remember(config: Config, tunables: Tunables, reason: str, at: datetime, image: str | None = None) -> LearnedEntry | None:
    """An entry for the settings a start reached ready with (from `image`, a container's), or None when they are just the config's own."""
    requested = Tunables.from_config(config.vllm)
    learned = {name: getattr(tunables, name) if getattr(tunables, name) != getattr(requested, name) else None for name in TUNABLE_NAMES}
    if all(value is None for value in learned.values()):
        return None
    return LearnedEntry(
        fingerprint=fingerprint(config, image),
        learned_for=learned_for(config, image),
        learned_at=at.isoformat(timespec="seconds"),
        reason=reason,
        **learned,
    )


def merge(tunables: Tunables, entry: LearnedEntry) -> Tunables:
    """The config's tunables with each learned value put in their place."""
    return tunables.with_(**learned_values(entry))


def learned_values(entry: LearnedEntry) -> dict[str, Any]:
    return {name: getattr(entry, name) for name in TUNABLE_NAMES if getattr(entry, name) is not None}
