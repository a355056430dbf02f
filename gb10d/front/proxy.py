"""One client request through the front: checked on its line and headers, its body read within bounds, routed, held
while its model's instance does not serve, then passed to vLLM and its answer pumped back as it comes.

The decisions are gb10d.front.routes' (where, whether, which headers) and gb10d.front.core's (go, wait or refuse);
this module reads, waits and writes. aiohttp parses both sides (llhttp); every wait has a bound: the body's next
bytes (front.body_timeout_s), a client that stops reading (front.send_timeout_s), vLLM's connect
(front.connect_timeout_s) and response head (front.upstream_head_timeout_s), and the hold itself
(front.hold_timeout_s), whose clock starts once per request and never again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..base.frontconfig import FrontSection
from .core import HOLD_COMMENT_S, Answer, Instance, Wait, admit, error, sse_comment, sse_error_event
from .journal import FrontJournal
from .metrics import FrontMetrics
from .routes import (
    ApiKey, Forward, NeedMore, Own, adapters_of, authorized, bare, cors_headers, forwarded_headers, is_multipart, kind_of,
    multipart_model, own_answer, request_fields, route, upstream_headers,
)
from .states import States, Watched
from .swaps import Swaps

# A JSON body larger than this is parsed off the event loop: 60 MiB take 0.4 s, which would stall every stream.
PARSE_INLINE_BYTES = 256 * 1024
# How much of a multipart body is read to find its `model` field; the file after it streams through unread.
MULTIPART_PEEK_BYTES = 1024 * 1024
# The LoRA adapters vLLM lists are looked up again at most this often, when a request names an unknown model.
ADAPTERS_AGAIN_S = 5.0


class Requeue(Exception):
    """The instance left serving before vLLM sent a response head: the request generated nothing, so it waits again."""


class Refused(Exception):
    """vLLM's address refused the connection, or did not accept it within front.connect_timeout_s."""


@dataclass
class Bodies:
    """The bytes of request bodies the front holds in memory at once, bounded by front.max_held_body_bytes."""

    limit: int
    held: int = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True


