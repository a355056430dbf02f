"""Config changes: what changed between two configs, and whether vLLM must restart for it.

`diff_configs` compares two `ConfigSnapshot`s (a config and its env_file
contents), names every changed key (old -> new, secrets masked) and
decides whether vLLM must be restarted, which is only the case when its
command line or environment comes out different, or, for vLLM in a
container, its image or how the container runs (`[container]`: engine,
mounts, GPU, run arguments): a container is replaced, never changed. Restarting vLLM costs
minutes of loading, so a change to gb10d's own settings (timeouts, restart
policy, metrics, logging) never does. Noticing edits on disk is the
watcher's job (`gb10d.daemon.watcher`). `judge_reload` decides what a valid new
config does (applied, refused, or only reported), and `tells_systemd` whether
systemd hears of the reload at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from ..base.command import REDACTED, build_argv, build_env, is_secret_name, read_env_file, redact_setting
from ..base.config import Config, VllmSection, normalize_flag
from ..vllm.sleepmode import vllm_flags
from . import programs

NOT_SET = "(not set)"


# --- the core: what changed ---------------------------------------------------


@dataclass(frozen=True)
class ConfigSnapshot:
    """A config and the contents of its env_file, read at the same moment.

    The env_file is part of what vLLM sees, but a `Config` only holds its
    path; re-reading it when comparing would compare the file with itself.
    So the keeper holds the snapshot vLLM was started from.
    """

    config: Config
    env_file: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def take(cls, config: Config) -> ConfigSnapshot:
        """Read the env_file now; raises ConfigError (located) when it cannot be read or parsed."""
        path = config.vllm.env_file
        return cls(config, read_env_file(path) if path is not None else {})

    @property
    def vllm(self) -> VllmSection:
        """[vllm] with the env_file's contents as read inlined under [vllm.env] (which wins over the file).

        Whatever builds vLLM's environment from it never reads the file
        again: an edit of the env_file takes effect at the next reload, not
        at the next crash-restart, and a deleted one does not stop a running gb10d.
        """
        vllm = self.config.vllm
        return vllm.model_copy(update={"env_file": None, "env": {**self.env_file, **vllm.env}})

    def env(self, base: Mapping[str, str] | None = None, added: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
        """vLLM's environment as a process as of this snapshot (plus a `Tunables.env`): the env_file as it was read."""
        return build_env(self.vllm, base, added)


@dataclass(frozen=True)
class Change:
    """One changed key, with values safe to print (`None` when the key is not set)."""

    key: str
    old: Any
    new: Any

    def describe(self) -> str:
        """`vllm.port 8000 -> 8001`; a secret says only that it changed."""
        if REDACTED in (self.old, self.new):
            verb = "set" if self.old is None else "removed" if self.new is None else "changed"
            return f"{self.key} (secret) {verb}"
        return f"{self.key} {_shown(self.old)} -> {_shown(self.new)}"


@dataclass(frozen=True)
class ConfigDiff:
    """Every changed key, and which of them require restarting vLLM.

    `restart_keys` changed vLLM's command line or environment. `live_keys`
    are gb10d's own settings, applied in place. `no_effect_keys` are [vllm]
    keys written differently that give the same command line and
    environment (e.g. `served_model_name = "a"` -> `["a"]`).
    """

    changes: tuple[Change, ...] = ()
    restart_keys: tuple[str, ...] = ()
    live_keys: tuple[str, ...] = ()
    no_effect_keys: tuple[str, ...] = ()

    @property
    def needs_vllm_restart(self) -> bool:
        """Whether vLLM would be started differently now."""
        return bool(self.restart_keys)

    def __bool__(self) -> bool:
        return bool(self.changes)

    def describe(self) -> str:
        """The journal text: `2 keys changed: vllm.served_model_name "a" -> "b", restart.max_attempts 5 -> 3`."""
        if not self.changes:
            return "no keys changed"
        count = len(self.changes)
        return f"{count} key{'s' if count != 1 else ''} changed: " + ", ".join(c.describe() for c in self.changes)


def diff_configs(old: ConfigSnapshot, new: ConfigSnapshot) -> ConfigDiff:
    """What changed from `old` to `new`; vLLM needs a restart exactly when its argv or environment differs."""
    before, after = _settings(old), _settings(new)
    # Listed in schema order (that of `check-config --explain`), added keys among the others.
    position = {dotted: index for index, (dotted, _) in enumerate(_fields(new.config))}
    changed = sorted(
        (key for key in {**before, **after} if canonical(before.get(key)) != canonical(after.get(key))),
        key=lambda key: position[".".join(key.split(".")[:2])],
    )
    changes = tuple(Change(key, _masked(key, before.get(key)), _masked(key, after.get(key))) for key in changed)
    vllm_keys = tuple(key for key in changed if key.startswith(_RUNS_VLLM))
    live = tuple(key for key in changed if not key.startswith(_RUNS_VLLM))
    if _vllm_sees(old) != _vllm_sees(new):
        return ConfigDiff(changes, restart_keys=vllm_keys, live_keys=live)
    return ConfigDiff(changes, live_keys=live, no_effect_keys=vllm_keys)


