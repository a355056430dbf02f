"""The bytes vLLM's processes put on stdout and stderr, era by era.

Pure formatting (`format_record`, `format_uvicorn`, the tqdm meters) sits
next to `Console`, the one object that writes, so that the rules of
REFERENCE §1 live in one place: the stream-wrapper tag of 0.23-0.30 at the
start of every physical line, the in-format tag of 0.31+, `\\r\\n`
continuation of multi-line records, `VLLM_LOGGING_PREFIX` and colour.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

STDOUT = 1
STDERR = 2

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
_COLORS = {"DEBUG": "\x1b[37m", "INFO": "\x1b[32m", "WARNING": "\x1b[33m", "ERROR": "\x1b[31m", "CRITICAL": "\x1b[1;31m"}
_CYAN = "\x1b[36m"
_GREY = "\x1b[90m"
_RESET = "\x1b[0m"


@dataclass(frozen=True)
class LogStyle:
    """How vLLM's logging is configured in this process (REFERENCE §1)."""

    wrapper_tag: bool  # 0.23-0.30: decorate_logs() tags every physical line
    prefix: str = ""
    configured: bool = True  # VLLM_CONFIGURE_LOGGING
    threshold: int = LEVELS["INFO"]
    color: bool = False
    process_tag: bool = True  # False in a Ray worker: Ray puts its own `(RayWorkerWrapper pid=N)` in front


def tag(name: str, pid: int) -> str:
    """The process tag vLLM puts in front of its lines."""
    return f"({name} pid={pid}) "


def format_record(style: LogStyle, name: str, pid: int, level: str, when: float, src: str, message: str) -> str:
    """One vLLM log record as vLLM's formatter writes it, newline included.

    `src` is the path relative to the vllm package; vLLM shows only the file
    name unless the logging level is DEBUG. Every line of a multi-line
    message is repeated with the full prefix, joined by `\\r\\n`, as
    NewLineFormatter does.
    """
    fileinfo = src if style.threshold <= LEVELS["DEBUG"] else src.rsplit("/", 1)[-1]
    file, _, line = fileinfo.rpartition(":")
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(when))
    in_format_tag = tag(name, pid) if style.process_tag and not style.wrapper_tag else ""
    if style.color:
        if in_format_tag:
            in_format_tag = f"{_CYAN}{in_format_tag[:-1]}{_RESET} "
        head = f"{style.prefix}{in_format_tag}{_COLORS[level]}{level}{_RESET} {_GREY}{stamp} [{file}:{line}]{_RESET} "
    else:
        head = f"{style.prefix}{in_format_tag}{level} {stamp} [{file}:{line}] "
    return "\r\n".join(head + part for part in message.split("\n")) + "\n"


def format_uvicorn(level: str, message: str) -> str:
    """A uvicorn log line: `INFO:     message` (levelname + ':' padded to 9, then a space)."""
    return f"{level}:{' ' * (8 - len(level))} {message}\n"


class Console:
    """Writes one process's output to fds 1 and 2 the way vLLM's would appear.

    In the 0.23-0.30 era the tag is written at the start of every physical
    line of both streams (uvicorn, tracebacks and tqdm included), exactly as
    vLLM's patched `write` does: a write that ends mid-line leaves the next
    write untagged. Writes go straight to the file descriptors, unbuffered,
    so that a forked EngineCore never repeats its parent's buffered bytes.
    """

    def __init__(self, style: LogStyle, name: str, pid: int | None = None) -> None:
        self.style = style
        self.name = name
        self.pid = os.getpid() if pid is None else pid
        self._at_line_start = {STDOUT: True, STDERR: True}
        self._lock = threading.Lock()

    def write(self, fd: int, text: str) -> None:
        """Write `text` to fd 1 or 2, tagging line starts in the wrapper era."""
        if not text:
            return
        with self._lock:
            self._write_locked(fd, text)

    def _write_locked(self, fd: int, text: str) -> None:
        if self.style.wrapper_tag and self.style.configured and self.style.process_tag:
            prefix = tag(self.name, self.pid)
            if self.style.color:
                prefix = f"{_CYAN}{prefix[:-1]}{_RESET} "
            lines = text.split("\n")
            pieces = []
            for index, piece in enumerate(lines):
                starts_line = self._at_line_start[fd] if index == 0 else True
                if piece or index < len(lines) - 1:
                    pieces.append((prefix if starts_line else "") + piece)
                else:
                    pieces.append("")
            self._at_line_start[fd] = text.endswith("\n")
            text = "\n".join(pieces)
        try:
            os.write(fd, text.encode("utf-8", errors="replace"))
        except OSError:
            # The reader is gone (a killed supervisor); vLLM would die of the
            # write error only much later, so carry on silently.
            pass

    def log(self, level: str, src: str, message: str, name: str | None = None) -> None:
        """Emit a vLLM log record (stdout), honouring level and VLLM_CONFIGURE_LOGGING.

        Without vLLM's handler Python's last-resort handler still prints
        WARNING and above, as the bare message on stderr.
        """
        if not self.style.configured:
            if LEVELS[level] >= LEVELS["WARNING"]:
                self.write(STDERR, message + "\n")
            return
        if LEVELS[level] < self.style.threshold:
            return
        record = format_record(self.style, name or self.name, self.pid, level, time.time(), src, message)
        self.write(STDOUT, record)

    def uvicorn(self, message: str, level: str = "INFO", fd: int = STDERR) -> None:
        """Emit a uvicorn line (server messages on stderr, access log on stdout)."""
        self.write(fd, format_uvicorn(level, message))


