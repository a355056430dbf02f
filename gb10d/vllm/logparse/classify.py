"""Classifying a line: its process tag, level, source and kind, and the syslog priority it deserves in the journal.

`Classifier` remembers when it is inside a traceback (whose lines are errors whatever they look like);
`classify` is the stateless form for one line.
"""

from __future__ import annotations

import re
from enum import Enum
from functools import lru_cache
from typing import NamedTuple

from ...base.levels import PRIORITY_DEBUG, PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from .framing import _NAME, _ONE_TAG

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
