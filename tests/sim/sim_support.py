"""Running gb10d.sim as a real child process, and the line formats it must produce.

The regexes are built from REFERENCE §1-§5 and checked against the real
vLLM 0.23.0 recording too (test_sim_recordings.py), so a regex that only
fits the stand-in fails there.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from gb10d.daemon.lab import free_port, live_pids

DEADLINE_S = 30.0
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "real-vllm-0.23.0"

TAG = r"\((?:APIServer|EngineCore|MainProcess) pid=\d+\) "
_T = f"(?:{TAG})?"
RECORD = re.compile(
    rf"^(?P<tag>{TAG})?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[(?P<src>[\w./]+):\d+\] (?P<msg>.*?)(?P<cr>\r?)$"
)
UVICORN = re.compile(rf"^{_T}(?P<level>INFO|WARNING|ERROR):(?P<pad> +)(?P<msg>.*)$")
ACCESS = re.compile(rf'^{_T}INFO:     \d+\.\d+\.\d+\.\d+:\d+ - "(?:GET|POST|HEAD) \S+ HTTP/1\.1" \d{{3}} [\w ]+$')
SHARD_BAR = re.compile(
    rf"^{_T}(?: *)\rLoading safetensors checkpoint shards(?: \(eager\))?: +(\d+)% Completed \| (\d+)/(\d+) \[([\d:]+)<([\d:?]+), +([\d.?]+)(it/s|s/it)\]$"
)
GRAPH_STATE = r"\rCapturing CUDA graphs \((?:PIECEWISE|FULL)\): +\d+%\|[ \u258f\u258e\u258d\u258c\u258b\u258a\u2589\u2588]{10}\| \d+/\d+ \[[\d:]+<[\d:?]+, +[\d.?]+it/s\]"
GRAPH_BAR = re.compile(rf"^{_T}(?:{GRAPH_STATE})+$")
BLANK_TAGGED = re.compile(rf"^{_T}$")
TRACEBACK = re.compile(
    rf"^{_T}(?:Traceback \(most recent call last\):|Process EngineCore:|  File \"[^\"]+\", line \d+, in \S+|    \S.*| +\^+|"
    r"During handling of the above exception, another exception occurred:|The above exception was the direct cause of the following exception:|"
    r"[\w.]+(?:Error|Exception|Interrupt): .*|If this is a private repository.*|Please verify.*|\d\. .*|   - .*)$"
)

# Third-party lines in the recording that the stand-in does not imitate.
THIRD_PARTY = re.compile(r"^(?:\[W\d{4} [\d:.]+ socket\.cpp:\d+\] .*|/usr/lib/python3\.\d+/multiprocessing/resource_tracker\.py:\d+: UserWarning: .*|  warnings\.warn\(.*)$")

LINE_KINDS: dict[str, re.Pattern[str]] = {
    "record": RECORD,
    "access": ACCESS,
    "uvicorn": UVICORN,
    "shard_bar": SHARD_BAR,
    "graph_bar": GRAPH_BAR,
    "blank": BLANK_TAGGED,
    "traceback": TRACEBACK,
}

# The startup phases, in order, as message regexes (REFERENCE §2).
STARTUP_ORDER: list[tuple[str, re.Pattern[str]]] = [
    ("args", re.compile(r"^non-default args: \{.*\}$")),
    ("architecture", re.compile(r"^Resolved architecture: \w+$")),
    ("engine init", re.compile(r"^Initializing a V1 LLM engine \(v[\d.]+\) with config: model='[^']+'")),
    ("runner", re.compile(r"^Loading model from scratch\.\.\.$")),
    ("filesystem", re.compile(r"^Filesystem type for checkpoints: \w+\. Checkpoint size: [\d.]+ GiB\. Available RAM: [\d.]+ GiB\.$")),
    ("weights", re.compile(r"^Loading weights took [\d.]+ seconds$")),
    ("model loading", re.compile(r"^Model loading took [\d.]+ GiB(?: memory)? and [\d.]+ seconds$")),
    ("compile cache", re.compile(r"^Using cache directory: \S+ for vLLM's torch\.compile$")),
    ("dynamo", re.compile(r"^Dynamo bytecode transform time: [\d.]+ s$")),
    ("compile range", re.compile(r"^Compiling a graph for compile range \(1, \d+\) takes [\d.]+ s$")),
    ("compile total", re.compile(r"^torch\.compile took [\d.]+ s in total$")),
    ("kv memory", re.compile(r"^Available KV cache memory: [\d.]+ GiB$")),
    ("kv size", re.compile(r"^GPU KV cache size: [\d,]+ tokens(?:, Maximum concurrency for [\d,]+ tokens per request: [\d.]+x)?$")),
    ("graphs", re.compile(r"^Graph capturing finished in \d+ secs, took [\d.]+ GiB$")),
    ("engine done", re.compile(r"^init engine \(profile, create kv cache, warmup model\) took [\d.]+ s(?: \(compilation: [\d.]+ s\))?$")),
    ("serving", re.compile(r"^Starting vLLM server on https?://\S+:\d+$")),
    ("routes", re.compile(r"^Available routes are:$")),
    ("route", re.compile(r"^Route: /\S*, Methods: [A-Z, ]+$")),
]
UVICORN_STARTUP = ["Started server process", "Waiting for application startup.", "Application startup complete."]
STATS = re.compile(
    r"^Engine 000: Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, Running: \d+ reqs, "
    r"Waiting: \d+ reqs, GPU KV cache usage: [\d.]+%(?:, Prefix cache hit rate: [\d.]+%)?$"
)
SPEC = re.compile(
    r"^SpecDecoding metrics: Mean acceptance length: ([\d.]+|nan|inf), Accepted throughput: ([\d.]+) tokens/s, Drafted throughput: "
    r"([\d.]+) tokens/s, Accepted: (\d+) tokens, Drafted: (\d+) tokens, Per-position acceptance rate: ([\d., ]*), Avg Draft acceptance rate: ([\d.]+|nan)%$"
)


def kind_of(line: str) -> str | None:
    """The first line kind whose regex matches, or None."""
    for name, pattern in LINE_KINDS.items():
        if pattern.match(line):
            return name
    return None


def physical_lines(data: bytes) -> list[str]:
    """Split on `\\n` only (a `\\r` stays in the line, as it is on the wire)."""
    text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def messages(data: bytes) -> list[str]:
    """The messages of the vLLM log records in `data`, in order."""
    found = []
    for line in physical_lines(data):
        match = RECORD.match(line)
        if match:
            found.append(match.group("msg"))
    return found


def port_refuses(port: int) -> bool:
    """True if a TCP connect to the port is refused."""
    with socket.socket() as s:
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
        return False


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


def http(port: int, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None, timeout: float = DEADLINE_S) -> Reply:
    """One HTTP request; any status comes back as a Reply."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, response.read(), {k.lower(): v for k, v in response.headers.items()})
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, exc.read(), {k.lower(): v for k, v in exc.headers.items()})


