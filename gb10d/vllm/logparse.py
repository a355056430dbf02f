"""Reading vLLM's output: framing bytes into lines, classifying lines, and parsing them into events.

Everything here is pure and synchronous, because the supervisor runs it for
every byte vLLM prints on both pipes (well over 100,000 lines a second must be
possible) and `diagnose` runs it over pasted logs. The formats are those of
vLLM 0.23 to 0.34 (both process-tag eras), uvicorn, tqdm and Python
tracebacks; where the reference and a real recording differ, the recording
wins.

Four pieces, used in this order:

- `LineFramer` turns raw pipe bytes into `Line`s (UTF-8 with replacement,
  `\\n` framing, `\\r` redraws as they happen, ANSI stripped, runaway lines
  capped).
- `Classifier.classify` (or the stateless `classify`) tells a line's process
  tag, level, source and kind, and the syslog priority it deserves in the
  journal; it remembers when it is inside a traceback.
- `BarCollapser` decides which progress-bar redraws are worth a journal line.
- `parse_line` / `EventScanner` turn lines into `events.Event`s;
  `EventScanner` also joins a failure message that was split over two lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum
from functools import lru_cache
from typing import Any, Callable, NamedTuple

from . import known
from ..base.levels import PRIORITY_DEBUG, PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from .events import (
    ArgsSeen,
    BadArgument,
    CompileProgressed,
    CudaOutOfMemory,
    DownloadProgressed,
    EngineDied,
    EngineInitialized,
    EngineStartFailed,
    Event,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    GraphsProgressed,
    InternalPortInUse,
    KvCacheInsufficient,
    KvCacheSized,
    LoadStarted,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    ProgramNotRun,
    RayWorkerLost,
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

# --- framing ----------------------------------------------------------------

MAX_LINE_BYTES = 64 * 1024
"""A line longer than this is cut: vLLM's longest real line (the engine config dump) is ~6 KiB."""

_ANSI_B = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
# Process names are words (`EngineCore_DP0`, `Worker_TP0`); 0.9-0.10 also wrote `VllmWorker rank=0`.
_NAME = r"[\w.\[\]=-]+(?: [\w.\[\]=-]+)?"
# Ray forwards an actor's lines behind its own tag, `(RayWorkerProc pid=N, ip=ADDR) ` (no `ip=` for the
# driver's node), after the EngineCore's tag and before vLLM's own one in the actor: a line can carry a
# chain, `(EngineCore pid=1) (RayWorkerProc pid=2, ip=10.0.0.2) (Worker pid=2) INFO ...`.
_ONE_TAG = r"\(" + _NAME + r" pid=\d+(?:, ip=[0-9A-Fa-f.:]+)?\) "
_TAGS_B = re.compile(rb"(?:" + _ONE_TAG.encode() + rb")+")


class Line(NamedTuple):
    """One logical line of output, clean text without its line ending.

    `redraw` is true for a `\\r` refresh (a tqdm bar state); `truncated` marks
    a line cut at `MAX_LINE_BYTES`, whose rest up to the next newline is dropped.
    """

    text: str
    redraw: bool = False
    truncated: bool = False


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _cut(raw: bytes, limit: int) -> bytes:
    """`raw` cut to at most `limit` bytes, not inside a UTF-8 sequence (so no stray replacement char)."""
    end = limit
    # Step back over continuation bytes (10xxxxxx) to the start of the cut character.
    while end > 0 and (raw[end] & 0xC0) == 0x80 and limit - end < 4:
        end -= 1
    return raw[:end]


