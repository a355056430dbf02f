"""`gb10d diagnose`: what happened in a pasted vLLM log, and which gb10d.toml key to change.

Pure: `diagnose(text)` takes the whole log as people paste it (journalctl
output in its usual forms and as JSON, docker, docker compose and kubectl
logs, ANSI colours, `\\r` progress bars, both vLLM tag eras, pre-0.23
untagged lines, lines wrapped by a terminal, records run together where a
newline was lost) and returns a `Diagnosis`. Wrappers are removed by
families of patterns rather than per example, so logs in shapes not seen
before still read.

The verdict is about the latest start in the input: a new banner, a new
`non-default args` line, a new API-server pid, an argparse `usage:` line or
gb10d's own `started vLLM` line begins a new attempt once the current one has
shown anything beyond its banner.
"""

from __future__ import annotations

import calendar
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from . import advice
from ..base.command import Tunables
from ..base.config import Config
from ..base.errors import EXIT_CONFIG
from ..vllm.events import (
    ArgsSeen,
    BadArgument,
    CudaOutOfMemory,
    DriverOutOfMemory,
    EngineDied,
    EngineStartFailed,
    Event,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    GpuXid,
    HiddenInitFailure,
    InternalPortInUse,
    IpcRemoved,
    KvCacheInsufficient,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    PtxasArchUnsupported,
    RdmaRegistrationFailed,
    ServerStarting,
    ShutdownStarted,
    SpecDecodingLogged,
    StartupCompleted,
    StatsLogged,
    UnsupportedBuild,
    VersionSeen,
    WeightsLoaded,
)
from ..vllm.kernel import describe as kernel_describe
from ..vllm.kernel import xid_meaning
from ..vllm.known import ISSUES, by_name, issue_for
from ..base.levels import PRIORITY_ERR
from ..vllm.logparse import Classifier, EventScanner, Kind, LineFramer
from .phases import Phase, StartupState, advance
from .outcome import Cause, Failed
from .policy import GiveUp, History, Retry, next_attempt

# Every verdict and what it means, for `gb10d diagnose --help`; the GB10 platform's come from the known-issues table.
VERDICT_HELP: dict[str, str] = {
    "ready": "vLLM started and serves",
    "loading": "still starting, nothing failed yet",
    "shard_stall": "weight loading stopped making progress",
    "free_memory": "too little free memory for gpu_memory_utilization at start",
    "cuda_oom": "CUDA ran out of memory (loading, profiling, CUDA graphs or serving)",
    "kv_cache_insufficient": "the KV cache cannot hold one request of max_model_len, or there is no memory for it",
    "port_in_use": "the API port, or a port of vLLM's internal sockets, is taken",
    "model_not_found": "the model is not a local directory or a reachable (or permitted) Hugging Face repository",
    "bad_argument": "vLLM rejected a flag or its value",
    "engine_dead": "vLLM's engine process died",
    **{issue.name: issue.title for issue in ISSUES},
    "crash": "vLLM failed in another way (the error is named)",
    "unknown": "no vLLM startup in the input",
}
VERDICTS = tuple(VERDICT_HELP)
DEFAULT_PORT = 8000  # vLLM's, when the log does not say
VLLM_DEFAULT_UTILIZATION = 0.92


@dataclass(frozen=True)
class Diagnosis:
    """A verdict (one of `VERDICTS`), the numbers behind it, and what to change."""

    verdict: str
    facts: dict[str, Any]
    advice: str
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        """The `--json` object: exactly verdict, facts and advice."""
        return {"verdict": self.verdict, "facts": dict(self.facts), "advice": self.advice}

    def render(self) -> str:
        """The human report: verdict and summary, the facts, then the advice."""
        lines = [f"verdict: {self.verdict}"]
        if self.summary:
            lines.append(self.summary)
        if self.facts:
            lines.append("facts:")
            lines.extend(f"  {key}: {value}" for key, value in self.facts.items())
        lines.append(f"advice: {self.advice}")
        return "\n".join(lines) + "\n"


# --- reading pasted text -------------------------------------------------------------

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
class _Line:
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


