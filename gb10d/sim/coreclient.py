"""The API server's side of the EngineCore's socket: requests sent, tokens routed to the waiting request threads, the metrics kept.

Apart from the routes as in vLLM (v1/engine/core_client.py): a request
thread only waits on its `Pending`, and a reader thread owns the socket, so
an engine that dies or hangs shows through every route at once.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .metrics import Metrics


@dataclass
class Pending:
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
        self.pending: dict[str, Pending] = {}
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

    def submit(self, prompt_key: str, prompt_tokens: int, max_tokens: int, pooling: bool = False) -> tuple[str, Pending] | None:
        """Queue a request on the engine; None if the engine is dead."""
        with self.lock:
            if self.dead:
                return None
            self._counter += 1
            rid = f"{self._counter:x}"
            pending = Pending(prompt_tokens, max_tokens, time.monotonic(), pooling=pooling)
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
