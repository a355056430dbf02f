"""vLLM in a container under a real systemd: the unit as installed from the .deb drives the host's docker.

A Debian 12 system is booted with the host's network and the host's docker
socket bound in, and only the docker CLI installed, as a GB10 whose gb10d
user is in the docker group. vLLM is gb10d.sim as the `vllm` of an image
built on the host (tests/containers.py). What is asserted is what systemd
and the host's docker show: the unit serves once the container does; after
`systemctl stop` no container is left; after `kill -9` of gb10d the unit's
cleanup (ExecStopPost=gb10d cleanup) removes the container; and where that
cleanup did not run, the next `systemctl start` removes the stale one.
"""

from __future__ import annotations

import grp
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from containers import engine_or_skip, ensure_sim_image
from harness import free_port
from systemd_harness import BOOT_TIMEOUT_S, DEBIAN_12_AMD64, BootFailed, Container, boot, cached_root, missing_tools
from test_systemd_e2e import MEMINFO, drop_in, journal, meminfo

pytestmark = [pytest.mark.systemd, pytest.mark.slow, pytest.mark.timeout(900)]

UNIT = "gb10d.service"
CONFIG = "/etc/gb10d.toml"
DOCKER_SOCKET = Path("/var/run/docker.sock")


def host_docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def image() -> str:
    """The sim image in the host's docker (built from this tree if missing)."""
    return ensure_sim_image(engine_or_skip("docker"))


@contextmanager
def docker_box(tmp_path_factory: pytest.TempPathFactory, build_deb: Callable[[str, str], Path], binds: tuple[Path, ...]) -> Iterator[Container]:
    """A booted Debian 12 with the .deb installed, the docker CLI, and gb10d in the group of the host's docker socket.

    Each of `binds` is a host directory seen at the same path inside: what
    the host's docker mounts into a container must lie where both sides see it.
    """
    if os.geteuid() != 0 or missing_tools("debootstrap", "systemd-nspawn", "nsenter"):
        pytest.skip("needs root, debootstrap, systemd-nspawn and nsenter (test_systemd_e2e.py says more)")
    share = tmp_path_factory.mktemp("engine-share")
    try:
        container = boot(
            cached_root(DEBIAN_12_AMD64), share, share.parent / f"{share.name}-console.log", BOOT_TIMEOUT_S, host_network=True, binds=(DOCKER_SOCKET, *binds))
    except BootFailed as exc:
        if os.environ.get("GB10D_REQUIRE_SYSTEMD_E2E") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    try:
        container.run("dpkg", "-i", container.put(build_deb(DEBIAN_12_AMD64.arch, DEBIAN_12_AMD64.python), "gb10d.deb"))
        # Only the client: the engine is the host's, reached through its socket.
        container.run("install", "-m", "0755", container.put(Path(str(shutil.which("docker"))), "docker"), "/usr/bin/docker")
        gid = os.stat(DOCKER_SOCKET).st_gid
        if container.run("getent", "group", str(gid), check=False).returncode != 0:
            container.run("groupadd", "--gid", str(gid), grp.getgrgid(gid).gr_name)
        group = container.run("getent", "group", str(gid)).stdout.split(":")[0]
        container.run("usermod", "-aG", group, "gb10d")  # what the README asks for: as good as root
        container.write(MEMINFO, meminfo(total_gib=121.69, free_gib=115.0))
        yield container
    finally:
        container.halt()


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, build_deb: Callable[[str, str], Path], image: str) -> Iterator[Container]:
    """The docker box, with a config of the sim image whose caches lie where both sides see them."""
    cache = tmp_path_factory.mktemp("engine-cache")
    try:
        with docker_box(tmp_path_factory, build_deb, (cache,)) as container:
            container.write(CONFIG, config(image, cache))
            yield container
    finally:
        host_docker("rm", "--force", NAME)


NAME = f"gb10d-systemd-test-{os.getpid()}"