def read_lines(text: str) -> list[_Line]:
    """Pasted text as clean logical lines with the time each wrapper gave it."""
    out: list[_Line] = []
    physicals = text.replace("\r\n", "\n").split("\n") if "\r\n" in text else text.split("\n")
    physicals = [_ANSI.sub("", p) if "\x1b" in p else p for p in physicals]
    physicals = [_ANSI_LEFTOVER.sub("", p) if "m" in p and "[" in p else p for p in physicals]
    for physical in _unwrap([p for p in physicals if not _FENCE.match(p)]):
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
                    out.append(_Line(record, when))
                    continue
                framer = LineFramer()
                for line in framer.feed(record.encode("utf-8", "replace") + b"\n"):
                    out.append(_Line(line.text, when))
    return out


# --- attempts -----------------------------------------------------------------------

_API_TAGS = ("APIServer", "MainProcess")
_START_WORDS = re.compile(r"^(?:vLLM (?:API )?server version|non-default args:|usage: vllm)|started vLLM as pid")
_ARGS_UTIL = re.compile(r"'gpu_memory_utilization': ([\d.]+)")
_ARGS_PORT = re.compile(r"'port': (\d+)")
_ARGS_MODEL = re.compile(r"'model(?:_tag)?': '([^']+)'")
_ARGS_MAX_LEN = re.compile(r"'max_model_len': (\d+)")
# A model's parameter count and quantization as its name gives them (`Qwen3.6-27B-FP8`, `Llama-3.1-8B-Instruct-AWQ`).
_NAME_PARAMS = re.compile(r"(?:^|[-_])(\d+(?:\.\d+)?)[Bb](?=$|[-_.])")
_NAME_BYTES = ((re.compile(r"(?i)fp4|mxfp4|awq|gptq|int4|w4a"), 0.5), (re.compile(r"(?i)fp8|int8|w8a"), 1.0))
# Free memory below this share of the total means something holds it, not the desktop and the OS.
_MUCH_HELD = 0.25
_GB10D_STALL = re.compile(r"no loading progress for (\d+) s")
# SIGKILL from outside, told by a shell, systemd or the kernel (on GB10 almost always the OOM killer).
_KILLED = re.compile(
    r"(?:^|: )Killed\s*$|\d+ Killed\s|^\[\d+\][+-]?\s+Killed\s|status=9/KILL|killed by the OOM killer"
    r"|Out of memory: Killed process"
)


@dataclass
class _Attempt:
    """What one start printed, in order."""

    events: list[tuple[int, Event]] = field(default_factory=list)
    first_line: int = 0
    api_pid: int | None = None
    substantive: bool = False
    args: str = ""
    gb10d_stall: bool = False
    killed: bool = False
    error_at: int | None = None  # the last traceback or ERROR line


def _times(lines: list[_Line], records: list[tuple[str | None, int | None, str | None]]) -> list[float | None]:
    """One time per line: the wrapper's when the paste has them, else vLLM's own record time."""
    if any(line.when is not None for line in lines):
        raw = [line.when for line in lines]
    else:
        raw = []
        for _, _, ts in records:
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


def logging_prefix(lines: list[_Line]) -> str:
    """The VLLM_LOGGING_PREFIX the log was written with: the text that most records carry before the level."""
    counts: dict[str, int] = {}
    for line in lines[:2000]:
        m = _PREFIXED_RECORD.match(line.text)
        if m is not None:
            counts[m.group("prefix")] = counts.get(m.group("prefix"), 0) + 1
    best = max(counts, key=counts.__getitem__, default="")
    return best if counts.get(best, 0) >= 3 else ""


def _split_attempts(lines: list[_Line]) -> tuple[list[_Attempt], list[float | None], list[Event]]:
    prefix = logging_prefix(lines)
    classifier = Classifier(prefix)
    scanner = EventScanner(prefix, wrapped=True)
    attempts = [_Attempt()]
    records: list[tuple[str | None, int | None, str | None]] = []
    every: list[Event] = []
    for index, line in enumerate(lines):
        record = classifier.classify(line.text)
        records.append((record.tag, record.pid, record.ts))
        current = attempts[-1]
        message = record.message
        # The ASCII-logo banner's first line (the logo is drawn with full blocks).
        starts = _START_WORDS.search(message) is not None or (record.kind is Kind.VLLM and "\u2588" in message)
        new_api = record.tag in _API_TAGS and record.pid is not None and current.api_pid not in (None, record.pid)
        if (starts or new_api) and current.substantive:
            current = _Attempt(first_line=index)
            attempts.append(current)
        if record.tag in _API_TAGS and record.pid is not None and current.api_pid is None:
            current.api_pid = record.pid
        if _GB10D_STALL.search(message):
            current.gb10d_stall = True
        if "ill" in message and _KILLED.search(message):
            current.killed = True
        if record.kind is Kind.TRACEBACK or (record.kind is Kind.VLLM and record.priority <= PRIORITY_ERR):
            current.error_at = index
        for event in scanner.feed_message(record.message):
            _add(current, index, event)
            every.append(event)
    for event in scanner.flush():
        _add(attempts[-1], len(lines) - 1, event)
        every.append(event)
    return attempts, _times(lines, records), every


