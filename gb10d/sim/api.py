"""The API server's HTTP side: vLLM's OpenAI routes, /health, /metrics, on a stdlib server.

Request threads never generate anything themselves: they hand the request
to the EngineCore over the socket and wait for its tokens, so a dead or
deadlocked engine shows through HTTP exactly as in vLLM (503 on /health
once dead; completions that never finish while /health stays 200 when hung).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Sequence

from . import texts
from .devapi import DEV_ROUTES, SLEEP_STATES, dev_route
from .output import STDOUT, Console
from .pooling import pool, routes

WORDS = ("The", "stand-in", "engine", "answers", "every", "prompt", "with", "this", "same", "short", "calm", "sentence", ".")
CHAT_ANSWER_TOKENS = len(WORDS)
TEMPLATE_TOKENS = 10

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

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

def token_text(index: int) -> str:
    """The deterministic text of generated token number `index`."""
    return " " + WORDS[index % len(WORDS)]


def count_prompt_tokens(prompt: Any) -> int:
    """A stable stand-in for tokenization: one token per word, plus BOS."""
    if isinstance(prompt, list):
        return sum(count_prompt_tokens(p) if isinstance(p, str) else 1 for p in prompt) or 1
    return len(str(prompt or "").split()) + 1


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.count += 1


@dataclass
class Metrics:
    """vLLM's `vllm:` metrics of REFERENCE §4, for one engine."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FINISHED_REASONS})
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_per_pos: list[int] = field(default_factory=list)
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(_ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    iteration: Histogram = field(default_factory=lambda: Histogram(_ITERATION_BUCKETS))
    created: float = field(default_factory=time.time)


def _labels(values: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(values.items())) + "}"


def render_metrics(m: Metrics, model_name: str, running: int, kv_usage: float, spec_k: int | None, utilization: float, sleep_level: int = 0) -> str:
    """The Prometheus text exposition of the vllm: metrics (labels sorted, as the recording shows)."""
    base = {"engine": "0", "model_name": model_name}
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, dict[str, str], float]]) -> None:
        # prometheus_client names a counter family after its _total sample and
        # exposes the _created samples as a gauge family of their own.
        head = f"{name}_total" if kind == "counter" else name
        out.append(f"# HELP {head} {help_text}")
        out.append(f"# TYPE {head} {kind}")
        created = [s for s in samples if s[0] == "_created"]
        for suffix, extra, value in samples:
            if suffix != "_created":
                out.append(f"{name}{suffix}{_labels({**base, **extra})} {float(value)!r}")
        if created:
            out.append(f"# HELP {name}_created {help_text}")
            out.append(f"# TYPE {name}_created gauge")
            out.extend([f"{name}_created{_labels({**base, **extra})} {float(value)!r}" for _, extra, value in created])

    def counter(value: float) -> list[tuple[str, dict[str, str], float]]:
        return [("_total", {}, value), ("_created", {}, m.created)]

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        samples: list[tuple[str, dict[str, str], float]] = [("_bucket", {"le": repr(b)}, c) for b, c in zip(h.buckets, h.counts)]
        samples += [("_bucket", {"le": "+Inf"}, h.count), ("_count", {}, h.count), ("_sum", {}, h.total), ("_created", {}, m.created)]
        family(name, "histogram", help_text, samples)

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [("", {}, running)])
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [("", {}, 0)])
    family("vllm:num_requests_waiting_by_reason", "gauge", "Number of requests waiting, by reason.", [("", {"reason": r}, 0) for r in ("capacity", "deferred")])
    family("vllm:engine_sleep_state", "gauge", "Engine sleep state; awake = 0 means engine is sleeping.", [("", {"sleep_state": s}, int(s == SLEEP_STATES[sleep_level])) for s in SLEEP_STATES])
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", {}, kv_usage)])
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [("", {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "gpu_memory_utilization": repr(utilization)}, 1)])
    family("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.", counter(m.prefix_queries))
    family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", counter(m.prefix_hits))
    family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", counter(0))
    family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", counter(m.prompt_tokens))
    family("vllm:generation_tokens", "counter", "Number of generation tokens processed.", counter(m.generation_tokens))
    success: list[tuple[str, dict[str, str], float]] = []
    for reason in FINISHED_REASONS:
        success += [("_total", {"finished_reason": reason}, m.success[reason])]
    success += [("_created", {"finished_reason": reason}, m.created) for reason in FINISHED_REASONS]
    family("vllm:request_success", "counter", "Count of successfully processed requests.", success)
    histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", m.iteration)
    histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft)
    histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl)
    histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e)
    histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", m.queue_time)
    histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", m.prefill)
    histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", m.decode)
    if spec_k:
        family("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.", counter(m.spec_drafts))
        family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", counter(m.spec_draft_tokens))
        family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.", counter(m.spec_accepted))
        per_pos = [("_total", {"position": str(p)}, m.spec_per_pos[p] if p < len(m.spec_per_pos) else 0) for p in range(spec_k)]
        family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.", per_pos)
    return "\n".join(out) + "\n"


