"""One client request through the front: checked on its line and headers, its body read within bounds (exchange),
routed, held while its model's instance does not serve, then passed to vLLM and its answer pumped back as it comes
(upstream).

The decisions are gb10d.front.routes' (where, whether, which headers) and gb10d.front.core's (go, wait or refuse);
this module reads, waits and writes. aiohttp parses both sides (llhttp); every wait has a bound: the body's next
bytes (front.body_timeout_s), a client that stops reading (front.send_timeout_s), vLLM's connect
(front.connect_timeout_s) and response head (front.upstream_head_timeout_s), and the hold itself
(front.hold_timeout_s), whose clock starts once per request and never again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from aiohttp import web

from ..base.frontconfig import FrontSection
from .core import HOLD_COMMENT_S, Answer, Instance, Wait, admit, error, sse_comment, sse_error_event
from .exchange import Client, Exchange
from .journal import FrontJournal
from .metrics import FrontMetrics
from .routes import (
    ApiKey,
    Forward,
    Own,
    authorized,
    bare,
    cors_headers,
    is_multipart,
    kind_of,
    multipart_model,
    own_answer,
    request_fields,
    route,
)
from .states import States, Watched
from .swaps import Swaps
from .upstream import Refused, Requeue, Upstream

# A JSON body larger than this is parsed off the event loop: 60 MiB take 0.4 s, which would stall every stream.
PARSE_INLINE_BYTES = 256 * 1024


class Proxy:
    """The front's request handler: aiohttp's low-level server calls `handle` once per request."""

    def __init__(
        self, settings: FrontSection, states: States, swaps: Swaps, keys: Sequence[ApiKey], metrics: FrontMetrics, journal: FrontJournal,
    ) -> None:
        self.settings = settings
        self.states = states
        self.swaps = swaps
        self.keys = keys
        self.metrics = metrics
        self.journal = journal
        self.client = Client(settings, journal)
        self.upstream = Upstream(settings, states, self.client, journal)
        self.upstream.keyed = bool(keys)
        # Connections with a request in progress: the door sheds only the others when it runs out of room.
        self.busy: dict[object, int] = {}
        # While the front drains for a stop: the monotonic time by which held requests are answered.
        self.drain_deadline: float | None = None
        # The front's page (gb10d.front.page): its answer to a request, or None when the request is not the page's.
        self.page: Callable[[web.BaseRequest], Awaitable[web.StreamResponse | None]] | None = None

    def configure(self, settings: FrontSection, keys: Sequence[ApiKey]) -> None:
        """Take a reloaded config: its bounds and keys hold for the requests that come from now on."""
        self.settings = self.client.settings = self.upstream.settings = settings
        self.keys = keys
        self.upstream.keyed = bool(keys)

    @property
    def instances(self) -> list[Instance]:
        return [w.known.instance for w in self.states.watched.values()]

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Answer one request; nothing it sends, and no failure of an instance, ends in a traceback."""
        protocol = request.protocol
        self.busy[protocol] = self.busy.get(protocol, 0) + 1
        try:
            response = await self._handle(request)
            if self.drain_deadline is not None:
                response.force_close()  # the front stops: this connection carries no further request
            return response
        except ConnectionError:
            # The client is gone: nothing can reach it, and aiohttp closes the connection; no traceback for it.
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=499)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a defect of the front's own: one line, the client gets 500, the front goes on
            self.journal.say(f"internal error on {request.method} {bare(request.path)}: {type(exc).__name__}: {exc}", 3, cause="internal")
            return self.client.reply(request, error(500, f"the front failed on this request ({type(exc).__name__}); see journalctl -u gb10d-front", "InternalServerError"), {}, close=True)
        finally:
            left = self.busy.pop(protocol, 1) - 1
            if left:
                self.busy[protocol] = left

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        method, path = request.method, request.raw_path
        if self.page is not None and (shown := await self.page(request)) is not None:
            return shown
        origin = request.headers.get("Origin")
        if method == "OPTIONS":
            headers = cors_headers(origin, self.settings.cors_origins, True, request.headers.get("Access-Control-Request-Headers", ""))
            return web.Response(status=204, headers={"allow": "GET, HEAD, POST, OPTIONS", **headers})
        cors = cors_headers(origin, self.settings.cors_origins, False)
        kind = kind_of(method, path, frozenset(self.settings.open_routes))
        pending = bool(request.body_exists)
        if isinstance(kind, Answer):
            return self.client.reply(request, kind, cors, close=pending)
        key = authorized(path, request.raw_headers, self.keys)
        if isinstance(key, Answer):
            return self.client.reply(request, key, cors, close=pending)
        allowed = key.models if key is not None else frozenset()
        if isinstance(kind, Own):
            return self.client.reply(request, own_answer(method, path, self.instances, self.states.readiness(), time.time(), allowed), cors, close=pending)
        read = await self.client.read(request, cors)
        if isinstance(read, Answer):
            return self.client.reply(request, read, cors, close=True)
        exchange = read
        try:
            return await self._route_and_forward(exchange, allowed)
        finally:
            self.client.bodies.give(exchange.taken)

    async def _route_and_forward(self, exchange: Exchange, allowed: frozenset[str]) -> web.StreamResponse:
        request = exchange.request
        ctype = request.headers.get("Content-Type", "")
        model: str | None
        if is_multipart(ctype):
            found = multipart_model(exchange.body, ctype, exchange.rest is None)
            model = found if isinstance(found, str) else None
        else:
            fields = await self._fields(exchange.body, ctype)
            if isinstance(fields, Answer):
                return self.client.reply(request, fields, exchange.cors)
            model, exchange.stream = fields
        decided = self._route(request, model, allowed)
        if isinstance(decided, Answer) and decided.status == 404 and model is not None and await self.upstream.learn_adapters():
            decided = self._route(request, model, allowed)
        if isinstance(decided, Answer):
            return self.client.reply(request, decided, exchange.cors, close=exchange.rest is not None)
        return await self.forward(exchange, self.states[decided.instance.name])

    def _route(self, request: web.BaseRequest, model: str | None, allowed: frozenset[str]) -> Forward | Answer:
        return route(request.method, request.raw_path, b"", "", self.instances, self.states.readiness(), time.time(), allowed, self.upstream.adapters, model)

    async def _fields(self, body: bytes, ctype: str) -> tuple[str | None, bool] | Answer:
        """The body's `model` and `stream`, parsed off the event loop when the body is large."""
        if len(body) > PARSE_INLINE_BYTES:
            model, stream, problem = await asyncio.to_thread(request_fields, body, ctype)
        else:
            model, stream, problem = request_fields(body, ctype)
        return problem if problem is not None else (model, stream)

    async def forward(self, exchange: Exchange, watched: Watched) -> web.StreamResponse:
        """Hold until the instance serves, then pass the request; a refused connect backs off, and a request vLLM
        did not answer before its instance left serving waits again, on the same hold clock."""
        while True:
            refusal = await self.hold(watched, exchange)
            if refusal is not None:
                return await self.refuse(exchange, refusal)
            instance = watched.known.instance
            watched.in_flight += 1
            try:
                try:
                    upstream = await self.upstream.ask(watched, exchange)
                except Refused:
                    self.states.refused(watched)
                    continue
                except Requeue:
                    if exchange.rest_sent:
                        return await self.refuse(exchange, error(502, f"{instance.name} left serving while the request's body was streamed to it; send it again", "BadGatewayError"))
                    self.journal.say(f"{instance.name} left serving before it answered; its requests wait for it again", cause=f"requeue {instance.name}")
                    continue
                except TimeoutError:
                    return await self.refuse(exchange, error(504, f"{instance.name} sent no response head within {self.settings.upstream_head_timeout_s:.0f} s (front.upstream_head_timeout_s)", "GatewayTimeoutError"))
                except aiohttp.ClientError as exc:
                    return await self.refuse(exchange, error(502, f"{instance.name} failed the request: {exc}", "BadGatewayError"))
                self.states.connected(watched)
                if upstream.status in (500, 503) and self._stopping(watched) and not exchange.rest_sent:
                    # vLLM refused it as its gb10d began to stop it (a reload that restarts vLLM): it generated
                    # nothing, and the restart is only a wait for the client, as for a request held before it.
                    upstream.close()
                    self.journal.say(f"{instance.name} answered {upstream.status} while its gb10d stops vLLM; the request waits for the restart", cause=f"stopping {instance.name}")
                    continue
                return await self.upstream.pump(exchange, upstream, instance)
            finally:
                watched.in_flight -= 1
                watched.active_at = time.monotonic()

    def _stopping(self, watched: Watched) -> bool:
        """Whether the instance's gb10d now says vLLM is on its way down but coming back (read afresh)."""
        self.states.refresh(watched)
        return not watched.ready.serving and watched.ready.coming and not watched.ready.parked

    async def hold(self, watched: Watched, exchange: Exchange) -> Answer | None:
        """Wait until the instance serves (None), or the answer that refuses the request. The clock is the
        request's own (`exchange.started`): a refusal, a requeue or a restart does not reset it."""
        instance = watched.known.instance
        if not watched.ready.serving:
            # A start may have just ended: decided on a fresh read, not one up to a poll old. One that serves is
            # not read again per request (the poll reads it every 0.1 s, and a request vLLM has not answered when
            # its instance leaves serving is held again).
            self.states.refresh(watched)
        limit_s = watched.known.hold_timeout_s or self.settings.hold_timeout_s or 900.0
        room = self.swaps.first_room(watched)
        decision = admit(instance, self.states.current(watched), watched.held, self.settings.queue_limit, self._waited(exchange), limit_s, True, room)
        if isinstance(decision, Wait):
            now = time.monotonic()
            if watched.held == 0:
                watched.hold_started, watched.held_since = now, time.time()
                self.journal.say(f"holding requests for {instance.name}: it is {self.states.current(watched).detail}")
            watched.held += 1
            watched.active_at = now
            self.metrics.held.labels(instance.name).inc()
            self.swaps.tick(watched)
            try:
                while isinstance(decision, Wait):
                    if exchange.stream:
                        await self._comment(exchange, f"{instance.name} is {self.states.current(watched).detail}")
                    await self._wait_for_change(watched, exchange, limit_s)
                    if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                        decision = error(503, "the front is stopping (a restart or an upgrade); send the request again", "ServiceUnavailableError", 1)
                        break
                    decision = admit(instance, self.states.current(watched), watched.held, self.settings.queue_limit, self._waited(exchange), limit_s, False)
            finally:
                watched.held -= 1
                self.metrics.held.labels(instance.name).dec()
                self.metrics.hold_seconds.labels(instance.name).observe(self._waited(exchange))
                if watched.held == 0 and watched.ready.serving:
                    self.journal.say(f"released the requests held for {instance.name} after {time.monotonic() - watched.hold_started:.1f} s: it serves")
        if isinstance(decision, Answer):
            self.journal.say(f"rejected a request for {instance.name} ({decision.status}): {decision.message}", 4, cause=f"rejected {instance.name} {decision.status}")
            self.metrics.rejected.labels(instance.name, str(decision.status)).inc()
            return decision
        self.metrics.requests.labels(instance.name).inc()
        return None

    def _waited(self, exchange: Exchange) -> float:
        return time.monotonic() - exchange.started

    async def _wait_for_change(self, watched: Watched, exchange: Exchange, limit_s: float) -> None:
        """Until the instance's state changes, its back-off after a refusal ends, the next comment of a held
        stream is due, the hold's time is up, or the drain's."""
        now = time.monotonic()
        until = exchange.started + limit_s
        if watched.refused_until > now:
            until = min(until, watched.refused_until)
        if exchange.stream:
            until = min(until, exchange.told_at + HOLD_COMMENT_S)
        if self.drain_deadline is not None:
            until = min(until, self.drain_deadline)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watched.changed.wait(), max(0.0, until - now))

    async def _comment(self, exchange: Exchange, text: str) -> None:
        """A held stream's 200 head once, then an SSE comment every HOLD_COMMENT_S (so proxies and clients keep
        waiting, and see why)."""
        now = time.monotonic()
        if text == exchange.told and now - exchange.told_at < HOLD_COMMENT_S:
            return
        exchange.told, exchange.told_at = text, now
        response = exchange.held_stream
        if response is None:
            response = web.StreamResponse(status=200, headers={"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache", **exchange.cors})
            await response.prepare(exchange.request)
            exchange.held_stream = response
        await self.client.send(response, sse_comment(text))

    async def refuse(self, exchange: Exchange, answer: Answer) -> web.StreamResponse:
        """The front's own answer to a request it passed no further; an SSE error event for a stream it holds."""
        if exchange.held_stream is not None:
            await self.client.send(exchange.held_stream, sse_error_event(answer.message))
            return exchange.held_stream
        return self.client.reply(exchange.request, answer, exchange.cors, close=exchange.rest is not None)

