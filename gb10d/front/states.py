"""What the front knows of each instance: its readiness, read from its own state file apart from every other, the
requests held for it and in flight on it, and its pool of upstream connections.

One `Watched` per instance. Each state file is read on its own, so one unreadable file makes one instance unknown,
never the others. A change wakes the requests held for the instance (`changed`), and leaving serving also wakes
the requests that wait for vLLM's response head (`left`): they generated nothing, and are held again instead of
keeping vLLM's shutdown waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from ..machine.procs import pid_alive
from ..machine.statefile import read_state
from .core import Readiness, readiness_of, reconnect_delay_s
from .instances import Known
from .journal import FrontJournal


@dataclass
class Watched:
    """One instance: its readiness as last read, the requests waiting for it, and its upstream connections."""

    known: Known
    ready: Readiness
    session: aiohttp.ClientSession
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set when the instance leaves serving; a new one each time it serves again.
    left: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    hold_started: float = 0.0
    # The same moment on the wall clock, for `gb10d status --all`.
    held_since: float = 0.0
    # Requests passed on and not yet answered, and when the last one came or ended (for parking when idle).
    in_flight: int = 0
    active_at: float = field(default_factory=time.monotonic)
    # A park or a wake asked and not yet shown in the state file (asked once, not every poll), and when.
    parking_asked: bool = False
    wake_asked: bool = False
    # Busy and chosen to make room: new requests wait (parking_asked is set), the park is asked once none is in flight.
    draining: bool = False
    # When it last became serving: a busy model is drained only after its turn (core.SWAP_TURN_S).
    serving_since: float = 0.0
    asked_at: float = 0.0
    # When the last wake was asked, for the swap time; the last reason said for not waking it yet (said once).
    wake_asked_at: float | None = None
    room_said: str = ""
    # Connects its address refused in a row while its state file said serving, and until when requests wait.
    refusals: int = 0
    refused_until: float = 0.0
    # When the front first saw its gb10d's pid gone without a final state (a crash; systemd restarts it).
    dead_since: float | None = None
    # Why its state file could not be read, said once per cause.
    unreadable: str = ""
    # Its gb10d's pid as the state file last said: its record in the memory ledger carries the same.
    pid: int | None = None

    @property
    def name(self) -> str:
        return self.known.instance.name


def _session(known: Known, upstream_connections: int, connect_timeout_s: float) -> aiohttp.ClientSession:
    """The instance's pool: at most `upstream_connections` at once (held requests are released into it, never all
    onto vLLM at once), idle ones kept for the next request; a connect that takes longer than `connect_timeout_s`
    is a refusal."""
    connector = aiohttp.TCPConnector(limit=upstream_connections, limit_per_host=0, keepalive_timeout=30, force_close=False, enable_cleanup_closed=False)
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout_s, sock_read=None)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",))


class States:
    """Every instance's `Watched`, kept current from its state file."""

    def __init__(self, known: Sequence[Known], journal: FrontJournal, upstream_connections: int, connect_timeout_s: float) -> None:
        self.journal = journal
        self.upstream_connections = upstream_connections
        self.connect_timeout_s = connect_timeout_s
        self.watched: dict[str, Watched] = {}
        self.retired: list[aiohttp.ClientSession] = []
        self.update(known)

    def update(self, known: Sequence[Known]) -> list[str]:
        """Take a new list of instances (a reload): new ones are watched, removed ones dropped (their requests in
        flight finish on the connections they have), a changed address gets a new pool. What changed, in words."""
        said = []
        fresh: dict[str, Watched] = {}
        for k in known:
            old = self.watched.get(k.instance.name)
            if old is not None and old.known.instance.host == k.instance.host and old.known.instance.port == k.instance.port:
                old.known = k
                fresh[k.instance.name] = old
                continue
            if old is not None:
                self.retired.append(old.session)
                said.append(f"{k.instance.name} moves to {k.instance.host}:{k.instance.port}")
            else:
                said.append(f"{k.instance.name} ({', '.join(k.instance.models)}) is added")
            watched = Watched(k, Readiness(False, True, "not read yet"), _session(k, self.upstream_connections, self.connect_timeout_s))
            self.refresh(watched)
            fresh[k.instance.name] = watched
        for name, old in self.watched.items():
            if name not in fresh:
                self.retired.append(old.session)
                old.ready = Readiness(False, False, "not running (removed from the front's instances)")
                old.changed.set()
                said.append(f"{name} is removed")
        self.watched = fresh
        return said

    def __getitem__(self, name: str) -> Watched:
        return self.watched[name]

    def readiness(self) -> dict[str, Readiness]:
        return {name: self.current(w) for name, w in self.watched.items()}

    def read(self, watched: Watched) -> Readiness:
        """The instance's readiness from its state file; a file that cannot be read makes this instance (alone) not
        running, said once."""
        path = watched.known.state_file
        try:
            state = read_state(path)
        except OSError as exc:
            why = exc.strerror or str(exc)
            if why != watched.unreadable:
                watched.unreadable = why
                self.journal.say(f"cannot read {path} ({why}): {watched.name} counts as not running until it can be read", 4)
            return Readiness(False, False, f"not running (its state file cannot be read: {why})")
        watched.unreadable = ""
        watched.pid = state.pid if state is not None else None
        alive = state is not None and state.pid is not None and pid_alive(state.pid)
        if alive or state is None or state.state is None or state.state.final:
            watched.dead_since = None
        elif watched.dead_since is None:
            watched.dead_since = time.monotonic()
        dead_for = time.monotonic() - watched.dead_since if watched.dead_since is not None else 0.0
        return readiness_of(state, alive, dead_for)

    def refresh(self, watched: Watched) -> None:
        """Read the instance's state file; on a change, wake the requests held for it, and those waiting for a
        response head when it left serving."""
        ready = self.read(watched)
        if ready == watched.ready:
            return
        was_serving = watched.ready.serving
        if ready.serving or not ready.parked:
            watched.wake_asked = False
        if not ready.serving:
            watched.parking_asked = watched.draining = False
        elif not was_serving:  # idle counts from when it serves, not from before its start
            watched.active_at = watched.serving_since = time.monotonic()
        watched.ready = ready
        self.notify(watched, left=was_serving and not ready.serving)

    def notify(self, watched: Watched, left: bool) -> None:
        """Wake the requests held for the instance; with `left`, also those waiting on vLLM for a response head."""
        watched.changed.set()
        watched.changed = asyncio.Event()
        if left:
            watched.left.set()
            watched.left = asyncio.Event()

    def refused(self, watched: Watched) -> None:
        """Its address refused a connect while its state said serving (vLLM died and its gb10d has not written yet,
        gb10d itself died, or a reload moved it): its requests wait, and try again after a back-off that grows with
        each refusal in a row (core.reconnect_delay_s), or as soon as its state file changes."""
        watched.refusals += 1
        watched.refused_until = time.monotonic() + reconnect_delay_s(watched.refusals)

    def connected(self, watched: Watched) -> None:
        watched.refusals, watched.refused_until = 0, 0.0

    def current(self, watched: Watched) -> Readiness:
        """The instance's readiness as a request sees it now: a park decided by the front holds new requests until
        the instance parks; an address that refused waits out its back-off."""
        ready = watched.ready
        if ready.serving and watched.parking_asked:
            return Readiness(False, True, "parking: the front asked it to park (idle, or making room)")
        if ready.serving and time.monotonic() < watched.refused_until:
            return Readiness(False, True, f"restarting: its address refused {watched.refusals} connect(s) in a row while its state file says serving")
        return ready

    async def close(self) -> None:
        for session in [w.session for w in self.watched.values()] + self.retired:
            await session.close()