def _add(attempt: _Attempt, index: int, event: Event) -> None:
    attempt.events.append((index, event))
    if isinstance(event, ArgsSeen):
        attempt.args = event.text
    elif not isinstance(event, VersionSeen):
        attempt.substantive = True


# --- the verdict --------------------------------------------------------------------


def _serious_xid(e: Failure) -> bool:
    return isinstance(e, GpuXid) and xid_meaning(e.xid).serious


# What decides the verdict when a start shows several failures, most telling first: the
# platform's own failures explain the vLLM errors they cause, a specific failure explains
# the wrappers printed after it, and vLLM 0.23's bare `Failed core proc(s): {}` counts only
# when nothing else was printed. The driver's out-of-memory line is logged by healthy starts
# on GB10 too (driveroom.py): it explains an engine's death, never an error vLLM named itself.
_RANKS: tuple[Callable[[Failure], bool], ...] = (
    _serious_xid,
    lambda e: isinstance(e, UnsupportedBuild),
    lambda e: isinstance(e, PtxasArchUnsupported),
    lambda e: isinstance(e, RdmaRegistrationFailed),
    lambda e: isinstance(e, IpcRemoved) and e.confirmed,
    lambda e: isinstance(e, FreeMemoryShort),
    lambda e: isinstance(e, (KvCacheInsufficient, NoKvCacheMemory)),
    lambda e: isinstance(e, CudaOutOfMemory),
    lambda e: isinstance(e, (PortInUse, InternalPortInUse)),
    lambda e: isinstance(e, (ModelNotFound, ModelGated)),
    lambda e: isinstance(e, BadArgument),
    lambda e: isinstance(e, DriverOutOfMemory),
    lambda e: isinstance(e, EngineDied),
    lambda e: isinstance(e, (IpcRemoved, GpuXid)),
    lambda e: isinstance(e, ExceptionRaised) or (isinstance(e, EngineStartFailed) and not isinstance(e, HiddenInitFailure)),
    lambda e: isinstance(e, HiddenInitFailure),
)
# Exceptions that mean someone stopped vLLM, not that it broke.
_STOP_EXCEPTIONS = ("KeyboardInterrupt", "SystemExit", "CancelledError")


def _generic(event: Failure) -> bool:
    """A failure that wraps or hints at another rather than naming a cause of its own."""
    return (isinstance(event, (ExceptionRaised, EngineStartFailed, EngineDied, DriverOutOfMemory))
            or (isinstance(event, IpcRemoved) and not event.confirmed) or (isinstance(event, GpuXid) and not _serious_xid(event)))


def _passing(event: Failure) -> bool:
    """A failure line a start can go on after (a caught exception's traceback, a warning): it ends nothing by itself."""
    return (isinstance(event, (ExceptionRaised, DriverOutOfMemory)) or (isinstance(event, IpcRemoved) and not event.confirmed)
            or (isinstance(event, GpuXid) and not _serious_xid(event)))


def _gib(value: float) -> str:
    return f"{value:g}"


def _sentence(text: str) -> str:
    """A journal-style advice text (lower case, no full stop) as a sentence of its own."""
    head = text[:1] if text.startswith("vLLM") else text[:1].upper()
    return head + text[1:] + ("" if text.endswith(".") else ".")


def _what_gb10d_does(cause: Cause, failure: Failure | None, utilization: float | None, model: str | None,
                     port: int | None) -> Retry | GiveUp:
    """What gb10d's supervisor decides after this failure on a first attempt: its defaults, plus what the log says.

    The one place diagnose's numbers and words come from for the causes the
    supervisor handles, so the advice is never what gb10d would not do.
    """
    vllm: dict[str, object] = {"executable": "/usr/bin/vllm", "model": model or "MODEL"}
    if port:
        vllm["port"] = port
    if utilization is not None and 0 < utilization <= 1:
        vllm["gpu_memory_utilization"] = utilization
    config = Config.model_validate({"vllm": vllm})
    used = Tunables(config.vllm.gpu_memory_utilization)
    return next_attempt(Failed(cause=cause, failure=failure), used, History(1), config)