@dataclass
class _Pending:
    """One request waiting for the engine's tokens."""

    prompt_tokens: int
    max_tokens: int
    started: float
    events: queue.SimpleQueue[tuple[int, bool] | None] = field(default_factory=queue.SimpleQueue)
    produced: int = 0
    first_at: float | None = None
    last_at: float | None = None
    pooling: bool = False  # a pooling request: its one engine pass generates no token
    empty: bool = False  # the weights were woken without reload_weights: tokens come, text does not


class EngineClient:
    """The API server's view of the EngineCore: sends requests, routes tokens, keeps the metrics."""

    def __init__(self, conn: socket.socket, speed: float, kv_tokens: int, spec_k: int | None, on_death: Callable[[], None]) -> None:
        self.conn = conn
        self.speed = speed
        self.kv_tokens = max(kv_tokens, 1)
        self.spec_k = spec_k
        self.metrics = Metrics()
        self.lock = threading.Lock()
        self.pending: dict[str, _Pending] = {}
        self.dead = False
        self._on_death = on_death
        self._seen_prompts: set[str] = set()
        self._counter = 0
        self._controls: dict[str, queue.SimpleQueue[dict[str, Any] | None]] = {}
        self.sleep_level = 0

    def start(self) -> None:
        threading.Thread(target=self._read, name="engine-output", daemon=True).start()

    def _sim(self, wall_seconds: float) -> float:
        """Durations are reported in simulated seconds, like every other figure."""
        return wall_seconds / self.speed if self.speed > 0 else wall_seconds

    def submit(self, prompt_key: str, prompt_tokens: int, max_tokens: int, pooling: bool = False) -> tuple[str, _Pending] | None:
        """Queue a request on the engine; None if the engine is dead."""
        with self.lock:
            if self.dead:
                return None
            self._counter += 1
            rid = f"{self._counter:x}"
            pending = _Pending(prompt_tokens, max_tokens, time.monotonic(), pooling=pooling)
            self.pending[rid] = pending
            self.metrics.prefix_queries += prompt_tokens
            if prompt_key in self._seen_prompts:
                self.metrics.prefix_hits += prompt_tokens // 16 * 16
            self._seen_prompts.add(prompt_key)
            try:
                self.conn.sendall(json.dumps({"t": "gen", "id": rid, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens}).encode() + b"\n")
            except OSError:
                pass
        return rid, pending

    def control(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """A development endpoint's call to the engine, answered when it is done; None if the engine is dead."""
        answers: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        with self.lock:
            if self.dead:
                return None
            self._counter += 1
            rid = f"c{self._counter:x}"
            self._controls[rid] = answers
            try:
                self.conn.sendall(json.dumps({**message, "id": rid}).encode() + b"\n")
            except OSError:
                pass
        answer = answers.get()
        if answer is not None:
            self.sleep_level = int(answer.get("level", 0))
        return answer

    def running(self) -> int:
        with self.lock:
            return len(self.pending)

    def kv_usage(self) -> float:
        with self.lock:
            used = sum(p.prompt_tokens + p.produced for p in self.pending.values())
        return min(used / self.kv_tokens, 1.0)

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = self.conn.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line:
                    self._on_message(json.loads(line))
        with self.lock:
            self.dead = True
            waiting = list(self.pending.values())
            self.pending.clear()
            controls = list(self._controls.values())
            self._controls.clear()
        for pending in waiting:
            pending.events.put(None)
        for answers in controls:
            answers.put(None)
        self._on_death()

    def _on_message(self, message: dict[str, Any]) -> None:
        if message.get("t") == "done":
            with self.lock:
                answers = self._controls.pop(str(message.get("id")), None)
            if answers is not None:
                answers.put(message)
            return
        if message.get("t") != "tok":
            return
        now = time.monotonic()
        with self.lock:
            pending = self.pending.get(str(message["id"]))
            if pending is None:
                return
            count, finished = int(message["n"]), bool(message["fin"])
            m = self.metrics
            if pending.first_at is None:
                pending.first_at = now
                m.prompt_tokens += pending.prompt_tokens
                m.ttft.observe(self._sim(now - pending.started))
                m.queue_time.observe(0.0)
                m.prefill.observe(self._sim(now - pending.started))
            elif pending.last_at is not None:
                m.itl.observe(self._sim(now - pending.last_at))
            pending.last_at = now
            pending.empty = bool(message.get("empty"))
            pending.produced += count
            if not pending.pooling:
                m.generation_tokens += count
            m.iteration.observe(count)
            accepted = message.get("spec")
            if accepted:
                m.spec_drafts += 1
                m.spec_draft_tokens += len(accepted)
                m.spec_accepted += sum(accepted)
                if len(m.spec_per_pos) < len(accepted):
                    m.spec_per_pos += [0] * (len(accepted) - len(m.spec_per_pos))
                for position, hit in enumerate(accepted):
                    m.spec_per_pos[position] += hit
            if finished:
                del self.pending[str(message["id"])]
                m.e2e.observe(self._sim(now - pending.started))
                m.decode.observe(self._sim(now - (pending.first_at or now)))
        pending.events.put((count, finished))

    def snapshot(self) -> dict[str, float]:
        """Counters for the periodic stats line."""
        with self.lock:
            m = self.metrics
            return {
                "prompt": m.prompt_tokens, "generation": m.generation_tokens, "queries": m.prefix_queries,
                "hits": m.prefix_hits, "drafts": m.spec_drafts, "draft_tokens": m.spec_draft_tokens,
                "accepted": m.spec_accepted, "requests": sum(m.success.values()) + len(self.pending),
                **{f"pos{p}": v for p, v in enumerate(m.spec_per_pos)},
            }

    def finish(self, reason: str) -> None:
        with self.lock:
            self.metrics.success[reason] += 1


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

    def server_bind(self) -> None:  # the socket is already bound
        pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hangs up mid-answer is normal (probes with timeouts);
        # uvicorn says nothing about it, and neither may we.
        pass


class Handler(BaseHTTPRequestHandler):
    """vLLM's routes, with uvicorn's access log and headers."""

    protocol_version = "HTTP/1.1"
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
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        return json.loads(raw or b"{}")

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

    def tokens(self, pending: _Pending) -> Iterable[tuple[int, int, bool]]:
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

    def _complete(self, pending: _Pending, chat: bool, ident: str, name: str, reason: str, prompt_tokens: int) -> None:
        pieces: list[str] = []
        done = False
        for first, count, finished in self.tokens(pending):
            pieces += ["" if pending.empty else token_text(first + i) for i in range(count)]
            done = finished
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

    def _stream(self, pending: _Pending, chat: bool, ident: str, name: str, reason: str, prompt_tokens: int, include_usage: bool) -> None:
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
