"""`gb10d front`'s I/O: the public listener, the instances' state files, and the byte pump between client and vLLM.

Every decision is gb10d.front.core's; this module reads what it needs (request bytes, state files, the clock),
asks, and acts. One asyncio task per client connection; one upstream connection per request at a time (kept for the next one when it ended cleanly), closed when the
client leaves, which is how vLLM learns to stop generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

import h11

from ..base.frontconfig import FrontSection
from ..core import budget
from ..core.memory import read_meminfo
from ..daemon.control import ask
from ..core.statefile import read_state
from ..daemon.status import pid_alive
from ..machine.ledger import read_ledger
from .core import (
    Answer, ApiKey, Evict, Instance, Readiness, Room, Slot, StartIt, Wait, admit, authorized, error, forwarded_headers, make_room,
    readiness_of, route, should_park, should_wake, sse_error_event,
)
from . import snapshot
from .instances import Known
from .metrics import FrontMetrics
from .wire import READ_SIZE, Peer, connect

# Connections kept open to each instance between requests (as nginx's `keepalive`): a new one costs both sides.
IDLE_UPSTREAMS = 64
# After an instance's gb10d did not take a park or wake (not running, an old gb10d), ask again this much later.
ASK_AGAIN_S = 5.0
# How often each instance's state file is read: a held request goes through at most this long after READY.
STATE_POLL_S = 0.1


def say(line: str, level: int = 6) -> None:
    """One journal line per decision (journald takes `<N>` as the priority)."""
    print(f"<{level}>gb10d-front: {line}", flush=True)


@dataclass
class Watched:
    """One instance: its readiness as last read, and the requests waiting for it."""

    known: Known
    ready: Readiness
    changed: asyncio.Event
    held: int = 0
    hold_started: float = 0.0
    # The same moment on the wall clock, for `gb10d status --all`.
    held_since: float = 0.0
    # Requests passed on and not yet answered, and when the last one came or ended (for parking when idle).
    in_flight: int = 0
    active_at: float = field(default_factory=time.monotonic)
    # A park or a wake asked and not yet shown in the state file: asked once, not every poll.
    parking_asked: bool = False
    wake_asked: bool = False
    # When the last wake was asked, for the swap time; the last reason said for not waking it yet (said once).
    wake_asked_at: float | None = None
    room_said: str = ""


class Front:
    def __init__(self, settings: FrontSection, known: Sequence[Known], metrics: FrontMetrics, keys: Sequence[ApiKey]) -> None:
        self.settings = settings
        self.keys = keys
        self.metrics = metrics
        self.instances = [k.instance for k in known]
        self.watched = {k.instance.name: Watched(k, self._read(k), asyncio.Event()) for k in known}
        self.idle: dict[str, list[Peer]] = {k.instance.name: [] for k in known}
        self.asking: set[asyncio.Future[None]] = set()

    @staticmethod
    def _read(known: Known) -> Readiness:
        state = read_state(known.state_file)
        return readiness_of(state, state is not None and state.pid is not None and pid_alive(state.pid))

    async def watch_states(self) -> None:
        """Re-read every state file each STATE_POLL_S and wake the requests held for an instance whose state changed;
        rewrite the front's own state file when any model's state or queue changed."""
        shown: snapshot.FrontSnapshot | None = None
        while True:
            for watched in self.watched.values():
                self._refresh(watched)
                self._park_or_wake(watched)
            current = self.queues()
            if current != shown:
                try:
                    snapshot.write(self.settings.state_file, current)
                except OSError as exc:
                    if shown is None:  # said once, not every STATE_POLL_S
                        say(f"cannot write {self.settings.state_file} ({exc.strerror or exc}): gb10d status --all will not show the queues", 4)
                shown = current
            await asyncio.sleep(STATE_POLL_S)

    def queues(self) -> snapshot.FrontSnapshot:
        """Each model's instance, state and held requests, as `gb10d status --all` shows them."""
        models = tuple(
            snapshot.ModelQueue(
                model, name, watched.ready.detail, watched.held, watched.held_since if watched.held else None,
            )
            for name, watched in self.watched.items() for model in watched.known.instance.models
        )
        return snapshot.FrontSnapshot(os.getpid(), self.settings.listen, models)

    def _refresh(self, watched: Watched) -> None:
        """Read the instance's state file; on a change, wake the requests held for it."""
        ready = self._read(watched.known)
        if ready == watched.ready:
            return
        if ready.serving or not ready.parked:
            watched.wake_asked = False
        if ready.serving and watched.wake_asked_at is not None:
            self.metrics.swap_seconds.labels(watched.known.instance.name).observe(time.monotonic() - watched.wake_asked_at)
            watched.wake_asked_at = None
        if not ready.serving:
            watched.parking_asked = False
        elif not watched.ready.serving:  # idle counts from when it serves, not from before its start
            watched.active_at = time.monotonic()
        watched.ready = ready
        watched.changed.set()
        watched.changed = asyncio.Event()

    def _park_or_wake(self, watched: Watched) -> None:
        """Wake a sleeping instance that a request waits for; park an on-demand one idle for its timeout."""
        known = watched.known
        if known.control is None:
            return
        name = known.instance.name
        if should_wake(watched.ready, watched.held, watched.in_flight, watched.wake_asked):
            self._make_room(watched)
        idle_s = time.monotonic() - watched.active_at
        if should_park(watched.ready, watched.held, watched.in_flight, idle_s, known.idle_timeout_s, watched.parking_asked):
            watched.parking_asked = True
            say(f"parking {name}: no request for {idle_s:.0f} s (on_demand.idle_timeout_s)")
            self.metrics.swaps.labels(name, "park").inc()
            self._ask(watched, "park")

    def _make_room(self, watched: Watched) -> None:
        """Wake a parked instance that requests wait for when it fits; else park the least recently used idle
        on-demand one for it (its memory comes back before the wake), or keep holding; each decision said once."""
        name = watched.known.instance.name
        decided = self._room(watched)
        if isinstance(decided, StartIt):
            watched.wake_asked, watched.wake_asked_at, watched.room_said = True, time.monotonic(), ""
            say(f"waking {name}: {watched.held + watched.in_flight} request(s) wait for it; {decided.message}")
            self.metrics.swaps.labels(name, "wake").inc()
            self._ask(watched, "wake")
        elif isinstance(decided, Evict):
            victim = self.watched[decided.victim]
            victim.parking_asked = True
            say(f"evicting {decided.victim} to make room for {name}: {decided.message}")
            self.metrics.swaps.labels(decided.victim, "evict").inc()
            self._ask(victim, "park")
        else:
            text = decided.message  # AwaitRoom, or an Answer: it can no longer fit (a pinned instance started meanwhile)
            if text != watched.room_said:
                watched.room_said = text
                say(f"holding requests for {name}: {text}")

    def _room(self, watched: Watched) -> Room:
        """make_room on MemAvailable and the memory ledger as they are now, with every instance as the front sees it."""
        memory = watched.known.memory
        try:
            mem = read_meminfo(memory.meminfo_path)
        except (OSError, ValueError) as exc:
            return StartIt(f"{memory.meminfo_path} cannot be read ({exc}); the instance's own memory checks decide")
        try:
            records = read_ledger(memory.ledger_path) if memory.ledger_path is not None else []
        except OSError:
            records = []  # no ledger: every instance runs alone as far as the budget knows
        slots = {n: self._slot(w, mem.total) for n, w in self.watched.items()}
        wanted = slots.pop(watched.known.instance.name)
        return make_room(wanted, list(slots.values()), budget.left(records, mem), mem.total)

    @staticmethod
    def _slot(watched: Watched, total: int) -> Slot:
        known, ready = watched.known, watched.ready
        return Slot(
            known.instance.name, budget.share_bytes(known.utilization, total, known.memory.headroom_gib), known.control is not None,
            running=ready.coming and not ready.parked, serving=ready.serving, parking=watched.parking_asked or ready.parking,
            busy=watched.held + watched.in_flight > 0, waking=watched.wake_asked and ready.parked, active_at=watched.active_at,
            asleep=ready.asleep,
        )

    def _ask(self, watched: Watched, command: str) -> None:
        """Ask the instance's gb10d over its control socket, without holding up the state poll; when it does not
        take the command, a poll ASK_AGAIN_S later may ask again (not every poll: one warning, not ten a second)."""
        path, name = watched.known.control, watched.known.instance.name
        assert path is not None

        async def send() -> None:
            answer = await ask(path, command)
            if answer != "ok":
                say(f"{name}'s gb10d did not take {command!r} on {path}: {answer or 'no answer'}", 4)
                asyncio.get_running_loop().call_later(ASK_AGAIN_S, again)

        def again() -> None:
            watched.wake_asked = watched.parking_asked = False

        task = asyncio.ensure_future(send())
        self.asking.add(task)
        task.add_done_callback(self.asking.discard)

    def refused(self, instance: Instance) -> None:
        """The instance's address refused while its state said serving (vLLM restarting): wait for the next read."""
        watched = self.watched[instance.name]
        if watched.ready.serving:
            watched.ready = Readiness(serving=False, coming=True, detail="restarting: its address refuses connections")

    async def hold(self, instance: Instance) -> Answer | None:
        """Wait until the instance serves (None), or the answer that refuses the request."""
        watched = self.watched[instance.name]
        started = watched.active_at = time.monotonic()
        # The last read may be up to STATE_POLL_S old: every request is decided on a fresh one (a refusal, an
        # instance that has begun to fall asleep, or one whose gb10d has begun to stop vLLM for a reload).
        self._refresh(watched)
        # A parked instance's room is read only for the first request that finds it parked, not for each of a flood.
        room = self._room(watched) if watched.ready.parked and not watched.wake_asked and watched.held == 0 else None
        decision = admit(instance, watched.ready, watched.held, self.settings.queue_limit, 0.0, self.settings.hold_timeout_s, True, room)
        if isinstance(decision, Wait):
            if watched.held == 0:
                watched.hold_started, watched.held_since = started, time.time()
                say(f"holding requests for {instance.name}: it is {watched.ready.detail}")
            watched.held += 1
            self.metrics.held.labels(instance.name).inc()
            self._park_or_wake(watched)
            try:
                while isinstance(decision, Wait):
                    waited = time.monotonic() - started
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(watched.changed.wait(), max(0.0, self.settings.hold_timeout_s - waited))
                    waited = time.monotonic() - started
                    decision = admit(instance, watched.ready, watched.held, self.settings.queue_limit, waited, self.settings.hold_timeout_s, False)
            finally:
                watched.held -= 1
                self.metrics.held.labels(instance.name).dec()
                self.metrics.hold_seconds.labels(instance.name).observe(time.monotonic() - started)
                if watched.held == 0 and watched.ready.serving:
                    say(f"released the requests held for {instance.name} after {time.monotonic() - watched.hold_started:.1f} s: it serves")
        if isinstance(decision, Answer):
            say(f"rejected a request for {instance.name} ({decision.status}): {decision.message}", 4)
            self.metrics.rejected.labels(instance.name, str(decision.status)).inc()
            return decision
        self.metrics.requests.labels(instance.name).inc()
        return None

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one client connection, request after request, until either side ends it."""
        peer = Peer(reader, writer, h11.SERVER)
        try:
            while await self._exchange(peer):
                peer.conn.start_next_cycle()
        except h11.RemoteProtocolError as exc:
            if peer.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await _send_answer(peer, error(exc.error_status_hint, f"malformed HTTP request: {exc}", "BadRequestError"))
        except (OSError, h11.LocalProtocolError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _exchange(self, peer: Peer) -> bool:
        """One request and its answer; False when the connection must end."""
        request = await peer.next_event()
        if isinstance(request, h11.ConnectionClosed):
            return False
        assert isinstance(request, h11.Request)
        body = await _read_body(peer, request, self.settings.max_body_bytes)
        if isinstance(body, Answer):
            await _send_answer(peer, body, close=True)
            return False
        content_type = dict(request.headers).get(b"content-type", b"").decode("latin-1")
        target = request.target.decode("latin-1")
        readiness = {name: watched.ready for name, watched in self.watched.items()}
        key = authorized(target, request.headers, self.keys)
        decided = key if isinstance(key, Answer) else route(
            request.method.decode(), target, body, content_type, self.instances, readiness, time.time(), key.models if key else frozenset()
        )
        if isinstance(decided, Answer):
            await _send_answer(peer, decided)
            return peer.conn.our_state is h11.DONE and peer.conn.their_state is h11.DONE
        watch = asyncio.ensure_future(peer.reader.read(READ_SIZE))
        proxy = asyncio.ensure_future(self._forward(peer, request, body, decided.instance))
        try:
            await asyncio.wait({watch, proxy}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                data = watch.result()
                if not data:  # the client left: dropping the upstream connection tells vLLM to stop
                    return False
                peer.conn.receive_data(data)  # a pipelined next request, kept for h11
            kept = await proxy
        finally:
            for task in (watch, proxy):
                task.cancel()
            await asyncio.gather(watch, proxy, return_exceptions=True)
        return kept and peer.conn.our_state is h11.DONE and peer.conn.their_state is h11.DONE

    async def _forward(self, peer: Peer, request: h11.Request, body: bytes, instance: Instance) -> bool:
        """Hold until the instance serves, then pump its answer to the client; retried while its address refuses."""
        while True:
            refusal = await self.hold(instance)
            if refusal is not None:
                await _send_answer(peer, refusal)
                return True
            try:
                upstream, reused = await self._upstream(instance)
            except OSError:
                self.refused(instance)
                continue
            answered = False
            watched = self.watched[instance.name]
            watched.in_flight += 1
            try:
                response = await _ask(upstream, request, body, instance)
                if response is None:
                    if not reused:  # a kept connection vLLM closed meanwhile says nothing about vLLM
                        self.refused(instance)
                    continue
                if response.status_code in (500, 503) and self._stopping(watched):
                    # vLLM refused it as its gb10d began to stop it (a reload that restarts vLLM): it generated
                    # nothing, and the restart is only a wait for the client, as for a request held before it.
                    say(f"{instance.name} answered {response.status_code} while its gb10d stops vLLM; the request waits for the restart")
                    continue
                kept = await _pump(peer, upstream, response, request.method == b"HEAD", instance)
                answered = True
                return kept
            finally:
                self._release(instance, upstream, answered)
                watched.in_flight -= 1
                watched.active_at = time.monotonic()

    def _stopping(self, watched: Watched) -> bool:
        """Whether the instance's gb10d now says vLLM is on its way down but coming back (read afresh)."""
        self._refresh(watched)
        return not watched.ready.serving and watched.ready.coming and not watched.ready.parked

    async def _upstream(self, instance: Instance) -> tuple[Peer, bool]:
        """A connection to the instance, kept from an earlier request when one is open (True), else a new one."""
        idle = self.idle[instance.name]
        while idle:
            peer = idle.pop()
            if not peer.reader.at_eof() and not peer.writer.is_closing():
                return peer, True
            peer.close()
        return await connect(instance.host, instance.port), False

    def _release(self, instance: Instance, upstream: Peer, answered: bool) -> None:
        """Keep a connection whose exchange ended cleanly for the next request; close any other, which is also
        how vLLM learns that a client left."""
        idle = self.idle[instance.name]
        if answered and upstream.conn.our_state is h11.DONE and upstream.conn.their_state is h11.DONE and len(idle) < IDLE_UPSTREAMS:
            upstream.conn.start_next_cycle()
            idle.append(upstream)
        else:
            upstream.close()


