"""Several models on one GB10: real `gb10d run` instances sharing one memory budget, against gb10d.sim.

Every instance reads the same simulated /proc/meminfo, in which each
stand-in holds its own memory as it loads and gives it back when it ends,
and the same ledger directory. They start at the same moment, as units do
at boot; what each tells systemd, the journal and `gb10d status --all` is
what is checked. How a waiting start waits, stops or gives up
(memory.when_full) is tested in one process in test_shell_ledger.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gb10d.base.units import GIB
from gb10d.core.budget import Stage
from gb10d.machine.ledger import read_ledger
from harness import Daemon, NotifySocket, Setup, free_port, meminfo_text, vllm_groups, wait_until
from test_metrics import scrape_port, value

pytestmark = pytest.mark.slow

# What an instance's journal must never show when the ledger keeps the starts apart.
MEMORY_FAILURE = re.compile(r"Free memory on device|CUDA out of memory|gb10d: free memory .* is below")
START_TIMEOUT_S = 120.0


@dataclass
class Instance:
    setup: Setup
    notify: NotifySocket
    daemon: Daemon

    @property
    def name(self) -> str:
        """Outside systemd an instance is known by its config file."""
        return str(self.setup.config)

    def ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, str]:
        return self.notify.wait_for(lambda m: m.get("READY") == "1", timeout)

    def said(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in self.daemon.own_lines())

    def starts(self) -> int:
        return sum("started vLLM as pid" in line for line in self.daemon.own_lines())


@dataclass
class Machine:
    """One simulated GB10: its meminfo file and its ledger directory."""

    root: Path
    meminfo: Path
    ledger: Path
    daemons: list[Daemon]
    sockets: list[NotifySocket]

    def configure(self, name: str, utilization: float, scenario: str = "healthy", **extra: object) -> Setup:
        return Setup(
            self.root / name,
            utilization=utilization,
            scenario=scenario,
            sim_env={"GB10D_SIM_MEMINFO": str(self.meminfo)},
            extra={
                "memory.meminfo_path": str(self.meminfo),
                "memory.ledger_dir": str(self.ledger),
                # Shards of slow starts take seconds each; a stall is not what these tests are about.
                "startup.stall_timeout_s": 30.0,
                **extra,
            },
        )

    def start(self, setup: Setup) -> Instance:
        notify = NotifySocket()
        self.sockets.append(notify)
        daemon = Daemon(setup, notify)
        self.daemons.append(daemon)
        return Instance(setup, notify, daemon)

    def status_all(self, setup: Setup) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
        return subprocess.run(
            [sys.executable, "-m", "gb10d", "status", "--all", "--config", str(setup.config)], capture_output=True, text=True, timeout=60, env=env
        )


@pytest.fixture
def machine(tmp_path: Path, daemons: list[Daemon]) -> Iterator[Machine]:
    """121.69 GiB, 115 free and 117 available: two shares of 0.4 fit (2 x 49.68 GiB), three do not."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(meminfo_text(121.69, 115.0, 117.0))
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    box = Machine(tmp_path, meminfo, ledger, daemons, [])
    yield box
    for sock in box.sockets:
        sock.close()


def rows(status: str) -> dict[str, list[str]]:
    """`gb10d status --all`'s table, by instance name: the other columns, split on runs of spaces."""
    return {cells[0]: cells[1:] for line in status.splitlines()[2:] if not line.startswith("Memory:") for cells in [re.split(r"\s{2,}", line)]}


def test_three_instances_whose_shares_fit_all_reach_ready_without_a_memory_failure(machine: Machine) -> None:
    setups = [machine.configure(name, 0.3) for name in "abc"]  # 3 x (36.51 + 1) GiB of 117 available
    group = [machine.start(setup) for setup in setups]
    for instance in group:
        assert instance.ready()["STATUS"].startswith("serving tiny on")
    for instance in group:
        assert not [line for line in instance.daemon.lines if MEMORY_FAILURE.search(line)], instance.daemon.tail()
        assert instance.starts() == 1
    shown = machine.status_all(setups[0])
    assert shown.returncode == 0, shown.stderr
    table = rows(shown.stdout)
    assert set(table) == {i.name for i in group}
    assert all(table[i.name][:3] == ["serving", "ready", "37.51 GiB"] for i in group), shown.stdout
    for instance in group:
        assert instance.daemon.stop() == 0


