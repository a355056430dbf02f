"""`gb10d front`'s listener and lifetime: the listening socket (systemd's, or its own), a bound on client
connections, the state poll, and the signals: SIGTERM drains, SIGHUP reloads.

nginx's habits, kept in little code:
- The listening socket comes from gb10d-front.socket when systemd passes one, so that a restart or an upgrade
  queues new connections in the kernel instead of refusing them; `[front] listen` is bound only without it.
- The open-file limit is raised to its hard limit at start (systemd.exec(5) asks programs that need more than
  1,024 to), and the connection cap is sized from what was obtained. At the cap, the oldest idle connection is
  closed to make room (nginx's reusable connections); only when every connection has a request in progress is a
  new one answered 503. Accept never runs out of descriptors, so it never floods the journal.
- SIGTERM stops accepting, lets the streams in flight finish and the held requests be answered, up to
  front.drain_timeout_s, then exits 0. A second SIGTERM stops waiting.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ..base.configload import load_front
from ..base.errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_OK, ConfigError
from ..base.frontconfig import FrontSection
from ..machine.listenfds import ListenFdsError, listen_sockets, listening_address
from ..machine.ports import holder_of
from . import snapshot
from .core import error
from .instances import Known, api_keys, discover
from .journal import FrontJournal
from .metrics import FrontMetrics
from .page import Page
from .proxy import Proxy
from .routes import ApiKey
from .states import States
from .swaps import Swaps

# How often each instance's state file is read: a held request goes through at most this long after READY.
STATE_POLL_S = 0.1
# Descriptors kept free of clients and upstreams: state files, control sockets, the metrics listener, the journal.
SPARE_FDS = 128
# asyncio accepts up to its `backlog` argument's count of connections at each turn of the loop before any of them is
# counted (a socket a turn). This many a turn keeps a burst within SPARE_FDS of the cap; the kernel's own queue is
# set back to LISTEN_BACKLOG, so a burst or a restart still waits there instead of being refused.
ACCEPT_BATCH = 32
LISTEN_BACKLOG = 4096
# At a stop, a connection accepted just before gets this long for its request to arrive; then idle ones close.
IDLE_GRACE_S = 1.0
DRAIN_POLL_S = 0.05
# A request line or one header line longer than this gets 400 (aiohttp's llhttp limits).
MAX_LINE_BYTES = 65536
_BUSY_BODY = json.dumps(error(503, "the front has every connection busy (front.max_connections)", "ServiceUnavailableError").body).encode()
BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class Turnaway(asyncio.Protocol):
    """A connection past the cap when no idle one can make room: told 503 and closed, its request unread."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(BUSY)
        transport.close()


def raise_open_files() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most 2**20), and return the soft limit held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return wanted
        except (ValueError, OSError):
            pass
    return soft


