"""Turning lines into `events.Event`s: `parse_message`, `parse_line`, and `EventScanner`, which also joins a
failure message that was split over two lines.

Cheap literal gates come first: most lines vLLM prints carry no event, and they must cost next to nothing.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from .. import failures as failure_kinds
from .. import known
from ..events import (
    ArgsSeen,
    CompileProgressed,
    DownloadProgressed,
    EngineInitialized,
    Event,
    ExceptionRaised,
    Failure,
    GraphsProgressed,
    KvCacheSized,
    LoadStarted,
    NoKvCacheMemory,
    ServerStarting,
    ShardsProgressed,
    ShutdownStarted,
    SpecDecodingLogged,
    StartupCompleted,
    StatsLogged,
    TasksSupported,
    VersionSeen,
    WeightsLoaded,
)
from .bars import _scaled
from .classify import _SHARD_BAR, _TQDM_BAR, _TQDM_OPEN_BAR, message_of
from .failures import _COMPLETE, _LEADS, _MISMATCH, _PARTIAL, _failures, _fit
from .patterns import (
    _BANNER,
    _ENGINE_VERSION,
    _GRAPH_BAR,
    _GRAPH_DONE,
    _INIT_ENGINE,
    _KV_AVAILABLE,
    _KV_SIZE,
    _LOGO_VERSION,
    _MAX_CONCURRENCY,
    _MODEL_LOADING_TOOK,
    _SECONDS,
    _SERVER_ON,
    _SPEC,
    _STATS_HEAD,
    _TASK_NAMES,
    _V0_BLOCKS,
    _V0_WEIGHTS_TOOK,
    _WEIGHTS_TOOK,
    _f,
)


def _literal_gate(words: tuple[str, ...]) -> re.Pattern[str]:
    """A search for any of `words`, as a trie: one branch per next character instead of one per word.

    Python's `re` tries every alternative at every position of the text; with
    the words folded by their common beginnings it tries one. The gates run
    on every line vLLM prints, where this halves their cost.
    """
    tree: dict[str, dict[str, Any]] = {}
    for word in words:
        node = tree
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict[str, Any]) -> str:
        ends = "" in node
        alternatives = [re.escape(ch) + pattern(rest) for ch, rest in sorted(node.items()) if ch]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 and not ends else "(?:" + "|".join(alternatives) + ")"
        return body + ("?" if ends else "")

    return re.compile(pattern(tree))


# Cheap gates: a message with none of these words holds no progress event, or no failure.
_PROGRESS_GATE = _literal_gate((
    "%", "/s]", "s/it]", "Engine", "SpecDecoding", "compile", "Dynamo", "KV cache", "Maximum concurrency", "took",
    "Graph capturing", "Starting", "Loading model", "Filesystem type", "blocks:", "Uvicorn running", "Application startup",
    "version", "Initializing a V1", "non-default args", "shutdown triggered", "trigger received", "Shutting down", "Supported tasks",
))
_FAILURE_GATE = _literal_gate((
    "Error", "error", "memory", "Exception", "failed", "in use", "not a local", "Invalid repository", "Not Found", "gated",
    "parser", "configuration of", "unexpectedly", "Interrupt", "Exit", "positional", "Fault", "yaml", "Repo id",
    "does not appear", "couldn't connect", "No such file", "not found", "registered", *known.NEEDLES, *failure_kinds.NEEDLES,
))


def _stats(msg: str) -> StatsLogged | None:
    head = _STATS_HEAD.match(msg)
    if head is None:
        return None
    values: dict[str, float] = {}
    for part in msg[head.end():].split(", "):
        key, sep, value = part.partition(": ")
        if not sep:
            continue
        number = value.split(" ", 1)[0].rstrip("%.")
        try:
            values[key.strip()] = float(number)
        except ValueError:
            continue
    if "Avg prompt throughput" not in values or "Avg generation throughput" not in values:
        return None
    kv = next((v for k, v in values.items() if k.endswith("KV cache usage") and not k.startswith("CPU")), None)
    engine = head.group("engine") or (f"{head.group('n')} aggregated" if head.group("n") else "000")
    return StatsLogged(
        values["Avg prompt throughput"], values["Avg generation throughput"],
        int(values.get("Running", 0)), int(values.get("Waiting", values.get("Pending", 0))),
        kv, values.get("Prefix cache hit rate"), engine,
    )


def _spec(msg: str) -> SpecDecodingLogged | None:
    m = _SPEC.search(msg)
    if m is None:
        return None
    positions = tuple(float(p) for p in m.group("pos").split(", ") if p.strip())
    rate = m.group("rate")
    return SpecDecodingLogged(
        _f(m.group("mal")), _f(m.group("acc_s")), _f(m.group("dr_s")), int(m.group("acc")), int(m.group("dr")),
        positions, None if rate == "nan" else _f(rate),
    )


def _compile(msg: str) -> CompileProgressed | None:
    # 0.34 without the AOT compile: `torch.compile and initial profiling/warmup run together took %.2f s in total`.
    if "in total" in msg and ("torch.compile took" in msg or "torch.compile and initial profiling/warmup run together took" in msg):
        s = _SECONDS.search(msg)
        return CompileProgressed(True, _f(s.group("s")) if s else None)
    if ("Dynamo bytecode transform time" in msg or "Compiling a graph for" in msg or "from the cache, took" in msg
            or "for vLLM's torch.compile" in msg or "torch.compile cache is disabled" in msg
            or "Starting torch.compile" in msg or "Cache the graph of" in msg):
        s = _SECONDS.search(msg)
        return CompileProgressed(False, _f(s.group("s")) if s else None)
    return None


def parse_message(msg: str) -> list[Event]:
    """The events in one message (a line with its tag, level, timestamp and source already removed)."""
    if _PROGRESS_GATE.search(msg) is not None:
        progress = _progress(msg)
        if progress:
            return progress
    if _FAILURE_GATE.search(msg) is not None or (failure_kinds.TAUGHT_NEEDLES and _taught_spotted(msg)):
        return _failures(msg)
    return []


def _taught_spotted(msg: str) -> bool:
    """Whether a failure kind taught after the gate was built may be in the message."""
    return any(needle in msg for needle in failure_kinds.TAUGHT_NEEDLES)


def _progress(msg: str) -> list[Event]:
    """The startup, steady-state and shutdown events of a message that passed the cheap gate.

    Three groups, tried in this order: progress bars and the periodic stats; memory, loading and its timings;
    the server, the release and the shutdown. The first that finds an event answers.
    """
    return _bars_and_stats(msg) or _memory_and_loading(msg) or _server_and_shutdown(msg) or []


def _bars_and_stats(msg: str) -> list[Event] | None:
    """Shard, CUDA-graph and download bars; throughput, speculative-decoding and compile lines."""
    if "%" in msg:
        if "% Completed |" in msg:
            s = _SHARD_BAR.search(msg)
            if s is not None:
                return [ShardsProgressed(int(s.group("n")), int(s.group("total")), s.group("eager") is not None)]
        if "%|" in msg:
            g = _GRAPH_BAR.search(msg) if "CUDA graph" in msg else None
            if g is not None:
                return [GraphsProgressed(int(g.group("n")), int(g.group("total")))]
            b = _TQDM_BAR.match(msg)
            if b is not None:
                desc = b.group("desc").strip()
                return [DownloadProgressed(_scaled(b.group("n"), b.group("nu")), _scaled(b.group("total"), b.group("tu")), desc)]
    elif "/s]" in msg or "s/it]" in msg:
        o = _TQDM_OPEN_BAR.match(msg)
        if o is not None:
            return [DownloadProgressed(_scaled(o.group("n"), o.group("nu")), None, o.group("desc").strip())]
    if msg.startswith(("Engine ", "Avg prompt throughput")) or "Engines Aggregated" in msg:
        stats = _stats(msg)
        if stats is not None:
            return [stats]
    if msg.startswith("SpecDecoding metrics"):
        spec = _spec(msg)
        if spec is not None:
            return [spec]
    if "compile" in msg or "Dynamo" in msg:
        c = _compile(msg)
        if c is not None:
            return [c]
    return None


def _memory_and_loading(msg: str) -> list[Event] | None:
    """The KV cache's size (or its absence), the weights' load times, the end of graph capture."""
    if "KV cache" in msg:
        a = _KV_AVAILABLE.search(msg)
        k = _KV_SIZE.search(msg)
        if a is not None or k is not None:
            c_ = _MAX_CONCURRENCY.search(msg)
            return [KvCacheSized(
                _f(a.group("gib")) if a else None,
                int(k.group("tokens").replace(",", "")) if k else None,
                _f(c_.group("x")) if c_ else None,
            )]
    if "blocks:" in msg:
        b = _V0_BLOCKS.search(msg)
        if b is not None:
            # The V0 engine's `# GPU blocks: 0`: the weights left nothing for the KV cache.
            return [KvCacheSized()] if b.group("n") != "0" else [NoKvCacheMemory()]
    if msg.startswith("Maximum concurrency for"):
        c_ = _MAX_CONCURRENCY.search(msg)
        if c_ is not None:
            return [KvCacheSized(max_concurrency=_f(c_.group("x")))]
    if "took" in msg:
        if "Loading weights took" in msg:
            w = _WEIGHTS_TOOK.search(msg)
            if w is not None:
                return [WeightsLoaded(seconds=_f(w.group("s")))]
        if "Model loading took" in msg:
            w = _MODEL_LOADING_TOOK.search(msg)
            if w is not None:
                return [WeightsLoaded(seconds=_f(w.group("s")), gib=_f(w.group("gib")))]
        if "Loading model weights took" in msg:
            w = _V0_WEIGHTS_TOOK.search(msg)
            if w is not None:
                return [WeightsLoaded(gib=_f(w.group("gib")))]
        if "init engine" in msg:
            i = _INIT_ENGINE.search(msg)
            if i is not None:
                return [EngineInitialized(_f(i.group("s")))]
    if "Graph capturing finished" in msg:
        g2 = _GRAPH_DONE.search(msg)
        gib = g2.group("gib") if g2 else None
        return [GraphsProgressed(finished=True, gib=_f(gib) if gib else None)]
    return None


def _server_and_shutdown(msg: str) -> list[Event] | None:
    """The load beginning, the server starting, the release, the arguments, and the shutdown."""
    if msg.startswith(("Starting to load model", "Loading model from scratch", "Filesystem type for checkpoints")):
        return [LoadStarted()]
    if "Starting vLLM" in msg or "Uvicorn running on" in msg:
        s2 = _SERVER_ON.search(msg)
        if s2 is not None:
            return [ServerStarting(s2.group("url"))]
    if msg.startswith("Application startup complete"):
        return [StartupCompleted()]
    if msg.startswith("Supported tasks: ") and (names := _TASK_NAMES.findall(msg)):
        return [TasksSupported(tuple(names))]
    if "version" in msg:
        v = _BANNER.search(msg) or (_LOGO_VERSION.search(msg) if "\u2588" in msg else None)
        if v is not None:
            return [VersionSeen(v.group("v"))]
    if msg.startswith("Initializing a V1 LLM engine"):
        v = _ENGINE_VERSION.search(msg)
        if v is not None:
            return [VersionSeen(v.group("v"))]
    if msg.startswith("non-default args:"):
        return [ArgsSeen(msg[len("non-default args:"):].strip())]
    if ("shutdown triggered" in msg or "trigger received signal" in msg or msg == "Shutting down"
            or msg.startswith("Shutting down FastAPI")):
        return [ShutdownStarted()]
    return None




def parse_line(text: str, prefix: str = "") -> list[Event]:
    """The events in one line as `LineFramer` gives it (tag, level and source still on it)."""
    return parse_message(message_of(text, prefix))


# The first letters of a failure message at the end of a pasted line (at least four): a terminal may have
# wrapped the line there.
_WRAPPED_LEAD = re.compile(
    "(?:" + "|".join(re.escape(lead[:k]) for lead in _LEADS for k in range(len(lead), 3, -1)) + ")$"
)
_MAX_JOIN = 5  # a 300-character record wrapped at 80 columns is 4 lines; more is not one message
# Words of a known failure's line that a wrap may have cut before what makes it recognisable.
_PASTE_HOLD = re.compile("|".join(re.escape(w) for w in (*known.NEEDLES, "ptxas", "NCCL WARN", "NVRM", "Repro command", "ibv_")))


# The driver's re-raise of a Ray worker's exception names the worker's machine; the exception's own line follows
# the worker's frames: `ray.exceptions.RayTaskError(ValueError): ray::RayWorkerWrapper.execute_method() (pid=N, ip=A, ...)`.
_RAY_TASK_ERROR = re.compile(r"RayTaskError\([\w.]*\): .*?\(pid=\d+, ip=(?P<ip>[0-9A-Fa-f.:]+)")


class EventScanner:
    """`parse_line` over a stream, joining a failure message that was split across lines.

    A long failure text can arrive in pieces: the message itself held a
    newline (vLLM then prints the rest as a new record with the same prefix),
    or a terminal or pager wrapped it before it was pasted. When a line stops
    inside one of those failure messages (its text so far is the beginning
    of the message, judged against the whole message, not its first words),
    the scanner holds that line's failure events back and tries it joined
    with the following lines (directly, and with a space), up to `_MAX_JOIN`
    lines. The first line that does not continue it ends the wait at once:
    the held failure is reported with what it had, then that line is read on
    its own. So a failure may be reported a line late, never twice; call
    `flush()` when the stream ends. Other events are never delayed.

    A Ray worker's exception re-raised in the driver starts with a
    `RayTaskError(...)` line naming the worker's machine; the failure its
    last line reports carries that machine as `node`.
    """

    def __init__(self, prefix: str = "", wrapped: bool = False) -> None:
        # `wrapped`: the text may have been wrapped at any character (pasted
        # logs), so a line ending in the first letters of a failure message is
        # held too. Pipes never wrap, so the supervisor leaves this off.
        self._prefix = prefix
        self._wrapped = wrapped
        self._held: list[str] = []
        self._generic: list[str] = []  # wrapped mode: an exception line whose cause may be on the next line
        self._task_node: str | None = None

    def feed(self, text: str) -> list[Event]:
        """The events this line completes."""
        return self.feed_message(message_of(text, self._prefix))

    def feed_message(self, msg: str) -> list[Event]:
        """`feed` for a line already classified: `Record.message` is the same text `message_of` gives."""
        if "RayTaskError(" in msg and (m := _RAY_TASK_ERROR.search(msg)) is not None:
            self._task_node = m.group("ip")
            return []
        events = self._scan(msg)
        if self._task_node is not None and any(isinstance(e, Failure) for e in events):
            node, self._task_node = self._task_node, None
            return [replace(e, node=node) if isinstance(e, Failure) and e.node is None else e for e in events]
        return events

    def _scan(self, msg: str) -> list[Event]:
        if self._generic:
            return self._continue_generic(msg)
        if self._held:
            pieces = self._held + [msg]
            state, joined = _best_join(pieces)
            if state == _COMPLETE:
                self._held = []
                return [e for e in parse_message(joined) if isinstance(e, Failure)] + _others(msg)
            if state == _PARTIAL and len(pieces) < _MAX_JOIN:
                self._held = pieces
                return _others(msg)
            # Not a continuation: report what was held, then read this line on its own.
            return self.flush() + self._scan(msg)
        events = parse_message(msg)
        if _fit(msg) == _PARTIAL or (self._wrapped and _WRAPPED_LEAD.search(msg[-60:]) is not None):
            self._held = [msg]
            return [e for e in events if not isinstance(e, Failure)]
        failures = [e for e in events if isinstance(e, Failure)]
        if self._wrapped and ((failures and all(isinstance(e, ExceptionRaised) for e in failures))
                              or (not failures and _PASTE_HOLD.search(msg) is not None)):
            # A pasted exception line may have been wrapped before the words that name its cause.
            self._generic = [msg]
            return [e for e in events if not isinstance(e, Failure)]
        return events

    def _continue_generic(self, msg: str) -> list[Event]:
        """A held exception line and the next one: a named cause if joined they show one, else both as they are."""
        pieces = self._generic + [msg]
        own = parse_message(msg)
        for joined in ("".join(pieces), " ".join(p.strip() for p in pieces)):
            found = parse_message(joined)
            if any(isinstance(e, Failure) and not isinstance(e, ExceptionRaised) for e in found):
                self._generic = []
                return [e for e in found if isinstance(e, Failure)] + [e for e in own if not isinstance(e, Failure)]
        if not own and len(pieces) < 3:
            self._generic = pieces
            return []
        return self.flush() + self._scan(msg)

    def flush(self) -> list[Event]:
        """The failure events of a message still waiting for its end, as far as it got."""
        if self._generic:
            first, self._generic = self._generic[0], []
            return parse_message(first)
        if not self._held:
            return []
        pieces, self._held = self._held, []
        _, joined = _best_join(pieces)
        return [e for e in parse_message(joined) if isinstance(e, Failure)]


def _others(msg: str) -> list[Event]:
    """The events of a continuation line that are not failures (a failure in a piece belongs to the joined message)."""
    return [e for e in parse_message(msg) if not isinstance(e, Failure)]


def _best_join(pieces: list[str]) -> tuple[int, str]:
    """The pieces joined the way that fits a failure message best, and how well.

    A terminal wrap keeps every character (`utiliza` + `tion`); a newline in
    the message replaced a space, and the next piece may be indented.
    """
    best = (_MISMATCH, pieces[0])
    for joined in ("".join(pieces), " ".join(p.strip() for p in pieces)):
        state = _fit(joined)
        if state > best[0]:
            best = (state, joined)
    return best