class LineFramer:
    """Frames one pipe's bytes into `Line`s, the same whatever the read sizes are.

    `\\n` ends a line; one `\\r` before it is part of the ending (vLLM's
    multi-line records end their physical lines in `\\r\\n`). Any other `\\r`
    is a tqdm redraw: each redraw state is emitted as soon as the next `\\r`
    shows it is complete, so a bar that never prints `\\n` until it closes
    (CUDA graph capture) is still seen live. A 0.23-0.30 process tag written
    before the first `\\r` is kept on every redraw, so each line still says
    which process printed it. Blank redraw states (tqdm's padding spaces) are
    dropped.
    """

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self._max = max_line_bytes
        self._buf = b""
        # The current physical line already had redraw states emitted; its
        # next segment is a redraw too and carries this tag.
        self._continuing = False
        self._tag = b""
        self._discarding = False

    def feed(self, data: bytes) -> list[Line]:
        """Frame `data`; returns the lines it completed (possibly none)."""
        out: list[Line] = []
        if self._discarding:
            cut = data.find(b"\n")
            if cut < 0:
                return out
            data = data[cut + 1 :]
            self._discarding = False
        buf = self._buf + data if self._buf else data
        last_nl = buf.rfind(b"\n")
        if last_nl >= 0:
            self._buf = buf[last_nl + 1 :]
            physical = buf[:last_nl].split(b"\n")
            if self._continuing:
                self._continuing = False
                self._segments(physical[0], out, continuing=True)
                physical = physical[1:]
            for raw in physical:
                if b"\r" in raw or b"\x1b" in raw or len(raw) > self._max:
                    self._segments(raw, out, continuing=False)
                else:
                    out.append(Line(raw.decode("utf-8", "replace")))
        else:
            self._buf = buf
        if b"\r" in self._buf:
            self._soft(out)
        if len(self._buf) > self._max:
            self._emit(self._tag + self._buf if self._continuing else self._buf, self._continuing, out)
            self._buf = b""
            self._continuing = False
            self._discarding = True
        return out

    def flush(self) -> list[Line]:
        """The unterminated rest, as if a newline followed (call at end of stream)."""
        out: list[Line] = []
        rest, self._buf = self._buf, b""
        if rest or self._continuing:
            continuing, self._continuing = self._continuing, False
            self._segments(rest, out, continuing=continuing)
        self._discarding = False
        return out

    def _soft(self, out: list[Line]) -> None:
        """Emit the redraw states of the unterminated line that a later `\\r` has completed."""
        buf = self._buf
        last = buf.rfind(b"\r")
        if last == len(buf) - 1:
            # A trailing \r may be the first half of \r\n: not a boundary yet.
            last = buf.rfind(b"\r", 0, last)
        if last < 0:
            return
        done, self._buf = buf[:last], buf[last + 1 :]
        self._segments(done + b"\r", out, continuing=self._continuing, complete=False)
        self._continuing = True

    def _segments(self, raw: bytes, out: list[Line], continuing: bool, complete: bool = True) -> None:
        """Split one physical line (or its completed part) at `\\r` and emit each state."""
        if complete and raw.endswith(b"\r"):
            raw = raw[:-1]
        if b"\x1b" in raw:
            raw = _ANSI_B.sub(b"", raw)
        parts = raw.split(b"\r")
        if not complete:
            parts.pop()  # the empty piece after the final \r
        if continuing:
            for part in parts:
                if part.strip():
                    self._emit(self._tag + part, True, out)
            return
        first = parts[0]
        if complete and len(parts) == 1:
            self._emit(first, False, out)
            return
        tag = _TAGS_B.match(first)
        self._tag = tag.group(0) if tag else b""
        head = first[len(self._tag) :]
        if head.strip():
            self._emit(first, False, out)
        for part in parts[1:]:
            if part.strip():
                self._emit(self._tag + part, True, out)

    def _emit(self, raw: bytes, redraw: bool, out: list[Line]) -> None:
        if len(raw) > self._max:
            out.append(Line(_decode(_cut(raw, self._max)), redraw, True))
        else:
            out.append(Line(_decode(raw), redraw))


# --- classification -----------------------------------------------------------


class Kind(str, Enum):
    """What a line is, for forwarding and parsing."""

    VLLM = "vllm"  # a vLLM logger record (level, timestamp, source)
    UVICORN = "uvicorn"  # `INFO:     ...` from uvicorn
    BAR = "bar"  # a tqdm progress-bar state
    TRACEBACK = "traceback"  # a Python traceback line, or `Process EngineCore:`
    RAW = "raw"  # anything else (third-party text, warnings, blank lines)


_LEVEL_PRIORITY = {
    "CRITICAL": PRIORITY_ERR,
    "ERROR": PRIORITY_ERR,
    "WARNING": PRIORITY_WARNING,
    "INFO": PRIORITY_INFO,
    "DEBUG": PRIORITY_DEBUG,
    "TRACE": PRIORITY_DEBUG,
}