async def _read_body(peer: Peer, request: h11.Request, limit: int) -> bytes | Answer:
    """The whole request body, or 413 once it passes `limit` (by its Content-Length, before reading, when it has one)."""
    too_large = error(413, f"the request body is over {limit} bytes (front.max_body_bytes)", "RequestTooLargeError")
    declared = dict(request.headers).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > limit:
        return too_large
    if peer.conn.they_are_waiting_for_100_continue:
        await peer.send(h11.InformationalResponse(status_code=100, headers=[]))
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await peer.next_event()
        if isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > limit:
                return too_large
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.ConnectionClosed):
            raise asyncio.IncompleteReadError(b"", None)


async def _ask(upstream: Peer, request: h11.Request, body: bytes, instance: Instance) -> h11.Response | None:
    """Send the request upstream and read the response head; None when the instance closed without answering."""
    headers = [*forwarded_headers(request.headers), (b"host", f"{instance.host}:{instance.port}".encode()), (b"content-length", str(len(body)).encode())]
    try:
        await upstream.send(h11.Request(method=request.method, target=request.target, headers=headers), *([h11.Data(data=body)] if body else []), h11.EndOfMessage())
        while True:
            event = await upstream.next_event()
            if isinstance(event, h11.Response):
                return event
            if not isinstance(event, h11.InformationalResponse):
                return None
    except (OSError, h11.RemoteProtocolError):
        return None


