"""vLLM in a container, against real engines: the launcher and runtime gb10d drives, with gb10d.sim as the image's vllm.

Each test runs under docker and under rootful podman (and the lifecycle ones
also through podman's API socket, the way a gb10d that is not root reaches
it). What is asserted is what an operator sees: the container's output and
exit status through the client, the port on the host, the engine's own list
of containers, the cgroup's counters.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from config_support import make_config
from containers import (
    Registry,
    SlowLink,
    container_exists,
    container_running,
    engine_or_skip,
    engine_run,
    ensure_sim_image,
    plain_http_registry,
    push_random_image,
    registries_conf,
    remove_image,
    run_args_for,
    sigterm_ignoring_program,
    start_registry,
)
from gb10d.base.command import Engine, EngineKind, build_argv
from gb10d.base.config import Config
from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP, SpawnError
from gb10d.base.image import PullFailed, PullProgress
from gb10d.core.containerstart import refused_before_vllm, run_failure, signal_status
from gb10d.launch.cgroup import ContainerCgroup, blkio_bytes, cgroup_files, cgroup_mounts, io_stat_bytes, paged_in_bytes
from gb10d.launch.container import ContainerLauncher
from gb10d.launch.engine import EngineUnavailable, unreachable_advice
from gb10d.launch.runtime import Launcher, Runtime
from harness import DEADLINE_S, free_port, live_pids, wait_until

pytestmark = pytest.mark.timeout(240)

# The sim at 1/50 of GB10's pace: serving about three seconds after its container starts.
SIM_SPEED = "0.02"


# --- what the engine's words and the cgroup files mean (plain functions) --------------------------------

DOCKER = Engine("docker", ("docker",))
PODMAN = Engine("podman", ("podman", "--remote", "--url", "unix:///run/podman/podman.sock"))


@pytest.mark.parametrize(
    ("engine", "text", "advice"),
    [
        (DOCKER, 'permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock: Get '
         '"http://%2Fvar%2Frun%2Fdocker.sock/v1.50/version": dial unix /var/run/docker.sock: connect: permission denied',
         "the user gb10d may not use docker's socket /var/run/docker.sock; add it to the docker group (sudo usermod -aG docker gb10d, "
         "then restart gb10d). Membership of the docker group is as good as root on this machine"),
        (DOCKER, "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?",
         "docker's daemon is not running (nothing answers on /var/run/docker.sock); start it: sudo systemctl enable --now docker"),
        (PODMAN, 'Error: unable to connect to Podman socket: Get "http://d/v4.3.1/libpod/_ping": dial unix /run/podman/podman.sock: connect: no such file or directory',
         "podman's API service is not running (nothing answers on /run/podman/podman.sock); start it: sudo systemctl enable --now podman.socket"),
        (PODMAN, 'Error: unable to connect to Podman socket: Get "http://d/v4.3.1/libpod/_ping": dial unix /run/podman/podman.sock: connect: permission denied',
         "the user gb10d may not use podman's socket /run/podman/podman.sock; let its group in (sudo systemctl edit podman.socket: "
         "[Socket] SocketGroup=gb10d, then sudo systemctl restart podman.socket). Access to the socket is as good as root on this machine"),
        (DOCKER, 'Error response from daemon: Get "http://127.0.0.1:5000/v2/": dial tcp 127.0.0.1:5000: connect: connection refused', None),
    ],
)
def test_an_unreachable_engine_is_explained_with_the_fix(engine: Engine, text: str, advice: str | None) -> None:
    assert unreachable_advice(engine, text, "gb10d") == advice


@pytest.mark.parametrize(
    ("text", "advice"),
    [
        ('docker: Error response from daemon: could not select device driver "" with capabilities: [[gpu]].',
         "docker cannot give the container the GPU: install the NVIDIA Container Toolkit"),
        ("Error: setting up CDI devices: unresolvable CDI devices nvidia.com/gpu=all", "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"),
        ("docker: Error response from daemon: No such image: nvcr.io/nvidia/vllm:26.05-py3.", 'set container.pull = "missing"'),
        ('docker: Error response from daemon: Conflict. The container name "/gb10d" is already in use by container "b4b0".', "remove it (docker rm -f NAME) or set container.name"),
        ("Error: runc: runc create failed: unable to start container process: error during container init: error setting rlimits for ready process",
         "give them in container.run_args (--ulimit NAME=SOFT:HARD)"),
    ],
)
def test_an_engine_that_refuses_to_start_the_container_says_what_to_do(text: str, advice: str) -> None:
    message = run_failure(DOCKER, "nvcr.io/nvidia/vllm:26.05-py3", text, 125)
    assert message.startswith("docker could not start the container of nvcr.io/nvidia/vllm:26.05-py3: ")
    assert advice in message


@pytest.mark.parametrize(("status", "reported"), [(0, 0), (1, 1), (127, 127), (130, -signal.SIGINT), (137, -signal.SIGKILL), (143, -signal.SIGTERM), (255, 255)])
def test_a_container_killed_by_a_signal_is_reported_like_a_process(status: int, reported: int) -> None:
    assert signal_status(status) == reported


@pytest.mark.parametrize(
    ("status", "inspected", "started_at", "refused"),
    [
        (125, False, "", True),  # the engine cannot show the container: it never had one
        (125, True, "0001-01-01T00:00:00Z\n", True),  # created, never started
        (127, True, "0001-01-01T00:00:00Z\n", True),
        (127, True, "2026-12-05T10:00:00.1Z\n", False),  # it ran: vLLM's own output says why it ended
        (1, False, "", False),  # vLLM's exit status, not the engine's
    ],
)
def test_only_an_engine_status_for_a_container_that_never_ran_is_the_engines_refusal(
    status: int, inspected: bool, started_at: str, refused: bool
) -> None:
    assert refused_before_vllm(status, inspected, started_at) is refused


HYBRID = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
# A booted container with its own cgroup namespace root: the host's docker cgroups lie outside it.
NAMESPACED = "30 23 0:26 /machine.slice/gb10d-test /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
DOCKER_CGROUP = "0::/system.slice/docker-0123abcd.scope\n"


def test_cgroup_v2_counts_block_io_in_io_stat() -> None:
    files = cgroup_files(DOCKER_CGROUP, cgroup_mounts(V2))
    assert files == ContainerCgroup(Path("/sys/fs/cgroup/system.slice/docker-0123abcd.scope"),
                                    io_stat=Path("/sys/fs/cgroup/system.slice/docker-0123abcd.scope/io.stat"))


def test_hybrid_cgroups_count_blkio_and_the_pages_the_memory_cgroup_took_in() -> None:
    proc = "9:name=systemd:/docker/0123abcd\n7:blkio:/docker/0123abcd\n4:memory:/docker/0123abcd\n1:cpu,cpuacct:/docker/0123abcd\n0::/docker/0123abcd\n"
    assert cgroup_files(proc, cgroup_mounts(HYBRID)) == ContainerCgroup(
        Path("/sys/fs/cgroup/memory/docker/0123abcd"),
        blkio=Path("/sys/fs/cgroup/blkio/docker/0123abcd/blkio.throttle.io_service_bytes_recursive"),
        memory_stat=Path("/sys/fs/cgroup/memory/docker/0123abcd/memory.stat"),
    )


def test_a_cgroup_outside_this_namespace_is_not_guessed_at() -> None:
    assert cgroup_files("0::/../../system.slice/docker-0123abcd.scope\n", cgroup_mounts(NAMESPACED)) is None


def test_cgroup_counters_are_summed_over_devices() -> None:
    # io.stat as a cgroup v2 kernel (6.18) wrote it after 300 reads of 40 KiB past the page cache, and with a second device.
    assert io_stat_bytes("254:0 rbytes=12288000 wbytes=0 rios=300 wios=0 dbytes=0 dios=0\n") == 12288000
    assert io_stat_bytes("259:0 rbytes=1048576 wbytes=4096 rios=10 wios=1 dbytes=0 dios=0\n8:0 rbytes=10 wbytes=0 rios=1 wios=0 dbytes=0 dios=0\n") == 1048576 + 4096 + 10
    assert blkio_bytes("8:0 Read 100\n8:0 Write 20\n8:0 Sync 120\n8:0 Async 0\n8:0 Discard 0\n8:0 Total 120\nTotal 120\n") == 120
    assert paged_in_bytes("cache 348160\npgpgin 6876\npgpgout 6791\ntotal_pgpgin 7000\n", 4096) == 7000 * 4096
    assert paged_in_bytes("cache 0\npgpgin 12\n", 4096) == 12 * 4096


@pytest.fixture(scope="module", params=["docker", "podman"])
def engine(request: pytest.FixtureRequest) -> Engine:
    kind: EngineKind = request.param
    return engine_or_skip(kind)


@pytest.fixture(scope="module")
def podman_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Rootful podman's API service on a socket of the test's own, as podman.socket provides it to a gb10d that is not root."""
    engine_or_skip("podman")
    sock = tmp_path_factory.mktemp("podman") / "podman.sock"
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(sock.exists, DEADLINE_S, f"podman's API socket {sock}")
    yield sock
    service.terminate()
    service.wait(timeout=60)


