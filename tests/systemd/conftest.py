"""Fixtures for the packaging tests: real .deb builds and a real systemd in a container.

A module boots Debian 12 on amd64 unless it overrides the `debian` fixture.
Set GB10D_REQUIRE_SYSTEMD_E2E=1 (as .ci/run does) to turn "cannot boot a
container here" from a skip into a failure.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

import pytest

from systemd_harness import BOOT_TIMEOUT_S, DEBIAN_12_AMD64, REPO, BootFailed, Container, Debian, boot, cached_root, gb10d_version, missing_tools


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "emulated_too: also runs where the container's programs run under qemu-user emulation")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here builds packages or boots a container: all of them are slow."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report ends with what gb10d and systemd logged in its container, read before teardown."""
    report = yield
    if report.when == "call" and report.failed:
        boxes = [value for value in getattr(item, "funcargs", {}).values() if isinstance(value, Container)]
        if boxes and boxes[0].nspawn.poll() is None:
            log = boxes[0].run("journalctl", "--no-pager", "-b", "-n", "150", "-u", "gb10d*", check=False)
            report.sections.append(("the journal of gb10d's units in the container (last 150 lines)", log.stdout + log.stderr))
    return report


def skip_unless_tools(*names: str, package_hint: str) -> None:
    """Skip the test, naming what to install, when a build tool is missing."""
    missing = missing_tools(*names)
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install {package_hint}; .ci/run installs it)")


@pytest.fixture(scope="session")
def build_deb(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """Build the .deb with packaging/build-deb, once per run, architecture and Python minor.

    `build("arm64", "3.12")` is the package GB10 owners install;
    `build("arm64", "3.13")` the same scripts with the wheels for Debian 13's
    python3. Each build gets its own directory: both are gb10d_VERSION_arm64.deb.
    """
    # Under pytest-xdist each worker has a base directory of its own inside the run's: the
    # workers share the run's, so each package is built once per run, not once per worker.
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if "PYTEST_XDIST_WORKER" in os.environ else base) / "deb"
    root.mkdir(exist_ok=True)

    def build(arch: str, python: str) -> Path:
        tools = ["dpkg-buildpackage", "dh"] + (["aarch64-linux-gnu-objdump"] if arch == "arm64" else [])
        skip_unless_tools(*tools, package_hint="dpkg-dev debhelper binutils-aarch64-linux-gnu")
        out = root / f"{arch}-python{python}"
        deb = out / "dist" / f"gb10d_{gb10d_version()}_{arch}.deb"
        with open(root / f"{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if deb.is_file():
                return deb
            env = dict(os.environ, GB10D_BUILD_DIR=str(out / "build"), GB10D_DIST_DIR=str(out / "dist"))
            argv = [str(REPO / "packaging" / "build-deb"), arch, python]
            result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            assert result.returncode == 0, f"{' '.join(argv[1:])}: build-deb failed:\n{result.stdout}\n{result.stderr}"
            assert deb.is_file(), f"build-deb {arch} did not write {deb}:\n{result.stdout}"
            return deb

    return build


def _cannot_boot(reason: str) -> None:
    """Skip where containers cannot boot, unless the run requires them (CI)."""
    if os.environ.get("GB10D_REQUIRE_SYSTEMD_E2E") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def debian() -> Debian:
    """The Debian release and architecture the module's container boots."""
    return DEBIAN_12_AMD64


@pytest.fixture(scope="module")
def container(debian: Debian, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """One booted container for all checks of a module; always torn down, even on failure."""
    if os.geteuid() != 0:
        _cannot_boot("needs root to debootstrap and boot a systemd-nspawn container")
    missing = missing_tools("debootstrap", "systemd-nspawn", "nsenter")
    if missing:
        _cannot_boot(f"needs {', '.join(missing)} (apt-get install debootstrap systemd-container util-linux)")
    share = tmp_path_factory.mktemp(f"share-{debian.name}")
    log = share.parent / f"{share.name}-console.log"
    try:
        box = boot(cached_root(debian), share, log, BOOT_TIMEOUT_S * debian.time_scale())
    except BootFailed as exc:
        _cannot_boot(str(exc))
    try:
        yield box
    finally:
        box.halt()