def sizes(open_files: int, settings: FrontSection, instances: int) -> tuple[int, int]:
    """(client connections, connections per instance) that fit the open-file limit together: upstream pools take
    at most a quarter of it, clients the rest less SPARE_FDS, each within its setting."""
    per_instance = max(4, min(settings.upstream_connections, open_files // 4 // max(instances, 1)))
    clients = max(16, min(settings.max_connections, open_files - SPARE_FDS - per_instance * instances))
    return clients, per_instance


class Server(web.Server):
    """aiohttp's server, counting its open connections as they come and go: the cap is checked at every accept, and
    aiohttp's `connections` copies the whole list, which made a burst of thousands of connections cost time
    quadratic in their number (seconds in which no request was answered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.open = 0

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.open += 1

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.open -= 1


def in_progress(handler: RequestHandler, proxy: Proxy) -> bool:
    """Whether the connection has a request in progress, its answer being written included: aiohttp's flag spans
    the write after the handler returns, the proxy's own count the handler; closing it would cut that answer."""
    return handler in proxy.busy or bool(getattr(handler, "_request_in_progress", False))


class Door:
    """The protocol factory before aiohttp's: counts client connections and keeps them under the cap."""

    def __init__(self, server: Server, proxy: Proxy, cap: int, journal: FrontJournal) -> None:
        self.server = server
        self.proxy = proxy
        self.cap = cap
        self.journal = journal

    def __call__(self) -> asyncio.BaseProtocol:
        if self.server.open >= self.cap:
            idle = next((c for c in self.server.connections if c.transport is not None and not in_progress(c, self.proxy)), None)
            if idle is None:
                self.journal.say(f"answered a new connection 503: all {self.cap} connections have a request in progress (front.max_connections)", 4, cause="cap busy")
                return Turnaway()
            self.journal.say(f"closed the oldest idle connection to make room for a new one: {self.cap} connections are open (front.max_connections)", 5, cause="cap shed")
            idle.force_close()
        return self.server()


def listen_socket(settings: FrontSection) -> socket.socket:
    """The socket systemd passed (gb10d-front.socket), else one bound to front.listen; OSError when that fails."""
    passed = listen_sockets()
    if passed:
        return passed[0]
    host, port = settings.address
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def bind_failure(settings: FrontSection, exc: OSError) -> tuple[str, int]:
    """The one journal line for a listen that failed, and the exit status: 75 for an address in use (its holder
    may go), 78 for an address this machine cannot take (the config must change)."""
    host, port = settings.address
    if exc.errno == errno.EADDRINUSE:
        holder = holder_of(port)
        who = f"held by {holder}" if holder else "held by another program"
        return (f"cannot listen on {settings.listen} (front.listen): the port is {who}; stop it (an old start script's "
                "vLLM?) or move the front with front.listen, then systemctl start gb10d-front"), EXIT_GAVE_UP
    if exc.errno == errno.EACCES:
        return f"cannot listen on {settings.listen} (front.listen): port {port} needs privileges gb10d does not have; use a port above 1023, or gb10d-front.socket", EXIT_CONFIG
    return f"cannot listen on {settings.listen} (front.listen): {exc.strerror or exc}; is {host} an address of this machine?", EXIT_CONFIG


class Front:
    """One run of `gb10d front`: its parts, and the loop that keeps them current until a stop."""

    def __init__(self, config_path: Path, settings: FrontSection, known: Sequence[Known], keys: Sequence[ApiKey]) -> None:
        self.config_path = config_path
        self.settings = settings
        self.journal = FrontJournal()
        self.metrics = FrontMetrics()
        open_files = raise_open_files()
        self.cap, per_instance = sizes(open_files, settings, len(known))
        self.open_files = open_files
        self.states = States(known, self.journal, per_instance, settings.connect_timeout_s)
        self.swaps = Swaps(self.states, self.journal, self.metrics)
        self.proxy = Proxy(settings, self.states, self.swaps, keys, self.metrics, self.journal)
        self.page = Page(self.states, self.swaps, self.journal, lambda: self.proxy.keys)
        self.proxy.page = self.page.handle
        self.stopping = asyncio.Event()
        self.stops = 0

    async def run(self) -> int:
        try:
            sock = listen_socket(self.settings)
        except ListenFdsError as exc:
            self.journal.say(str(exc), 3)
            return exc.exit_status
        except OSError as exc:
            line, status = bind_failure(self.settings, exc)
            self.journal.say(line, 3)
            return status
        if self.settings.metrics_address is not None:
            try:
                self.metrics.serve(*self.settings.metrics_address)
            except OSError as exc:
                self.journal.say(f"cannot serve metrics on {self.settings.metrics_listen} (front.metrics_listen): {exc.strerror or exc}; serving without them", 4)
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(self._loop_error)
        _quiet_aiohttp(self.journal)
        server = Server(
            self.proxy.handle, handler_cancellation=True, keepalive_timeout=self.settings.idle_timeout_s,
            max_line_size=MAX_LINE_BYTES, max_field_size=MAX_LINE_BYTES, lingering_time=2.0,
        )
        listener = await loop.create_server(Door(server, self.proxy, self.cap, self.journal), sock=sock, backlog=ACCEPT_BATCH)
        sock.listen(LISTEN_BACKLOG)
        self.journal.say(
            f"serving {', '.join(m for w in self.states.watched.values() for m in w.known.instance.models)} on {listening_address(sock)}; "
            f"up to {self.cap} connections (open-file limit {self.open_files})"
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop_asked)
        loop.add_signal_handler(signal.SIGHUP, self.reload)
        poll = asyncio.ensure_future(self._poll())
        try:
            await self.stopping.wait()
            await self._drain(listener, server)
        finally:
            poll.cancel()
            await self.states.close()
        self.journal.flush()
        return EXIT_OK

    def _stop_asked(self) -> None:
        self.stops += 1
        if self.stops == 1:
            self.stopping.set()
        else:
            self.journal.say("asked to stop again: not waiting for the requests in flight", 4)
            self.proxy.drain_deadline = time.monotonic()
            for watched in self.states.watched.values():
                self.states.notify(watched, left=False)

    async def _drain(self, listener: asyncio.Server, server: Server) -> None:
        """Stop accepting, then give the requests in flight and the held ones front.drain_timeout_s. A connection
        accepted just before has IDLE_GRACE_S for its request to arrive (it is served, then closed); idle ones are
        closed after that; each answer from now on closes its connection."""
        listener.close()
        self.page.stopping.set()
        timeout = self.settings.drain_timeout_s
        held = sum(w.held for w in self.states.watched.values())
        self.journal.say(f"stopping: no new connections; {len(self.proxy.busy)} connection(s) with a request in progress ({held} held) get up to {timeout:.0f} s (front.drain_timeout_s)")
        started = time.monotonic()
        self.proxy.drain_deadline = started + max(timeout - 1.0, 0.0)
        for watched in self.states.watched.values():
            self.states.notify(watched, left=False)
        while time.monotonic() < started + timeout:
            grace_over = time.monotonic() >= started + IDLE_GRACE_S
            open_now = [c for c in server.connections if c.transport is not None]
            for idle in [c for c in open_now if not in_progress(c, self.proxy)] if grace_over else []:
                idle.force_close()
            if grace_over and not any(in_progress(c, self.proxy) for c in open_now):
                break
            # A short bounded poll: aiohttp tells no event when a connection's last answer is written.
            await asyncio.sleep(DRAIN_POLL_S)
        await server.shutdown(1.0)
        self.journal.say(f"stopped after {time.monotonic() - started:.1f} s of draining")

    def reload(self) -> None:
        """SIGHUP: read the config and instances_dir again; an added instance is served, a removed one finishes its
        requests, a changed port is used; a config that does not load leaves the one in force."""
        try:
            settings = load_front(self.config_path)
            known = discover(settings, self.config_path)
            keys = api_keys(settings)
        except ConfigError as exc:
            for problem in exc.problems:
                self.journal.say(f"reload: {problem}", 3)
            self.journal.say(f"reload: {self.config_path} has problems; the config in force stays", 4)
            return
        changes = self.states.update(known)
        if settings.listen != self.settings.listen:
            changes.append(f"front.listen changed to {settings.listen}, which takes a restart (systemctl restart gb10d-front; with gb10d-front.socket, edit its ListenStream=)")
        self.settings = settings.model_copy(update={"listen": self.settings.listen})
        self.proxy.configure(self.settings, keys)
        self.journal.say(f"reloaded {self.config_path}: {'; '.join(changes) or 'no instance changed'}")

    async def _poll(self) -> None:
        """Re-read every state file each STATE_POLL_S, each apart (one bad file affects one instance), wake the
        requests held for an instance whose state changed, park or wake on-demand ones, and rewrite the front's
        own state file when any model's state or queue changed."""
        shown: snapshot.FrontSnapshot | None = None
        while True:
            for watched in list(self.states.watched.values()):
                try:
                    self.states.refresh(watched)
                    self.swaps.tick(watched)
                except Exception as exc:  # one instance's trouble must not stop the others' polling
                    self.journal.say(f"cannot follow {watched.name}: {type(exc).__name__}: {exc}", 3, cause=f"poll {watched.name}")
            current = self._queues()
            if current != shown:
                try:
                    snapshot.write(self.settings.state_file, current)
                except OSError as exc:
                    self.journal.say(f"cannot write {self.settings.state_file} ({exc.strerror or exc}): gb10d status --all will not show the queues", 4, cause="snapshot")
                shown = current
            self.journal.flush()
            await asyncio.sleep(STATE_POLL_S)

    def _queues(self) -> snapshot.FrontSnapshot:
        """Each model's instance, state and held requests, as `gb10d status --all` shows them."""
        models = tuple(
            snapshot.ModelQueue(model, name, self.states.current(w).detail, w.held, w.held_since if w.held else None)
            for name, w in self.states.watched.items() for model in w.known.instance.models
        )
        return snapshot.FrontSnapshot(os.getpid(), self.settings.listen, models)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's unhandled errors (a failed accept, a callback's exception): one line per kind, counted."""
        exc = context.get("exception")
        what = f"{type(exc).__name__}: {exc}" if exc is not None else ""
        self.journal.say(f"{context.get('message', 'event loop error')} {what}".strip(), 4, cause=f"loop {type(exc).__name__}")


class _JournalHandler(logging.Handler):
    def __init__(self, journal: FrontJournal) -> None:
        super().__init__(logging.WARNING)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        text = record.getMessage() + (f": {type(exc).__name__}: {exc}" if exc is not None else "")
        self.journal.say(text, 4, cause=f"aiohttp {record.msg}")


def _quiet_aiohttp(journal: FrontJournal) -> None:
    """aiohttp's own warnings (a client's malformed request, a handler error) as counted journal lines, never a
    traceback per connection."""
    for name in ("aiohttp", "asyncio"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [_JournalHandler(journal)]
        logger.propagate = False


async def serve(config_path: Path, settings: FrontSection, known: Sequence[Known], keys: Sequence[ApiKey]) -> int:
    """Run the front until a stop; the exit status."""
    return await Front(config_path, settings, known, keys).run()