@pytest.fixture(scope="module", params=["docker", "podman", "podman-remote"])
def any_engine(request: pytest.FixtureRequest) -> Engine:
    """Each engine, and podman through its API socket."""
    if request.param == "podman-remote":
        return engine_or_skip("podman", request.getfixturevalue("podman_service"))
    kind: EngineKind = request.param
    return engine_or_skip(kind)


def sim_config(engine: Engine, tmp_path: Path, image: str, scenario: str = "healthy", **container: Any) -> Config:
    """A config that runs the sim image on a free port, without a GPU, under a container name of this test's own."""
    socket_path = engine.client[engine.client.index("--url") + 1].removeprefix("unix://") if "--url" in engine.client else None
    table: dict[str, Any] = {
        "engine": engine.kind,
        "gpu": "none",
        "cache_dir": str(tmp_path / "cache"),
        "name": f"gb10d-test-{os.getpid()}-{tmp_path.name[-24:]}".replace("_", "-"),
        "run_args": run_args_for(engine.kind),
        "pull": "never",
        **({"socket": socket_path} if socket_path else {}),
        **container,
    }
    return make_config(
        vllm={"image": image, "port": free_port(), "env": {"GB10D_SIM_SPEED": SIM_SPEED, "GB10D_SIM_SCENARIO": scenario}},
        daemon={"stop_timeout_s": 10},
        container=table,
    )


