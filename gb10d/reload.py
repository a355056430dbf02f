"""Config changes: what changed between two configs, and a watcher that notices edits.

`diff_configs` is the core: it compares two `ConfigSnapshot`s (a config and
its env_file contents), names every changed key (old -> new, secrets masked)
and decides whether vLLM must be restarted, which is only the case when its
command line or environment comes out different. Restarting vLLM
costs minutes of loading, so a change to gb10d's own settings (timeouts,
restart policy, metrics, logging) never does.

`ConfigWatcher` is the shell: watchdog's inotify observer on the config's
directory and drop-in directory, debounced on the asyncio loop, so a burst
of editor writes becomes one call of `on_change`. It only reports that
something changed; the supervisor re-reads, validates and decides.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

from .command import REDACTED, build_argv, build_env, is_secret_name, read_env_file, redact_setting
from .config import Config, dropin_dir_for, normalize_flag
from .errors import Gb10dError

DEFAULT_DEBOUNCE_S = 0.5
NOT_SET = "(not set)"
_INOTIFY_HINT = " (raise fs.inotify.max_user_instances or fs.inotify.max_user_watches with sysctl)"

# The event kinds that mean content changed. Opens and reads are left out on
# purpose: gb10d reads the file to validate it, and a watcher that woke up on
# that would validate forever; leaving them out of the inotify mask also spares
# the thread every read of every file in /etc.
_CONTENT_EVENTS: list[type[FileSystemEvent]] = [
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileClosedEvent,
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
]


# --- the core: what changed ---------------------------------------------------


@dataclass(frozen=True)
class ConfigSnapshot:
    """A config and the contents of its env_file, read at the same moment.

    The env_file is part of what vLLM sees, but a `Config` only holds its
    path; re-reading it when comparing would compare the file with itself.
    So the supervisor keeps the snapshot vLLM was started from.
    """

    config: Config
    env_file: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def take(cls, config: Config) -> ConfigSnapshot:
        """Read the env_file now; raises ConfigError (located) when it cannot be read or parsed."""
        path = config.vllm.env_file
        return cls(config, read_env_file(path) if path is not None else {})


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
    vllm_keys = tuple(key for key in changed if key.startswith("vllm."))
    live = tuple(key for key in changed if not key.startswith("vllm."))
    if _vllm_sees(old) != _vllm_sees(new):
        return ConfigDiff(changes, restart_keys=vllm_keys, live_keys=live)
    return ConfigDiff(changes, live_keys=live, no_effect_keys=vllm_keys)


def _vllm_sees(snapshot: ConfigSnapshot) -> tuple[list[str], dict[str, str]]:
    """The argv and added environment vLLM gets, with the env_file contents taken from the snapshot."""
    vllm = snapshot.config.vllm
    # Inlining the snapshot's env_file contents (under [vllm.env], which wins over
    # the file) lets build_env decide the environment without reading the file again.
    inlined = vllm.model_copy(update={"env_file": None, "env": {**snapshot.env_file, **vllm.env}})
    return build_argv(vllm), build_env(inlined, base={})


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


# --- the shell: noticing edits ------------------------------------------------


class WatchUnavailable(Gb10dError):
    """The config file cannot be watched; edits take effect only with systemctl reload."""


class ConfigWatcher:
    """Calls `on_change` in the loop's thread once per burst of edits to the config or its drop-ins.

    The config's directory is watched rather than the file, because editors
    replace files by rename (vim, sed -i) and a watch on the old inode would
    go silent. The drop-in directory is watched once it exists; its creation
    or removal is itself an edit. A burst ends `debounce_s` after its last
    event, measured by a loop timer that every event re-arms.
    """

    def __init__(
        self,
        path: Path,
        loop: asyncio.AbstractEventLoop,
        on_change: Callable[[], None],
        debounce_s: float = DEFAULT_DEBOUNCE_S,
    ) -> None:
        self.path = path.absolute()
        self.dropin_dir = dropin_dir_for(self.path)
        self._loop = loop
        self._on_change = on_change
        self._debounce_s = debounce_s
        self._observer: BaseObserver | None = None
        self._dropin_watch: ObservedWatch | None = None
        self._dropin_inode: tuple[int, int] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._handler = _Relay(self._relevant, loop, self._event)

    def start(self) -> None:
        """Begin watching; raises WatchUnavailable when inotify refuses (limits, missing directory)."""
        observer: BaseObserver | None = None
        try:
            observer = Observer()
            observer.schedule(self._handler, str(self.path.parent), event_filter=_CONTENT_EVENTS)
            observer.start()
        except OSError as exc:
            if observer is not None:
                observer.stop()
            hint = _INOTIFY_HINT if exc.errno in (errno.EMFILE, errno.ENOSPC) else ""
            raise WatchUnavailable(
                f"cannot watch {self.path.parent} for config changes: {exc.strerror or exc}{hint}; "
                "edits take effect with: systemctl reload gb10d"
            ) from None
        self._observer = observer
        self._follow_dropin_dir()

    def stop(self) -> None:
        """Stop watching; no `on_change` call happens after this returns. Safe to call twice."""
        observer, self._observer = self._observer, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if observer is not None:
            observer.stop()
            observer.join(timeout=10.0)

    def _relevant(self, event: FileSystemEvent) -> bool:
        """Whether an event touches the config file, the drop-in directory or a drop-in."""
        paths = [event.src_path, getattr(event, "dest_path", "")]
        for raw in filter(None, paths):
            path = Path(os.fsdecode(raw))
            if path == self.path:
                return True
            if path == self.dropin_dir and event.event_type in ("created", "deleted", "moved"):
                return True
            # The same rule as config's loader: *.toml, hidden files (editor swap files) excluded.
            if path.parent == self.dropin_dir and path.suffix == ".toml" and not path.name.startswith("."):
                return True
        return False

    def _event(self) -> None:
        """In the loop thread: an edit happened; (re)start the quiet period."""
        if self._observer is None:
            return  # stopped while the event was on its way
        self._follow_dropin_dir()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self._debounce_s, self._quiet)

    def _quiet(self) -> None:
        self._timer = None
        if self._observer is not None:
            self._on_change()

    def _follow_dropin_dir(self) -> None:
        """Watch the drop-in directory while it exists; a new directory of the same name needs a new watch."""
        assert self._observer is not None
        try:
            st = self.dropin_dir.stat()
        except OSError:
            st = None
        inode = (st.st_dev, st.st_ino) if st is not None and stat.S_ISDIR(st.st_mode) else None
        if inode == self._dropin_inode:
            return
        if self._dropin_watch is not None:
            try:
                self._observer.unschedule(self._dropin_watch)
            except (KeyError, OSError):
                pass  # the watch of a deleted directory is already gone on the kernel's side
            self._dropin_watch = None
        self._dropin_inode = None
        if inode is None:
            return
        try:
            self._dropin_watch = self._observer.schedule(self._handler, str(self.dropin_dir), event_filter=_CONTENT_EVENTS)
        except OSError:
            # Gone again, or inotify is out of watches: the parent watch still
            # sees the directory itself, and the next event tries again.
            return
        self._dropin_inode = inode


class _Relay(FileSystemEventHandler):
    """Runs in watchdog's thread: filters events and hands the relevant ones to the loop's thread."""

    def __init__(
        self,
        relevant: Callable[[FileSystemEvent], bool],
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[], None],
    ) -> None:
        self._relevant = relevant
        self._loop = loop
        self._deliver = deliver

    def on_any_event(self, event: FileSystemEvent) -> None:
        if not self._relevant(event):
            return
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass  # the loop is closed: gb10d is shutting down and nobody waits for edits any more