async def _pump(peer: Peer, upstream: Peer, response: h11.Response, head_only: bool, instance: Instance) -> bool:
    """Pass the response through chunk by chunk; an instance lost mid-answer ends an event stream with an error event."""
    length = [(n, v) for n, v in response.headers if n == b"content-length"]
    headers = forwarded_headers(response.headers) + length
    stream = any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in response.headers)
    await peer.send(h11.Response(status_code=response.status_code, headers=headers, reason=response.reason))
    finished = False
    try:
        while not finished:
            out: list[h11.Data | h11.EndOfMessage] = []
            for event in await upstream.next_events():
                if isinstance(event, h11.Data):
                    out.append(h11.Data(data=bytes(event.data)))
                elif isinstance(event, h11.EndOfMessage):
                    out.append(h11.EndOfMessage())
                    finished = True
                elif isinstance(event, h11.ConnectionClosed):
                    raise h11.RemoteProtocolError("the instance closed the connection mid-answer")
            await peer.send(*out)
    except (OSError, h11.RemoteProtocolError):
        if not stream or length or head_only:
            return False
        say(f"{instance.name} ended a stream mid-answer; the client got an error event", 4)
        await peer.send(h11.Data(data=sse_error_event(f"{instance.name} stopped answering mid-stream")), h11.EndOfMessage())
    return True


async def _send_answer(peer: Peer, answer: Answer, close: bool = False) -> None:
    body = json.dumps(answer.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if answer.retry_after_s is not None:
        headers.append((b"retry-after", str(answer.retry_after_s).encode()))
    if close:
        headers.append((b"connection", b"close"))
    await peer.send(h11.Response(status_code=answer.status, headers=headers, reason=HTTPStatus(answer.status).phrase))
    await peer.send(h11.Data(data=body))
    await peer.send(h11.EndOfMessage())


async def serve(settings: FrontSection, known: Sequence[Known], keys: Sequence[ApiKey]) -> None:
    """Listen on front.listen until cancelled."""
    metrics = FrontMetrics()
    front = Front(settings, known, metrics, keys)
    host, port = settings.address
    if settings.metrics_address is not None:
        metrics.serve(*settings.metrics_address)
    server = await asyncio.start_server(front.client, host, port, backlog=1024, limit=READ_SIZE)
    say(f"serving {', '.join(m for i in front.instances for m in i.models)} on {settings.listen}")
    sys.stdout.flush()
    watcher = asyncio.ensure_future(front.watch_states())
    try:
        async with server:
            await server.serve_forever()
    finally:
        watcher.cancel()