class Output:
    """What the container printed, as the client hands it over, with a wait for a text to appear."""

    def __init__(self) -> None:
        self.text = b""
        self.stderr = b""
        self._changed = asyncio.Event()

    def on_stdout(self, chunk: bytes) -> None:
        self.text += chunk
        self._changed.set()

    def on_stderr(self, chunk: bytes) -> None:
        self.stderr += chunk
        self.text += chunk
        self._changed.set()

    async def wait_for(self, needle: bytes, timeout_s: float = DEADLINE_S) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while needle not in self.text:
            self._changed.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                raise AssertionError(f"{needle!r} not printed within {timeout_s} s; got:\n{self.text[-3000:].decode(errors='replace')}")
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass


class Started:
    """A launched container with its output being read."""

    def __init__(self, runtime: Runtime, output: Output, readers: list[asyncio.Task[None]]) -> None:
        self.runtime = runtime
        self.output = output
        self.readers = readers


async def start(launcher: ContainerLauncher, argv: list[str] | None = None) -> Started:
    """Launch as an attempt does, through the Launcher and Runtime interfaces only (mypy checks the container fits them)."""
    vllm = launcher.config.vllm
    attempt: Launcher = launcher
    runtime = await attempt.launch(argv or build_argv(vllm), attempt.environment(vllm))
    output = Output()
    readers = [asyncio.ensure_future(r) for r in runtime.readers(output.on_stdout, output.on_stderr)]
    return Started(runtime, output, readers)