def config(image: str, cache: Path) -> str:
    """vLLM from the sim image through docker, on a port of the host's network, its caches where both sides see them alike."""
    return f"""
[vllm]
image = "{image}"
model = "Qwen/Qwen3.6-27B-FP8"
served_model_name = "qwen-test"
host = "127.0.0.1"
port = {free_port()}
gpu_memory_utilization = 0.8

[vllm.env]
GB10D_SIM_SPEED = "0.01"

[memory]
meminfo_path = "{MEMINFO}"
preflight = false

[metrics]
listen = ""

[container]
engine = "docker"
gpu = "none"
pull = "never"
cache_dir = "{cache}"
name = "{NAME}"
"""


@pytest.fixture
def unit(box: Container) -> Iterator[Container]:
    """The booted system for one test; the unit is stopped and reset afterwards, and no container of it is left."""
    yield box
    box.run("systemctl", "stop", UNIT, check=False)
    box.run("systemctl", "reset-failed", UNIT, check=False)
    host_docker("rm", "--force", NAME)


def containers() -> list[str]:
    """The containers the host's docker holds for the booted gb10d's config, by gb10d's label."""
    return host_docker("ps", "--all", "--filter", f"label=gb10d.config={CONFIG}", "--filter", f"name=^{NAME}$", "--format", "{{.Names}}").stdout.split()


def container_id() -> str:
    return host_docker("container", "inspect", "--format", "{{.Id}}", NAME).stdout.strip()


def test_the_unit_serves_once_the_container_does(unit: Container, image: str) -> None:
    unit.run("systemctl", "start", UNIT)
    state = unit.show(UNIT, "ActiveState", "SubState", "StatusText", "NRestarts")
    assert (state["ActiveState"], state["SubState"], state["NRestarts"]) == ("active", "running", "0"), state
    assert state["StatusText"].startswith("serving qwen-test"), state
    assert containers() == [NAME]
    status = unit.run("gb10d", "status")
    assert f"Image: {image} (sha256:" in status.stdout and f"Container: {NAME} (docker)" in status.stdout, status.stdout
    log = journal(unit, UNIT)
    assert f"vLLM runs from the image {image} (sha256:" in log and f"started vLLM as container {NAME} (docker run pid " in log, log


def test_stop_leaves_no_container(unit: Container) -> None:
    unit.run("systemctl", "start", UNIT)
    unit.run("systemctl", "stop", UNIT)
    assert unit.show(UNIT, "ActiveState", "Result") == {"ActiveState": "inactive", "Result": "success"}
    assert containers() == []
    assert "vLLM stopped; nothing of its container is left" in journal(unit, UNIT)


def test_kill_9_of_gb10d_leaves_the_container_to_the_units_cleanup(unit: Container) -> None:
    unit.run("systemctl", "start", UNIT)
    left = container_id()
    main = unit.show(UNIT, "MainPID")["MainPID"]
    unit.run("kill", "-9", main)
    # systemd runs ExecStopPost= once the main process is gone, whatever killed it; the
    # cleanup says what it removed once the engine has removed it.
    removed = rf"removed the container {NAME} \({left[:12]}, up [^)]*\) that an earlier gb10d left behind"
    unit.wait_for("the cleanup to say it removed the container", lambda: re.search(removed, journal(unit, UNIT)) is not None, timeout=120)
    assert containers() == []


def test_after_kill_9_without_the_cleanup_the_next_start_removes_the_stale_container(unit: Container) -> None:
    # As on a machine whose cleanup could not reach the engine: the container of the killed gb10d stays.
    with drop_in(unit, UNIT, "[Service]\nExecStopPost=\nRestart=no\n"):
        unit.run("systemctl", "start", UNIT)
        left = container_id()
        unit.run("kill", "-9", unit.show(UNIT, "MainPID")["MainPID"])
        unit.wait_for("the unit to fail", lambda: unit.show(UNIT, "ActiveState")["ActiveState"] == "failed")
    assert containers() == [NAME] and container_id() == left
    mark = unit.journal_mark()
    unit.run("systemctl", "start", UNIT)
    assert unit.show(UNIT, "StatusText")["StatusText"].startswith("serving")
    log = unit.messages(UNIT, mark)
    assert re.search(rf"removed the container {NAME} \({left[:12]}, up [^)]*\) that an earlier gb10d left behind", log), log[-3000:]
    assert containers() == [NAME] and container_id() != left
