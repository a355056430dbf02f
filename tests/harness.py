"""Real-process test harness: gb10d run as a child, gb10d.sim as its vLLM, a real NOTIFY_SOCKET.

Nothing here imitates gb10d: the daemon is the real `python -m gb10d run`,
vLLM is the real stand-in program, systemd's notify socket is a real
AF_UNIX datagram socket. Waits are for observable facts (a datagram, a
journal line, a port) with generous deadlines.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import tomli_w

from gb10d.process import group_alive

DEADLINE_S = 60.0
GIB_KB = 1024 * 1024


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def meminfo_text(total_gib: float, free_gib: float, available_gib: float | None = None, cached_gib: float = 2.0) -> str:
    """A /proc/meminfo-format text with the four fields gb10d and the sim read."""
    available = free_gib + cached_gib if available_gib is None else available_gib
    kb = lambda gib: int(gib * GIB_KB)  # noqa: E731 - tiny local conversion
    return (
        f"MemTotal:       {kb(total_gib)} kB\n"
        f"MemFree:        {kb(free_gib)} kB\n"
        f"MemAvailable:   {kb(available)} kB\n"
        f"Buffers:          123456 kB\n"
        f"Cached:         {kb(cached_gib)} kB\n"
    )


class NotifySocket:
    """A real sd_notify receiver: binds an AF_UNIX datagram socket and records every message.

    `on_message` runs in the receiving thread the moment a datagram arrives,
    before anything else is recorded: what it observes is what a program
    acting on that message at once (systemctl returning, a scraper) would see.
    """

    def __init__(self, on_message: Callable[[dict[str, str]], None] | None = None) -> None:
        self._on_message = on_message
        # Socket paths are limited to 108 bytes; pytest's tmp_path can be longer.
        self._dir = tempfile.mkdtemp(prefix="gb10d-n-")
        self.path = os.path.join(self._dir, "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._queue: queue.Queue[tuple[int, dict[str, str]]] = queue.Queue()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode("latin-1").splitlines() if "=" in line)
            if self._on_message is not None:
                self._on_message(fields)
            self.messages.append((time.monotonic(), fields))
            self._queue.put((len(self.messages) - 1, fields))

    def wait_for(self, predicate: Callable[[dict[str, str]], bool], timeout: float = DEADLINE_S, since: int = 0) -> dict[str, str]:
        """The first message (already received or arriving), from the `since`-th on, that satisfies `predicate`."""
        for _, fields in self.messages[since:]:
            if predicate(fields):
                return fields
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no matching sd_notify message within {timeout} s; got {self.keys()}")
            try:
                index, fields = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if index >= since and predicate(fields):
                return fields

    def keys(self) -> list[str]:
        """Compact view of every message, for assertion messages."""
        return [";".join(f"{k}={v[:60]}" for k, v in m.items()) for _, m in self.messages]

    def statuses(self) -> list[str]:
        return [m["STATUS"] for _, m in self.messages if "STATUS" in m]

    def count(self, key: str, value: str | None = None) -> int:
        return sum(1 for _, m in self.messages if key in m and (value is None or m[key] == value))

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class Setup:
    """Files of one test deployment: a fake vLLM venv, a meminfo file, a config."""

    root: Path
    port: int = field(default_factory=free_port)
    scenario: str = "healthy"
    speed: float = 0.01
    era: str | None = None
    total_gib: float = 121.69
    free_gib: float = 110.0
    available_gib: float | None = None
    utilization: float = 0.8
    served_name: str = "tiny"
    extra: dict[str, Any] = field(default_factory=dict)
    sim_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.venv = self.root / "venv"
        if not (self.venv / "bin" / "vllm").exists():
            from gb10d.sim import make_venv

            make_venv(self.venv)
        self.meminfo = self.root / "meminfo"
        self.write_meminfo(self.free_gib, self.available_gib)
        self.config = self.root / "gb10d.toml"
        self.state_file = self.root / "run" / "state.json"
        self.write_config()

    def write_meminfo(self, free_gib: float, available_gib: float | None = None, total_gib: float | None = None) -> None:
        tmp = self.meminfo.with_suffix(".tmp")
        tmp.write_text(meminfo_text(total_gib or self.total_gib, free_gib, available_gib))
        tmp.replace(self.meminfo)

    def data(self) -> dict[str, Any]:
        env = {
            "GB10D_SIM_SPEED": str(self.speed),
            "GB10D_SIM_SCENARIO": self.scenario,
            "GB10D_SIM_MEMINFO": str(self.meminfo),
            **self.sim_env,
        }
        if self.era:
            env["GB10D_SIM_ERA"] = self.era
        data: dict[str, Any] = {
            "vllm": {
                "venv": str(self.venv),
                "model": "/srv/models/tiny-llama",
                "served_model_name": self.served_name,
                "host": "127.0.0.1",
                "port": self.port,
                "gpu_memory_utilization": self.utilization,
                "args": {"max_model_len": 2048},
                "env": env,
            },
            "startup": {"stall_timeout_s": 5.0, "ready_timeout_s": 120.0, "health_poll_interval_s": 1.0},
            # The machine's memory ledger is not the test's: tests of several instances give one of their own.
            "memory": {"meminfo_path": str(self.meminfo), "recovery_timeout_s": 3.0, "ledger_dir": ""},
            "restart": {"max_attempts": 3, "backoff_initial_s": 0.2, "backoff_max_s": 1.0},
            "metrics": {"listen": ""},
            "daemon": {
                "stop_timeout_s": 10.0,
                "state_file": str(self.state_file),
                "learned_file": str(self.root / "lib" / "state.toml"),
                "watch_config": False,
                # The machine's kernel log is not the test's: tests that need one give a file to follow.
                "kernel_log": "none",
            },
        }
        for dotted, value in self.extra.items():
            table = data
            *parents, key = dotted.split(".")
            for part in parents:
                table = table.setdefault(part, {})
            table[key] = value
        return data

    def write_config(self) -> None:
        self.config.write_text(tomli_w.dumps(self.data()))


class Daemon:
    """`gb10d run` as a real child process, with its stdout (the journal stream) collected."""

    def __init__(self, setup: Setup, notify: NotifySocket | None, env: dict[str, str] | None = None, netns: str | None = None) -> None:
        """`netns`: run it inside that network namespace (`ip netns exec` execs it: the pid is gb10d's)."""
        self.setup = setup
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_"))}
        if notify is not None:
            child_env["NOTIFY_SOCKET"] = notify.path
        child_env.update(env or {})
        self.proc = subprocess.Popen(
            [*(["ip", "netns", "exec", netns] if netns else []), sys.executable, "-m", "gb10d", "run", "--config", str(setup.config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[tuple[int, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.lines.append(line)
            self._queue.put((len(self.lines) - 1, line))
        self._queue.put(None)

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S, since: int = 0) -> re.Match[str]:
        """The first journal line (past or future), from the `since`-th on, matching `pattern`."""
        rx = re.compile(pattern)
        for line in self.lines[since:]:
            if m := rx.search(line):
                return m
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.tail())
            try:
                item = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if item is None:
                self._queue.put(None)  # the end stays visible to the next wait
                raise AssertionError(f"gb10d exited ({self.proc.poll()}) before a line matched {pattern!r}:\n" + self.tail())
            index, line = item
            if index >= since and (m := rx.search(line)):
                return m

    def own_lines(self) -> list[str]:
        """gb10d's own decisions (not forwarded vLLM lines)."""
        return [line for line in self.lines if re.match(r"^<\d>gb10d: ", line)]

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def wait_exit(self, timeout: float = DEADLINE_S) -> int:
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"gb10d still running after {timeout} s:\n" + self.tail()) from None
        self._thread.join(10)
        return status

    def stop(self, timeout: float = DEADLINE_S) -> int:
        """SIGTERM gb10d and wait for its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill_everything(self) -> None:
        """Test teardown: nothing of this test may outlive it, whatever happened."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pgid in [*vllm_groups(self.lines), *ray_groups(self.lines)]:
            if group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
        if tmpdir := self.setup.sim_env.get("RAY_TMPDIR"):
            # Ray starts its workers in sessions of their own; they are known by the node's RAY_TMPDIR.
            for pid in ray_processes(tmpdir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _groups(lines: list[str], program: str) -> Iterator[int]:
    for line in lines:
        if m := re.match(rf"^<\d>gb10d: started {program} as pid (\d+)", line):
            yield int(m.group(1))


def vllm_groups(lines: list[str]) -> Iterator[int]:
    """Process groups of the vLLM servers gb10d started (their leader's pid), from its own journal lines."""
    return _groups(lines, "vLLM")


def ray_groups(lines: list[str]) -> Iterator[int]:
    """Process groups of the `ray start` gb10d started, from its own journal lines."""
    return _groups(lines, "Ray")


def ray_processes(tmpdir: str) -> list[int]:
    """Live processes of the Ray node whose environment names RAY_TMPDIR=`tmpdir`."""
    ours = f"RAY_TMPDIR={tmpdir}".encode()
    return live_pids(lambda entry, _fields: ours in (entry / "environ").read_bytes().split(b"\0"))


def wait_until(predicate: Callable[[], bool], timeout: float = DEADLINE_S, what: str = "condition") -> None:
    """Poll a cheap observable fact until it holds (for facts with no event to wait on, like a pid vanishing)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def live_pids(selects: Callable[[Path, list[str]], bool]) -> list[int]:
    """Sorted pids of live (non-zombie) processes that `selects(/proc/PID, stat fields after the name)` picks.

    A process that vanishes while being looked at (OSError) is not picked.
    """
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z" and selects(entry, fields):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)
