"""Noticing edits of the config: watchdog's inotify observer on the config's directory and drop-in directory.

Debounced on the asyncio loop, so a burst of editor writes becomes one call
of `on_change`. It only reports that something changed; the config keeper
re-reads, validates and decides (`gb10d.core.reload` says what changed).
"""

from __future__ import annotations

import asyncio
import errno
import os
import stat
from pathlib import Path
from typing import Callable

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

from ..base.configfile import dropin_dir_for
from ..base.errors import Gb10dError

DEFAULT_DEBOUNCE_S = 0.5
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