async def serving(port: int, timeout_s: float = DEADLINE_S) -> None:
    """Wait until vLLM's /health on the host's port answers 200."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            try:
                if (await client.get(f"http://127.0.0.1:{port}/health", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"nothing served /health on port {port} within {timeout_s} s")
            await asyncio.sleep(0.1)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def cleanup(engine: Engine) -> Iterator[list[str]]:
    """Container names a test used; whatever happened, none of them outlives it."""
    names: list[str] = []
    yield names
    for name in names:
        engine_run(engine, "rm", "--force", name, check=False)


def test_healthy_sim_serves_on_the_hosts_port_and_stop_leaves_nothing(any_engine: Engine, tmp_path: Path) -> None:
    config = sim_config(any_engine, tmp_path, ensure_sim_image(any_engine))
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", any_engine)

    async def scenario() -> None:
        started = await start(launcher)
        runtime = started.runtime
        try:
            await serving(config.vllm.port)
            assert runtime.alive() and runtime.members(), "the container's processes are seen from the host"
            assert container_running(any_engine, launcher.name)
            await started.output.wait_for(b"Starting vLLM server on http://0.0.0.0:")
            began = time.monotonic()
            assert await runtime.stop(config.daemon.stop_timeout_s) is True
            assert time.monotonic() - began < config.daemon.stop_timeout_s, "vLLM drained on SIGTERM; no escalation was needed"
            assert await runtime.wait() == 0
            await asyncio.gather(*started.readers)
            assert b"[shutdown] API server: shutdown triggered" in started.output.text
        finally:
            await runtime.kill()
        assert not runtime.alive()
        assert not container_exists(any_engine, launcher.name), "stop removes the container"
        assert not port_open(config.vllm.port)

    asyncio.run(scenario())


def test_vllms_exit_status_and_error_reach_gb10d_through_the_client(engine: Engine, tmp_path: Path, cleanup: list[str]) -> None:
    config = sim_config(engine, tmp_path, ensure_sim_image(engine), scenario="model_not_found")
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", engine)
    cleanup.append(launcher.name)

    async def scenario() -> None:
        started = await start(launcher)
        assert await started.runtime.wait() == 1
        await asyncio.gather(*started.readers)
        assert b"Qwen/Qwen3.6-27B-FP8" in started.output.stderr and b"Traceback" in started.output.stderr
        # An exited container stays until removed, so gb10d can read how it ended; kill() removes it.
        assert container_exists(engine, launcher.name)
        assert await started.runtime.kill() is True
        assert not container_exists(engine, launcher.name)

    asyncio.run(scenario())


def test_stop_escalates_to_sigkill_when_vllm_ignores_sigterm(engine: Engine, tmp_path: Path, cleanup: list[str]) -> None:
    config = sim_config(engine, tmp_path, ensure_sim_image(engine))
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", engine)
    cleanup.append(launcher.name)
    escalated: list[list[int]] = []

    async def scenario() -> None:
        started = await start(launcher, sigterm_ignoring_program())
        await started.output.wait_for(b"ignoring SIGTERM")
        began = time.monotonic()
        assert await started.runtime.stop(1.0, escalated.append) is True
        assert 1.0 <= time.monotonic() - began < 1.0 + 5, "SIGKILL follows the grace at once"
        assert await started.runtime.wait() == -signal.SIGKILL

    asyncio.run(scenario())
    assert escalated and escalated[0], "the escalation names the processes it kills"
    assert not container_exists(engine, launcher.name)


def test_sigkill_of_the_client_leaves_the_container_running_and_the_next_start_removes_it(any_engine: Engine, tmp_path: Path) -> None:
    config = sim_config(any_engine, tmp_path, ensure_sim_image(any_engine))
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", any_engine)

    async def first_gb10d() -> int:
        started = await start(launcher)
        await serving(config.vllm.port)
        return started.runtime.pid

    try:
        client = asyncio.run(first_gb10d())
        os.kill(client, signal.SIGKILL)  # as when gb10d and its client die together (SIGKILL of the unit's main process)
        wait_until(lambda: not live_pids(lambda entry, _f: entry.name == str(client)), DEADLINE_S, "the client to be gone")
        assert container_running(any_engine, launcher.name), "the engine keeps the container running without its client"
        assert port_open(config.vllm.port)

        removed = asyncio.run(ContainerLauncher(config, tmp_path / "gb10d.toml", any_engine).clear_leftovers())
        assert removed is not None and removed.startswith(f"removed the container {launcher.name} (") and "earlier gb10d" in removed
        assert not container_exists(any_engine, launcher.name)
        wait_until(lambda: not port_open(config.vllm.port), DEADLINE_S, "vLLM's port to close")
        assert asyncio.run(launcher.clear_leftovers()) is None, "nothing is left to remove the second time"
    finally:
        engine_run(any_engine, "rm", "--force", launcher.name, check=False)


def test_a_container_gb10d_did_not_start_is_left_alone(engine: Engine, tmp_path: Path, cleanup: list[str]) -> None:
    config = sim_config(engine, tmp_path, ensure_sim_image(engine))
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", engine)
    cleanup.append(launcher.name)
    engine_run(engine, "create", "--name", launcher.name, *run_args_for(engine.kind), config.vllm.image or "", "python3")
    with pytest.raises(SpawnError) as refused:
        asyncio.run(launcher.clear_leftovers())
    assert f"a container named {launcher.name} exists that something other than gb10d started" in str(refused.value)
    assert f"{engine.kind} rm -f {launcher.name}" in str(refused.value)
    assert container_exists(engine, launcher.name)


async def _settled(count: Callable[[], int | None], within_s: float = 30.0) -> int | None:
    """The count once two readings a quarter second apart agree: the loader has gone to sleep in its hang.

    The stand-in reads all through a shard's load, so a loading shard moves the count between any two such readings."""
    deadline = asyncio.get_running_loop().time() + within_s
    last = count()
    while True:
        await asyncio.sleep(0.25)
        now = count()
        if now == last:
            return now
        assert asyncio.get_running_loop().time() < deadline, f"the byte count still moved {within_s:.0f} s after the loader's hang began"
        last = now


