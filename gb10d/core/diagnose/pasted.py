"""Pasted text as clean log lines: wrappers, wrapping and glued records removed, each line with its time.

People paste vLLM's log as journalctl prints it (in its usual forms and as
JSON), as docker, docker compose and kubectl print it, with ANSI colours,
`\\r` progress bars, lines a terminal wrapped and records run together
where a newline was lost. Wrappers are removed by families of patterns
rather than per example, so logs in shapes not seen before still read.
Apart from the verdicts because it knows the paste's shapes, not vLLM's
failures: `gb10d diagnose` reads its input here, then judges the lines.
"""

from __future__ import annotations

import calendar
import json
import re
from dataclasses import dataclass
from datetime import datetime

from ...vllm.logparse import MAX_LINE_BYTES, LineFramer

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_MONTHS = {name: number for number, name in enumerate(calendar.month_abbr) if name}
_JOURNAL_SHORT = re.compile(
    r"^(?P<mon>[A-Z][a-z]{2}) (?P<day>[ \d]?\d) (?P<time>\d\d:\d\d:\d\d(?:\.\d+)?) (?P<host>\S+) "
    r"(?P<ident>[^\s\[\]:]+)(?:\[(?P<pid>\d+)\])?: ?"
)
_JOURNAL_ISO = re.compile(
    # journald gives microseconds at most; docker's nanosecond stamps (`...123456789Z`) are not a journal line.
    r"^(?P<iso>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d{1,6})?(?:Z|[+-]\d\d:?\d\d)?) (?P<host>\S+) "
    r"(?P<ident>[^\s\[\]:]+)(?:\[(?P<pid>\d+)\])?: ?"
)
_JOURNAL_FULL = re.compile(  # -o short-full
    r"^[A-Z][a-z]{2} (?P<date>\d{4}-\d\d-\d\d) (?P<time>\d\d:\d\d:\d\d(?:\.\d+)?) [A-Z]{2,5} (?P<host>\S+) "
    r"(?P<ident>[^\s\[\]:]+)(?:\[(?P<pid>\d+)\])?: ?"
)
_JOURNAL_UNIX = re.compile(r"^(?P<unix>\d{9,11}\.\d+) (?P<host>\S+) (?P<ident>[^\s\[\]:]+)(?:\[(?P<pid>\d+)\])?: ?")
_JOURNAL_MONOTONIC = re.compile(r"^\[\s*(?P<mono>\d+\.\d+)\] (?P<host>[^\s:]+) (?P<ident>[^\s\[\]:]+)(?:\[(?P<pid>\d+)\])?: ?")
_DOCKER_TS = re.compile(r"^(?P<iso>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)) ")
_COMPOSE = re.compile(r"^[\w][\w.-]*\s*\| ?")
_KUBECTL = re.compile(r"^\[pod/[^\]\s]+\] ")
_SYSLOG_LEVEL = re.compile(r"^<[0-7]>")
# torch.distributed's per-rank prefix, a Markdown quote, and a launcher's own `[name] ` or `name | ` in front.
_OTHER_PREFIX = re.compile(r"^(?:\[rank\d+\]:\s?|>\s?|\[[\w.-]{1,30}\]\s(?=\S))")
# Colour codes whose escape character a paste lost (`[1;36m(EngineCore pid=1)[0;0m ERROR ...`).
_ANSI_LEFTOVER = re.compile(r"\[\d{1,3}(?:;\d{1,3})*m")
_FENCE = re.compile(r"^\s*(?:```|~~~)[\w-]*\s*$")
_JOURNAL_NOTE = re.compile(r"^-- .* --$")
# Where a newline was lost: a journal prefix, a process tag or a vLLM record start in mid-line.
_GLUED_JOURNAL = re.compile(
    r"(?<=\S)(?=(?:[A-Z][a-z]{2} [ \d]?\d \d\d:\d\d:\d\d(?:\.\d+)?|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S*) \S+ [^\s\[\]:]+\[\d+\]: )"
)
_GLUED_RECORD = re.compile(
    r"(?<=\S)(?=\((?:APIServer|EngineCore|MainProcess|Worker|VllmWorker|DPCoordinator)[\w.\[\]= -]* pid=\d+\) )"
    r"|(?<=[^\s)])(?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[)"
    r"|(?<=[^\s)])(?=(?:INFO|WARNING|ERROR):\s{2,})"
)
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_VLLM_TS = re.compile(r"^(?P<mon>\d\d)-(?P<day>\d\d) (?P<h>\d\d):(?P<m>\d\d):(?P<s>\d\d)$")
_ASSUMED_YEAR = 2024  # year-less timestamps: a leap year, so 02-29 exists


def _yearless(month: int, day: int, clock: str) -> float | None:
    try:
        h, m, s = clock.split(":")
        moment = datetime(_ASSUMED_YEAR, month, day, int(h), int(m), int(float(s)))
    except ValueError:
        return None
    return calendar.timegm(moment.timetuple()) + (float(s) % 1)


