"""Real-process test harness: gb10d run as a child, gb10d.sim as its vLLM, a real NOTIFY_SOCKET.

Nothing here imitates gb10d: the daemon is the real `python -m gb10d run`,
vLLM is the real stand-in program, systemd's notify socket is a real
AF_UNIX datagram socket. Waits are for observable facts (a datagram, a
journal line, a port) with generous deadlines. The parts are gb10d.daemon.lab's,
shared with the benchmarks and `gb10d demo`; what this module adds is the
test's verdict: a wait that runs out fails the test with what gb10d said.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import tomli_w

from gb10d.daemon import lab
from gb10d.daemon.lab import (
    DEADLINE_S,
    GIB_KB,
    Gb10d,
    NotifyReceiver,
    carries,
    free_port,
    live_pids,
    meminfo_text,
    ray_processes,
    with_overrides,
    write_meminfo,
)

__all__ = [
    "DEADLINE_S", "GIB_KB", "Daemon", "NotifySocket", "Setup", "free_port", "live_pids", "meminfo_text",
    "ray_groups", "ray_processes", "vllm_groups", "wait_until",
]


class NotifySocket(NotifyReceiver):
    """gb10d.daemon.lab's sd_notify receiver, whose waits fail the test.

    `on_message` runs in the receiving thread the moment a datagram arrives,
    before anything else is recorded: what it observes is what a program
    acting on that message at once (systemctl returning, a scraper) would see.
    """

    def wait_for(self, predicate: Callable[[dict[str, str]], bool], timeout: float = DEADLINE_S, since: int = 0) -> dict[str, str]:
        """The first message (already received or arriving), from the `since`-th on, that satisfies `predicate`."""
        found = self.wait(predicate, timeout, since)
        if found is None:
            raise AssertionError(f"no matching sd_notify message within {timeout} s; got {self.keys()}")
        return found.item

    def keys(self) -> list[str]:
        """Compact view of every message, for assertion messages."""
        return [";".join(f"{k}={v[:60]}" for k, v in m.items()) for _, m in self.messages]

    def statuses(self) -> list[str]:
        return [m["STATUS"] for _, m in self.messages if "STATUS" in m]

    def count(self, key: str, value: str | None = None) -> int:
        return sum(1 for _, m in self.messages if carries(key, value)(m))


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
        write_meminfo(self.meminfo, total_gib or self.total_gib, free_gib, available_gib)

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
        return with_overrides(data, self.extra)

    def write_config(self) -> None:
        self.config.write_text(tomli_w.dumps(self.data()))


class Daemon:
    """`gb10d run` as a real child process (gb10d.daemon.lab's), with its stdout (the journal stream) collected."""

    def __init__(
        self, setup: Setup, notify: NotifySocket | None, env: dict[str, str] | None = None, netns: str | None = None, wrapper: Sequence[str] = ()
    ) -> None:
        """`netns`: run it inside that network namespace (`ip netns exec` execs it: the pid is gb10d's);
        `wrapper`: any other command that sets up the machine gb10d sees and then execs it."""
        self.setup = setup
        self.child = Gb10d(
            setup.config, notify, env=env, wrapper=[*(["ip", "netns", "exec", netns] if netns else []), *wrapper],
            ray_tmpdir=setup.sim_env.get("RAY_TMPDIR"),
        )
        self.proc = self.child.proc

    @property
    def lines(self) -> list[str]:
        """Every line gb10d wrote so far."""
        return self.child.texts()

    def wait_line(self, pattern: str, timeout: float = DEADLINE_S, since: int = 0) -> re.Match[str]:
        """The first journal line (past or future), from the `since`-th on, matching `pattern`."""
        found = self.child.wait_line(pattern, timeout, since)
        if found is not None and (m := re.search(pattern, found.item)):
            return m
        if self.child.out is not None and self.child.out.ended:
            raise AssertionError(f"gb10d exited ({self.proc.poll()}) before a line matched {pattern!r}:\n" + self.tail())
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n" + self.tail())

    def own_lines(self) -> list[str]:
        """gb10d's own decisions (not forwarded vLLM lines)."""
        return [line for line in self.lines if re.match(r"^<\d>gb10d: ", line)]

    def tail(self, n: int = 60) -> str:
        return self.child.tail(n)

    def wait_exit(self, timeout: float = DEADLINE_S) -> int:
        status = self.child.wait_exit(timeout)
        if status is None:
            raise AssertionError(f"gb10d still running after {timeout} s:\n" + self.tail())
        return status

    def stop(self, timeout: float = DEADLINE_S) -> int:
        """SIGTERM gb10d and wait for its exit status."""
        self.child.terminate()
        return self.wait_exit(timeout)

    def kill_everything(self) -> None:
        """Test teardown: nothing of this test may outlive it, whatever happened."""
        self.child.close()


def vllm_groups(lines: list[str]) -> Iterator[int]:
    """Process groups of the vLLM servers gb10d started (their leader's pid), from its own journal lines."""
    return iter(lab.started_groups(lines, "vLLM"))


def ray_groups(lines: list[str]) -> Iterator[int]:
    """Process groups of the `ray start` gb10d started, from its own journal lines."""
    return iter(lab.started_groups(lines, "Ray"))


def wait_until(predicate: Callable[[], bool], timeout: float = DEADLINE_S, what: str = "condition") -> None:
    """Poll a cheap observable fact until it holds (for facts with no event to wait on, like a pid vanishing)."""
    if lab.wait_until(predicate, timeout) is None:
        raise AssertionError(f"{what} not reached within {timeout} s")