def test_io_bytes_grow_while_the_sim_loads_and_stay_flat_while_it_hangs(engine: Engine, tmp_path: Path, cleanup: list[str]) -> None:
    # Two shards of about two seconds each, really reading, then the loader hangs as on GB10's mmap stall.
    config = sim_config(engine, tmp_path, ensure_sim_image(engine), scenario="slow_shards=100,stall_at=2")
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", engine)
    cleanup.append(launcher.name)

    async def scenario() -> tuple[int, int, int, int]:
        started = await start(launcher)
        runtime = started.runtime
        await started.output.wait_for(b"0/6 [")
        loading = runtime.io_bytes()
        await started.output.wait_for(b"1/6 [")
        loaded = runtime.io_bytes()
        await started.output.wait_for(b"2/6 [")
        hung = await _settled(runtime.io_bytes)
        await asyncio.sleep(3.0)  # a span to measure over, not a synchronisation
        still = runtime.io_bytes()
        await runtime.kill()
        assert loading is not None and loaded is not None and hung is not None and still is not None
        return loading, loaded, hung, still

    loading, loaded, hung, still = asyncio.run(scenario())
    assert loaded - loading >= 1 << 20, f"a loading shard moved the count by {loaded - loading} bytes only"
    assert still - hung < 1 << 20, f"a hung loader moved the count by {still - hung} bytes"


def test_engine_that_cannot_give_the_gpu_is_a_spawn_error_that_says_what_to_install(engine: Engine, tmp_path: Path, cleanup: list[str]) -> None:
    # No CDI description of an NVIDIA GPU exists on the test machines, so the engine refuses before vLLM runs.
    config = sim_config(engine, tmp_path, ensure_sim_image(engine), gpu="cdi")
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", engine)
    cleanup.append(launcher.name)
    with pytest.raises(EngineUnavailable) as refused:
        asyncio.run(start(launcher))
    message = str(refused.value)
    assert message.startswith(f"{engine.kind} could not start the container of {config.vllm.image}: ")
    assert "there is no CDI description of the GPU: sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml" in message
    assert refused.value.exit_status == EXIT_CONFIG
    assert not container_exists(engine, launcher.name), "nothing of the refused start is left"


def test_an_image_without_vllm_fails_like_a_vllm_that_cannot_start(engine: Engine, tmp_path: Path, cleanup: list[str]) -> None:
    # With --init the container starts (its init runs) and init reports that it cannot run vllm: docker's tini
    # exits 127, podman's catatonit 1, each with its reason on stderr, which reaches the journal.
    config = sim_config(engine, tmp_path, ensure_sim_image(engine))
    launcher = ContainerLauncher(config, tmp_path / "gb10d.toml", engine)
    cleanup.append(launcher.name)

    async def scenario() -> None:
        started = await start(launcher, ["vllm-missing", "serve", "m"])
        assert await started.runtime.wait() == {"docker": 127, "podman": 1}[engine.kind]
        await asyncio.gather(*started.readers)
        assert b"No such file or directory" in started.output.stderr
        assert await started.runtime.kill() is True

    asyncio.run(scenario())
    assert not container_exists(engine, launcher.name)


# --- pulling -------------------------------------------------------------------------------------------


def prepare(launcher: ContainerLauncher) -> tuple[Any, list[PullProgress]]:
    facts: list[PullProgress] = []
    prepared = asyncio.run(launcher.prepare(facts.append))
    return prepared, facts