# The keys that say how vLLM runs ([on_demand] park: its sleep mode); gb10d's own settings are all the others.
_RUNS_VLLM = ("vllm.", "container.", "on_demand.park")


def _vllm_sees(snapshot: ConfigSnapshot) -> tuple[list[str], dict[str, str], str | None, dict[str, Any] | None]:
    """The argv and added environment vLLM gets (the env_file contents from the snapshot); in a container, its image and [container]."""
    config = snapshot.config
    container = config.container.model_dump(mode="json") if config.vllm.image is not None else None
    # [on_demand]'s sleep mode is a flag and an environment variable of vLLM's: turning it on or off restarts vLLM.
    return [*build_argv(config.vllm, stop_timeout_s=config.daemon.stop_timeout_s), *vllm_flags(config)], snapshot.env(base={}), config.vllm.image, container


def _fields(config: Config) -> Iterator[tuple[str, Any]]:
    """(section.key, value) for every field of the schema, in schema order."""
    for section_name, section in config.tables():
        for key in type(section).model_fields:
            yield f"{section_name}.{key}", getattr(section, key)


def _settings(snapshot: ConfigSnapshot) -> dict[str, Any]:
    """Every set value by dotted key, tables one level deep, args under their normalised flag name."""
    flat: dict[str, Any] = {}
    for dotted, value in _fields(snapshot.config):
        if isinstance(value, dict):
            # `max_model_len` and `max-model-len` are the same flag: respelling it changes nothing.
            names = normalize_flag if dotted == "vllm.args" else str
            flat.update({f"{dotted}.{names(k)}": v for k, v in value.items()})
        elif value is not None:
            flat[dotted] = str(value) if isinstance(value, Path) else value
    flat.update({f"vllm.env_file.{name}": value for name, value in snapshot.env_file.items()})
    return flat


def canonical(value: Any) -> str:
    """A comparison key for config values that tells `1`, `1.0` and `true` apart, as vLLM's argv does."""
    return json.dumps(value, sort_keys=True, default=str)


def _masked(key: str, value: Any) -> Any:
    if value is None:
        return None
    table, _, name = key.rpartition(".")
    if table == "vllm.env_file" and is_secret_name(name):
        return REDACTED
    return redact_setting(key, value)


def _shown(value: Any) -> str:
    """A value as it reads in TOML (strings quoted, true/false), or "(not set)"."""
    return NOT_SET if value is None else json.dumps(value, default=str)


@dataclass(frozen=True)
class ReloadRefused:
    """A valid new config that cannot be applied: its lines for the journal, the running config kept."""

    lines: tuple[str, ...]


@dataclass(frozen=True)
class OnlyReported:
    """An edit seen on disk while daemon.apply_on_change is off: said, not applied."""

    line: str


def judge_reload(
    path: str, running: ConfigSnapshot, new: ConfigSnapshot, record: programs.Programs, requested: bool
) -> ConfigDiff | ReloadRefused | OnlyReported:
    """What a valid config read again does: the changes to apply (maybe none), a refusal, or a report only.

    A machine's part in a Ray cluster changes only at a start, and a candidate program that failed its start
    stays refused until it is forgotten; an edit on disk applies only with daemon.apply_on_change.
    """
    keep = "keeping the running configuration"
    if new.config.cluster != running.config.cluster:
        return ReloadRefused((
            "config not applied: [cluster] changed, and this machine's part in a Ray cluster changes only at a start; "
            f"{keep}; apply it with: systemctl restart gb10d",
        ))
    rejected = record.rejected
    if rejected is not None and programs.is_rejected(new.config, record) and programs.program_path(new.config.vllm) != programs.program_path(running.config.vllm):
        return ReloadRefused((
            f"config not applied: it runs the candidate {rejected.program.describe()}, which failed its start "
            f"{rejected.at} ({rejected.failure}); keeping {programs.program_path(running.config.vllm)}; once it is "
            "fixed: gb10d forget --candidate, then systemctl reload gb10d",
        ))
    diff = diff_configs(running, new)
    if not requested and not running.config.daemon.apply_on_change:
        if diff:
            return OnlyReported(f"{path} changed on disk, not applied ({diff.describe()}); apply it with: systemctl reload gb10d")
        return OnlyReported(f"{path} changed on disk; it is valid and nothing gb10d uses differs")
    return diff


def tells_systemd(serving: bool, requested: bool, apply_on_change: bool) -> bool:
    """Whether systemd hears RELOADING=1 (and READY=1 after) for a config change.

    Only while vLLM serves, and only for a change that is applied: during a start the next READY=1 is the start's
    own, and an edit that is only reported reloads nothing.
    """
    return serving and (requested or apply_on_change)
