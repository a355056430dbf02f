"""The bench's real-process plumbing: deployments, `gb10d run` with timestamped output, a notify socket.

Every benchmark measures real programs: the real `python -m gb10d run`, the
real stand-in `gb10d.sim` (or a flood program) as its vLLM, a real AF_UNIX
datagram socket as systemd's NOTIFY_SOCKET. Each line gb10d writes and each
datagram it sends is stamped with `time.monotonic()` the moment the bench
receives it, so both ends of a latency are read on one clock. CLOCK_MONOTONIC
is system-wide on Linux, so children (the flood program) can report
timestamps on the same clock. The parts are gb10d.daemon.lab's, shared with the
tests and `gb10d demo`; this module adds the bench's deployments and its
readings of them (a time, or None when a run never got there).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from gb10d.daemon import lab
from gb10d.daemon.lab import (
    DEADLINE_S,
    GB10_TOTAL_GIB,
    LineReader,
    carries,
    clean_env,
    free_port,
    kill_group,
    with_overrides,
    write_meminfo,
)

__all__ = [
    "DEADLINE_S", "GB10_TOTAL_GIB", "Deployment", "Gb10d", "NotifyReceiver", "Sim", "Workspace", "free_port",
    "http_status", "kill_group", "summary", "wait_until",
]


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
        self.meminfo = write_meminfo(self.dir / "meminfo", self.total_gib, self.free_gib)
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
            # One instance at a time, on its own figures: the machine's memory ledger is not the bench's.
            "memory": {"meminfo_path": str(self.meminfo), "recovery_timeout_s": 5.0, "ledger_dir": ""},
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
        return with_overrides(data, self.overrides)

    def vllm_argv(self, utilization: float | None = None) -> list[str]:
        """The `vllm serve` command line a hand-written unit would run (for the baselines)."""
        assert self.venv is not None
        u = self.utilization if utilization is None else utilization
        return [
            str(self.venv / "bin" / "vllm"), "serve", "/srv/models/tiny-llama",
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
            "--gpu-memory-utilization", f"{u:g}", "--max-model-len", "2048",
        ]


class NotifyReceiver(lab.NotifyReceiver):
    """gb10d.daemon.lab's sd_notify receiver, read as the bench reads it: when did a message arrive."""

    def wait_for(self, key: str, value: str | None = None, timeout: float = DEADLINE_S) -> float | None:
        """Arrival time of the first message carrying `key` (with `value`), or None after `timeout`."""
        found = self.wait(carries(key, value), timeout)
        return None if found is None else found.at


class Gb10d(lab.Gb10d):
    """`gb10d run` for one benchmark run, with a notify socket of its own in the deployment's directory."""

    notify: NotifyReceiver | None

    def __init__(self, deployment: Deployment, notify: bool = True, stdout: int | None = None) -> None:
        """Start gb10d, with its own notify socket unless `notify` is false.

        With `stdout` (a file descriptor) gb10d's output goes there instead of
        being stamped into `out`: the forwarding benchmark reads it faster raw.
        """
        self.deployment = deployment
        super().__init__(deployment.config, NotifyReceiver(deployment.dir) if notify else None, stdout=stdout)

    def wait_ready(self, timeout: float = DEADLINE_S) -> float:
        """Arrival time of READY=1; a run that never gets there is a broken benchmark, not a result."""
        assert self.notify is not None
        at = self.notify.wait_for("READY", "1", timeout)
        if at is None:
            raise RuntimeError(f"gb10d sent no READY=1 within {timeout:g} s:\n{self.tail()}")
        return at

    def close(self) -> None:
        """Kill what the run started (benchmarks other than the shutdown one do not measure it), then close the socket."""
        super().close()
        if self.notify is not None:
            self.notify.close()


class Sim:
    """The stand-in `vllm serve` started directly (no gb10d), as a baseline loop or a unit would run it."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=clean_env({"PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "VLLM_DISABLE_LOG_LOGO": "1", **env}),
                                     start_new_session=True)
        assert self.proc.stdout is not None
        self.out = LineReader(self.proc.stdout)

    @property
    def pgid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        kill_group(self.pgid)
        self.proc.wait(10)
        self.out.join(5)


def wait_until(predicate: Callable[[], bool], timeout: float, step_s: float = 0.002) -> float | None:
    """`gb10d.daemon.lab.wait_until`, polling every 2 ms: what the bench waits for is what it times."""
    return lab.wait_until(predicate, timeout, step_s)


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


def standalone(run: Callable[[Workspace, bool], dict[str, Any]], markdown: Callable[[dict[str, Any]], str], results: Path, argv: Sequence[str]) -> int:
    """A benchmark run as its own program (`python -m bench.NAME [--quick]`): run it in a workspace that is
    always cleaned up, keep its results as JSON in `results`, print its markdown."""
    import json

    ws = Workspace()
    try:
        result = run(ws, "--quick" in argv)
    finally:
        ws.close()
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0
