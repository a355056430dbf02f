"""The stand-in with `--distributed-executor-backend ray`, against real local Ray heads.

Each head is a real `ray start --head --block` with fake GPUs, shared by the
tests of this module (one per GPU count): a 1-GPU head, and a 2-GPU head
whose `ray start` environment says its machine has only LOW_FREE_GIB free,
so the sim's workers there need a low --gpu-memory-utilization. Ray's
unix sockets live under RAY_TMPDIR and must stay under 107 bytes, hence a
short private directory under /tmp rather than pytest's tmp_path.
"""

from __future__ import annotations

import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from gb10d.daemon.lab import free_port, live_pids
from gb10d.sim import make_venv, texts
from sim_support import Sim, StartSim, http, physical_lines

ray = pytest.importorskip("ray")
from ray._raylet import GcsClient  # noqa: E402 - only once Ray is known to be there
from ray.core.generated import gcs_pb2  # noqa: E402

DEADLINE_S = 120.0
RAY = Path(sys.executable).with_name("ray")
REPO = Path(__file__).resolve().parents[2]
TOTAL_GIB = 121.69
LOW_FREE_GIB = 40.0
FITS = ["--gpu-memory-utilization", "0.3"]  # 36.5 of 121.69 GiB: fits in LOW_FREE_GIB
TP2 = ["m", "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--max-model-len", "4096"]
WORKER = rb"\(RayWorkerWrapper pid=(\d+)\)"


@dataclass
class RayHead:
    """A running `ray start --head --block` and the private directory it keeps its sessions in."""

    process: subprocess.Popen[bytes]
    address: str
    tmpdir: str

    def env(self) -> dict[str, str]:
        """What the sim needs to join this cluster, as gb10d sets it."""
        return {"RAY_ADDRESS": self.address, "RAY_COLOR_PREFIX": "0", "GB10D_SIM_SHARDS": "3"}

    def worker_pids(self) -> list[int]:
        """Live RayWorkerWrapper processes of this cluster (their environment names its RAY_TMPDIR)."""
        ours = f"RAY_TMPDIR={self.tmpdir}".encode()

        def worker_of_this_cluster(entry: Path, _fields: list[str]) -> bool:
            named = "RayWorkerW" in (entry / "comm").read_text() or b"RayWorkerWrapper" in (entry / "cmdline").read_bytes()
            return named and ours in (entry / "environ").read_bytes().split(b"\0")

        return live_pids(worker_of_this_cluster)


def _wait_alive(head: RayHead) -> None:
    """Until the GCS reports an ALIVE node; the GcsClient itself waits for the GCS to come up."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert head.process.poll() is None, Path(head.tmpdir, "head.log").read_text(errors="replace")
        try:
            nodes = GcsClient(address=head.address).get_all_node_info(timeout=2)
        except Exception:
            continue
        if any(node.state == gcs_pb2.GcsNodeInfo.ALIVE for node in nodes.values()):
            return
    raise AssertionError(f"no Ray node came up within {DEADLINE_S} s")


def _stop(head: RayHead) -> None:
    """SIGKILL to the head's process group (GCS, raylet, agents; `ray start`'s own SIGTERM path takes tens of seconds).

    Ray starts its workers in sessions of their own; they exit once their
    raylet is gone, and are waited for.
    """
    workers = head.worker_pids()
    try:
        os.killpg(head.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.process.wait(DEADLINE_S)
    _wait_gone(workers)
    shutil.rmtree(head.tmpdir, ignore_errors=True)


def _wait_gone(pids: list[int], timeout: float = DEADLINE_S) -> None:
    """Until every one of these processes has exited (pidfds turn readable), at most `timeout` seconds."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    try:
        waiting = list(fds)
        while waiting:
            left = deadline - time.monotonic()
            assert left > 0, f"{len(waiting)} of {pids} still running after {timeout} s"
            ready, _, _ = select.select(waiting, [], [], left)
            waiting = [fd for fd in waiting if fd not in ready]
    finally:
        for fd in fds:
            os.close(fd)