def diagnose(text: str, stall_timeout_s: float = 300.0) -> Diagnosis:
    """The verdict about the latest start in `text`, its facts and the advice."""
    lines = read_lines(text)
    attempts, times, every = _split_attempts(lines)
    attempt = attempts[-1]
    facts: dict[str, Any] = {}
    version = next((e.version for e in reversed(every) if isinstance(e, VersionSeen)), None)
    if version:
        facts["vllm_version"] = version
    _stats_facts(every, facts)

    state = StartupState(phase=Phase.SPAWNING)
    progress_index: int | None = None
    for index, event in attempt.events:
        state = advance(state, event, float(index))
        if state.progressed:
            progress_index = index
    failure = _deciding_failure(attempt, progress_index)
    if failure is not None:
        weights = next((e.gib for e in reversed(every) if isinstance(e, WeightsLoaded) and e.gib), None)
        return _failure_verdict(failure, attempt, facts, weights)

    if attempt.killed:
        return _killed_verdict(attempt, facts)
    if any(isinstance(e, (StartupCompleted, ServerStarting)) for _, e in attempt.events):
        url = next((e.url for _, e in attempt.events if isinstance(e, ServerStarting)), None)
        where = f" on {url}" if url else ""
        return Diagnosis("ready", facts, "vLLM started and serves; nothing to change.", f"vLLM is serving{where}.")
    stopped = _stop_index(attempt)
    if (attempt.error_at is not None and (progress_index is None or attempt.error_at > progress_index)
            and (stopped is None or stopped < (progress_index or 0))):
        # A traceback or an error after the last progress ended the start, even if its last line is missing.
        return Diagnosis(
            "crash", facts,
            "The lines above the end of the log say what broke (the exception's own line is missing); if they name "
            "a flag or a value, change that in vllm.args of gb10d.toml (gb10d print-command shows the full command).",
            "vLLM failed after its last progress; the log ends inside the error.",
        )
    if not attempt.events:
        return Diagnosis(
            "unknown", facts,
            "Found no vLLM startup in the input; pass the whole log, e.g. journalctl -u gb10d -b --no-pager.",
            "No vLLM startup lines found.",
        )
    if state.shards_total:
        facts["shards_loaded"] = state.shards_done
        facts["shards_total"] = state.shards_total
    quiet_s = _quiet_seconds(times, progress_index, attempt.first_line)
    loading_phase = state.phase in (Phase.SPAWNING, Phase.DOWNLOADING, Phase.LOADING_WEIGHTS)
    stalled = attempt.gb10d_stall or (quiet_s is not None and quiet_s > stall_timeout_s)
    if stalled and loading_phase and not (state.shards_total and state.shards_done >= state.shards_total):
        where = f" at shard {state.shards_done}/{state.shards_total}" if state.shards_total else ""
        how_long = f" for {quiet_s:.0f} s" if quiet_s is not None else ""
        if state.eager:
            advice_text = ("Loading stalls even with the eager strategy: check the model's disk (dmesg, iostat) and "
                           'MemAvailable, or try vllm.args.safetensors_load_strategy = "prefetch" in gb10d.toml.')
        else:
            advice_text = ('Set vllm.args.safetensors_load_strategy = "eager" in gb10d.toml (reads each shard into memory '
                           "instead of mmap, which avoids this stall on GB10); gb10d's startup.load_strategy_ladder does "
                           "this on the next attempt.")
        return Diagnosis(
            "shard_stall", facts, advice_text,
            f"Weight loading made no progress{how_long}{where} (stall timeout {stall_timeout_s:g} s).",
        )
    where = f" ({state.shards_done}/{state.shards_total} shards)" if state.phase is Phase.LOADING_WEIGHTS and state.shards_total else ""
    return Diagnosis(
        "loading", facts,
        f"Nothing failed yet; vLLM is still starting. If it stays silent longer than startup.stall_timeout_s "
        f"({stall_timeout_s:g} s), set vllm.args.safetensors_load_strategy = \"eager\".",
        f"The latest start is in phase {state.phase.value}{where}"
        + (f", last progress {quiet_s:.0f} s before the log ends." if quiet_s is not None else "."),
    )


