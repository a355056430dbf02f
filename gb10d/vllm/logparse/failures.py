"""Failure messages that can arrive in pieces, recognised by what makes them one.

Each message is written out as literal pieces and value slots (`_Template`), so a message cut by a line
wrap, a pipe read or a paste still fits, and its values come out with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .. import failures as failure_kinds
from .. import known
from ..events import (
    BadArgument,
    CudaOutOfMemory,
    EngineDied,
    EngineStartFailed,
    Event,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    InternalPortInUse,
    KvCacheInsufficient,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    ProgramNotRun,
    RayWorkerLost,
)
from .classify import _EXC_LINE
from .patterns import (
    _ARGPARSE,
    _ARGPARSE_FLAG,
    _ARGUMENT_WORDS,
    _BAD_PARSER,
    _GATED_URL,
    _HF_VALIDATION,
    _HUB_UNREACHABLE,
    _INIT_EXEC,
    _INTERNAL_PORT,
    _INTERNAL_SOCKET,
    _MISSING_CONFIG,
    _MODEL_WORDS,
    _NO_CONFIG,
    _NO_CONFIG_FILE,
    _NOT_LOCAL,
    _PARSER_NOT_FOUND,
    _PORT,
    _REPO_NOT_FOUND,
    _SOCKET_ADDRESS,
    _UNIT_GIB,
    _V0_KV_INSUFFICIENT,
    _f,
)

# --- failure messages that can arrive in pieces ---------------------------------------
#
# A failure is recognised by what makes it one, not by its first words: each
# of these messages is written out as literal pieces and value slots, and a
# text is judged against the whole of it. Another message that starts the
# same way (vLLM 0.26 logs `Free memory on device (38.77/139.8 GiB) on
# startup. Desired GPU memory utilization is ...` on every healthy start) is
# not this failure and is never held back for a continuation.

_COMPLETE, _PARTIAL, _MISMATCH = 2, 1, 0
# Both of vLLM 0.34's hints for a KV cache sized from measured memory name it (`_more_kv_cache_memory_hint`).
_EXTENSIBLE = "extensible KV cache"
_CUT = "_cut"  # names the value a partial text ends in, which may be missing digits
_NUM = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True)
class _Slot:
    """A value in a failure message: its name and what it looks like."""

    name: str
    pattern: re.Pattern[str]


@dataclass(frozen=True)
class _Either:
    """Alternatives at one point of a message (each a sequence of parts; an empty one makes the point optional)."""

    options: tuple[tuple[object, ...], ...]


def _slot(name: str, pattern: str) -> _Slot:
    return _Slot(name, re.compile(pattern))


def _walk(parts: tuple[object, ...], text: str, pos: int, values: dict[str, str]) -> tuple[int, dict[str, str]]:
    """How `text[pos:]` fits `parts`: all of them (_COMPLETE), a beginning of them (_PARTIAL), or not (_MISMATCH)."""
    if not parts:
        return _COMPLETE, values
    head, rest = parts[0], parts[1:]
    if isinstance(head, str):
        chunk = text[pos : pos + len(head)]
        if chunk == head:
            return _walk(rest, text, pos + len(head), values)
        return (_PARTIAL, values) if pos + len(chunk) == len(text) and head.startswith(chunk) else (_MISMATCH, values)
    if isinstance(head, _Slot):
        m = head.pattern.match(text, pos)
        if m is None:
            return (_PARTIAL, values) if pos == len(text) else (_MISMATCH, values)
        values = {**values, head.name: m.group(0)}
        if m.end() == len(text) and rest:
            return _PARTIAL, {**values, _CUT: head.name}  # the value itself may go on in the next piece
        return _walk(rest, text, m.end(), values)
    assert isinstance(head, _Either)
    best: tuple[int, dict[str, str]] = (_MISMATCH, values)
    for option in head.options:
        found = _walk(option + rest, text, pos, values)
        if found[0] > best[0]:
            best = found
    return best


@dataclass(frozen=True)
class _Template:
    """A failure message that may be split or cut: its lead, its parts, and the event its values make.

    `build(values, complete)` returns the event, or None when the values
    found are too few to say anything (a cut message).
    """

    lead: str
    parts: tuple[object, ...]
    build: Callable[[dict[str, str], bool, str], Failure | None]

    def fit(self, text: str) -> tuple[int, dict[str, str]]:
        """How the text from the lead's last occurrence on fits the message (_MISMATCH without the lead)."""
        at = text.rfind(self.lead)
        if at < 0:
            return _MISMATCH, {}
        return _walk(self.parts, text, at + len(self.lead), {})


def _free_memory(v: dict[str, str], complete: bool, msg: str) -> Failure | None:
    if not complete:
        return None
    device = {"device": v["device"]} if v.get("device") else {}
    return FreeMemoryShort(_f(v["free"]), _f(v["total"]), _f(v["util"]), _f(v["requested"]), **device)