@dataclass
class Exchange:
    """One request on its way: what was read of it, and the stream response begun while it was held."""

    request: web.BaseRequest
    body: bytes
    # The rest of a multipart body, still unread on the client's connection; None once the whole body is in `body`.
    rest: aiohttp.StreamReader | None
    stream: bool
    cors: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    held_stream: web.StreamResponse | None = None
    # What the held stream was last told, and when: a comment when the phase changes or HOLD_COMMENT_S passed.
    told: str = ""
    told_at: float = 0.0
    taken: int = 0
    rest_sent: bool = False


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
        self.bodies = Bodies(settings.max_held_body_bytes)
        # Connections with a request in progress: the door sheds only the others when it runs out of room.
        self.busy: dict[object, int] = {}
        self.adapters: dict[str, str] = {}
        self.adapters_at = 0.0
        # While the front drains for a stop: the monotonic time by which held requests are answered.
        self.drain_deadline: float | None = None
        # The front's page (gb10d.front.page): its answer to a request, or None when the request is not the page's.
        self.page: Callable[[web.BaseRequest], Awaitable[web.StreamResponse | None]] | None = None

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
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a defect of the front's own: one line, the client gets 500, the front goes on
            self.journal.say(f"internal error on {request.method} {bare(request.path)}: {type(exc).__name__}: {exc}", 3, cause="internal")
            return self.reply(request, error(500, f"the front failed on this request ({type(exc).__name__}); see journalctl -u gb10d-front", "InternalServerError"), {}, close=True)
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
            return self.reply(request, kind, cors, close=pending)
        key = authorized(path, request.raw_headers, self.keys)
        if isinstance(key, Answer):
            return self.reply(request, key, cors, close=pending)
        allowed = key.models if key is not None else frozenset()
        if isinstance(kind, Own):
            return self.reply(request, own_answer(method, path, self.instances, self.states.readiness(), time.time(), allowed), cors, close=pending)
        read = await self._read(request, cors)
        if isinstance(read, Answer):
            return self.reply(request, read, cors, close=True)
        exchange = read
        try:
            return await self._route_and_forward(exchange, allowed)
        finally:
            self.bodies.held -= exchange.taken

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
                return self.reply(request, fields, exchange.cors)
            model, exchange.stream = fields
        decided = self._route(request, model, allowed)
        if isinstance(decided, Answer) and decided.status == 404 and model is not None and await self._learn_adapters():
            decided = self._route(request, model, allowed)
        if isinstance(decided, Answer):
            return self.reply(request, decided, exchange.cors, close=exchange.rest is not None)
        return await self.forward(exchange, self.states[decided.instance.name])

    def _route(self, request: web.BaseRequest, model: str | None, allowed: frozenset[str]) -> Forward | Answer:
        return route(request.method, request.raw_path, b"", "", self.instances, self.states.readiness(), time.time(), allowed, self.adapters, model)

    async def _fields(self, body: bytes, ctype: str) -> tuple[str | None, bool] | Answer:
        """The body's `model` and `stream`, parsed off the event loop when the body is large."""
        if len(body) > PARSE_INLINE_BYTES:
            model, stream, problem = await asyncio.to_thread(request_fields, body, ctype)
        else:
            model, stream, problem = request_fields(body, ctype)
        return problem if problem is not None else (model, stream)

    async def _learn_adapters(self) -> bool:
        """Ask each serving instance's vLLM which LoRA adapters it serves (cards with a `parent` in /v1/models);
        True when the list changed. At most every ADAPTERS_AGAIN_S: an unknown model is no reason to flood vLLM."""
        now = time.monotonic()
        if now - self.adapters_at < ADAPTERS_AGAIN_S:
            return False
        self.adapters_at = now
        found: dict[str, str] = {}
        for watched in self.states.watched.values():
            if not watched.ready.serving:
                continue
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with asyncio.timeout(self.settings.connect_timeout_s):
                    async with watched.session.get(self._url(watched.known.instance, "/v1/models"), headers=self._key_header(watched)) as answer:
                        found.update(adapters_of(watched.name, await answer.json(content_type=None)))
        changed = found != self.adapters
        self.adapters = found
        return changed

    async def _read(self, request: web.BaseRequest, cors: dict[str, str]) -> Exchange | Answer:
        """The body, within front.max_body_bytes, front.body_timeout_s between reads and front.max_held_body_bytes
        for all held bodies together; a multipart body only up to its `model` field. `100 Continue` goes out only
        now, after the key and the declared length were checked."""
        limit = self.settings.max_body_bytes
        too_large = error(413, f"the request body is over {limit} bytes (front.max_body_bytes)", "RequestTooLargeError")
        declared = request.content_length
        if declared is not None and declared > limit:
            return too_large
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        ctype = request.headers.get("Content-Type", "")
        multipart = is_multipart(ctype)
        exchange = Exchange(request, b"", None, False, cors)
        chunks: list[bytes] = []
        size = 0
        while True:
            if multipart and not isinstance(multipart_model(b"".join(chunks), ctype, False), NeedMore):
                exchange.rest = request.content
                break
            if multipart and size >= MULTIPART_PEEK_BYTES:
                exchange.rest = request.content
                break
            chunk = await self._next_chunk(request.content)
            if isinstance(chunk, Answer):
                self.bodies.held -= exchange.taken
                return chunk
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                self.bodies.held -= exchange.taken
                return too_large
            if not self.bodies.take(len(chunk)):
                self.bodies.held -= exchange.taken
                self.journal.say(f"refused a request: the request bodies held reach front.max_held_body_bytes ({self.bodies.limit} bytes)", 4, cause="bodies")
                return error(503, f"the front holds {self.bodies.held} bytes of request bodies already (front.max_held_body_bytes)", "ServiceUnavailableError", 1)
            exchange.taken += len(chunk)
            chunks.append(chunk)
        exchange.body = b"".join(chunks)
        return exchange

    async def _next_chunk(self, content: aiohttp.StreamReader) -> bytes | Answer:
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                return await content.readany()
        except TimeoutError:
            return error(408, f"the request body stopped arriving: nothing for {self.settings.body_timeout_s:.0f} s (front.body_timeout_s)", "RequestTimeoutError")

    # --- holding and forwarding ---------------------------------------------------------------------------------

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
                    upstream = await self._ask(watched, exchange)
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
                return await self.pump(exchange, upstream, instance)
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
        await self._send(response, sse_comment(text))

    async def refuse(self, exchange: Exchange, answer: Answer) -> web.StreamResponse:
        """The front's own answer to a request it passed no further; an SSE error event for a stream it holds."""
        if exchange.held_stream is not None:
            await self._send(exchange.held_stream, sse_error_event(answer.message))
            return exchange.held_stream
        return self.reply(exchange.request, answer, exchange.cors, close=exchange.rest is not None)

    async def _ask(self, watched: Watched, exchange: Exchange) -> aiohttp.ClientResponse:
        """Send the request to the instance and wait for its response head, or until the instance leaves serving
        (Requeue) or front.upstream_head_timeout_s passes (TimeoutError)."""
        request, instance = exchange.request, watched.known.instance
        headers = upstream_headers(
            request.raw_headers, request.remote, request.host, watched.known.api_key, strip_credentials=bool(self.keys),
        )
        data: bytes | AsyncIterator[bytes] = exchange.body if exchange.rest is None else self._streamed(exchange)
        if exchange.rest is not None and request.content_length is not None:
            # The streamed rest is exactly the client's body: its length goes along (vLLM gets no chunked upload).
            headers.append((b"content-length", str(request.content_length).encode()))
        sending = asyncio.ensure_future(watched.session.request(
            request.method, self._url(instance, request.raw_path), headers=CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in headers),
            data=data, allow_redirects=False, skip_auto_headers=("Content-Type", "Accept", "Accept-Encoding"),
        ))
        leaving = asyncio.ensure_future(watched.left.wait())
        try:
            done, _ = await asyncio.wait({sending, leaving}, timeout=self.settings.upstream_head_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
        if sending in done:
            try:
                return sending.result()
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError) as exc:
                raise Refused(str(exc)) from exc
        if sending.done() and not sending.cancelled() and sending.exception() is None:
            sending.result().close()
        if leaving in done:
            raise Requeue()
        raise TimeoutError()

    async def _streamed(self, exchange: Exchange) -> AsyncIterator[bytes]:
        """A multipart body: what was read to find its model, then the rest as it arrives, within the same bounds."""
        yield exchange.body
        assert exchange.rest is not None
        size = len(exchange.body)
        while True:
            chunk = await self._next_chunk(exchange.rest)
            if isinstance(chunk, Answer):
                raise aiohttp.ClientPayloadError(chunk.message)
            if not chunk:
                return
            exchange.rest_sent = True
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise aiohttp.ClientPayloadError(f"the request body is over {self.settings.max_body_bytes} bytes (front.max_body_bytes)")
            yield chunk

    @staticmethod
    def _url(instance: Instance, path: str) -> URL:
        host = f"[{instance.host}]" if ":" in instance.host else instance.host
        return URL(f"http://{host}:{instance.port}{path}", encoded=True)

    @staticmethod
    def _key_header(watched: Watched) -> dict[str, str]:
        return {"authorization": f"Bearer {watched.known.api_key}"} if watched.known.api_key else {}

    async def pump(self, exchange: Exchange, upstream: aiohttp.ClientResponse, instance: Instance) -> web.StreamResponse:
        """Pass vLLM's answer through piece by piece as it comes; an instance lost mid-answer ends an event stream
        with an error event and any other answer by closing the connection (the client sees it cut, not done)."""
        request = exchange.request
        try:
            if exchange.held_stream is not None:
                response = exchange.held_stream
                if upstream.status != 200:
                    text = (await upstream.read()).decode("utf-8", "replace")
                    await self._send(response, sse_error_event(_error_text(text) or f"{instance.name} answered {upstream.status}", upstream.status))
                    return response
            else:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                for name, value in forwarded_headers(upstream.raw_headers):
                    response.headers.add(name.decode("latin-1"), value.decode("latin-1"))
                response.headers.update(exchange.cors)
                if upstream.content_length is not None and "chunked" not in upstream.headers.get("Transfer-Encoding", "").lower():
                    response.content_length = upstream.content_length
                await response.prepare(request)
            stream = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            try:
                async for chunk in upstream.content.iter_any():
                    await self._send(response, chunk)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError):
                if not stream or request.method == "HEAD":
                    self.journal.say(f"{instance.name} broke off an answer; the client's connection is closed so it sees it cut", 4, cause=f"broke {instance.name}")
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                self.journal.say(f"{instance.name} ended a stream mid-answer; the client got an error event", 4, cause=f"broke {instance.name}")
                await self._send(response, sse_error_event(f"{instance.name} stopped answering mid-stream"))
            upstream.release()
            return response
        finally:
            upstream.close()

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        """Write to the client; one that has not taken a byte for front.send_timeout_s is dropped (ConnectionError
        ends the request, and aiohttp closes the connection)."""
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await response.write(data)
        except TimeoutError:
            self.journal.say(f"dropped a client that read nothing for {self.settings.send_timeout_s:.0f} s (front.send_timeout_s)", 4, cause="send timeout")
            raise ConnectionResetError("the client stopped reading") from None

    def reply(self, request: web.BaseRequest, answer: Answer, cors: dict[str, str], close: bool = False) -> web.Response:
        """The front's own JSON answer (an error, the model list, its health); `close` when the request's body was
        not read, so the connection cannot carry another request."""
        body = b"" if request.method == "HEAD" else json.dumps(answer.body).encode()
        headers = {"content-type": "application/json", **cors}
        if answer.retry_after_s is not None:
            headers["retry-after"] = str(answer.retry_after_s)
        response = web.Response(status=answer.status, reason=HTTPStatus(answer.status).phrase, body=body, headers=headers)
        if close:
            response.force_close()
        return response


def _error_text(body: str) -> str:
    """The message of vLLM's JSON error body, else the body itself (cut short)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        parsed = json.loads(body)
        message = parsed.get("error", {}).get("message") if isinstance(parsed.get("error"), dict) else parsed.get("message")
        if isinstance(message, str):
            return message
    return body[:500]