def _deciding_failure(attempt: _Attempt, progress_index: int | None) -> Failure | None:
    """The failure that ended the start, or None.

    What fails after a stop was asked for (the engine "exiting unexpectedly"
    on SIGTERM, KeyboardInterrupt tracebacks) is the stop, not a fault; a
    generic error the start went on after did not end it. A paste of errors
    alone (no startup lines) gets the verdict of the last failure that names
    a cause; otherwise the most telling failure of the start decides.
    """
    stop_at = _stop_index(attempt)
    failures = [
        (i, e) for i, e in attempt.events
        if isinstance(e, Failure) and (stop_at is None or i < stop_at)
        and not (isinstance(e, ExceptionRaised) and e.exc_type.split(".")[-1] in _STOP_EXCEPTIONS)
        and not (_passing(e) and progress_index is not None and progress_index >= i)
    ]
    if progress_index is None:
        specific = [e for _, e in failures if not _generic(e)]
        if specific:
            return specific[-1]
    for rank in _RANKS:
        found = [e for _, e in failures if rank(e)]
        if found:
            return _best(found)
    return None


def _stop_index(attempt: _Attempt) -> int | None:
    """Where someone asked vLLM to stop (a shutdown line, or a KeyboardInterrupt or SystemExit), if anywhere."""
    return next((i for i, e in attempt.events if isinstance(e, ShutdownStarted)
                 or (isinstance(e, ExceptionRaised) and e.exc_type.split(".")[-1] in _STOP_EXCEPTIONS)), None)


def _best(found: list[Failure]) -> Failure:
    """The most informative of several events of one kind (a joined message has the numbers)."""
    def score(event: Failure) -> int:
        return sum(value not in (None, "", False) for value in vars(event).values())
    return max(reversed(found), key=score)


def _quiet_seconds(times: list[float | None], progress_index: int | None, first_line: int) -> float | None:
    """Seconds from the last progress to the last line, when timestamps show it; None when they cannot."""
    last = next((t for t in reversed(times[first_line:]) if t is not None), None)
    if last is None or progress_index is None:
        return None
    # A progress line without its own time (a bar) happened no earlier than the
    # next timed line: take that, so a stall is only claimed on evidence.
    at = next((t for t in times[progress_index:] if t is not None), None)
    return None if at is None else max(last - at, 0.0)


def _stats_facts(events: list[Event], facts: dict[str, Any]) -> None:
    stats = next((e for e in reversed(events) if isinstance(e, StatsLogged)), None)
    if stats is not None:
        facts["generation_tokens_per_second"] = stats.generation_tokens_per_s
    spec = next((e for e in reversed(events) if isinstance(e, SpecDecodingLogged)), None)
    if spec is not None:
        facts["mean_acceptance_length"] = spec.mean_acceptance_length
        if spec.acceptance_rate_percent is not None:
            facts["acceptance_rate_percent"] = spec.acceptance_rate_percent


def _current_utilization(attempt: _Attempt) -> float | None:
    """The start's gpu_memory_utilization: from `non-default args`, else vLLM's default where it has a fixed one."""
    found = _ARGS_UTIL.search(attempt.args)
    if found:
        return float(found.group(1))
    version = next((e.version for _, e in attempt.events if isinstance(e, VersionSeen)), "")
    # Not listed means the default: 0.92 up to 0.33; 0.34 resolves its own (extensible KV cache).
    if attempt.args and version and not version.startswith("0.34"):
        return VLLM_DEFAULT_UTILIZATION
    return None


def _lowered(decision: Retry | GiveUp, otherwise: str) -> str:
    """Advice from gb10d's decision on a memory failure: the value it restarts with, or why it gives up."""
    if isinstance(decision, Retry):
        return _sentence(advice.utilization_that_fits(decision.tunables.gpu_memory_utilization))
    return _sentence(decision.message) if decision.exit_status != EXIT_CONFIG else otherwise


def _killed_verdict(attempt: _Attempt, facts: dict[str, Any]) -> Diagnosis:
    util = _current_utilization(attempt)
    lower = "Lower vllm.gpu_memory_utilization by 0.05."
    if util is not None:
        # gb10d answers running out of memory by lowering the utilization 0.05, never below its minimum.
        lower = _lowered(_what_gb10d_does(Cause.CUDA_OOM, CudaOutOfMemory(None), util, None, None), lower)
    return Diagnosis(
        "crash", facts,
        "vLLM was killed from outside, most likely by the kernel's OOM killer (on GB10 the GPU's memory is the "
        f"system's). {lower} A lower vllm.args.max_model_len and stopping other large processes help too.",
        "vLLM was killed (SIGKILL), most likely out of host memory.",
    )