def test_missing_image_with_pull_never_is_a_clear_error(engine: Engine, tmp_path: Path) -> None:
    config = sim_config(engine, tmp_path, "localhost/gb10d-test/absent:1", pull="never")
    with pytest.raises(PullFailed) as failed:
        prepare(ContainerLauncher(config, tmp_path / "gb10d.toml", engine))
    assert str(failed.value) == (
        f'the image localhost/gb10d-test/absent:1 is not present in {engine.kind} and container.pull is "never"; '
        f'load it ({engine.kind} pull localhost/gb10d-test/absent:1, or {engine.kind} load -i FILE) or set container.pull = "missing"'
    )
    assert failed.value.exit_status == EXIT_CONFIG and failed.value.retry_worthy is False


def test_pull_from_an_unreachable_registry_fails_quickly_and_says_so(engine: Engine, tmp_path: Path) -> None:
    image = f"127.0.0.1:{free_port()}/gb10d/absent:1"
    config = sim_config(engine, tmp_path, image, pull="missing")
    began = time.monotonic()
    with pytest.raises(PullFailed) as failed:
        prepare(ContainerLauncher(config, tmp_path / "gb10d.toml", engine))
    assert time.monotonic() - began < 60
    assert failed.value.kind == "unreachable", str(failed.value)
    assert str(failed.value).startswith(f"cannot pull {image}: ")
    assert "connection refused" in str(failed.value).lower()
    assert f"127.0.0.1:{image.split(':')[1].split('/')[0]} cannot be reached from this machine" in str(failed.value)
    assert failed.value.exit_status == EXIT_GAVE_UP


@pytest.fixture
def registry(tmp_path: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """A local registry this test's engine may use over plain HTTP."""
    with plain_http_registry(tmp_path, monkeypatch) as started:
        yield started


@pytest.mark.slow
def test_missing_image_is_pulled_with_progress_and_its_digest_is_known(engine: Engine, tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    # Over a link of 8 MB/s the 32 MiB layer takes seconds, so the engine reports its bytes as they arrive.
    digest = push_random_image(engine, tmp_path, f"{registry.address}/gb10d/random:1", size_mib=32)
    link = SlowLink(registry.address, rate_bps=8 << 20)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries_conf(tmp_path, link.address)))
    image = f"{link.address}/gb10d/random:1"
    launcher = ContainerLauncher(sim_config(engine, tmp_path, image, pull="missing"), tmp_path / "gb10d.toml", engine)
    try:
        prepared, facts = prepare(launcher)
    finally:
        link.close()
        remove_image(engine, image)
    assert prepared.pulled and prepared.previous is None and prepared.moved is None
    assert prepared.info.repo_digest == digest and prepared.info.identity == digest
    assert facts[0].layers_total == 0, "the pull is announced before the registry answers"
    downloading = [f.downloaded_bytes for f in facts if 0 < f.downloaded_bytes < f.total_bytes]
    assert len(downloading) >= 3 and downloading == sorted(downloading), [f.describe() for f in facts]
    last = facts[-1]
    assert last.layers_done == last.layers_total == 1
    assert last.downloaded_bytes == last.total_bytes >= 32 << 20
    assert last.describe() == f"pulling {image}: {last.total_bytes / 1e9:.2f} of {last.total_bytes / 1e9:.2f} GB downloaded, {last.unpacked_bytes / 1e9:.2f} GB unpacked (1 of 1 layers)"


def test_present_image_is_not_pulled_again_with_pull_missing(engine: Engine, tmp_path: Path) -> None:
    image = ensure_sim_image(engine)
    launcher = ContainerLauncher(sim_config(engine, tmp_path, image, pull="missing"), tmp_path / "gb10d.toml", engine)
    prepared, facts = prepare(launcher)
    assert not prepared.pulled and facts == [] and prepared.moved is None
    assert prepared.info.identity.startswith("sha256:")
    assert prepare(launcher)[0].info == prepared.info, "the same image is the same identity at the next start"