@dataclass
class Sim:
    """A running `python -m gb10d.sim serve ...` with its output captured from real pipes."""

    process: subprocess.Popen[bytes]
    port: int
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    changed: threading.Condition = field(default_factory=threading.Condition)
    pumps: list[threading.Thread] = field(default_factory=list)

    reading: set[int] = field(default_factory=set)  # the pipes whose pump waits in read(), holding no chunk

    def _pump(self, pipe: Any, into: bytearray) -> None:
        fd = pipe.fileno()
        while True:
            with self.changed:
                self.reading.add(fd)
            chunk = os.read(fd, 65536)
            with self.changed:
                self.reading.discard(fd)
                if chunk:
                    into.extend(chunk)
                self.changed.notify_all()
            if not chunk:
                return

    def _caught_up(self) -> bool:
        """Whether everything the sim wrote to stdout so far is in `stdout`: the pipe holds nothing unread, and then
        its pump waits in read() (a chunk it had read before is appended by then)."""
        fd = self.process.stdout.fileno()  # type: ignore[union-attr]
        unread = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        with self.changed:
            return unread == 0 and fd in self.reading

    def start_pumps(self) -> None:
        for pipe, into in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr)):
            thread = threading.Thread(target=self._pump, args=(pipe, into), daemon=True)
            thread.start()
            self.pumps.append(thread)

    def wait_output(self, predicate: Callable[[bytes, bytes], bool], timeout: float = DEADLINE_S) -> None:
        """Until predicate(stdout, stderr) holds, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate(bytes(self.stdout), bytes(self.stderr)):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"output condition not met within {timeout} s; stdout tail: {bytes(self.stdout[-1500:])!r} stderr tail: {bytes(self.stderr[-1500:])!r}")
                self.changed.wait(left)

    def wait_text(self, text: str, stream: str = "stdout", timeout: float = DEADLINE_S) -> None:
        needle = text.encode()
        index = 0 if stream == "stdout" else 1
        self.wait_output(lambda out, err: needle in (out, err)[index], timeout)

    def wait_ready(self, timeout: float = DEADLINE_S) -> None:
        """Until /health answers 200 (retrying refusals: listen() follows the startup line).

        """
        self.wait_text("Application startup complete.", "stderr", timeout)
        # stdout has a reader thread of its own: what the sim printed there before that line is in `stdout` once
        # that thread caught up, which a test reading stdout after the start relies on.
        deadline = time.monotonic() + timeout
        while not self._caught_up():
            assert time.monotonic() < deadline, "the stdout reader did not catch up"
            with self.changed:
                self.changed.wait(0.01)
        while True:
            try:
                if http(self.port, "/health", timeout=5).status == 200:
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise
            with self.changed:
                self.changed.wait(0.05)

    def wait_exit(self, timeout: float = DEADLINE_S) -> int:
        """The API server's exit status."""
        return self.process.wait(timeout)

    def drain(self, timeout: float = DEADLINE_S) -> None:
        """Until both pipes reached EOF, i.e. every process holding them is gone."""
        for thread in self.pumps:
            thread.join(timeout)
            assert not thread.is_alive(), "a process of the group still holds the output pipes"

    def kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(DEADLINE_S)

    def group_pids(self) -> list[int]:
        """Live (non-zombie) processes in the sim's process group."""
        return live_pids(lambda entry, fields: int(fields[2]) == self.process.pid)

    def engine_pid(self, timeout: float = DEADLINE_S) -> int:
        """The EngineCore child's pid, from its tag in the output."""
        self.wait_text("(EngineCore pid=", "stdout", timeout)
        match = re.search(rb"\(EngineCore pid=(\d+)\)", bytes(self.stdout))
        assert match
        return int(match.group(1))


class StartSim(Protocol):
    """The `sim` fixture (tests/sim/conftest.py): start_sim with the arguments spread, each process killed at teardown."""

    def __call__(self, *args: str, env: dict[str, str] | None = None, port: int | None = None, speed: str = "0.01") -> Sim: ...


def start_sim(args: list[str], env: dict[str, str] | None = None, port: int | None = None, speed: str = "0.01") -> Sim:
    """Start the stand-in in a new session, as gb10d does."""
    port = free_port() if port is None else port
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("GB10D_SIM_", "VLLM_"))}
    full_env.update({"GB10D_SIM_SPEED": speed, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1"})
    full_env.update(env or {})
    process = subprocess.Popen(
        [sys.executable, "-m", "gb10d.sim", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env, start_new_session=True,
    )
    sim = Sim(process, port)
    sim.start_pumps()
    return sim