def _failure_verdict(event: Failure, attempt: _Attempt, facts: dict[str, Any], weights_gib: float | None = None) -> Diagnosis:
    current_util = _current_utilization(attempt)
    args_model = _ARGS_MODEL.search(attempt.args)
    args_port = _ARGS_PORT.search(attempt.args)
    log_model = args_model.group(1) if args_model else None
    log_port = int(args_port.group(1)) if args_port else None
    issue = issue_for(event)
    if issue is not None:
        return _platform_verdict(issue.name, event, facts)
    if isinstance(event, FreeMemoryShort):
        return _free_memory_verdict(event, attempt, facts, weights_gib, log_model, log_port)
    if isinstance(event, KvCacheInsufficient):
        facts["max_model_len"] = event.max_model_len
        if event.needed_gib is not None and event.available_gib is not None:
            facts.update(needed_gib=event.needed_gib, available_gib=event.available_gib)
        if event.estimated_max_model_len is not None:
            facts["estimated_max_model_len"] = event.estimated_max_model_len
        decision = _what_gb10d_does(Cause.KV_CACHE, event, current_util, log_model, log_port)
        return Diagnosis(
            "kv_cache_insufficient", facts, _sentence(decision.message),
            f"The KV cache cannot hold one request of max_model_len {event.max_model_len}"
            + (f": it needs {_gib(event.needed_gib)} GiB, {_gib(event.available_gib)} GiB are available."
               if event.needed_gib is not None and event.available_gib is not None else "."),
        )
    if isinstance(event, NoKvCacheMemory):
        decision = _what_gb10d_does(Cause.NO_KV_MEMORY, event, current_util, log_model, log_port)
        return Diagnosis(
            "kv_cache_insufficient", facts, _sentence(decision.message),
            "No memory was left for the KV cache blocks after loading the weights.",
        )
    if isinstance(event, CudaOutOfMemory):
        if event.tried_gib is not None:
            facts["tried_to_allocate"] = event.tried_gib
        lower = "Lower vllm.gpu_memory_utilization by 0.05."
        if current_util is not None:
            lower = _lowered(_what_gb10d_does(Cause.CUDA_OOM, event, current_util, log_model, log_port), lower)
        where = " while loading the weights" if event.during_load else ""
        tried = f" allocating {_gib(event.tried_gib)} GiB" if event.tried_gib is not None else ""
        return Diagnosis(
            "cuda_oom", facts,
            f"{lower} A lower vllm.args.max_model_len helps too; on GB10 also check what else uses the shared memory.",
            f"CUDA ran out of memory{where}{tried}.",
        )
    if isinstance(event, InternalPortInUse):
        facts.update(socket="internal")
        if event.port is not None:
            facts["port"] = event.port
        if event.address:
            facts["address"] = event.address
        return Diagnosis(
            "port_in_use", facts, _sentence(advice.internal_port_in_use(event.port, event.address)),
            f"vLLM could not bind an internal socket ({event.address or event.port or 'address not shown'}); "
            "this is not the API port.",
        )
    if isinstance(event, PortInUse):
        port = event.port or log_port or DEFAULT_PORT
        facts["port"] = port
        decision = _what_gb10d_does(Cause.PORT_IN_USE, event, None, log_model, port)
        return Diagnosis("port_in_use", facts, _sentence(decision.message),
                         f"vLLM could not bind port {port}: another process has it.")
    if isinstance(event, (ModelNotFound, ModelGated)):
        model = event.model or log_model
        if model:
            facts["model"] = model
        if isinstance(event, ModelGated):
            decision = _what_gb10d_does(Cause.MODEL_GATED, event, None, model, log_port)
            return Diagnosis(
                "model_not_found", facts, _sentence(decision.message),
                f"Hugging Face refused access to the gated repository {model or ''}".rstrip() + ".",
            )
        if event.unreachable:
            facts["hub_unreachable"] = True
        decision = _what_gb10d_does(Cause.MODEL_NOT_FOUND, event, None, model, log_port)
        return Diagnosis("model_not_found", facts, _sentence(decision.message), f"vLLM cannot find the model {model!r}.")
    if isinstance(event, BadArgument):
        if event.flag:
            facts["flag"] = event.flag
        if event.value is not None:
            facts["value"] = event.value
        decision = _what_gb10d_does(Cause.BAD_ARGUMENT, event, None, log_model, log_port)
        return Diagnosis("bad_argument", facts, _sentence(decision.message), f"vLLM exited at once: {event.message}.")
    if isinstance(event, EngineDied):
        return Diagnosis(
            "engine_dead", facts,
            "The engine process died; the lines before its death name the cause. gb10d restarts it; if it keeps "
            "dying under load, lower vllm.gpu_memory_utilization or vllm.args.max_model_len.",
            "vLLM's engine core died" + (" after startup." if attempt.substantive else "."),
        )
    exc = event if isinstance(event, ExceptionRaised) else next(
        (e for _, e in reversed(attempt.events) if isinstance(e, ExceptionRaised) and e.exc_type.split(".")[-1] not in _STOP_EXCEPTIONS),
        None)
    cause = f"{exc.exc_type}: {exc.message}" if exc else "the engine core failed to start"
    return Diagnosis(
        "crash", facts,
        "The error says what broke; if it names a flag or a value, change that in vllm.args of gb10d.toml "
        "(gb10d print-command shows the full command), then restart gb10d.",
        f"vLLM crashed: {cause}.",
    )