class ConsoleStream(io.TextIOBase):
    """A `sys.stdout` / `sys.stderr` that writes through the Console, as vLLM's decorate_logs() patches them.

    Python-level writers in the EngineCore (Ray's own logger, and the
    worker lines Ray forwards to its driver) then reach the fd tagged like
    every other line of the 0.23-0.30 era. Text is passed on in whole lines,
    so that a `print()` (text, then a separate newline) from Ray's log thread
    cannot be split by a record from another thread. The lines that passed
    are kept, so the driver can wait until a worker's lines have arrived.
    """

    def __init__(self, console: Console, fd: int, keep: int = 10000) -> None:
        super().__init__()
        self.console = console
        self.fd = fd
        self._partial = ""
        self._seen: deque[str] = deque(maxlen=keep)
        self._changed = threading.Condition()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._changed:
            complete, newline, self._partial = (self._partial + text).rpartition("\n")
            if newline:
                self.console.write(self.fd, complete + newline)
                self._seen.extend(complete.split("\n"))
                self._changed.notify_all()
        return len(text)

    def flush(self) -> None:
        with self._changed:
            if self._partial:
                self.console.write(self.fd, self._partial)
                self._partial = ""

    def wait_line(self, predicate: Callable[[str], bool], timeout: float) -> bool:
        """Until a line that passed satisfies `predicate` (True), or `timeout` seconds (False)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(predicate(line) for line in self._seen):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True


# --- tqdm -------------------------------------------------------------------

# tqdm's Bar.UTF: a blank, then eighths from one to eight.
_BAR_CHARS = " " + "".join(chr(c) for c in range(0x258F, 0x2587, -1))


def format_interval(seconds: float) -> str:
    """tqdm.format_interval: MM:SS, or H:MM:SS from one hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours:d}:{minutes:02d}:{secs:02d}"
    return f"{minutes:02d}:{secs:02d}"


def _rate_parts(n: int, total: int, elapsed: float, rate: float | None) -> tuple[str, str]:
    """tqdm's `remaining` and `rate_fmt` fields (s/it below one iteration a second)."""
    if rate is None and elapsed and n:
        rate = n / elapsed
    if not rate:
        return "?", "?it/s"
    remaining = format_interval((total - n) / rate)
    inverse = 1 / rate
    rate_fmt = f"{inverse:5.2f}s/it" if inverse > 1 else f"{rate:5.2f}it/s"
    return remaining, rate_fmt


def format_shard_meter(desc: str, n: int, total: int, elapsed: float, rate: float | None) -> str:
    """vLLM's shard bar: `_BAR_FORMAT` of weight_utils.py, ending in a newline."""
    remaining, rate_fmt = _rate_parts(n, total, elapsed, rate)
    percentage = n / total * 100 if total else 0
    return (
        f"{desc}: {percentage:3.0f}% Completed | {n}/{total} "
        f"[{format_interval(elapsed)}<{remaining}, {rate_fmt}]\n"
    )