@pytest.mark.slow
def test_a_tag_that_moved_is_noticed_by_pull_always(engine: Engine, tmp_path: Path, registry: Registry) -> None:
    image = f"{registry.address}/gb10d/moving:1"
    first = push_random_image(engine, tmp_path, image, size_mib=1)
    launcher = ContainerLauncher(sim_config(engine, tmp_path, image, pull="always"), tmp_path / "gb10d.toml", engine)
    pulled: list[str] = []
    try:
        before, _ = prepare(launcher)
        pulled.append(before.info.image_id)
        # Re-pushed under the registry's other name, so the image pulled before stays here, as on a machine that pulled last month.
        second = push_random_image(engine, tmp_path, image.replace("127.0.0.1", "localhost"), size_mib=1)
        after, _ = prepare(launcher)
    finally:
        for leftover in [image, *pulled]:
            remove_image(engine, leftover)
    assert before.info.identity == first and after.info.identity == second != first
    assert after.previous == before.info
    assert after.moved == (
        f"the tag {image} now points to another image: {second} (was {first}); "
        "settings learned with the old image are not applied until this one has started"
    )


def test_unknown_tag_is_a_config_error_naming_the_registry(engine: Engine, tmp_path: Path, registry: Registry) -> None:
    image = f"{registry.address}/gb10d/random:no-such-tag"
    with pytest.raises(PullFailed) as failed:
        prepare(ContainerLauncher(sim_config(engine, tmp_path, image, pull="missing"), tmp_path / "gb10d.toml", engine))
    assert failed.value.kind == "not_found", str(failed.value)
    assert f"{registry.address} has no image {image}; check the repository and tag of vllm.image" in str(failed.value)
    assert failed.value.exit_status == EXIT_CONFIG


def test_refused_credentials_say_how_to_log_in(engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    guarded = start_registry(tmp_path / "guarded", auth=True)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries_conf(tmp_path, guarded.address)))
    image = f"{guarded.address}/gb10d/private:1"
    try:
        with pytest.raises(PullFailed) as failed:
            prepare(ContainerLauncher(sim_config(engine, tmp_path, image, pull="missing"), tmp_path / "gb10d.toml", engine))
    finally:
        guarded.stop()
    assert failed.value.kind == "unauthorized", str(failed.value)
    assert f"log in as that user (sudo -u gb10d {engine.kind} login {guarded.address})" in str(failed.value)
    assert failed.value.exit_status == EXIT_CONFIG


@pytest.mark.slow
async def _reported(facts: list[PullProgress], loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the engine reports downloaded bytes within the deadline (it tells them a moment after they arrive)."""
    deadline = loop.time() + DEADLINE_S
    while not any(f.downloaded_bytes for f in facts):
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def test_a_stalled_pull_stops_reporting_progress_and_ends_when_cancelled(engine: Engine, tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    # The link delivers 4 MiB of the layer and then nothing, holding the connection open, as a stalled download does.
    push_random_image(engine, tmp_path, f"{registry.address}/gb10d/stalled:1", size_mib=32)
    link = SlowLink(registry.address, rate_bps=8 << 20, stall_after=4 << 20)
    monkeypatch.setenv("CONTAINERS_REGISTRIES_CONF", str(registries_conf(tmp_path, link.address)))
    image = f"{link.address}/gb10d/stalled:1"
    launcher = ContainerLauncher(sim_config(engine, tmp_path, image, pull="missing"), tmp_path / "gb10d.toml", engine)
    facts: list[PullProgress] = []

    def pulling() -> list[int]:
        return live_pids(lambda entry, _f: image.encode() in (entry / "cmdline").read_bytes())

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(launcher.prepare(facts.append))
        assert await asyncio.to_thread(link.stalled.wait, DEADLINE_S), "the link never sent its bytes before the stall"
        assert await _reported(facts, loop), "no bytes were reported before the stall"
        # The engine reports the bytes that reached it before the stall, then nothing: a span of 3 s
        # without a report (what the stall timer sees) comes, however late the last bytes are told.
        deadline = loop.time() + DEADLINE_S
        reported, since = len(facts), loop.time()
        while loop.time() - since < 3.0:
            assert loop.time() < deadline, f"nothing moved, yet progress was still reported {DEADLINE_S:.0f} s after the stall"
            await asyncio.sleep(0.1)
            if len(facts) != reported:
                reported, since = len(facts), loop.time()
        assert not task.done() and pulling(), "the pull neither failed nor finished"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(scenario())
    finally:
        link.close()
        remove_image(engine, image)
    assert 0 < max(f.downloaded_bytes for f in facts) < 32 << 20
    assert not pulling(), "cancelling the pull ends the engine's client"