def _kv_insufficient(v: dict[str, str], complete: bool, msg: str) -> Failure | None:
    whole = {key: value for key, value in v.items() if key != v.get(_CUT)}
    if "len" not in whole:
        return None
    needed, available, estimate = (whole.get(key) for key in ("needed", "available", "estimate"))
    return KvCacheInsufficient(
        int(whole["len"]), _f(needed) if needed else None, _f(available) if available else None,
        int(estimate) if estimate else None, _EXTENSIBLE in msg,
    )


def _cuda_oom(v: dict[str, str], complete: bool, msg: str) -> Failure | None:
    tried = round(_f(v["n"]) * _UNIT_GIB[v["unit"].strip()], 4) if complete else None
    return CudaOutOfMemory(tried, "Failed to load model" in msg)


def _invalid_repo(v: dict[str, str], complete: bool, msg: str) -> Failure | None:
    return ModelNotFound(v["model"]) if complete else None


_QUOTE = _Either((("'",), ('"',)))
_TEMPLATES: tuple[_Template, ...] = (
    _Template(
        "Free memory on device",
        (_Either(((" ", _slot("device", r"[^\s(]+")), ())), " (", _slot("free", _NUM), "/", _slot("total", _NUM),
         " GiB) on startup is less than desired GPU memory utilization (", _slot("util", _NUM), ", ",
         _slot("requested", _NUM), " GiB)"),
        _free_memory,
    ),
    _Template(
        "To serve at least one request with the ",
        # "models's": the wording of some releases.
        (_Either((("model's",), ("models's",), ("model\u2019s",))), " max seq len (", _slot("len", r"\d+"), "), (",
         _slot("needed", _NUM), " GiB KV cache is needed, which is larger than the available KV cache memory (",
         _slot("available", _NUM), " GiB).",
         # vLLM's estimate, if it gave one, then its hint; the message is whole once either has begun.
         _Either(((" Based on the available memory, the estimated maximum model length is ", _slot("estimate", r"\d+"), "."),
                  (" ", _slot("tail", r"[^\sB]")), (" B", _slot("tail", r"[^a]")), (" Ba", _slot("tail", r"[^s]"))))),
        _kv_insufficient,
    ),
    _Template(
        "CUDA out of memory.",
        (" Tried to allocate ", _slot("n", _NUM), _Either(((" ",), ())), _slot("unit", r"[KMGT]i?B|B\b|bytes")),
        _cuda_oom,
    ),
    _Template(
        "Invalid repository ID or local directory specified: ",
        (_QUOTE, _slot("model", r"[^'\"]+"), _QUOTE),
        _invalid_repo,
    ),
)
_LEADS = tuple(t.lead for t in _TEMPLATES)


def _fit(text: str) -> int:
    """How far `text` is from ending a failure message: _PARTIAL when it stops inside one."""
    best = _MISMATCH
    for template in _TEMPLATES:
        if template.lead in text:
            best = max(best, template.fit(text)[0])
    return best


def _template_events(msg: str) -> list[Event]:
    out: list[Event] = []
    for template in _TEMPLATES:
        if template.lead in msg:
            state, values = template.fit(msg)
            if state != _MISMATCH:
                event = template.build(values, state == _COMPLETE, msg)
                if event is not None:
                    out.append(event)
    return out


def _port_in_use(msg: str) -> Failure | None:
    if "Retrying with a new port" in msg:  # vLLM retries that itself: not a failure
        return None
    if _INTERNAL_SOCKET.search(msg) is not None:
        a = _SOCKET_ADDRESS.search(msg)
        address = a.group("address") if a else ""
        port = _INTERNAL_PORT.search(address or msg)
        return InternalPortInUse(int(port.group("port")) if port else None, address)
    p = _PORT.search(msg)
    port_text = (p.group("p1") or p.group("p2")) if p else None
    return PortInUse(int(port_text) if port_text else None)