def test_a_third_that_does_not_fit_waits_says_for_whom_and_starts_once_another_stops(machine: Machine) -> None:
    # Each load takes about 12 s: the two admitted are still starting while the test looks.
    ports = {name: free_port() for name in "abc"}
    group = [machine.start(machine.configure(name, 0.4, "slow_shards=200", **{"metrics.listen": f"127.0.0.1:{ports[name]}"})) for name in "abc"]
    wait_until(lambda: any(i.said("waiting until they serve or stop") for i in group), 60, "one instance waiting for memory")
    waiter = next(i for i in group if i.said("waiting until they serve or stop"))
    first, second = (i for i in group if i is not waiter)
    wait_line = waiter.daemon.wait_line(r"gb10d: memory: gpu_memory_utilization 0\.4 \(48\.68 GiB \+ 1\.00 GiB headroom\) does not fit beside the starts of (.*)").string
    assert first.name in wait_line and second.name in wait_line and "MemAvailable 117.00 GiB leaves" in wait_line, wait_line
    assert waiter.notify.wait_for(lambda m: m.get("STATUS", "").startswith("waiting for memory: needs 49.68 GiB, "))
    table = rows(machine.status_all(waiter.setup).stdout)
    assert table[waiter.name][0] == "waiting" and table[waiter.name][-1] in (f"{first.name}, {second.name}", f"{second.name}, {first.name}")
    assert {table[first.name][0], table[second.name][0]} <= {"starting", "serving"}
    assert waiter.starts() == 0
    own = subprocess.run([sys.executable, "-m", "gb10d", "status", "--config", str(waiter.setup.config)], capture_output=True, text=True, timeout=60)
    assert own.stdout.splitlines()[0] == "gb10d is running: waiting for memory"
    assert re.search(r"^Waiting for: .*49\.68 GiB, starting", own.stdout, re.M), own.stdout
    metrics = scrape_port(ports[waiter.setup.root.name])
    assert value(metrics, "gb10d_memory_waiting") == 1
    assert value(metrics, "gb10d_memory_reservation_bytes", instance_name=waiter.name) == pytest.approx(49.68 * GIB, rel=1e-3)

    assert first.daemon.stop() == 0
    waiter.ready()
    assert waiter.said(r"gb10d: memory: gpu_memory_utilization 0\.4 .* fits.*; waited \d+ s for ")
    second.ready(timeout=10)  # it served before the waiter could start beside it
    assert value(scrape_port(ports[waiter.setup.root.name]), "gb10d_memory_waiting") == 0
    for instance in (waiter, second):
        assert not [line for line in instance.daemon.lines if MEMORY_FAILURE.search(line)], instance.daemon.tail()
    table = rows(machine.status_all(waiter.setup).stdout)
    assert set(table) == {waiter.name, second.name}
    assert table[waiter.name][0] == table[second.name][0] == "serving"


def test_kill_9_of_a_starting_instance_frees_its_reservation_for_the_one_waiting(machine: Machine) -> None:
    loading = machine.start(machine.configure("a", 0.5, "slow_shards=300"))
    loading.daemon.wait_line(r"gb10d: started vLLM as pid")
    waiting = machine.start(machine.configure("b", 0.5))
    waiting.daemon.wait_line(rf"gb10d: memory: .* does not fit beside the starts of {re.escape(loading.name)} \(61\.8\d GiB, starting")
    # While the start it waits for loads shard after shard, systemd is asked to wait longer for this one too.
    extended = len(waiting.notify.messages)
    waiting.notify.wait_for(lambda m: "EXTEND_TIMEOUT_USEC" in m, 30, since=extended)
    os.kill(loading.daemon.proc.pid, signal.SIGKILL)
    # Its vLLM goes too, as systemd's KillMode=mixed ends the rest of the unit once the main process is gone.
    for pgid in vllm_groups(loading.daemon.lines):
        os.killpg(pgid, signal.SIGKILL)
    waiting.ready()
    assert waiting.said(rf"; waited \d+ s for {re.escape(loading.name)}$")
    assert not [line for line in waiting.daemon.lines if MEMORY_FAILURE.search(line)], waiting.daemon.tail()
    assert set(rows(machine.status_all(waiting.setup).stdout)) == {waiting.name}


def test_kill_9_of_a_waiting_instance_frees_its_place_in_the_queue(machine: Machine) -> None:
    # a's load waits at this gate (never opened): it is still starting when c serves, whatever the machine's speed.
    gate = machine.root / "a-load-gate"
    loading = machine.start(machine.configure("a", 0.5, **{"vllm.env.GB10D_SIM_LOAD_GATE": str(gate), "startup.stall_timeout_s": 600.0}))
    loading.daemon.wait_line(r"gb10d: started vLLM as pid")
    big = machine.start(machine.configure("b", 0.5))
    big.daemon.wait_line(r"gb10d: memory: .* does not fit beside the starts of")
    # 0.3 would fit beside the start in progress, but b asked first.
    small = machine.start(machine.configure("c", 0.3))
    small.daemon.wait_line(rf"fits beside the starts of {re.escape(loading.name)} .*, but {re.escape(big.name)} \(61\.8\d GiB, waiting\) asked first and waits")
    assert rows(machine.status_all(small.setup).stdout)[small.name][0] == "waiting"
    os.kill(big.daemon.proc.pid, signal.SIGKILL)
    small.ready()
    table = rows(machine.status_all(small.setup).stdout)
    assert set(table) == {loading.name, small.name}
    assert table[loading.name][0] == "starting" and table[small.name][0] == "serving"
    assert loading.daemon.stop() == 0


def test_the_control_without_the_ledger_two_starts_race_for_the_same_memory(machine: Machine) -> None:
    # The same two shares that do not fit together, each instance on its own: what every gb10d did before.
    group = [machine.start(machine.configure(name, 0.5, **{"memory.ledger_dir": ""})) for name in "ab"]
    wait_until(
        lambda: any(MEMORY_FAILURE.search(line) for i in group for line in i.daemon.own_lines()),
        START_TIMEOUT_S,
        "one of two starts that do not fit together to fail on memory",
    )
    # Without the ledger no one waited for the other: the start that failed had gone ahead beside the other.
    assert not any(i.said("does not fit beside the starts of") for i in group)
    assert all(i.starts() >= 1 for i in group), "both went ahead at once, the failed one beside the other"


def test_a_removed_ledger_directory_comes_back_with_the_records_of_the_instances_that_serve(machine: Machine) -> None:
    # A cleanup of /run by hand: without the records, the next start counts nobody's share and takes their memory.
    group = [machine.start(machine.configure(name, 0.3)) for name in "ab"]
    for instance in group:
        instance.ready()
    shutil.rmtree(machine.ledger)
    wait_until(lambda: machine.ledger.is_dir() and {r.name for r in read_ledger(machine.ledger)} == {i.name for i in group},
               timeout=30, what="every serving instance's record written again")
    assert {r.stage for r in read_ledger(machine.ledger)} == {Stage.SERVING}
    for instance in group:
        instance.daemon.wait_line(r"this instance's record had been removed; written again")
        assert instance.daemon.stop() == 0
