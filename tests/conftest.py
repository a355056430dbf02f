"""Fixtures shared by the tests that run the real `gb10d run` against gb10d.sim."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from harness import Daemon, NotifySocket, wait_until

# Fixtures that bring real processes, engines or network namespaces: a test that asks for one is slow.
SLOW_FIXTURES = frozenset({"daemons", "notify", "link", "engine", "any_engine", "podman_service", "registry"})


# Fixtures of the container engines: the tests that use one share dockerd and podman's store.
ENGINE_FIXTURES = frozenset({"engine", "any_engine", "podman_service", "registry"})
# Booted systemd containers that run images under the host's docker.
ENGINE_MODULES = frozenset({"test_systemd_container.py", "test_systemd_playbook.py"})
SYSTEMD_DIR = Path(__file__).parent / "systemd"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the slow tests and group them for pytest-xdist, whose own hook reads the groups after this one."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def xdist_group(item: pytest.Item) -> str | None:
    """Which tests pytest-xdist (`-n`, `--dist loadgroup`) keeps on one worker, one after another.

    - The container-engine tests share dockerd and podman: one group.
    - A module of booted systemd tests shares its container (a module fixture):
      one group per module and Debian release, so each boots once, and the
      releases and modules boot side by side (each in cgroups of its own).
    - The other tests go wherever a worker is free: each gb10d they start
      has its own ports, files and config (no memory ledger unless the test
      gives it one of its own), and the one test that needs /dev/shm to
      itself gives gb10d a private one.
    """
    path = Path(str(item.fspath))
    if path.name in ENGINE_MODULES or ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "engines"
    if path.parent == SYSTEMD_DIR:
        callspec = getattr(item, "callspec", None)
        debian = callspec.params.get("debian") if callspec is not None else None
        return f"systemd-{path.stem}-{getattr(debian, 'name', 'debian12')}"
    return None


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    """A real sd_notify receiver, bound for the test and closed after it."""
    sock = NotifySocket()
    yield sock
    sock.close()


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Daemons a test starts; whatever happened, none of them (nor their vLLM or Ray) outlives it."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.kill_everything()


def _ip(*args: str) -> str:
    """`ip ARGS`, its output; a failure fails the test with ip's own words."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def link() -> Iterator[tuple[str, str]]:
    """Two machines on one: head and worker network namespaces joined by a veth pair.

    The private test link is 10.213.60.0/24 (head .1 on gb10c-h, worker .2
    on gb10c-w); each namespace has its own loopback, so nothing leaves the
    machine and each side has its own ports, as two machines would.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    head, worker = f"gb10c-h{os.getpid()}", f"gb10c-w{os.getpid()}"
    try:
        for ns in (head, worker):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", "gb10c-h", "netns", head, "type", "veth", "peer", "name", "gb10c-w", "netns", worker)
        for ns, dev, address in ((head, "gb10c-h", "10.213.60.1/24"), (worker, "gb10c-w", "10.213.60.2/24")):
            _ip("-n", ns, "addr", "add", address, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        for ns, dev in ((head, "gb10c-h"), (worker, "gb10c-w")):
            # A veth reports its carrier a moment after both ends are up.
            wait_until(lambda ns=ns, dev=dev: "LOWER_UP" in _ip("-n", ns, "link", "show", dev), 30, f"{dev} to come up")
        yield head, worker
    finally:
        for ns in (head, worker):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
