"""The API server's HTTP side: vLLM's OpenAI routes, /health, /metrics, on a stdlib server.

Request threads never generate anything themselves: they hand the request
to the EngineCore over the socket and wait for its tokens, so a dead or
deadlocked engine shows through HTTP exactly as in vLLM (503 on /health
once dead; completions that never finish while /health stays 200 when hung).
The engine's side of that socket is coreclient's, the `vllm:` metrics are
metrics', the words of every answer tokens'.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

from . import texts
from .coreclient import EngineClient, Pending
from .devapi import DEV_ROUTES, dev_route
from .metrics import render_metrics
from .output import STDOUT, Console
from .pooling import pool, routes
from .tokens import CHAT_ANSWER_TOKENS, TEMPLATE_TOKENS, count_prompt_tokens, token_text

ROUTES = [
    ("/openapi.json", "HEAD, GET"), ("/docs", "HEAD, GET"), ("/docs/oauth2-redirect", "HEAD, GET"), ("/redoc", "HEAD, GET"),
    ("/load", "GET"), ("/version", "GET"), ("/health", "GET"), ("/metrics", "GET"), ("/tokenize", "POST"),
    ("/detokenize", "POST"), ("/v1/models", "GET"), ("/ping", "GET"), ("/ping", "POST"), ("/invocations", "POST"),
    ("/v1/chat/completions", "POST"), ("/v1/chat/completions/batch", "POST"), ("/v1/responses", "POST"),
    ("/v1/responses/{response_id}", "GET"), ("/v1/responses/{response_id}/cancel", "POST"), ("/v1/completions", "POST"),
    ("/v1/messages", "POST"), ("/v1/messages/count_tokens", "POST"), ("/generative_scoring", "POST"),
    ("/inference/v1/generate", "POST"), ("/scale_elastic_ep", "POST"), ("/is_scaling_elastic_ep", "POST"),
    ("/v1/chat/completions/render", "POST"), ("/v1/completions/render", "POST"),
]


@dataclass(frozen=True)
class ServeConfig:
    """What the HTTP side needs to know about this server."""

    served_names: tuple[str, ...]
    root: str
    max_model_len: int
    version: str
    minor: int
    api_keys: tuple[str, ...]
    access_log: bool
    utilization: float
    tasks: tuple[str, ...] = ("generate",)  # `Supported tasks`: which routes are open (`pooling.routes`)
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: the development endpoints exist
    max_queued: int | None = None  # --max-num-queued-reqs (0.34): more in the engine are refused with 503


_JSON = "application/json"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _rand_hex() -> str:
    return os.urandom(8).hex()


class SimHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer on a socket that was bound long before it listens."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, sock: socket.socket, handler: type[BaseHTTPRequestHandler], config: ServeConfig, client: EngineClient, console: Console) -> None:
        super().__init__(sock.getsockname()[:2], handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.config = config
        self.client = client
        self.console = console
        self.engine_dead = False
        self.routes = routes(ROUTES, config.tasks) + (DEV_ROUTES if config.dev_mode else [])
        # Set when a SIGTERM aborts the engine's requests: an unanswered one is then never answered (vLLM 0.26's
        # abort mode), and uvicorn waits for its connection to close before the process exits. `unanswered`: the
        # connections of the plain (not streamed) completions under way, whose answer has not begun.
        self.aborting = threading.Event()
        self.unanswered: set[socket.socket] = set()
        self.unanswered_lock = threading.Lock()

    def wait_for_unanswered(self) -> None:
        """uvicorn's shutdown: the connections of requests never answered are waited for until their clients
        close them (a proxy that keeps one open keeps vLLM's process alive until gb10d's SIGKILL)."""
        with self.unanswered_lock:
            if self.unanswered:
                self.console.uvicorn("Waiting for connections to close. (CTRL+C to force quit)")
        while True:
            with self.unanswered_lock:
                left = list(self.unanswered)
            if not left:
                return
            ready, _, _ = select.select(left, [], [], 1.0)
            for conn in ready:
                try:
                    closed = conn.recv(65536, socket.MSG_PEEK) == b""
                except OSError:
                    closed = True
                if closed:
                    with self.unanswered_lock:
                        self.unanswered.discard(conn)

    def server_bind(self) -> None:  # the socket is already bound
        pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-answer is normal (probes with timeouts);
        # uvicorn says nothing about it, and neither may we.
        pass


class Handler(BaseHTTPRequestHandler):
    """vLLM's routes, with uvicorn's access log and headers."""

    protocol_version = "HTTP/1.1"
    raw_body = b""  # this request's body, read whole before it is routed
    # uvicorn sets TCP_NODELAY; without it keep-alive answers wait for a delayed ACK (~40 ms).
    disable_nagle_algorithm = True
    server: SimHTTPServer

    def version_string(self) -> str:
        return "uvicorn"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if not self.server.config.access_log:
            return
        status = int(code) if str(code).isdigit() else 0
        phrase = HTTPStatus(status).phrase if status else ""
        host, port = self.client_address[:2]
        self.server.console.uvicorn(f'{host}:{port} - "{self.command} {self.path} HTTP/1.1" {status} {phrase}', fd=STDOUT)

    # --- plumbing ------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", content_type: str | None = _JSON) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        if body and content_type:
            self.send_header("content-type", content_type)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _body(self) -> Any:
        """The request's JSON (an empty body reads as {}); ValueError when it is not JSON."""
        return json.loads(self.raw_body or b"{}")

    def _read_body(self) -> bytes:
        """The whole request body, read before any route answers, as uvicorn reads it whatever the route does with it:
        a body left in the connection would be parsed as the next request on a kept-alive connection.

        Sized by content-length or sent chunked; ValueError when neither can be read.
        """
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after each chunk
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers, up to the blank line that ends the request
            return b"".join(parts)
        length = int(self.headers.get("content-length") or 0)
        if length < 0:
            raise ValueError(f"content-length {length}")
        return self.rfile.read(length) if length else b""

    def _authorized(self) -> bool:
        keys = self.server.config.api_keys
        path = self.path.split("?", 1)[0]
        if not keys or not path.startswith(("/v1", "/v2", "/inference")):
            return True
        return self.headers.get("authorization", "") in {f"Bearer {k}" for k in keys}

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            self.raw_body = self._read_body()
        except ValueError:
            # uvicorn's answer to a request it cannot parse; nothing after it on this connection can be trusted.
            self.close_connection = True
            self._send(400, b"Invalid HTTP request received.", "text/plain; charset=utf-8")
            return
        if not self._authorized():
            self._send(401, _dumps({"error": "Unauthorized"}))
            return
        if path in ("/health", "/ping") and (method in ("GET", "HEAD") or path == "/ping"):
            self._send(503 if self.server.engine_dead else 200, content_type=None)
        elif path == "/version" and method in ("GET", "HEAD"):
            self._send(200, _dumps({"version": self.server.config.version}))
        elif path == "/v1/models" and method in ("GET", "HEAD"):
            self._send(200, _dumps(self._models()))
        elif path.startswith("/metrics") and method in ("GET", "HEAD"):
            self._metrics()
        elif path == "/load" and method == "GET":
            self._send(200, _dumps({"server_load": self.server.client.running()}))
        elif path in ("/v1/completions", "/v1/chat/completions") and self._opened(path, method):
            self._generate(chat=path == "/v1/chat/completions")
        elif path in ("/v1/embeddings", "/classify", "/pooling") and self._opened(path, method):
            pool(self, path)
        elif self.server.config.dev_mode and dev_route(self, method, path):
            pass
        elif self._opened(path, method):
            self.error(501, "NotImplementedError", f"{method} {path} is a vLLM route the stand-in does not simulate")
        elif any(path == route for route, _ in self.server.routes):
            self._send(405, _dumps({"detail": "Method Not Allowed"}))
        else:
            self._send(404, _dumps({"detail": "Not Found"}))

    def _opened(self, path: str, method: str) -> bool:
        """vLLM serves this route, with this method, for this model's tasks."""
        return any(path == route and method in methods for route, methods in self.server.routes)

    def _models(self) -> dict[str, Any]:
        config = self.server.config
        created = int(time.time())
        cards = []
        for name in config.served_names:
            permission = {
                "id": f"modelperm-{_rand_hex()}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }
            cards.append({
                "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": config.root,
                "parent": None, "max_model_len": config.max_model_len, "permission": [permission],
            })
        return {"object": "list", "data": cards}

    def _metrics(self) -> None:
        client, config = self.server.client, self.server.config
        usage = client.kv_usage()
        with client.lock:
            text = render_metrics(client.metrics, config.served_names[0], len(client.pending), usage, client.spec_k, config.utilization, client.sleep_level)
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    # --- generation ----------------------------------------------------------------

    def error(self, status: int, kind: str, message: str) -> None:
        """vLLM's error body."""
        self._send(status, _dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}))

    def send_json(self, status: int, value: Any) -> None:
        self._send(status, _dumps(value))

    def read_json(self) -> dict[str, Any]:
        """The request's JSON object; ValueError if it is none."""
        body = self._body()
        if not isinstance(body, dict):
            raise ValueError("body is not a JSON object")
        return body

    def model_served(self, model: Any) -> bool:
        """A request's `model` names a served model (or none); else vLLM's 404 is sent."""
        config = self.server.config
        if model and model not in config.served_names:
            self._send(404, texts.not_found_body(str(model), config.served_names, config.minor).encode())
            return False
        return True

    def _generate(self, chat: bool) -> None:
        config = self.server.config
        try:
            body = self.read_json()
        except ValueError as exc:
            self.error(400, "BadRequestError", f"Invalid JSON body: {exc}")
            return
        model = body.get("model")
        if not self.model_served(model):
            return
        if chat:
            messages = body.get("messages") or []
            text = " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
            prompt_tokens = count_prompt_tokens(text) + TEMPLATE_TOKENS
            limit = body.get("max_completion_tokens") or body.get("max_tokens")
            wanted = min(int(limit), CHAT_ANSWER_TOKENS) if limit else CHAT_ANSWER_TOKENS
            natural_stop = not limit or int(limit) >= CHAT_ANSWER_TOKENS
        else:
            text = body.get("prompt", "")
            prompt_tokens = count_prompt_tokens(text)
            wanted = int(body.get("max_tokens") or 16)
            natural_stop = False
        wanted = max(1, min(wanted, max(config.max_model_len - prompt_tokens, 1)))
        if config.max_queued is not None and self.server.client.running() + 1 > config.max_queued:
            self.error(503, "Service Unavailable", texts.QUEUE_FULL)  # QueueOverflowError, a GracefulHTTPError
            return
        submitted = self.server.client.submit(json.dumps(text), prompt_tokens, wanted)
        if submitted is None:
            self.error(500, "InternalServerError", "EngineCore encountered an issue. See stack trace (above) for the root cause.")
            return
        _, pending = submitted
        reason = "stop" if natural_stop else "length"
        ident = ("chatcmpl-" if chat else "cmpl-") + _rand_hex()
        name = str(model or config.served_names[0])
        if body.get("stream"):
            self._stream(pending, chat, ident, name, reason, prompt_tokens, bool((body.get("stream_options") or {}).get("include_usage")))
        else:
            self._complete(pending, chat, ident, name, reason, prompt_tokens)

    def tokens(self, pending: Pending) -> Iterable[tuple[int, int, bool]]:
        """(first index, count, finished) as the engine produces them; stops early if it dies."""
        index = 0
        while True:
            event = pending.events.get()
            if event is None:
                return
            count, finished = event
            yield index, count, finished
            index += count
            if finished:
                return

    def _complete(self, pending: Pending, chat: bool, ident: str, name: str, reason: str, prompt_tokens: int) -> None:
        pieces: list[str] = []
        done = False
        with self.server.unanswered_lock:
            self.server.unanswered.add(self.connection)
        for first, count, finished in self.tokens(pending):
            pieces += ["" if pending.empty else token_text(first + i) for i in range(count)]
            done = finished
        if not done and self.server.aborting.is_set():
            # Aborted by the shutdown: vLLM never answers it, and its connection stays open until the client leaves.
            self.close_connection = True
            threading.Event().wait()
        with self.server.unanswered_lock:
            self.server.unanswered.discard(self.connection)
        if not done:
            self.error(500, "InternalServerError", "EngineCore encountered an issue. See stack trace (above) for the root cause.")
            return
        self.server.client.finish(reason)
        text = "".join(pieces)
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + len(pieces), "completion_tokens": len(pieces), "prompt_tokens_details": None}
        created = int(time.time())
        if chat:
            message: dict[str, object] = {"role": "assistant", "content": text.strip(), "refusal": None, "annotations": None, "audio": None, "function_call": None, "tool_calls": [], "reasoning_content": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason, "stop_reason": None, "token_ids": None}
            result = {"id": ident, "object": "chat.completion", "created": created, "model": name, "choices": [choice], "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
            result = {"id": ident, "object": "text_completion", "created": created, "model": name, "choices": [choice], "service_tier": None, "system_fingerprint": f"vllm-{self.server.config.version}", "usage": usage, "kv_transfer_params": None}
        self._send(200, _dumps(result))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _stream(self, pending: Pending, chat: bool, ident: str, name: str, reason: str, prompt_tokens: int, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict[str, Any], usage: Any = None) -> None:
            payload: dict[str, Any] = {"id": ident, "object": kind, "created": created, "model": name, "choices": [choice]}
            if usage is not None:
                payload["usage"] = usage
            self._chunk(b"data: " + _dumps(payload) + b"\n\n")

        produced = 0
        if chat:
            event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        finished = False
        for first, count, finished in self.tokens(pending):
            text = "" if pending.empty else "".join(token_text(first + i) for i in range(count))
            produced += count
            end = reason if finished else None
            if chat:
                event({"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": end, "stop_reason": None})
            else:
                event({"index": 0, "text": text, "logprobs": None, "finish_reason": end, "stop_reason": None})
        if finished:
            self.server.client.finish(reason)
            if include_usage:
                usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + produced, "completion_tokens": produced}
                payload = {"id": ident, "object": kind, "created": created, "model": name, "choices": [], "usage": usage}
                self._chunk(b"data: " + _dumps(payload) + b"\n\n")
        else:
            error = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.", "type": "InternalServerError", "param": None, "code": 500}}
            self._chunk(b"data: " + _dumps(error) + b"\n\n")
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")
