"""The client's side of one request through the front: its body read within bounds, and what is written back to it
within front.send_timeout_s.

A body is read whole (it is routed by its JSON `model`, and held while its instance starts), within
front.max_body_bytes, front.body_timeout_s between reads, and front.max_held_body_bytes for all bodies the front
holds at once; a multipart body only up to its `model` field, the file after it streamed on as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus

import aiohttp
from aiohttp import web

from ..base.frontconfig import FrontSection
from .core import Answer, error
from .journal import FrontJournal
from .routes import NeedMore, is_multipart, multipart_model

# How much of a multipart body is read to find its `model` field; the file after it streams through unread.
MULTIPART_PEEK_BYTES = 1024 * 1024


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

    def give(self, size: int) -> None:
        self.held -= size


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


class Client:
    """Reads a request's body and writes its answer, each within the front's bounds."""

    def __init__(self, settings: FrontSection, journal: FrontJournal) -> None:
        self.settings = settings
        self.journal = journal
        self.bodies = Bodies(settings.max_held_body_bytes)

    async def read(self, request: web.BaseRequest, cors: dict[str, str]) -> Exchange | Answer:
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
        exchange = Exchange(request, b"", None, False, cors)
        refusal = await self._collect(exchange, ctype if is_multipart(ctype) else None, too_large)
        if refusal is not None:
            self.bodies.give(exchange.taken)
            return refusal
        return exchange

    async def _collect(self, exchange: Exchange, multipart: str | None, too_large: Answer) -> Answer | None:
        """Read the body into `exchange` (a multipart one, of type `multipart`, only up to its model field), each
        chunk counted in `exchange.taken` and the held bodies; the answer that refuses it, or None."""
        content = exchange.request.content
        chunks: list[bytes] = []
        while True:
            if multipart and (exchange.taken >= MULTIPART_PEEK_BYTES or not isinstance(multipart_model(b"".join(chunks), multipart, False), NeedMore)):
                exchange.rest = content
                break
            chunk = await self.next_chunk(content)
            if isinstance(chunk, Answer):
                return chunk
            if not chunk:
                break
            if exchange.taken + len(chunk) > self.settings.max_body_bytes:
                return too_large
            if not self.bodies.take(len(chunk)):
                self.journal.say(f"refused a request: the request bodies held reach front.max_held_body_bytes ({self.bodies.limit} bytes)", 4, cause="bodies")
                return error(503, f"the front holds {self.bodies.held} bytes of request bodies already (front.max_held_body_bytes)", "ServiceUnavailableError", 1)
            exchange.taken += len(chunk)
            chunks.append(chunk)
        exchange.body = b"".join(chunks)
        return None

    async def next_chunk(self, content: aiohttp.StreamReader) -> bytes | Answer:
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                return await content.readany()
        except TimeoutError:
            return error(408, f"the request body stopped arriving: nothing for {self.settings.body_timeout_s:.0f} s (front.body_timeout_s)", "RequestTimeoutError")

    async def streamed(self, exchange: Exchange) -> AsyncIterator[bytes]:
        """A multipart body: what was read to find its model, then the rest as it arrives, within the same bounds."""
        yield exchange.body
        assert exchange.rest is not None
        size = len(exchange.body)
        while True:
            chunk = await self.next_chunk(exchange.rest)
            if isinstance(chunk, Answer):
                raise aiohttp.ClientPayloadError(chunk.message)
            if not chunk:
                return
            exchange.rest_sent = True
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                raise aiohttp.ClientPayloadError(f"the request body is over {self.settings.max_body_bytes} bytes (front.max_body_bytes)")
            yield chunk

    async def send(self, response: web.StreamResponse, data: bytes) -> None:
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