class Record(NamedTuple):
    """A classified line: who printed it, how loud it is, and its message without prefixes.

    `priority` is the syslog level for journald's `<N>` prefix. `ts` is vLLM's
    `MM-DD HH:MM:SS` (local time, no year) when the line is a vLLM record.
    A named tuple, not a dataclass: one is made for every line vLLM prints,
    and a tuple is made in half the time.
    """

    kind: Kind
    priority: int
    message: str
    tag: str | None = None
    pid: int | None = None
    level: str | None = None
    ts: str | None = None
    source: str | None = None
    lineno: int | None = None
    node: str | None = None  # the Ray node address of a remote worker's line (`ip=` in its tag)


_TAG_PARTS = re.compile(r"\((?P<t>" + _NAME + r") pid=(?P<p>\d+)(?:, ip=(?P<i>[0-9A-Fa-f.:]+))?\) ")


@lru_cache(maxsize=1024)
def _tag_facts(chain: str) -> tuple[str | None, int | None, str | None]:
    """The innermost process name and pid of a tag chain, and the Ray node address any of its tags names.

    Cached: a run has a handful of processes, so nearly every line repeats a chain seen before.
    """
    name: str | None = None
    pid: int | None = None
    node: str | None = None
    for t in _TAG_PARTS.finditer(chain):
        name, pid = t.group("t"), int(t.group("p"))
        node = node or t.group("i")
    return name, pid, node


@lru_cache(maxsize=8)
def _log_regex(prefix: str) -> re.Pattern[str]:
    """vLLM's record format for a given VLLM_LOGGING_PREFIX, both eras, plus the pre-0.23 bracketless source."""
    return re.compile(
        "^(?P<tags>(?:" + _ONE_TAG + ")*"
        + (f"(?:{re.escape(prefix)})?(?:" + _ONE_TAG + ")*" if prefix else "") + ")"
        r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<ts>\d\d-\d\d \d\d:\d\d:\d\d)(?:[.,]\d+)? "
        r"\[?(?P<src>[^\]\s:]+):(?P<ln>\d+)\] ?(?P<msg>.*)$",
        re.S,
    )