def _bar(frac: float) -> str:
    """The 10-column bar tqdm draws when the width is unknown (a pipe)."""
    nsyms = len(_BAR_CHARS) - 1
    full, part = divmod(int(frac * 10 * nsyms), nsyms)
    bar = _BAR_CHARS[-1] * full
    if full < 10:
        bar += _BAR_CHARS[part] + _BAR_CHARS[0] * (10 - full - 1)
    return bar


def format_default_meter(desc: str, n: int, total: int, elapsed: float, rate: float | None) -> str:
    """tqdm's default format with the 10-column bar it uses when the width is unknown (a pipe)."""
    remaining, rate_fmt = _rate_parts(n, total, elapsed, rate)
    frac = n / total if total else 0
    return f"{desc}: {frac * 100:3.0f}%|{_bar(frac)}| {n}/{total} [{format_interval(elapsed)}<{remaining}, {rate_fmt}]"


def format_sizeof(num: float) -> str:
    """tqdm.format_sizeof with divisor 1000: `1.53k`, `4.89G`, `79.5M`."""
    for unit in ("", "k", "M", "G", "T", "P", "E", "Z"):
        if abs(num) < 999.5:
            if abs(num) < 99.95:
                if abs(num) < 9.995:
                    return f"{num:1.2f}{unit}"
                return f"{num:2.1f}{unit}"
            return f"{num:3.0f}{unit}"
        num /= 1000
    return f"{num:3.1f}Y"


def format_bytes_meter(desc: str, n: int, total: int, elapsed: float, rate: float | None) -> str:
    """A huggingface_hub download bar: tqdm's default format with unit="B", unit_scale=True."""
    if rate is None and elapsed and n:
        rate = n / elapsed
    remaining = format_interval((total - n) / rate) if rate else "?"
    rate_fmt = f"{format_sizeof(rate)}B/s" if rate else "?B/s"
    frac = n / total if total else 0
    return (
        f"{desc}: {frac * 100:3.0f}%|{_bar(frac)}| {format_sizeof(n)}/{format_sizeof(total)} "
        f"[{format_interval(elapsed)}<{remaining}, {rate_fmt}]"
    )


class _Ema:
    """tqdm's exponential moving average (smoothing 0.3), bias-corrected."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.last = 0.0
        self.calls = 0

    def add(self, value: float) -> None:
        self.last = self.alpha * value + (1 - self.alpha) * self.last
        self.calls += 1

    def value(self) -> float:
        return self.last / (1 - (1 - self.alpha) ** self.calls) if self.calls else self.last


class Bar:
    """A tqdm progress bar on stderr, redrawn as tqdm 4.x redraws it.

    Each refresh writes `\\r` + meter + blanks over what is left of the
    previous meter; a refresh happens only when `mininterval` (0.1 s, wall
    clock) has passed since the last one, so fast loops skip counts; closing
    draws the final state once more and then a newline.
    """

    MININTERVAL_S = 0.1

    def __init__(
        self, console: Console, desc: str, total: int, shard_format: bool, meter: Callable[[str, int, int, float, float | None], str] | None = None
    ) -> None:
        self.console = console
        self.desc = desc
        self.total = total
        self.meter = meter or (format_shard_meter if shard_format else format_default_meter)
        self.n = 0
        self._start = time.monotonic()
        self._last_print_t = self._start
        self._last_print_n = 0
        self._last_len = 0
        self._dn = _Ema()
        self._dt = _Ema()
        self._draw()

    def _rate(self) -> float | None:
        dt = self._dt.value()
        return self._dn.value() / dt if dt else None

    def _draw(self) -> None:
        text = self.meter(self.desc, self.n, self.total, time.monotonic() - self._start, self._rate())
        self.console.write(STDERR, "\r" + text + " " * max(self._last_len - len(text), 0))
        self._last_len = len(text)

    def advance(self, by: int = 1) -> None:
        """`by` more items (or bytes) done; redraw if tqdm would."""
        self.n += by
        now = time.monotonic()
        dt = now - self._last_print_t
        if dt >= self.MININTERVAL_S:
            dn = self.n - self._last_print_n
            self._dn.add(dn)
            self._dt.add(dt)
            self._last_print_t, self._last_print_n = now, self.n
            self._draw()

    def close(self) -> None:
        """Draw the final state again and end the line, as `leave=True` does."""
        self._draw()
        self.console.write(STDERR, "\n")
