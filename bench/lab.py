"""The bench's real-process plumbing: deployments, `gb10d run` with timestamped output, a notify socket.

Every benchmark measures real programs: the real `python -m gb10d run`, the
real stand-in `gb10d.sim` (or a flood program) as its vLLM, a real AF_UNIX
datagram socket as systemd's NOTIFY_SOCKET. Each line gb10d writes and each
datagram it sends is stamped with `time.monotonic()` the moment the bench
receives it, so both ends of a latency are read on one clock. CLOCK_MONOTONIC
is system-wide on Linux, so children (the flood program) can report
timestamps on the same clock.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w


GIB_KB = 1024 * 1024
# vLLM's physical RAM on a GB10 as `cudaMemGetInfo` reports it (REFERENCE §3.1 / §8).
GB10_TOTAL_GIB = 121.69
DEADLINE_S = 60.0


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def meminfo_text(total_gib: float, free_gib: float, cached_gib: float = 2.0) -> str:
    """A /proc/meminfo-format text with the fields gb10d and the sim read."""

    def kb(gib: float) -> int:
        return int(gib * GIB_KB)

    return (
        f"MemTotal:       {kb(total_gib)} kB\n"
        f"MemFree:        {kb(free_gib)} kB\n"
        f"MemAvailable:   {kb(free_gib + cached_gib)} kB\n"
        f"Buffers:          123456 kB\n"
        f"Cached:         {kb(cached_gib)} kB\n"
    )


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """Median and spread (min, max, interquartile range) of repeated measurements."""
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "p25": None, "p75": None}
    ordered = sorted(values)
    if len(ordered) >= 2:
        p25, _, p75 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        p25 = p75 = ordered[0]
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "p25": p25,
        "p75": p75,
    }


class Workspace:
    """A scratch directory holding one stand-in vLLM virtualenv, shared by every run of the bench."""

    def __init__(self) -> None:
        # Short prefix: AF_UNIX socket paths inside it are limited to 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="gb10d-b-"))
        self._venv: Path | None = None
        self._count = 0

    @property
    def venv(self) -> Path:
        """A virtualenv whose bin/vllm is `gb10d.sim` (made on first use)."""
        if self._venv is None:
            from gb10d.sim import make_venv

            self._venv = self.root / "venv"
            make_venv(self._venv)
        return self._venv

    def scratch(self, name: str) -> Path:
        """A fresh directory for one run."""
        self._count += 1
        path = self.root / f"{self._count:03d}-{name}"
        path.mkdir()
        return path

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Deployment:
    """The files of one gb10d deployment: a meminfo file and a gb10d.toml.

    `overrides` maps dotted keys (`startup.warmup`) to values on top of a
    config that suits benchmarks: fast backoff, no state files outside the
    scratch directory, metrics off unless asked for.
    """

    dir: Path
    venv: Path | None
    sim_env: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    free_gib: float = 110.0
    total_gib: float = GB10_TOTAL_GIB
    utilization: float = 0.8
    executable: Path | None = None
    port: int = field(default_factory=free_port)
    # vLLM from this image instead, with this [container] table (the stand-in's image, see bench/container.py).
    image: str | None = None
    container: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.meminfo = self.dir / "meminfo"
        self.meminfo.write_text(meminfo_text(self.total_gib, self.free_gib))
        self.config = self.dir / "gb10d.toml"
        self.config.write_text(tomli_w.dumps(self.data()))

    @property
    def vllm_env(self) -> dict[str, str]:
        """The environment the stand-in gets (through gb10d, or from a baseline loop)."""
        return {"GB10D_SIM_MEMINFO": str(self.meminfo), **self.sim_env}

    def data(self) -> dict[str, Any]:
        program: dict[str, Any] = (
            {"image": self.image} if self.image else {"executable": str(self.executable)} if self.executable else {"venv": str(self.venv)}
        )
        data: dict[str, Any] = {
            "vllm": {
                **program,
                "model": "/srv/models/tiny-llama",
                "served_model_name": "tiny",
                "host": "127.0.0.1",
                "port": self.port,
                "gpu_memory_utilization": self.utilization,
                "args": {"max_model_len": 2048},
                "env": self.vllm_env,
            },
            "startup": {"stall_timeout_s": 30.0, "ready_timeout_s": 300.0, "health_poll_interval_s": 2.0},
            "memory": {"meminfo_path": str(self.meminfo), "recovery_timeout_s": 5.0},
            "restart": {"max_attempts": 5, "backoff_initial_s": 0.0, "backoff_max_s": 0.0},
            "metrics": {"listen": ""},
            "daemon": {
                "stop_timeout_s": 10.0,
                "state_file": str(self.dir / "state.json"),
                "learned_file": str(self.dir / "learned.toml"),
                "watch_config": False,
            },
            **({"container": self.container} if self.image else {}),
        }
        for dotted, value in self.overrides.items():
            table = data
            *parents, key = dotted.split(".")
            for part in parents:
                table = table.setdefault(part, {})
            table[key] = value
        return data

    def vllm_argv(self, utilization: float | None = None) -> list[str]:
        """The `vllm serve` command line a hand-written unit would run (for the baselines)."""
        assert self.venv is not None
        u = self.utilization if utilization is None else utilization
        return [
            str(self.venv / "bin" / "vllm"), "serve", "/srv/models/tiny-llama",
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
            "--gpu-memory-utilization", f"{u:g}", "--max-model-len", "2048",
        ]


class NotifyReceiver:
    """A real sd_notify socket: an AF_UNIX datagram socket whose messages are stamped on arrival."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "notify")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            now = time.monotonic()
            fields = dict(line.split("=", 1) for line in data.decode("latin-1").splitlines() if "=" in line)
            with self._changed:
                self.messages.append((now, fields))
                self._changed.notify_all()

    def wait_for(self, key: str, value: str | None = None, timeout: float = DEADLINE_S) -> float | None:
        """Arrival time of the first message carrying `key` (with `value`), or None after `timeout`."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for at, fields in self.messages[seen:]:
                    if key in fields and (value is None or fields[key] == value):
                        return at
                seen = len(self.messages)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def close(self) -> None:
        self.sock.close()


class Stamped:
    """Reads a child's stdout line by line on a thread, stamping each line as it arrives."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for raw in stream:
            now = time.monotonic()
            with self._changed:
                self.lines.append((now, raw.decode("utf-8", "replace").rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S, start: int = 0) -> tuple[float, str, int] | None:
        """(arrival time, line, index) of the first line from index `start` matching `pattern`; None on timeout or EOF."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        index = start
        with self._changed:
            while True:
                while index < len(self.lines):
                    at, line = self.lines[index]
                    if rx.search(line):
                        return at, line, index
                    index += 1
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    return None
                self._changed.wait(remaining)

    def find(self, pattern: str) -> list[tuple[float, str]]:
        """Every line so far matching `pattern`."""
        rx = re.compile(pattern)
        with self._changed:
            return [(at, line) for at, line in self.lines if rx.search(line)]

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def tail(self, n: int = 30) -> str:
        with self._changed:
            return "\n".join(line for _, line in self.lines[-n:])


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "JOURNAL_STREAM"))}
    env.update(extra or {})
    return env


class Gb10d:
    """`gb10d run` as a real child in its own session, its stdout stamped line by line.

    A context manager: leaving the block kills whatever the run started, so
    no benchmark leaves processes behind when it fails half-way.
    """

    def __init__(self, deployment: Deployment, notify: bool = True, stdout: int | None = None) -> None:
        """Start gb10d, with its own notify socket unless `notify` is false.

        With `stdout` (a file descriptor) gb10d's output goes there instead of
        being stamped into `out`: the forwarding benchmark reads it faster raw.
        """
        self.deployment = deployment
        self.notify = NotifyReceiver(deployment.dir) if notify else None
        env = _clean_env({"NOTIFY_SOCKET": self.notify.path} if self.notify else None)
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gb10d", "run", "--config", str(deployment.config)],
            stdout=stdout if stdout is not None else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.out = Stamped(self.proc.stdout) if stdout is None else None

    def __enter__(self) -> Gb10d:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self) -> str:
        """gb10d's last lines, for error messages."""
        return self.out.tail() if self.out is not None else "(output not captured)"

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S, start: int = 0) -> tuple[float, str, int] | None:
        """See `Stamped.wait_line`."""
        assert self.out is not None
        return self.out.wait_line(pattern, timeout, start)

    def wait_ready(self, timeout: float = DEADLINE_S) -> float:
        """Arrival time of READY=1; a run that never gets there is a broken benchmark, not a result."""
        assert self.notify is not None
        at = self.notify.wait_for("READY", "1", timeout)
        if at is None:
            raise RuntimeError(f"gb10d sent no READY=1 within {timeout:g} s:\n{self.tail()}")
        return at

    def vllm_pgids(self) -> list[int]:
        """Process groups of the vLLM servers gb10d started, from its own journal lines."""
        assert self.out is not None
        return [int(m.group(1)) for _, line in self.out.find(r"gb10d: started vLLM as pid")
                if (m := re.search(r"started vLLM as pid (\d+)", line))]

    def wait_exit(self, timeout: float = DEADLINE_S) -> int | None:
        """gb10d's exit status, or None if it is still running after `timeout`."""
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

    def close(self) -> None:
        """Nothing this run started may outlive it: SIGKILL gb10d and every vLLM group it started.

        Benchmarks other than the shutdown one do not measure the teardown, so it is the quickest there is.
        """
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
            self.proc.wait(10)
        if self.out is not None:
            self.out.join(5)  # EOF once gb10d is gone: every "started vLLM" line is in
            for pgid in self.vllm_pgids():
                kill_group(pgid)
        if self.notify is not None:
            self.notify.close()


class Sim:
    """The stand-in `vllm serve` started directly (no gb10d), as a baseline loop or a unit would run it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=_clean_env({"PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "VLLM_DISABLE_LOG_LOGO": "1", **env}),
                                     start_new_session=True)
        self.out = Stamped(self.proc.stdout)

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        kill_group(self.pgid)
        self.proc.wait(10)
        self.out.join(5)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group if anything is left in it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_until(predicate: Callable[[], bool], timeout: float, step_s: float = 0.002) -> float | None:
    """Poll a fact that has no event (a process group vanishing); the time it first held, or None."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return time.monotonic()
        if time.monotonic() > deadline:
            return None
        time.sleep(step_s)


def http_status(port: int, path: str, timeout_s: float = 2.0) -> int | None:
    """Status of one plain GET on 127.0.0.1 (as curl would do it), None when refused or broken."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        conn.close()

