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
from typing import NamedTuple

from .levels import PRIORITY_DEBUG, PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
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
    KvCacheInsufficient,
    KvCacheSized,
    LoadStarted,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    RayWorkerLost,
    ServerStarting,
    ShardsProgressed,
    ShutdownStarted,
    SpecDecodingLogged,
    StartupCompleted,
    StatsLogged,
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


@dataclass(frozen=True, slots=True)
class Record:
    """A classified line: who printed it, how loud it is, and its message without prefixes.

    `priority` is the syslog level for journald's `<N>` prefix. `ts` is vLLM's
    `MM-DD HH:MM:SS` (local time, no year) when the line is a vLLM record.
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


def _tag_facts(chain: str) -> tuple[str | None, int | None, str | None]:
    """The innermost process name and pid of a tag chain, and the Ray node address any of its tags names."""
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
        node: str | None = None
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

_FREE_MEMORY = re.compile(
    r"Free memory on device(?: (?P<dev>[^\s(]+))? ?\((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup is less than "
    r"desired GPU memory utilization \((?P<util>[\d.]+), (?P<req>[\d.]+) GiB\)"
)
_CUDA_OOM = re.compile(r"CUDA out of memory\. Tried to allocate (?P<n>[\d.]+) ?(?P<u>[KMGT]i?B|B|bytes)")
_KV_INSUFFICIENT = re.compile(
    r"To serve at least one request with the model's max seq len \((?P<len>\d+)\), \((?P<need>[\d.]+) GiB KV cache "
    r"is needed, which is larger than the available KV cache memory \((?P<avail>[\d.]+) GiB\)\.?"
    r"(?: Based on the available memory, the estimated maximum model length is (?P<est>\d+))?"
)
_PORT = re.compile(r"(?:\(['\"][^'\"]*['\"], (?P<p1>\d+)\)|:(?P<p2>\d{2,5})\b)")
_NOT_LOCAL = re.compile(r"(?:OSError: )?['\"]?(?P<model>[^\s'\"]+)['\"]? is not a local folder and is not a valid model identifier")
_INVALID_REPO = re.compile(r"Invalid repository ID or local directory specified: ['\"](?P<model>[^'\"]+)['\"]")
_REPO_NOT_FOUND = re.compile(r"Repository Not Found for url: https?://[^/\s]+/(?:api/models/)?(?P<model>[^/\s]+/[^/\s]+)")
_NO_CONFIG = re.compile(r"Can't load the configuration of '(?P<model>[^']+)'")
_GATED_URL = re.compile(r"gated repo for url https?://[^/\s]+/(?:api/models/)?(?P<model>[^/\s]+/[^/\s]+)")
_BAD_PARSER = re.compile(r"invalid (?:tool call|reasoning) parser: [^'\"]*")
_ARGPARSE = re.compile(r"(?:^|\s)(?:vllm(?: serve)?|[\w.-]+): error: (?P<msg>.+)$")
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


def _failures(msg: str) -> list[Event]:
    """The failure events of one message; only called when a cheap keyword says one may be there."""
    out: list[Event] = []
    if "Free memory on device" in msg:
        m = _FREE_MEMORY.search(msg)
        if m is not None:
            kwargs = {"device": m.group("dev")} if m.group("dev") else {}
            out.append(FreeMemoryShort(_f(m.group("free")), _f(m.group("total")), _f(m.group("util")), _f(m.group("req")), **kwargs))
    if "out of memory" in msg or "not enough GPU memory" in msg:
        m = _CUDA_OOM.search(msg)
        during_load = "Failed to load model" in msg
        if m is not None:
            out.append(CudaOutOfMemory(round(_f(m.group("n")) * _UNIT_GIB[m.group("u")], 4), during_load))
        elif during_load or "CUDA out of memory" in msg or "CUDA error: out of memory" in msg:
            out.append(CudaOutOfMemory(None, during_load))
    if "To serve at least one request" in msg:
        m = _KV_INSUFFICIENT.search(msg)
        if m is not None:
            est = m.group("est")
            out.append(KvCacheInsufficient(int(m.group("len")), _f(m.group("need")), _f(m.group("avail")), int(est) if est else None))
    if "stored in KV cache" in msg:
        # The V0 engine's wording counts tokens, not GiB; what fits is the longest possible max_model_len.
        m = _V0_KV_INSUFFICIENT.search(msg)
        if m is not None:
            out.append(KvCacheInsufficient(int(m.group("len")), None, None, int(m.group("fit"))))
    if "No available memory for the cache blocks" in msg:
        out.append(NoKvCacheMemory())
    if "ddress already in use" in msg:
        p = _PORT.search(msg)
        port = (p.group("p1") or p.group("p2")) if p else None
        out.append(PortInUse(int(port) if port else None))
    if ("is not a local folder" in msg or "Invalid repository ID" in msg or "Repository Not Found" in msg
            or "load the configuration of" in msg):
        m = _NOT_LOCAL.search(msg) or _INVALID_REPO.search(msg) or _REPO_NOT_FOUND.search(msg) or _NO_CONFIG.search(msg)
        if m is not None:
            out.append(ModelNotFound(m.group("model")))
    if "gated repo" in msg:
        m = _GATED_URL.search(msg)
        out.append(ModelGated(m.group("model") if m else None))
    if "invalid tool call parser" in msg or "invalid reasoning parser" in msg:
        m = _BAD_PARSER.search(msg)
        out.append(BadArgument((m.group(0) if m else msg).strip().rstrip("'\"")))
    if "--enable-auto-tool-choice requires --tool-call-parser" in msg:
        out.append(BadArgument("--enable-auto-tool-choice requires --tool-call-parser"))
    if ": error: " in msg:
        m = _ARGPARSE.search(msg)
        if m is not None:
            out.append(BadArgument(m.group("msg").strip()))
    if "should be provided as the first positional argument" in msg or "Config file must be of a yaml" in msg:
        out.append(BadArgument(msg.split(": ", 1)[-1].strip()))
    # vLLM's Ray executors: V1 re-raises Ray's actor errors; V2 (0.23's default) has a monitor thread that says
    # `RayWorkerProc rank=[1] died unexpectedly, shutting down executor.`
    if ("ActorDiedError" in msg or "RayActorError" in msg or "ActorUnavailableError" in msg
            or ("RayWorkerProc rank=" in msg and "died unexpectedly" in msg)):
        out.append(RayWorkerLost(msg.strip()))
    elif "EngineDeadError" in msg or "engine core exited unexpectedly" in msg or "died unexpectedly" in msg:
        out.append(EngineDied(msg.strip()))
    if ("Engine core initialization failed" in msg or "EngineCore failed to start" in msg
            or "WorkerProc failed to start" in msg or "WorkerProc initialization failed" in msg
            or "failed during engine core initialization" in msg):
        out.append(EngineStartFailed())
    if not out:
        e = _EXC_LINE.match(msg)
        if e is not None and not e.group("type").endswith("Warning"):
            out.append(ExceptionRaised(e.group("type"), (e.group("msg") or "").strip()))
    return out


# Cheap gates: a message with none of these words holds no progress event, or no failure.
_PROGRESS_GATE = re.compile(
    "%|/s]|s/it]|Engine|SpecDecoding|compile|Dynamo|KV cache|Maximum concurrency|took|Graph capturing|Starting|Loading model"
    "|Filesystem type|blocks:|Uvicorn running|Application startup|version|Initializing a V1|non-default args|shutdown triggered|trigger received"
    "|Shutting down"
)
_FAILURE_GATE = re.compile(
    "Error|error|memory|Exception|failed|in use|not a local|Invalid repository|Not Found|gated|parser|configuration of"
    "|unexpectedly|Interrupt|Exit|positional|Fault|yaml"
)


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
    if "torch.compile took" in msg and "in total" in msg:
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
    if "blocks:" in msg and _V0_BLOCKS.search(msg) is not None:
        return [KvCacheSized()]
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


# Failure messages long enough to be wrapped or split over two lines: the
# words that start them, and the event that shows the message was whole.
_SPLITTABLE: tuple[tuple[str, type[Failure]], ...] = (
    ("Free memory on device", FreeMemoryShort),
    ("To serve at least one request", KvCacheInsufficient),
    ("CUDA out of memory", CudaOutOfMemory),
    ("is not a local folder", ModelNotFound),
    ("Invalid repository ID", ModelNotFound),
)
_KV_TAIL = ("Try increasing", "Decreasing", "See http")


# The first letters of a splittable failure message at the end of a line (at least four).
_WRAPPED_LEAD = re.compile(
    "(?:" + "|".join(re.escape(lead[:k]) for lead, _ in _SPLITTABLE for k in range(len(lead), 3, -1)) + ")$"
)
_MAX_JOIN = 5  # a 300-character record wrapped at 80 columns is 4 lines; more is not one message


# The driver's re-raise of a Ray worker's exception names the worker's machine; the exception's own line follows
# the worker's frames: `ray.exceptions.RayTaskError(ValueError): ray::RayWorkerWrapper.execute_method() (pid=N, ip=A, ...)`.
_RAY_TASK_ERROR = re.compile(r"RayTaskError\([\w.]*\): .*?\(pid=\d+, ip=(?P<ip>[0-9A-Fa-f.:]+)")


class EventScanner:
    """`parse_line` over a stream, joining a failure message that was split across lines.

    A long failure text can arrive in pieces: the message itself held a
    newline (vLLM then prints the rest as a new record with the same prefix),
    or a terminal or pager wrapped it before it was pasted. When a line starts
    a known failure message whose numbers are not all there, the scanner holds
    that line's failure events back and tries the message joined with the
    following lines (directly, and with a space), up to `_MAX_JOIN` lines. So
    a failure may be reported a few lines late, never twice; call `flush()`
    when the stream ends. Other events are never delayed.

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
        self._held_events: list[Event] = []
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
        events = parse_message(msg)
        failures: list[Event] = [e for e in events if isinstance(e, Failure)]
        others = [e for e in events if not isinstance(e, Failure)]
        if self._held:
            self._held.append(msg)
            joined = _join(self._held)
            if joined:
                self._held, self._held_events = [], []
                return joined + others
            self._held_events.extend(failures)
            if len(self._held) < _MAX_JOIN and not any(_complete(e, msg) for e in failures):
                return others
            return self.flush() + others
        if _incomplete(msg, events) or (self._wrapped and _WRAPPED_LEAD.search(msg[-40:]) is not None):
            self._held, self._held_events = [msg], failures
            return others
        return events

    def flush(self) -> list[Event]:
        """The failure events held back for a continuation that never came."""
        held, self._held, self._held_events = self._held_events, [], []
        return held


def _incomplete(msg: str, events: list[Event]) -> bool:
    for lead, wanted in _SPLITTABLE:
        if lead in msg:
            found = [e for e in events if isinstance(e, wanted)]
            if not found or not all(_complete(e, msg) for e in found):
                return True
    return False


def _join(pieces: list[str]) -> list[Event]:
    # A terminal wrap keeps every character ("utiliza" + "tion"); a newline in
    # the message replaced a space, and the next piece may be indented.
    for joined in ("".join(pieces), " ".join(p.strip() for p in pieces)):
        failures: list[Event] = [e for e in parse_message(joined) if isinstance(e, Failure)]
        if failures and any(_complete(e, joined) for e in failures):
            return failures
    return []


def _complete(event: Event, msg: str) -> bool:
    """A split failure is whole once its numbers are there (and vLLM's estimate, if it gave one)."""
    if isinstance(event, CudaOutOfMemory):
        return event.tried_gib is not None
    if isinstance(event, KvCacheInsufficient):
        return event.estimated_max_model_len is not None or any(t in msg for t in _KV_TAIL)
    return isinstance(event, (FreeMemoryShort, ModelNotFound))
