"""gb10d as real processes, for the tests, the benchmarks and `gb10d demo`: the plumbing they share.

gb10d is only ever exercised as the real program: `python -m gb10d run` as a
child in a session of its own (as systemd starts it), gb10d.sim as its
vLLM, a real AF_UNIX datagram socket as systemd's NOTIFY_SOCKET and a
meminfo file in place of /proc/meminfo. This module holds those parts once,
so that tests/harness.py, bench/lab.py and the demo watch gb10d the same way.

Each datagram and each line of gb10d's output is stamped with
`time.monotonic()` the moment it arrives, so both ends of a latency are read
on one clock (CLOCK_MONOTONIC is system-wide on Linux: a child can report
times on it too). Waits wake on each arrival (a condition variable, no
polling) and look from a given index on, so a caller can wait for "the next
such line after those I have seen". A wait that runs out returns None and
leaves the verdict to its caller: a test fails with the journal's tail, a
benchmark reports a missing measurement, the demo says what happened.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Generic, NamedTuple, Self, TypeVar

from ..machine.procs import processes, stat_fields

DEADLINE_S = 60.0
GIB_KB = 1024 * 1024
# vLLM's physical RAM on a GB10 as `cudaMemGetInfo` reports it (REFERENCE §3.1 / §8).
GB10_TOTAL_GIB = 121.69
# What systemd hands the process it starts. A test or benchmark run from a unit (or a shell inside one)
# must not pass its own to the gb10d it starts: that gb10d would notify, and log to, the wrong unit.
SYSTEMD_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM")

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def meminfo_text(total_gib: float, free_gib: float, available_gib: float | None = None, cached_gib: float = 2.0) -> str:
    """A /proc/meminfo-format text with the fields gb10d and the stand-in read.

    MemAvailable defaults to MemFree plus the page cache: on a GB10 the cache
    is what separates the two, and it is exactly what CUDA counts as used.
    """

    def kb(gib: float) -> int:
        return int(gib * GIB_KB)

    available = free_gib + cached_gib if available_gib is None else available_gib
    return (
        f"MemTotal:       {kb(total_gib)} kB\n"
        f"MemFree:        {kb(free_gib)} kB\n"
        f"MemAvailable:   {kb(available)} kB\n"
        f"Buffers:          123456 kB\n"
        f"Cached:         {kb(cached_gib)} kB\n"
    )


def write_meminfo(
    path: Path, total_gib: float, free_gib: float, available_gib: float | None = None, cached_gib: float = 2.0
) -> Path:
    """Replace `path` with a `meminfo_text` at once: gb10d or the stand-in may be reading it while it changes."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(meminfo_text(total_gib, free_gib, available_gib, cached_gib))
    partial.replace(path)
    return path


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without what systemd gave it (`SYSTEMD_VARIABLES`), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SYSTEMD_VARIABLES)}
    env.update(extra or {})
    return env


