"""The instance's side of one request through the front: sent with aiohttp's client over the instance's pool, its
response head awaited within front.upstream_head_timeout_s or until the instance leaves serving, and the answer
pumped back to the client piece by piece as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from ..base.frontconfig import FrontSection
from .core import Instance, sse_error_event
from .exchange import Client, Exchange
from .journal import FrontJournal
from .routes import adapters_of, forwarded_headers, upstream_headers
from .states import States, Watched

# The LoRA adapters vLLM lists are looked up again at most this often, when a request names an unknown model.
ADAPTERS_AGAIN_S = 5.0


class Requeue(Exception):
    """The instance left serving before vLLM sent a response head: the request generated nothing, so it waits again."""


class Refused(Exception):
    """vLLM's address refused the connection, or did not accept it within front.connect_timeout_s."""


class Upstream:
    """Passes requests to the instances and their answers back; knows the LoRA adapters they serve."""

    def __init__(self, settings: FrontSection, states: States, client: Client, journal: FrontJournal) -> None:
        self.settings = settings
        self.states = states
        self.client = client
        self.journal = journal
        self.keyed = False
        self.adapters: dict[str, str] = {}
        self.adapters_at = 0.0

    async def ask(self, watched: Watched, exchange: Exchange) -> aiohttp.ClientResponse:
        """Send the request to the instance and wait for its response head, or until the instance leaves serving
        (Requeue) or front.upstream_head_timeout_s passes (TimeoutError)."""
        request, instance = exchange.request, watched.known.instance
        headers = upstream_headers(
            request.raw_headers, request.remote, request.host, watched.known.api_key, strip_credentials=self.keyed,
        )
        data: bytes | AsyncIterator[bytes] = exchange.body if exchange.rest is None else self.client.streamed(exchange)
        if exchange.rest is not None and request.content_length is not None:
            # The streamed rest is exactly the client's body: its length goes along (vLLM gets no chunked upload).
            headers.append((b"content-length", str(request.content_length).encode()))
        sending = asyncio.ensure_future(watched.session.request(
            request.method, self.url(instance, request.raw_path), headers=CIMultiDict((n.decode("latin-1"), v.decode("latin-1")) for n, v in headers),
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
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError, aiohttp.ConnectionTimeoutError) as exc:  # refused, reset, or no accept in time
                # No response head came: vLLM generated nothing that reached anyone, and the request is tried again.
                raise Refused(str(exc)) from exc
        if sending.done() and not sending.cancelled() and sending.exception() is None:
            sending.result().close()
        if leaving in done:
            raise Requeue()
        raise TimeoutError()

    @staticmethod
    def url(instance: Instance, path: str) -> URL:
        host = f"[{instance.host}]" if ":" in instance.host else instance.host
        return URL(f"http://{host}:{instance.port}{path}", encoded=True)

    @staticmethod
    def key_header(watched: Watched) -> dict[str, str]:
        return {"authorization": f"Bearer {watched.known.api_key}"} if watched.known.api_key else {}

    async def learn_adapters(self) -> bool:
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
                    async with watched.session.get(self.url(watched.known.instance, "/v1/models"), headers=self.key_header(watched)) as answer:
                        found.update(adapters_of(watched.name, await answer.json(content_type=None)))
        changed = found != self.adapters
        self.adapters = found
        return changed

    async def pump(self, exchange: Exchange, upstream: aiohttp.ClientResponse, instance: Instance) -> web.StreamResponse:
        """Pass vLLM's answer through piece by piece as it comes; an instance lost mid-answer ends an event stream
        with an error event and any other answer by closing the connection (the client sees it cut, not done)."""
        request = exchange.request
        try:
            if exchange.held_stream is not None:
                response = exchange.held_stream
                if upstream.status != 200:
                    text = (await upstream.read()).decode("utf-8", "replace")
                    await self.client.send(response, sse_error_event(_error_text(text) or f"{instance.name} answered {upstream.status}", upstream.status))
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
                    try:
                        await self.client.send(response, chunk)
                    except ConnectionError:
                        # The client left (or stopped reading): closing the upstream connection (finally) tells vLLM
                        # to stop; not the instance's failure, and nothing more to say to anyone.
                        return response
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError):
                if not stream or request.method == "HEAD":
                    self.journal.say(f"{instance.name} broke off an answer; the client's connection is closed so it sees it cut", 4, cause=f"broke {instance.name}")
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                self.journal.say(f"{instance.name} ended a stream mid-answer; the client got an error event", 4, cause=f"broke {instance.name}")
                await self.client.send(response, sse_error_event(f"{instance.name} stopped answering mid-stream"))
            upstream.release()
            return response
        finally:
            upstream.close()


def _error_text(body: str) -> str:
    """The message of vLLM's JSON error body, else the body itself (cut short)."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        parsed = json.loads(body)
        message = parsed.get("error", {}).get("message") if isinstance(parsed.get("error"), dict) else parsed.get("message")
        if isinstance(message, str):
            return message
    return body[:500]