def _head(num_gpus: int, extra_env: dict[str, str]) -> Iterator[RayHead]:
    tmpdir = tempfile.mkdtemp(prefix="gbr", dir="/tmp")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GB10D_SIM_", "VLLM_", "RAY_"))}
    env.update({"RAY_TMPDIR": tmpdir, **extra_env})
    with open(Path(tmpdir, "head.log"), "wb") as log:
        process = subprocess.Popen(
            [str(RAY), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", f"--num-gpus={num_gpus}",
             "--include-dashboard=false", "--disable-usage-stats"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    head = RayHead(process, f"127.0.0.1:{port}", tmpdir)
    try:
        _wait_alive(head)
        yield head
    finally:
        _stop(head)


@pytest.fixture(scope="module")
def one_gpu() -> Iterator[RayHead]:
    """A cluster of one node with one GPU."""
    yield from _head(1, {})


@pytest.fixture(scope="module")
def two_gpus_low_memory() -> Iterator[RayHead]:
    """A cluster of one node with two GPUs, on a machine with LOW_FREE_GIB free (its `ray start` environment says so)."""
    yield from _head(2, {"GB10D_SIM_TOTAL_GIB": str(TOTAL_GIB), "GB10D_SIM_FREE_GIB": str(LOW_FREE_GIB)})


def _record_lines(data: bytes, prefix: str) -> list[str]:
    """The physical lines that start with `prefix` (tags and record head), the prefix cut off."""
    return [line[len(prefix):].rstrip("\r") for line in physical_lines(data) if line.startswith(prefix)]


def _assert_engine_init_failure(s: Sim, final: str) -> tuple[int, list[str]]:
    """vLLM's failed-to-start sequence: the EngineCore's ERROR record and dump, the API server's RuntimeError, exit 1.

    Returns the EngineCore's pid and the lines of its ERROR record.
    """
    assert s.wait_exit(DEADLINE_S) == 1
    s.drain(DEADLINE_S)
    engine = s.engine_pid()
    head = re.search(rf"\(EngineCore pid={engine}\) ERROR \d\d-\d\d \d\d:\d\d:\d\d \[core\.py:1020\] ".encode(), bytes(s.stdout))
    assert head, bytes(s.stdout)[-3000:]
    record = _record_lines(bytes(s.stdout), head.group().decode())
    assert record[:2] == ["EngineCore failed to start.", "Traceback (most recent call last):"]
    assert record[-1] == final
    stderr = physical_lines(bytes(s.stderr))
    dump = stderr.index(f"(EngineCore pid={engine}) Process EngineCore:")
    assert f"(EngineCore pid={engine}) {final}" in stderr[dump:]
    assert stderr[-1] == f"(APIServer pid={s.process.pid}) {texts.engine_init_failed()}"
    return engine, record


def test_tensor_parallel_2_on_a_one_gpu_cluster_refuses_to_start(sim: StartSim, one_gpu: RayHead) -> None:
    s = sim(*TP2, env=one_gpu.env())
    _, record = _assert_engine_init_failure(s, texts.RAY_NOT_ENOUGH_GPUS)
    assert '    initialize_ray_cluster(self.parallel_config)' in record
    assert b"Connecting to existing Ray cluster at address" in bytes(s.stderr)
    assert b"RayWorkerWrapper" not in bytes(s.stdout) + bytes(s.stderr)


def test_tensor_parallel_2_on_two_gpus_loads_in_workers_and_serves(sim: StartSim, two_gpus_low_memory: RayHead) -> None:
    s = sim(*TP2, *FITS, env=two_gpus_low_memory.env())
    s.wait_ready(DEADLINE_S)
    engine = s.engine_pid()
    bar = re.compile(rf"^\(EngineCore pid={engine}\) \(RayWorkerWrapper pid=\d+\) *\rLoading safetensors checkpoint shards: +\d+% Completed \| (\d)/3 \[")
    drawn = [m.group(1) for m in map(bar.match, physical_lines(bytes(s.stderr))) if m]
    assert drawn[0] == "0" and drawn[-1] == "3", drawn
    found = _record_lines(bytes(s.stdout), f"(EngineCore pid={engine}) (RayWorkerWrapper pid=")
    # Ray prints the first of two lines that differ only in numbers and holds back the other (log de-duplication).
    assert any(re.fullmatch(r"\d+\) INFO \S+ \S+ \[parallel_state\.py:\d+\] world_size=2 rank=([01]) local_rank=\1 distributed_init_method=tcp://[\d.]+:\d+ backend=nccl", line) for line in found)
    assert any(re.fullmatch(r"\d+\) INFO \S+ \S+ \[model_runner\.py:\d+\] Model loading took 13\.66 GiB and [\d.]+ seconds", line) for line in found)
    assert http(s.port, "/health").status == 200
    reply = http(s.port, "/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4}).json()
    assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["finish_reason"] == "length"


def test_a_node_short_of_memory_fails_in_the_worker_until_the_utilization_fits(sim: StartSim, two_gpus_low_memory: RayHead) -> None:
    total = int(TOTAL_GIB * 2**30)
    requested = math.ceil(total * 0.92)
    message = texts.free_memory_error(int(LOW_FREE_GIB * 2**30), total, 0.92, requested, "cuda:0")
    message_any_device = re.escape(message).replace("cuda:0", "cuda:[01]")
    s = sim(*TP2, env=two_gpus_low_memory.env())
    engine, record = _assert_engine_init_failure(s, "ValueError: " + message)  # rank 0 is cuda:0 of the driver's node
    # The worker's record: every line with the same ERROR head, as NewLineFormatter writes it.
    stdout = bytes(s.stdout)
    first = re.search(rb"\(RayWorkerWrapper pid=(\d+)\) (ERROR \d\d-\d\d \d\d:\d\d:\d\d \[worker_base\.py:\d+\] )Error executing method 'init_device'\. This might cause deadlock in distributed execution\.\n", stdout)
    assert first, stdout[-3000:]
    worker = _record_lines(stdout, f"(EngineCore pid={engine}) (RayWorkerWrapper pid={first.group(1).decode()}) {first.group(2).decode()}")
    assert worker[1:2] in ([], ["Traceback (most recent call last):"]), worker
    # Ray forwards a worker's output asynchronously and may not deliver the tail of the record before the
    # driver exits (real vLLM shares this race): what arrives is the record's beginning, in order, cut anywhere.
    frames, last = worker[2:-1], worker[-1]
    assert all(line.startswith("  ") for line in frames), worker
    assert len(worker) <= 2 or last.startswith("  ") or re.fullmatch(f"ValueError: {message_any_device}", last), worker
    assert stdout.index(first.group()) < stdout.index(b"EngineCore failed to start.")
    # The driver's traceback ends in the worker's exception as ray.get re-raises it.
    task_error = re.compile(
        r"ray\.exceptions\.RayTaskError\(ValueError\): \x1b\[36mray::RayWorkerWrapper\.execute_method\(\)\x1b\[39m "
        r"\(pid=\d+, ip=[\d.]+, actor_id=[0-9a-f]{32}, repr=<vllm\.v1\.executor\.ray_utils\.RayWorkerWrapper object at 0x[0-9a-f]+>\)"
    )
    at = next(i for i, line in enumerate(record) if task_error.fullmatch(line))
    assert record[at + 1:at + 3] == ['  File "/opt/vllm/lib/python3.12/site-packages/vllm/v1/worker/worker_base.py", line 363, in execute_method', "    raise e"]
    assert '    return ray.get(ray_worker_outputs, timeout=timeout)' in record[:at]

    fits = sim(*TP2, *FITS, env=two_gpus_low_memory.env())
    fits.wait_ready(DEADLINE_S)


def test_sigterm_to_the_group_leaves_no_ray_worker_behind(sim: StartSim, two_gpus_low_memory: RayHead) -> None:
    s = sim(*TP2, *FITS, env=two_gpus_low_memory.env())
    s.wait_ready(DEADLINE_S)
    seen = {int(pid) for pid in re.findall(WORKER, bytes(s.stdout) + bytes(s.stderr))}
    workers = two_gpus_low_memory.worker_pids()
    assert seen and seen <= set(workers)
    os.killpg(s.process.pid, signal.SIGTERM)
    assert s.wait_exit(DEADLINE_S) == 0
    s.drain(DEADLINE_S)
    assert bytes(s.stdout).decode().count("[shutdown] EngineCore: exiting busy loop") == 1
    _wait_gone(workers)
    assert not set(two_gpus_low_memory.worker_pids()) & seen


def test_a_worker_lost_while_serving_ends_the_engine_as_engine_death(sim: StartSim, two_gpus_low_memory: RayHead) -> None:
    s = sim(*TP2, *FITS, env=two_gpus_low_memory.env())
    s.wait_ready(DEADLINE_S)
    victim = int(re.findall(WORKER, bytes(s.stdout))[0])
    os.kill(victim, signal.SIGKILL)
    s.wait_text("EngineCore encountered a fatal error.", "stdout", DEADLINE_S)
    assert s.wait_exit(DEADLINE_S) == 0
    s.drain(DEADLINE_S)
    stdout = bytes(s.stdout).decode()
    assert re.search(r"\] ray\.exceptions\.ActorDiedError: The actor died unexpectedly before finishing this task\.\r?$", stdout, re.M)
    assert "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" in stdout
    assert "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue." in stdout


def test_without_ray_installed_the_engine_fails_with_vllms_import_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GB10D_SIM_", "VLLM_", "RAY_"))}
    env.update({"GB10D_SIM_SPEED": "0.01", "NO_COLOR": "1", "PYTHONPATH": str(REPO)})
    port = free_port()
    # -S: no site-packages, so no Ray (gb10d itself comes from PYTHONPATH).
    process = subprocess.Popen(
        [sys.executable, "-S", "-m", "gb10d.sim", "serve", *TP2, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    s = Sim(process, port)
    s.start_pumps()
    try:
        _assert_engine_init_failure(s, texts.ray_import_failed("No module named 'ray'"))
    finally:
        s.kill_group()


def test_make_venv_gives_ray_and_python_programs_of_this_interpreter(tmp_path: Path) -> None:
    make_venv(tmp_path / "venv")
    bin_dir = tmp_path / "venv" / "bin"
    bare = {"PATH": "/usr/bin:/bin"}
    version = subprocess.run([str(bin_dir / "ray"), "--version"], capture_output=True, text=True, timeout=DEADLINE_S, env=bare)
    assert (version.returncode, version.stdout) == (0, f"ray, version {ray.__version__}\n")
    usage = subprocess.run([str(bin_dir / "ray"), "--help"], capture_output=True, text=True, timeout=DEADLINE_S, env=bare)
    assert usage.stdout.startswith("Usage: ray [OPTIONS] COMMAND")  # argv[0] is the script, as in a real virtualenv
    python = subprocess.run(
        [str(bin_dir / "python"), "-c", "import sys, ray, gb10d.sim; print(sys.executable, sys.argv[1:])", "a b"],
        capture_output=True, text=True, timeout=DEADLINE_S, env=bare,
    )
    assert (python.returncode, python.stdout) == (0, f"{sys.executable} ['a b']\n")