def with_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`data` (a gb10d.toml as tables) with each dotted key of `overrides` (`startup.warmup`) set, tables made as needed.

    How a test or a benchmark varies one setting of the config it starts from.
    """
    for dotted, value in overrides.items():
        table = data
        *parents, key = dotted.split(".")
        for part in parents:
            table = table.setdefault(part, {})
        table[key] = value
    return data


class Arrival(NamedTuple, Generic[T]):
    """One recorded item: when it arrived, what it is, and its position (the `since` of a wait for the next one).

    A tuple in this order because the benchmarks unpack it as (time, line, index).
    """

    at: float
    item: T
    position: int


class Stamped(Generic[T]):
    """An append-only record of items stamped on arrival, filled by one thread, with waits that wake on each item.

    `entries` lists (arrival time, item) in arrival order; it only grows, so
    `len(entries)` taken now is the `since` of a wait for what comes next.
    `on_arrival` runs in the filling thread the moment an item arrives,
    before it is recorded: what it observes is what a program acting on that
    item at once (systemctl returning, a scraper) would see.
    """

    def __init__(self, on_arrival: Callable[[T], None] | None = None) -> None:
        self.entries: list[tuple[float, T]] = []
        self._on_arrival = on_arrival
        self._ended = False
        self._changed = threading.Condition()

    def _arrived(self, at: float, item: T) -> None:
        if self._on_arrival is not None:
            self._on_arrival(item)
        with self._changed:
            self.entries.append((at, item))
            self._changed.notify_all()

    def _end(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    @property
    def ended(self) -> bool:
        """Whether the source is exhausted: nothing more will arrive."""
        return self._ended

    def wait(self, predicate: Callable[[T], bool], timeout: float = DEADLINE_S, since: int = 0) -> Arrival[T] | None:
        """The first item from index `since` on, recorded or yet to come, that satisfies `predicate`.

        None after `timeout` seconds, or at once when the source has ended without one.
        """
        deadline = time.monotonic() + timeout
        index = since
        with self._changed:
            while True:
                while index < len(self.entries):
                    at, item = self.entries[index]
                    if predicate(item):
                        return Arrival(at, item, index)
                    index += 1
                remaining = deadline - time.monotonic()
                if self._ended or remaining <= 0:
                    return None
                self._changed.wait(remaining)


def carries(key: str, value: str | None = None) -> Callable[[dict[str, str]], bool]:
    """A predicate on sd_notify messages: the message has `key` (set to `value`, when given)."""
    return lambda fields: key in fields and (value is None or fields[key] == value)


def _notify_fields(data: bytes) -> dict[str, str]:
    """The KEY=value lines of one sd_notify datagram (systemd ignores any other line, and so do we)."""
    fields: dict[str, str] = {}
    for line in data.decode("latin-1").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key] = value
    return fields


class NotifyReceiver(Stamped[dict[str, str]]):
    """A real sd_notify receiver: an AF_UNIX datagram socket, as systemd binds for NOTIFY_SOCKET, recording every message.

    `on_message` is `Stamped`'s `on_arrival`. Without a `directory` the
    socket lives in a short private one, removed at `close`: socket paths
    are limited to 108 bytes, which a test's tmp_path can exceed.
    """

    def __init__(self, directory: Path | None = None, on_message: Callable[[dict[str, str]], None] | None = None) -> None:
        super().__init__(on_message)
        self._own_dir: Path | None = None
        if directory is None:
            directory = self._own_dir = Path(tempfile.mkdtemp(prefix="gb10d-n-"))
        self.path = str(directory / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self._closing = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    @property
    def messages(self) -> list[tuple[float, dict[str, str]]]:
        """(arrival time, fields) of every message so far."""
        return self.entries

    def _receive(self) -> None:
        try:
            while True:
                try:
                    data = self.sock.recv(65536)
                except OSError:
                    return
                at = time.monotonic()
                if not data and self._closing:
                    return  # the queue is drained after close() shut the socket down
                self._arrived(at, _notify_fields(data))
        finally:
            self._end()  # also when a hook raised: a wait must not sit out its whole timeout

    def close(self) -> None:
        """Stop listening; messages already queued are still recorded (and their hook run), later senders get an error."""
        self._closing = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RD)
        self._thread.join(10)
        self.sock.close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LineReader(Stamped[str]):
    """A child's output read line by line on a thread of its own, each line stamped as it arrives.

    It ends at EOF, that is when every process holding the pipe has closed it.
    """

    def __init__(self, stream: IO[bytes], on_line: Callable[[str], None] | None = None) -> None:
        super().__init__(on_line)
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    @property
    def lines(self) -> list[tuple[float, str]]:
        """(arrival time, text without its newline) of every line so far."""
        return self.entries

    def _read(self, stream: IO[bytes]) -> None:
        try:
            for raw in stream:
                self._arrived(time.monotonic(), raw.decode("utf-8", "replace").rstrip("\n"))
        finally:
            self._end()  # also when a hook raised: a wait must not sit out its whole timeout

    def texts(self) -> list[str]:
        """The lines so far, without their stamps."""
        return [line for _, line in self.entries]

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S, since: int = 0) -> Arrival[str] | None:
        """The first line from index `since` on matching `pattern` (`re.search`); None on timeout or at EOF."""
        rx = re.compile(pattern)
        return self.wait(lambda line: rx.search(line) is not None, timeout, since)

    def find(self, pattern: str) -> list[tuple[float, str]]:
        """Every line so far matching `pattern`, with its stamp."""
        rx = re.compile(pattern)
        return [(at, line) for at, line in self.entries if rx.search(line)]

    def join(self, timeout: float) -> None:
        """Until EOF has been read, at most `timeout` seconds."""
        self._thread.join(timeout)

    def tail(self, n: int = 30) -> str:
        """The last `n` lines, for error messages."""
        return "\n".join(line for _, line in self.entries[-n:])


def started_groups(lines: Iterable[str], program: str) -> list[int]:
    """Process groups (their leader's pid) of the `program` ("vLLM" or "Ray") gb10d started, from its own journal lines.

    Only gb10d's own lines count (`<N>gb10d: ` at the start): a line that
    vLLM printed and gb10d forwarded cannot name a group to kill.
    """
    rx = re.compile(rf"^<\d>gb10d: started {re.escape(program)} as pid (\d+)")
    return [int(m.group(1)) for line in lines if (m := rx.match(line))]


def kill_group(pgid: int) -> None:
    """SIGKILL a process group if anything is left in it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def live_pids(selects: Callable[[Path, list[str]], bool]) -> list[int]:
    """Sorted pids of live (non-zombie) processes that `selects(/proc/PID, stat fields after the name)` picks.

    A process that vanishes while being looked at (OSError) is not picked.
    """
    pids = []
    for pid, entry in processes():
        try:
            fields = [field.decode() for field in stat_fields(entry)]
            if fields[0] != "Z" and selects(entry, fields):
                pids.append(pid)
        except OSError:
            continue
    return sorted(pids)


def ray_processes(tmpdir: str) -> list[int]:
    """Live processes of the Ray node whose environment names RAY_TMPDIR=`tmpdir`.

    Ray starts its workers in sessions of their own, so no process group
    holds them all; the node's RAY_TMPDIR, inherited by each, does.
    """
    ours = f"RAY_TMPDIR={tmpdir}".encode()
    return live_pids(lambda entry, _fields: ours in entry.joinpath("environ").read_bytes().split(b"\0"))


def wait_until(predicate: Callable[[], bool], timeout: float = DEADLINE_S, step_s: float = 0.05) -> float | None:
    """Poll a cheap fact that has no event to wait on (a process group vanishing); the time it first held, or None."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            return None
        time.sleep(step_s)


class Gb10d:
    """`gb10d run` as a real child in a session of its own, with its output stamped line by line.

    A context manager: leaving the block (or `close`) kills whatever the run
    started, so a test or benchmark that fails half-way leaves no process
    behind. The notify receiver belongs to the caller, who closes it.
    """

    def __init__(
        self,
        config: Path,
        notify: NotifyReceiver | None = None,
        *,
        env: Mapping[str, str] | None = None,
        stdout: int | None = None,
        wrapper: Sequence[str] = (),
        ray_tmpdir: str | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        """Start `gb10d run --config CONFIG`.

        The child gets this environment without the caller's own systemd
        variables, NOTIFY_SOCKET set to `notify` (when given), then `env`.
        With `stdout` (a file descriptor) its output goes there instead of
        being read into `out`: a reader thread would be slower than what a
        benchmark measures. `wrapper` is a command that execs gb10d, so the
        pid stays gb10d's (`ip netns exec NS`). `ray_tmpdir`: the RAY_TMPDIR
        of the Ray node this run starts, whose processes the teardown finds
        by it. `on_line` is the `LineReader`'s hook.
        """
        self.notify = notify
        child_env = clean_env({"NOTIFY_SOCKET": notify.path} if notify is not None else None)
        child_env.update(env or {})
        self._ray_tmpdir = ray_tmpdir
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, "-m", "gb10d", "run", "--config", str(config)],
            stdout=subprocess.PIPE if stdout is None else stdout,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
        self.out = LineReader(self.proc.stdout, on_line) if self.proc.stdout is not None else None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        """gb10d's pid, which is also its process group and session."""
        return self.proc.pid

    def texts(self) -> list[str]:
        """gb10d's output so far (its journal stream); empty when it goes elsewhere."""
        return self.out.texts() if self.out is not None else []

    def tail(self, n: int = 30) -> str:
        """gb10d's last lines, for error messages."""
        return self.out.tail(n) if self.out is not None else "(output not captured)"

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S, since: int = 0) -> Arrival[str] | None:
        """See `LineReader.wait_line`; a run whose output goes elsewhere has no lines to wait for."""
        if self.out is None:
            raise RuntimeError("gb10d's output was not captured: there is no line to wait for")
        return self.out.wait_line(pattern, timeout, since)

    def wait_exit(self, timeout: float | None = DEADLINE_S) -> int | None:
        """gb10d's exit status once its output is read to the end, or None if it still runs after `timeout` (None: no limit)."""
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self.out is not None:
            self.out.join(10)
        return status

    def terminate(self) -> None:
        """SIGTERM, as `systemctl stop` sends it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def vllm_pgids(self) -> list[int]:
        """Process groups of the vLLM servers gb10d started, in order."""
        return started_groups(self.texts(), "vLLM")

    def close(self) -> None:
        """Nothing this run started may outlive it: SIGKILL gb10d, every vLLM and Ray group it started, and Ray's workers.

        No grace: nothing measures this teardown, and what it finds alive is
        left over from a failure anyway.
        """
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait(10)
        if self.out is not None:
            self.out.join(5)  # EOF once gb10d is gone: every "started ... as pid" line is in
        lines = self.texts()
        for pgid in [*started_groups(lines, "vLLM"), *started_groups(lines, "Ray")]:
            kill_group(pgid)
        if self._ray_tmpdir is not None:
            for pid in ray_processes(self._ray_tmpdir):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
