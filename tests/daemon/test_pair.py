"""Two GB10s as one server: `gb10d run` as Ray head and as Ray worker, each in its own network namespace.

Each "machine" is a network namespace of the `link` fixture (10.213.60.1
head, 10.213.60.2 worker, joined by a veth pair), with its own gb10d, its
own notify socket, its own real `ray start --block` (one fake GPU each) and
its own RAY_TMPDIR. The head's vLLM is gb10d.sim in Ray mode: it joins the
cluster through Ray's own API, places one rank on each machine and refuses
to start without two GPUs. What is asserted is what systemd and the
operator see on either machine: READY=1, STATUS=, and the journal.

Ray's node health check runs faster here than Ray's default (about 15 s
to declare a node dead), so that a lost worker is noticed in seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest

from harness import Daemon, NotifySocket, Setup, ray_groups

pytest.importorskip("ray")

HEAD_IP, WORKER_IP = "10.213.60.1", "10.213.60.2"
DEADLINE_S = 180.0  # two Ray nodes, a Ray driver and two actors on a small machine
LOW_FREE_GIB = 40.0  # the worker machine's free memory in the recovery test: 0.8 of 121.69 GiB does not fit
FAST_RAY = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}

pytestmark = pytest.mark.slow


def ready(fields: dict[str, str]) -> bool:
    return fields.get("READY") == "1"


def status_has(text: str):  # type: ignore[no-untyped-def]
    return lambda fields: text in fields.get("STATUS", "")


class Machine:
    """One side of the pair: its files, its notify socket, its Ray directory, and its gb10d once started."""

    def __init__(self, root: Path, role: str, netns: str, **setup: object) -> None:
        # Ray's socket paths must stay under 108 bytes: its directory is short and under /tmp.
        self.ray_tmpdir = tempfile.mkdtemp(prefix=f"gbp{role[0]}", dir="/tmp")
        self.netns = netns
        self.notify = NotifySocket()
        self.setup = Setup(
            root / role,
            sim_env={"RAY_TMPDIR": self.ray_tmpdir, "GB10D_SIM_SHARDS": "3", **FAST_RAY},
            extra={
                "cluster.role": role,
                "cluster.head_address": HEAD_IP,
                # A worker's Ray keeps its files in the head's --temp-dir path unless told otherwise:
                # on two machines those are two disks, here it would be one directory.
                "cluster.ray_args": ["--num-gpus=1", "--object-store-memory=100000000", f"--temp-dir={self.ray_tmpdir}"],
                "startup.stall_timeout_s": 60.0,
            },
            **setup,  # type: ignore[arg-type]
        )
        self.daemon: Daemon | None = None

    def start(self, daemons: list[Daemon]) -> Daemon:
        self.daemon = Daemon(self.setup, self.notify, netns=self.netns)
        daemons.append(self.daemon)
        return self.daemon

    def close(self) -> None:
        self.notify.close()
        shutil.rmtree(self.ray_tmpdir, ignore_errors=True)


@pytest.fixture
def machines(tmp_path: Path, link: tuple[str, str]) -> Iterator[Callable[..., Machine]]:
    """`machines("head")`, `machines("worker", free_gib=40)`: a side of the pair, in its namespace of the link."""
    made: list[Machine] = []

    def make(role: str, **setup: object) -> Machine:
        made.append(Machine(tmp_path, role, link[0] if role == "head" else link[1], **setup))
        return made[-1]

    yield make
    for machine in made:
        machine.close()


@pytest.fixture
def pair(machines: Callable[..., Machine]) -> tuple[Machine, Machine]:
    return machines("head"), machines("worker")


def test_started_head_first_the_head_waits_for_the_worker_then_both_are_ready(pair: tuple[Machine, Machine], daemons: list[Daemon]) -> None:
    head, worker = pair
    h = head.start(daemons)
    head.notify.wait_for(status_has("waiting for the Ray cluster: 1 of 2 machines with a GPU up: 10.213.60.1 (head); start gb10d on the other machine(s)"), DEADLINE_S)
    assert head.notify.count("EXTEND_TIMEOUT_USEC") >= 1
    assert not any(ready(m) for _, m in head.notify.messages)

    w = worker.start(daemons)
    worker.notify.wait_for(ready, DEADLINE_S)
    w.wait_line(rf"gb10d: joined the Ray cluster at {HEAD_IP}:6379 as {WORKER_IP} with its GPU")
    head.notify.wait_for(ready, DEADLINE_S)
    h.wait_line(r"gb10d: the Ray cluster is whole \(2 of 2 machines with a GPU up: .*10\.213\.60\.2.*\); starting vLLM")
    assert h.wait_line(r"gb10d: started vLLM as pid \d+ \(attempt 1/3, .*\): (.*)").group(1).endswith("--tensor-parallel-size 2 --distributed-executor-backend ray")
    # vLLM's rank on the worker machine reports through Ray, with its machine in the prefix.
    h.wait_line(rf"\(RayWorkerWrapper pid=\d+, ip={WORKER_IP}\) .*Loading weights took")
    # `gb10d status` on either machine shows the pair.
    for machine, line in ((head, "head of a 2-machine Ray cluster; this machine is 10.213.60.1 on gb10c-h"),
                          (worker, "worker of a 2-machine Ray cluster headed by 10.213.60.1:6379; this machine is 10.213.60.2 on gb10c-w")):
        shown = subprocess.run([sys.executable, "-m", "gb10d", "status", "--state-file", str(machine.setup.state_file)],
                               capture_output=True, text=True, timeout=60).stdout
        assert f"Cluster: {line}\n" in shown, shown
        assert "Machines: 2 of 2 with a GPU up: " in shown, shown
        assert ("URL: http://127.0.0.1:" in shown) is (machine is head), shown  # the API is the head's alone


def test_started_worker_first_the_worker_waits_to_join_then_both_are_ready(pair: tuple[Machine, Machine], daemons: list[Daemon]) -> None:
    head, worker = pair
    worker.start(daemons)
    worker.notify.wait_for(status_has(f"waiting to join the Ray cluster at {HEAD_IP}:6379"), DEADLINE_S)
    assert not any(ready(m) for _, m in worker.notify.messages)

    head.start(daemons)
    worker.notify.wait_for(ready, DEADLINE_S)
    head.notify.wait_for(ready, DEADLINE_S)


def test_killing_the_workers_ray_stops_vllm_on_the_head_and_serving_comes_back(pair: tuple[Machine, Machine], daemons: list[Daemon]) -> None:
    head, worker = pair
    h, w = head.start(daemons), worker.start(daemons)
    head.notify.wait_for(ready, DEADLINE_S)
    worker.notify.wait_for(ready, DEADLINE_S)
    (ray_pid,) = ray_groups(w.lines)
    head_mark, head_notes = len(h.lines), len(head.notify.messages)

    os.killpg(ray_pid, signal.SIGKILL)
    # vLLM may notice its lost worker before Ray's health checks do: then gb10d waits for Ray's word.
    lost = h.wait_line(r"gb10d: (.*?); (?:stopping vLLM|vLLM) \(pid \d+\).*: it cannot serve without all 2 machines; "
                       r"it starts again once the cluster is whole \(not counted as a failed attempt\)", DEADLINE_S, since=head_mark)
    assert lost.group(1).startswith(f"the worker {WORKER_IP} left the Ray cluster"), lost.group(0)
    w.wait_line(r"gb10d: Ray on this machine was killed by SIGKILL .*; starting it again in", DEADLINE_S)
    w.wait_line(rf"gb10d: this machine \({WORKER_IP}\) is no longer in the Ray cluster: .*; Ray here is restarted until it joins again", DEADLINE_S)
    w.wait_line(r"gb10d: joined the Ray cluster at", DEADLINE_S, since=w.lines.index(next(line for line in w.lines if "is no longer in the Ray cluster" in line)))
    h.wait_line(r"gb10d: the Ray cluster is whole \(2 of 2 machines with a GPU up", DEADLINE_S, since=head_mark)
    head.notify.wait_for(ready, DEADLINE_S, since=head_notes)
    starts = [line for line in h.own_lines() if "started vLLM as pid" in line]
    assert len(starts) == 2 and all("(attempt 1/3," in line for line in starts), "\n".join(h.own_lines())


def test_a_ray_worker_dying_on_a_machine_that_stays_is_a_counted_engine_failure(pair: tuple[Machine, Machine], daemons: list[Daemon]) -> None:
    head, worker = pair
    h, w = head.start(daemons), worker.start(daemons)
    head.notify.wait_for(ready, DEADLINE_S)
    worker.notify.wait_for(ready, DEADLINE_S)
    actor = int(h.wait_line(rf"\(RayWorkerWrapper pid=(\d+), ip={WORKER_IP}\)").group(1))
    head_mark, head_notes = len(h.lines), len(head.notify.messages)

    os.kill(actor, signal.SIGKILL)
    # FAST_RAY's health checks: Ray declares a dead machine dead within 2 x (3 x 0.5 + 1) s; gb10d waits that, plus 5 s.
    h.wait_line(r"gb10d: vLLM lost a Ray worker \(.*ActorDiedError.*\); waiting up to 10 s for Ray to tell whether its machine "
                r"left the cluster", DEADLINE_S, since=head_mark)
    # It served for seconds, far less than restart.reset_after_s: a failed start, restarted after back-off.
    h.wait_line(r"gb10d: ray_worker_lost: .*; it served only \d+ s .*, so this counts as a failed start; "
                r"restarting with the same settings in [\d.]+ s \(attempt 2/3\)", DEADLINE_S, since=head_mark)
    head.notify.wait_for(ready, DEADLINE_S, since=head_notes)
    assert not [line for line in h.lines[head_mark:] if "it cannot serve without all 2 machines" in line]
    assert not [line for line in w.own_lines() if "no longer in the Ray cluster" in line]


def test_a_free_memory_failure_on_the_worker_machine_is_named_and_recovered(machines: Callable[..., Machine], daemons: list[Daemon]) -> None:
    head, worker = machines("head"), machines("worker", free_gib=LOW_FREE_GIB)
    h = head.start(daemons)
    worker.start(daemons)
    head.notify.wait_for(ready, DEADLINE_S)
    lowered = h.wait_line(r"gb10d: free memory 40 of 121.69 GiB on the machine 10\.213\.60\.2 is below gpu_memory_utilization 0.8 "
                          r"\(97.35 GiB\); restarting with (0\.\d+) \(attempt 2/3\)").group(1)
    started = [line for line in h.own_lines() if "started vLLM as pid" in line]
    assert len(started) == 2, started
    assert "--gpu-memory-utilization 0.8 " in started[0] and f"--gpu-memory-utilization {lowered} " in started[1]