def _free_memory_verdict(event: FreeMemoryShort, attempt: _Attempt, facts: dict[str, Any], weights_gib: float | None,
                         model: str | None, port: int | None) -> Diagnosis:
    """Too little free memory: what holds it first when much is held, then the value that fits and whether it holds the model."""
    facts.update(free_gib=event.free_gib, total_gib=event.total_gib, requested_utilization=event.requested_utilization,
                 requested_gib=event.requested_gib)
    decision = _what_gb10d_does(Cause.FREE_MEMORY, event, event.requested_utilization, model, port)
    held = event.total_gib - event.free_gib
    parts = [advice.what_holds_memory(held, event.total_gib)] if held > _MUCH_HELD * event.total_gib else []
    parts.append(_lowered(decision, ""))
    if isinstance(decision, Retry):
        fits = decision.tunables.gpu_memory_utilization
        facts["suggested_utilization"] = fits
        found = _ARGS_MAX_LEN.search(attempt.args)
        max_len = int(found.group(1)) if found else None
        weights_from = "as vLLM loaded them before"
        if weights_gib is None and model:
            weights_gib, weights_from = _weights_from_name(model), f"estimated from the name {model}"
        if weights_gib is not None:
            facts["weights_gib"] = round(weights_gib, 2)
            warning = advice.share_too_small(fits, fits * event.total_gib, weights_gib, weights_from, max_len)
            parts += [warning] if warning else []
    return Diagnosis(
        "free_memory", facts, " ".join(_sentence(p) for p in parts if p),
        f"vLLM refused to start: free memory {_gib(event.free_gib)} of {_gib(event.total_gib)} GiB is below "
        f"gpu_memory_utilization {event.requested_utilization:g} ({_gib(event.requested_gib)} GiB).",
    )


def _weights_from_name(model: str) -> float | None:
    """The weights' GiB from the parameters and quantization a model's name states; None when it states no size."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    found = _NAME_PARAMS.search(name)
    if found is None:
        return None
    per_param = next((size for pattern, size in _NAME_BYTES if pattern.search(name)), 2.0)
    return float(found.group(1)) * 1e9 * per_param / 2**30


def _platform_verdict(name: str, event: Failure, facts: dict[str, Any]) -> Diagnosis:
    """A GB10 platform failure of the known-issues table: its meaning, its facts, its fix."""
    issue = by_name(name)
    if isinstance(event, PtxasArchUnsupported):
        facts["arch"] = event.arch
    if isinstance(event, GpuXid):
        meaning = xid_meaning(event.xid)
        facts.update(xid=event.xid, xid_name=meaning.name, reboot_needed=meaning.reboot)
        if event.pci:
            facts["pci"] = event.pci
    facts["retry_helps"] = issue.retry_helps and not (isinstance(event, GpuXid) and xid_meaning(event.xid).reboot)
    summary = kernel_describe(event) if isinstance(event, (GpuXid, DriverOutOfMemory)) else issue.meaning
    if isinstance(event, IpcRemoved) and not event.confirmed:
        summary = f"a vLLM process waited a minute or more for shared memory: a process hangs, or {summary}"
    return Diagnosis(name, facts, _sentence(advice.platform(event)), _sentence(summary))