def _bad_argument(msg: str) -> BadArgument | None:
    """vLLM's refusal of a flag or its value, with the flag and the value when the text names them."""
    if "parser" in msg:
        m = _BAD_PARSER.search(msg)
        if m is not None:
            flag = "--tool-call-parser" if m.group("kind") == "tool call" else "--reasoning-parser"
            return BadArgument(m.group(0).strip().rstrip("'\""), flag, m.group("value"))
        n = _PARSER_NOT_FOUND.search(msg)
        if n is not None:
            kind = (n.group("kind") or n.group("kind2")).lower()
            flag = "--tool-call-parser" if kind == "tool" else "--reasoning-parser"
            return BadArgument(n.group(0), flag, n.group("value") if n.group("value") is not None else n.group("value2"))
    if "--enable-auto-tool-choice requires --tool-call-parser" in msg:
        return BadArgument("--enable-auto-tool-choice requires --tool-call-parser", "--tool-call-parser")
    if ": error: " in msg:
        m = _ARGPARSE.search(msg)
        if m is not None:
            text = m.group("msg").strip()
            f = _ARGPARSE_FLAG.search(text)
            if f is None:
                return BadArgument(text)
            if f.group("words"):
                # `unrecognized arguments: --flag value`, or a stray word such as a docker port mapping.
                words = f.group("words").split()
                at = next((i for i, w in enumerate(words) if w.startswith("-")), None)
                if at is None:
                    return BadArgument(text, None, " ".join(words))
                return BadArgument(text, words[at], " ".join(words[at + 1 :]) or None)
            return BadArgument(text, f.group("flag") or f.group("required") or f.group("ambiguous"), f.group("value"))
    if "should be provided as the first positional argument" in msg or "Config file must be of a yaml" in msg:
        return BadArgument(msg.split(": ", 1)[-1].strip())
    return None


def _model_not_found(msg: str) -> ModelNotFound | None:
    m = _NOT_LOCAL.search(msg) or _REPO_NOT_FOUND.search(msg) or _NO_CONFIG.search(msg) or _HF_VALIDATION.search(msg)
    if m is None:
        m = _NO_CONFIG_FILE.search(msg) or _MISSING_CONFIG.search(msg)
    if m is not None:
        return ModelNotFound(m.group("model").rstrip(".,;'\""))
    u = _HUB_UNREACHABLE.search(msg)
    if u is not None:
        return ModelNotFound(u.group("model") or "", unreachable=True)
    return None


def _failures(msg: str) -> list[Event]:
    """The failure events of one message; only called when a cheap keyword says one may be there."""
    out: list[Event] = _template_events(msg)
    if ("out of memory" in msg or "not enough GPU memory" in msg) and not any(isinstance(e, CudaOutOfMemory) for e in out):
        if "Failed to load model" in msg or "CUDA error: out of memory" in msg or "CUDA out of memory" in msg:
            out.append(CudaOutOfMemory(None, "Failed to load model" in msg))
    if "stored in KV cache" in msg:
        # The V0 engine's wording counts tokens, not GiB; what fits is the longest possible max_model_len.
        m = _V0_KV_INSUFFICIENT.search(msg)
        if m is not None:
            out.append(KvCacheInsufficient(int(m.group("len")), None, None, int(m.group("fit"))))
    if "No available memory for the cache blocks" in msg:
        out.append(NoKvCacheMemory(_EXTENSIBLE in msg))
    if "ddress already in use" in msg:
        port = _port_in_use(msg)
        if port is not None:
            out.append(port)
    model = _model_not_found(msg) if _MODEL_WORDS.search(msg) else None
    if model is not None:
        out.append(model)
    if "gated repo" in msg:
        m = _GATED_URL.search(msg)
        out.append(ModelGated(m.group("model") if m else None))
    if "exec" in msg:
        init = _INIT_EXEC.match(msg)
        if init is not None:
            out.append(ProgramNotRun(init.group("program"), init.group("reason").strip()))
    bad = _bad_argument(msg) if _ARGUMENT_WORDS.search(msg) else None
    if bad is not None:
        out.append(bad)
    # vLLM's Ray executors: V1 re-raises Ray's actor errors; V2 (0.23's default) has a monitor thread that says
    # `RayWorkerProc rank=[1] died unexpectedly, shutting down executor.`
    if ("ActorDiedError" in msg or "RayActorError" in msg or "ActorUnavailableError" in msg
            or ("RayWorkerProc rank=" in msg and "died unexpectedly" in msg)):
        out.append(RayWorkerLost(msg.strip()))
    elif "EngineDeadError" in msg or "engine core exited unexpectedly" in msg or "died unexpectedly" in msg:
        out.append(EngineDied(msg.strip()))
    known_issues = known.match(msg) + failure_kinds.match(msg)
    wrapper = any(isinstance(e, EngineStartFailed) for e in known_issues)
    if not wrapper and ("Engine core initialization failed" in msg or "EngineCore failed to start" in msg
                        or "WorkerProc failed to start" in msg or "WorkerProc initialization failed" in msg
                        or "failed during engine core initialization" in msg):
        out.append(EngineStartFailed())
    # A known issue's exception line is also an exception: the supervisor's crash detail names it.
    if not out and not wrapper:
        e = _EXC_LINE.match(msg)
        if e is not None and not e.group("type").endswith("Warning"):
            out.append(ExceptionRaised(e.group("type"), (e.group("msg") or "").strip()))
    return known_issues + out