_UVICORN = re.compile(
    r"^(?P<tags>(?:" + _ONE_TAG + r")*)(?P<level>CRITICAL|ERROR|WARNING|INFO|DEBUG|TRACE):\s+(?P<msg>.*)$", re.S
)
_TAG_STR = re.compile(r"^(?:" + _ONE_TAG + ")+")
_SHARD_BAR = re.compile(
    r"(?P<desc>Loading safetensors checkpoint shards|Loading safetensors using [\w ]+?|Multi-thread loading shards"
    r"|Loading pt checkpoint shards|Loading np_cache checkpoint shards|Loading [\w ]*?shards)"
    r"(?P<eager> \(eager\))?:\s+(?P<pct>\d+)% Completed \| (?P<n>\d+)/(?P<total>\d+) \["
)
_TQDM_BAR = re.compile(
    r"^(?P<desc>.*?):?\s*(?P<pct>\d{1,3})%\|[^|]*\|\s*(?P<n>[\d.]+)\s?(?P<nu>[kMGTPEZY]?)(?:i?B)?"
    r"/(?P<total>[\d.]+)\s?(?P<tu>[kMGTPEZY]?)(?:i?B)?\s*\["
)
# A bar that does not know its total (hf_xet's `Downloading (incomplete total...): 2.23GB [00:31, 70.9MB/s]`).
_TQDM_OPEN_BAR = re.compile(
    r"^(?P<desc>[^\[\]]*?):\s+(?P<n>[\d.]+)\s?(?P<nu>[kMGTPEZY]?)(?:i?B|it)?\s+\[(?:(?P<h>\d+):)?(?P<m>\d\d):(?P<s>\d\d),"
)
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Fault|Warning))(?::\s?(?P<msg>.*))?$", re.S)
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
# Ray's own logger in the driver (`2026-12-03 15:16:30,441\tINFO worker.py:1691 -- Connected to Ray cluster.`).
_RAY_LOG = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\t(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
_GLOG = re.compile(r"^(?:\[rank\d+\]:)?\[(?P<sev>[IWEF])\d{4} \d\d:\d\d:\d\d")
_PROCESS_DUMP = re.compile(r"^Process [\w.\[\]-]+:$")
_CHAIN = ("The above exception was the direct cause", "During handling of the above exception")


def _bar_kind(text: str) -> bool:
    if "%|" in text:
        return _TQDM_BAR.search(text) is not None
    if "% Completed |" in text:
        return _SHARD_BAR.search(text) is not None
    if "/s]" in text or "s/it]" in text:
        return _TQDM_OPEN_BAR.match(text) is not None
    return False


class Classifier:
    """Classifies lines one after another, remembering per process whether a traceback is in progress.

    A traceback's frame lines (`  File ...`, source, carets) are only
    recognisable from context, so the state is kept per process tag (the
    0.23-0.30 stream wrapper tags tracebacks; in 0.31+ they are untagged and
    share one state). After the final `ExcType: message` line, further
    unprefixed lines stay errors until a blank line or a log record, because
    vLLM's exception messages continue over several lines (`Please verify the
    following requirements:`).
    """

    def __init__(self, prefix: str = "") -> None:
        self._log = _log_regex(prefix)
        # Per-process traceback state: "tb" inside frames, "exc" after the
        # exception line, "warn" after a Python warning line.
        self._state: dict[int | None, str] = {}

    def classify(self, text: str) -> Record:
        """The record for one line; updates the traceback state."""
        m = self._log.match(text) if " [" in text or "] " in text else None
        if m is not None:
            chain, level, ts, src, ln, msg = m.group("tags", "level", "ts", "src", "ln", "msg")
            name, record_pid, node = _tag_facts(chain) if chain else (None, None, None)
            if self._state:
                self._state.pop(record_pid, None)
                self._state.pop(None, None)
            return Record(Kind.VLLM, _LEVEL_PRIORITY[level], msg, name, record_pid, level, ts, src, int(ln), node)
        if ":" in text[:40]:
            u = _UVICORN.match(text)
            if u is not None:
                name, uvicorn_pid, _ = _tag_facts(u.group("tags"))
                if self._state:
                    self._state.pop(uvicorn_pid, None)
                    self._state.pop(None, None)
                level = u.group("level")
                return Record(Kind.UVICORN, _LEVEL_PRIORITY[level], u.group("msg"), name, uvicorn_pid, level)
        tag: str | None = None
        pid: int | None = None
        node = None
        message = text
        if text.startswith("("):
            t = _TAG_STR.match(text)
            if t is not None:
                tag, pid, node = _tag_facts(t.group(0))
                message = text[t.end():]
        if _bar_kind(message):
            return Record(Kind.BAR, PRIORITY_INFO, message, tag, pid, node=node)
        kind, priority = self._raw(message, pid)
        return Record(kind, priority, message, tag, pid, node=node)

    def _raw(self, message: str, key: int | None) -> tuple[Kind, int]:
        state = self._state.get(key)
        if message.startswith("Traceback (most recent call last)"):
            self._state[key] = "tb"
            return Kind.TRACEBACK, PRIORITY_ERR
        if not message.strip():
            # A blank line ends an exception message (chained tracebacks then say so in words).
            if state == "exc" or state == "warn":
                del self._state[key]
            return (Kind.TRACEBACK, PRIORITY_ERR) if state in ("tb", "exc") else (Kind.RAW, PRIORITY_INFO)
        if message.startswith(_CHAIN) or _PROCESS_DUMP.match(message):
            self._state[key] = "tb"
            return Kind.TRACEBACK, PRIORITY_ERR
        indented = message[0] in " \t"
        if state == "tb":
            if not indented:
                self._state[key] = "exc"
            return Kind.TRACEBACK, PRIORITY_ERR
        if state == "exc":
            return Kind.TRACEBACK, PRIORITY_ERR
        if state == "warn":
            if indented:
                return Kind.RAW, PRIORITY_WARNING
            del self._state[key]
        if message.startswith("  File \""):
            self._state[key] = "tb"
            return Kind.TRACEBACK, PRIORITY_ERR
        e = _EXC_LINE.match(message)
        if e is not None:
            if e.group("type").endswith("Warning"):
                return Kind.RAW, PRIORITY_WARNING
            self._state[key] = "exc"
            return Kind.TRACEBACK, PRIORITY_ERR
        if _PY_WARNING.match(message):
            self._state[key] = "warn"
            return Kind.RAW, PRIORITY_WARNING
        if message[:2] == "20" and (r := _RAY_LOG.match(message)) is not None:
            return Kind.RAW, _LEVEL_PRIORITY[r.group("level")]
        g = _GLOG.match(message)
        if g is not None:
            sev = g.group("sev")
            return Kind.RAW, PRIORITY_ERR if sev in "EF" else PRIORITY_WARNING if sev == "W" else PRIORITY_INFO
        return Kind.RAW, PRIORITY_INFO


def classify(text: str, prefix: str = "") -> Record:
    """Classify one line on its own (no traceback context; use `Classifier` for a stream)."""
    return Classifier(prefix).classify(text)


def message_of(text: str, prefix: str = "") -> str:
    """The message of a line without process tag, level, timestamp and source."""
    m = _log_regex(prefix).match(text) if "] " in text else None
    if m is not None:
        return m.group("msg")
    if text.startswith("("):
        t = _TAG_STR.match(text)
        if t is not None:
            text = text[t.end():]
    if ":" in text[:10]:
        u = _UVICORN.match(text)
        if u is not None:
            return u.group("msg")
    return text


# --- progress-bar collapsing ---------------------------------------------------


class BarCollapser:
    """Decides which progress-bar states reach the journal, so a bar costs a few lines, not thousands.

    - Shard bars (`Loading safetensors checkpoint shards`): a line each time
      the count n/N changes, so every shard step is visible and tqdm's
      repeated final state is not. A new 0/N pass (the MTP drafter loads the
      checkpoint again) is a change and is forwarded.
    - Every other tqdm bar (CUDA graph capture, Hugging Face downloads,
      `Fetching N files`): the first state, each new 10% decile, and the final
      state, once per bar (bars are told apart by process tag and description).
    - Blank lines (tqdm's closing newline, padding) are dropped: they carry nothing.
    - Every other line is forwarded.
    """

    _MAX_BARS = 512  # download bars are per file; forget the oldest beyond this

    def __init__(self) -> None:
        self._last: dict[tuple[str | None, str], tuple[int, int]] = {}

    def forward(self, text: str) -> bool:
        """Whether this line should be written to the journal."""
        if "%" not in text:
            if "/s]" in text or "s/it]" in text:
                return self._open_bar(text)
            if text.endswith(" "):
                return bool(text.strip()) and not _is_blank_tagged(text)
            return bool(text)
        tag = None
        body = text
        if text.startswith("("):
            t = _TAG_STR.match(text)
            if t is not None:
                tag, body = t.group(0), text[t.end():]
        if "% Completed |" in body:
            s = _SHARD_BAR.search(body)
            if s is not None:
                return self._changed((tag, s.group("desc")), (int(s.group("n")), int(s.group("total"))))
        if "%|" in body:
            b = _TQDM_BAR.match(body)
            if b is not None:
                return self._decile((tag, b.group("desc")), int(b.group("pct")), b)
        return True

    def _open_bar(self, text: str) -> bool:
        """A bar without a total: its first state, then one per 30 s of its own elapsed time."""
        tag, body = None, text
        if text.startswith("("):
            t = _TAG_STR.match(text)
            if t is not None:
                tag, body = t.group(0), text[t.end():]
        b = _TQDM_OPEN_BAR.match(body)
        if b is None:
            return True
        elapsed_s = int(b.group("h") or 0) * 3600 + int(b.group("m")) * 60 + int(b.group("s"))
        return self._changed((tag, b.group("desc")), (elapsed_s // 30, -1))

    def _remember(self, key: tuple[str | None, str], value: tuple[int, int]) -> None:
        self._last.pop(key, None)
        self._last[key] = value
        if len(self._last) > self._MAX_BARS:
            del self._last[next(iter(self._last))]

    def _changed(self, key: tuple[str | None, str], state: tuple[int, int]) -> bool:
        if self._last.get(key) == state:
            return False
        self._remember(key, state)
        return True

    def _decile(self, key: tuple[str | None, str], pct: int, m: re.Match[str]) -> bool:
        final = _scaled(m.group("n"), m.group("nu")) >= _scaled(m.group("total"), m.group("tu"))
        # States: decile 0..9 for running, 10 for done; forward when it rises, or when the bar restarts.
        state = 10 if final else min(pct // 10, 9)
        last = self._last.get(key)
        if last is not None and (state == last[0] or 0 < state < last[0]):
            return False
        self._remember(key, (state, 0))
        return True


def _is_blank_tagged(text: str) -> bool:
    if text.startswith("("):
        t = _TAG_STR.match(text)
        return t is not None and not text[t.end():].strip()
    return False


_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}


def _scaled(number: str, unit: str) -> float:
    try:
        return float(number) * _SCALE[unit]
    except ValueError:
        return 0.0


# --- events -----------------------------------------------------------------------

_PORT = re.compile(r"(?:\(['\"][^'\"]*['\"], (?P<p1>\d+)\)|:(?P<p2>\d{2,5})\b)")
_NOT_LOCAL = re.compile(r"(?:OSError: )?['\"]?(?P<model>[^\s'\"]+)['\"]? is not a local folder and is not a valid model identifier")
_REPO_NOT_FOUND = re.compile(r"Repository Not Found for url: https?://[^/\s]+/(?:api/models/)?(?P<model>[^/\s]+/[^/\s]+)")
_NO_CONFIG = re.compile(r"Can't load the configuration of '(?P<model>[^']+)'")
_GATED_URL = re.compile(r"gated repo for url https?://[^/\s]+/(?:api/models/)?(?P<model>[^/\s]+/[^/\s]+)")
_BAD_PARSER = re.compile(r"invalid (?P<kind>tool call|reasoning) parser: (?P<value>[^\s'\"]*)[^'\"]*")
# Later releases: `Tool parser 'x' not found.`, `Reasoning parser 'x' not found. ...`, and the TypeErrors
# `--enable-auto-tool-choice requires tool_parser:'x' which has not been registered`, `reasoning_parser_name='x' has not been registered`.
_PARSER_NOT_FOUND = re.compile(
    r"(?P<kind>Tool|Reasoning) parser '(?P<value>[^']*)' not found\.?|(?P<kind2>tool|reasoning)_parser(?:_name=|:)'(?P<value2>[^']*)'"
    r"(?: which)? has not been registered"
)
_ARGPARSE = re.compile(r"(?:^|\s)(?:vllm(?: serve)?|[\w.-]+): error: (?P<msg>.+)$")
_ARGPARSE_FLAG = re.compile(
    r"^argument (?P<flag>-[\w-]+)(?:/-[\w-]+)*: (?:invalid (?:choice|[\w ]+ value): '(?P<value>[^']*)')?"
    r"|^unrecognized arguments: (?P<words>.+)|^the following arguments are required: (?P<required>[^,\s]+)"
    r"|^ambiguous option: (?P<ambiguous>-[\w-]+)"
)
# Ports of vLLM's internal sockets: ZMQ (`zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:5555')`)
# and torch.distributed's store (`DistNetworkError: The server socket has failed to listen ... port: 29500, ... EADDRINUSE`).
_INTERNAL_SOCKET = re.compile(r"ZMQError|addr=|tcp://|ipc://|DistNetworkError|EADDRINUSE|server socket has failed|TCPStore|c10d")
_SOCKET_ADDRESS = re.compile(r"(?P<address>(?:tcp|ipc)://[^\s'\")]+)")
_INTERNAL_PORT = re.compile(r"(?:port: |:)(?P<port>\d{2,5})\b")
_HF_VALIDATION = re.compile(r"Repo id must (?:be in the form|use alphanumeric chars).*?: '(?P<model>[^']+)'")
_NO_CONFIG_FILE = re.compile(r"(?P<model>\S+) does not appear to have a file named (?:config\.json|params\.json)")
_MISSING_CONFIG = re.compile(r"No such file or directory: '(?P<model>[^']+)/(?:config|params|tokenizer_config)\.json'")
_HUB_UNREACHABLE = re.compile(
    r"We couldn't connect to '[^']+' to load (?:this file|the files)(?:.*?it looks like (?P<model>\S+) is not the path)?"
    r"|(?P<entry>LocalEntryNotFoundError|OfflineModeIsEnabled)"
)
_GRAPH_BAR = re.compile(r"Capturing CUDA graph[^:]*:\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)")
_GRAPH_DONE = re.compile(r"Graph capturing finished in [\d.]+ secs?(?:, took (?P<gib>-?[\d.]+) GiB)?")
_WEIGHTS_TOOK = re.compile(r"Loading weights took (?P<s>[\d.]+) seconds")
_MODEL_LOADING_TOOK = re.compile(r"Model loading took (?P<gib>[\d.]+) GiB(?: memory)? and (?P<s>[\d.]+) seconds")
_V0_WEIGHTS_TOOK = re.compile(r"Loading model weights took (?P<gib>[\d.]+) GB")
_V0_BLOCKS = re.compile(r"# (?:GPU|CUDA) blocks: (?P<n>\d+)")
_V0_KV_INSUFFICIENT = re.compile(
    r"The model's max seq len \((?P<len>\d+)\) is larger than the maximum number of tokens that can be stored in KV "
    r"cache \((?P<fit>\d+)\)"
)
_SECONDS = re.compile(r"(?:took|takes|time:) (?P<s>[\d.]+) ?s\b")
_KV_AVAILABLE = re.compile(r"Available KV cache memory: (?P<gib>-?[\d.]+) GiB")
_KV_SIZE = re.compile(r"KV cache size: (?P<tokens>[\d,]+) tokens")
_MAX_CONCURRENCY = re.compile(r"Maximum concurrency for [\d,]+ tokens per request: (?P<x>[\d.]+)x")
_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<s>[\d.]+) s")
_TASK_NAMES = re.compile(r"'([\w&]+)'")
_SERVER_ON = re.compile(r"(?:Starting vLLM (?:API )?server on|Uvicorn running on) (?P<url>[^\s)]+)")
_BANNER = re.compile(r"vLLM (?:API )?server version (?P<v>[^\s,]+)")
_LOGO_VERSION = re.compile(r"\bversion\s+(?P<v>\d+\.\d+[\w.+-]*)\s*$")
_ENGINE_VERSION = re.compile(r"Initializing a V1 LLM engine \(v(?P<v>[^)\s]+)\)")
# V0 engines (before 0.8) printed the same parts without the engine head.
_STATS_HEAD = re.compile(r"^(?:Engine (?P<engine>\d+): |(?P<n>\d+) Engines Aggregated: |(?=Avg prompt throughput))")
_SPEC = re.compile(
    r"SpecDecoding metrics: Mean acceptance length: (?P<mal>[\d.]+|nan|inf), Accepted throughput: (?P<acc_s>[\d.]+) tokens/s, "
    r"Drafted throughput: (?P<dr_s>[\d.]+) tokens/s, Accepted: (?P<acc>\d+) tokens, Drafted: (?P<dr>\d+) tokens, "
    r"Per-position acceptance rate: (?P<pos>[\d., ]*?), Avg Draft acceptance rate: (?P<rate>[\d.]+|nan)%"
)

_UNIT_GIB = {"B": 1 / 2**30, "bytes": 1 / 2**30, "KiB": 1 / 2**20, "KB": 1 / 2**20, "MiB": 1 / 1024, "MB": 1 / 1024,
             "GiB": 1.0, "GB": 1.0, "TiB": 1024.0, "TB": 1024.0}


def _f(value: str) -> float:
    return float(value)


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
    known_issues = known.match(msg)
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


_MODEL_WORDS = re.compile(
    "is not a local folder|Repository Not Found|load the configuration of|Repo id must|does not appear to have a file"
    "|No such file or directory: '.*json'|couldn't connect to|LocalEntryNotFound|OfflineModeIsEnabled"
)
# A container's init that could not start the image's program: docker's tini names it, podman's catatonit does not.
_INIT_EXEC = re.compile(r"(?:\[FATAL tini \(\d+\)\] exec (?P<program>\S+) failed|ERROR \(catatonit:\d+\): failed to exec pid1): (?P<reason>.+)")
_ARGUMENT_WORDS = re.compile("parser|: error: |--enable-auto-tool-choice|first positional argument|Config file must be of a yaml")


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
    "does not appear", "couldn't connect", "No such file", "not found", "registered", *known.NEEDLES,
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
    if _FAILURE_GATE.search(msg) is not None:
        return _failures(msg)
    return []


def _progress(msg: str) -> list[Event]:
    """The startup, steady-state and shutdown events of a message that passed the cheap gate."""
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
    return []




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