def _iso(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.replace(",", ".").replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _strip_wrappers(line: str) -> tuple[str, float | None]:
    """The line without journal/docker/compose/kubectl prefixes, and the wrapper's timestamp if any."""
    when: float | None = None
    for _ in range(6):
        m = _SYSLOG_LEVEL.match(line) or _KUBECTL.match(line)
        if m is None:
            m = _JOURNAL_SHORT.match(line)
            if m is not None:
                when = _yearless(_MONTHS.get(m.group("mon"), 0) or 1, int(m.group("day")), m.group("time"))
        if m is None:
            m = _JOURNAL_ISO.match(line) or _DOCKER_TS.match(line)
            if m is not None:
                when = _iso(m.group("iso"))
        if m is None:
            m = _JOURNAL_FULL.match(line)
            if m is not None:
                when = _iso(f"{m.group('date')}T{m.group('time')}")
        if m is None:
            m = _JOURNAL_UNIX.match(line) or _JOURNAL_MONOTONIC.match(line)
            if m is not None:
                when = float(m.group("unix") if "unix" in m.re.groupindex else m.group("mono"))
        if m is None:
            m = _COMPOSE.match(line) or _OTHER_PREFIX.match(line)
        if m is None or m.end() == 0:
            break
        line = line[m.end():]
    return line, when


@dataclass(frozen=True)
class Line:
    """One logical line of the paste, as vLLM wrote it."""

    text: str
    when: float | None  # the wrapper's time, seconds (year-less times in an assumed year)


_LINE_START = re.compile(
    r"(?:\([\w.\[\]= -]+ pid=\d+\) |<[0-7]>|[A-Z][a-z]{2} [ \d]?\d \d\d:|\d{4}-\d\d-\d\dT\d\d:"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)(?: \d\d-\d\d |:\s))"
)


def _unwrap(lines: list[str]) -> list[str]:
    """Undo a terminal's wrapping: when many lines are exactly as long as the longest, they were cut there.

    A wrapped paste has every long line cut at the terminal width, so that
    width is both the maximum length and a frequent one; a real log almost
    never has several lines of exactly its maximum length.
    """
    lengths = [len(line) for line in lines]
    width = max(lengths, default=0)
    if width < 40 or lengths.count(width) < 3:
        return lines
    out: list[str] = []
    joining = False
    for line, length in zip(lines, lengths):
        # A line that starts like a record of its own was not cut off the previous one.
        if joining and not _LINE_START.match(line):
            out[-1] += line
        else:
            out.append(line)
        joining = length == width
    return out


def _journal_json(line: str) -> tuple[str, float | None] | None:
    """MESSAGE and time of a `journalctl -o json` line, or None if it is not one."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict) or "MESSAGE" not in entry:
        return None
    message = entry["MESSAGE"]
    if isinstance(message, list):  # journald gives non-UTF-8 or control-character messages as byte arrays
        message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode("utf-8", "replace")
    try:
        when = int(entry["__REALTIME_TIMESTAMP"]) / 1e6
    except (KeyError, TypeError, ValueError):
        when = None
    return str(message), when


def read_lines(text: str) -> list[Line]:
    """Pasted text as clean logical lines with the time each wrapper gave it."""
    out: list[Line] = []
    physicals = text.replace("\r\n", "\n").split("\n") if "\r\n" in text else text.split("\n")
    # A runaway line is cut where the daemon's framer cuts it: every pattern below would otherwise scan it whole,
    # and glued-record splitting would turn 10 MB of junk into hundreds of thousands of lines (seconds, not ms).
    physicals = [p[:MAX_LINE_BYTES] for p in physicals]
    physicals = [_ANSI.sub("", p) if "\x1b" in p else p for p in physicals]
    physicals = [_ANSI_LEFTOVER.sub("", p) if "m" in p and "[" in p else p for p in physicals]
    for physical in _unwrap([p for p in physicals if not _FENCE.match(p)]):
        physical = physical[:MAX_LINE_BYTES]  # again: joining a terminal's wrapping may have made one long again
        if _JOURNAL_NOTE.match(physical.strip()):
            continue
        entry = _journal_json(physical) if physical.startswith("{") and '"MESSAGE"' in physical else None
        # Cheap counts first: two journal prefixes, or two level words or tags, before any split.
        pieces = [physical] if entry is not None or physical.count("]: ") <= 1 else _GLUED_JOURNAL.split(physical)
        for piece in pieces:
            body, when = entry if entry is not None else _strip_wrappers(piece)
            glued = body.count(" pid=") > 1 or sum(body.count(level) for level in _LEVELS) > 1
            for record in _GLUED_RECORD.split(body) if glued else (body,):
                if "\r" not in record:
                    out.append(Line(record, when))
                    continue
                framer = LineFramer()
                for line in framer.feed(record.encode("utf-8", "replace") + b"\n"):
                    out.append(Line(line.text, when))
    return out


def line_times(lines: list[Line], stamps: list[str | None]) -> list[float | None]:
    """One time per line: the wrapper's when the paste has them, else vLLM's own record time (`stamps`, one a line)."""
    if any(line.when is not None for line in lines):
        raw = [line.when for line in lines]
    else:
        raw = []
        for ts in stamps:
            m = _VLLM_TS.match(ts) if ts else None
            raw.append(_yearless(int(m.group("mon")), int(m.group("day")), f"{m.group('h')}:{m.group('m')}:{m.group('s')}")
                       if m else None)
    # Year-less times wrap at New Year: keep them increasing.
    out: list[float | None] = []
    offset = 0.0
    last: float | None = None
    for value in raw:
        if value is not None:
            value += offset
            if last is not None and value < last - 180 * 86400:
                offset += 366 * 86400
                value += 366 * 86400
            last = value
        out.append(value)
    return out


_PREFIXED_RECORD = re.compile(
    r"^(?:\([\w.\[\]= -]+ pid=\d+\) )?(?P<prefix>[^(\s][^\n]{0,38}?)(?:\([\w.\[\]= -]+ pid=\d+\) )?"
    r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d "
)


def logging_prefix(lines: list[Line]) -> str:
    """The VLLM_LOGGING_PREFIX the log was written with: the text that most records carry before the level."""
    counts: dict[str, int] = {}
    for line in lines[:2000]:
        m = _PREFIXED_RECORD.match(line.text)
        if m is not None:
            counts[m.group("prefix")] = counts.get(m.group("prefix"), 0) + 1
    best = max(counts, key=counts.__getitem__, default="")
    return best if counts.get(best, 0) >= 3 else ""
