"""The container harness behind tests/systemd: a cached Debian 12 root and a booted systemd.

The root is made by debootstrap once per machine (keyed by a hash of what
goes into it) and booted with `systemd-nspawn --volatile=overlay`, so every
boot starts from the pristine cache and nothing the tests do is written back.
The container has its own network namespace (only loopback), so vLLM's port
and the metrics port never meet the host's. Commands run inside it through
`nsenter` into the namespaces of its systemd; no system bus is needed on the
host.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SUITE = "bookworm"
MIRROR = os.environ.get("GB10D_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# systemd and dbus to boot; python3 and procps (/bin/kill for ExecReload)
# because the package depends on them and dpkg -i resolves nothing; man-db
# because `systemd-analyze verify` runs `man` for Documentation=man:gb10d(8).
ROOT_PACKAGES = ("systemd", "dbus", "python3", "procps", "man-db")
CACHE_DIR = Path(os.environ.get("GB10D_CI_CACHE", "/var/cache/gb10d-ci"))
SHARE_IN_CONTAINER = "/srv/gb10d-test"
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

BOOT_TIMEOUT_S = 120.0
COMMAND_TIMEOUT_S = 120.0
HALT_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def missing_tools(*names: str) -> list[str]:
    """The programs among `names` that are not on PATH."""
    return [name for name in names if shutil.which(name) is None]


def gb10d_version() -> str:
    """The version build-deb puts in the file name, read the way build-deb reads it."""
    for line in (REPO / "gb10d" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__ = "):
            return line.split('"')[1]
    raise AssertionError("gb10d/__init__.py has no __version__ line")


def cached_root() -> Path:
    """A debootstrapped Debian 12 root with systemd, made once per machine and reused.

    The key covers the suite, the mirror and the package list, so changing any
    of them makes a new root instead of reusing a stale one. A lock keeps two
    test runs from debootstrapping into the same place at once.
    """
    key = hashlib.sha256(repr((SUITE, MIRROR, ROOT_PACKAGES)).encode()).hexdigest()[:16]
    root = CACHE_DIR / f"{SUITE}-{key}"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "usr" / "lib" / "systemd" / "systemd").exists():
            return root
        partial = CACHE_DIR / f"{root.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        result = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(ROOT_PACKAGES)}", SUITE, str(partial), MIRROR],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise AssertionError(f"debootstrap failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        partial.rename(root)
        return root


def _container_init(nspawn_pid: int) -> int | None:
    """The host PID of the container's PID 1 (a child of systemd-nspawn), once it exists."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        nspid = fields.get("NSpid", "").split()
        if fields.get("PPid", "").strip() == str(nspawn_pid) and len(nspid) > 1 and nspid[-1] == "1":
            return int(entry.name)
    return None


class BootFailed(Exception):
    """The container could not be booted on this machine."""


@dataclass
class Container:
    """A booted Debian 12 system container; `run` executes a command inside it as root."""

    nspawn: subprocess.Popen[bytes]
    init_pid: int
    share: Path
    log: Path

    def run(self, *argv: str, input: str | None = None, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run argv in the container with a clean environment; fail the test on a non-zero exit when `check`."""
        command = ["nsenter", "-t", str(self.init_pid), "-a", "env", "-i", f"PATH={CONTAINER_PATH}", "LANG=C.UTF-8", *argv]
        result = subprocess.run(command, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode} in the container:\n{result.stdout}\n{result.stderr}")
        return result

    def sh(self, script: str, check: bool = True, timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a shell script in the container."""
        return self.run("sh", "-ec", script, check=check, timeout=timeout)

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        """Create or replace a file in the container."""
        self.run("sh", "-ec", 'mkdir -p "$(dirname "$1")"; cat > "$1"; chmod "$2" "$1"', "sh", path, mode, input=text)

    def read(self, path: str) -> str:
        """A file's content in the container."""
        return self.run("cat", path).stdout

    def exists(self, path: str) -> bool:
        """Whether a path exists in the container."""
        return self.run("test", "-e", path, check=False).returncode == 0

    def put(self, source: Path, name: str) -> str:
        """Make a host file visible in the container (read-only share); returns its path there."""
        shutil.copy(source, self.share / name)
        return f"{SHARE_IN_CONTAINER}/{name}"

    def show(self, unit: str, *properties: str) -> dict[str, str]:
        """`systemctl show -p ...` of a unit, as a dict."""
        out = self.run("systemctl", "show", "-p", ",".join(properties), unit).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
        """Re-check `predicate` until it holds, failing after `timeout` seconds.

        The container offers no change notification for unit properties without
        a bus connection, so this asks again at once; each check is a process
        start (tens of ms), which paces the loop.
        """
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")

    def halt(self) -> None:
        """Shut the container down, escalating to SIGKILL of its PID namespace if it does not halt."""
        if self.nspawn.poll() is None:
            self.nspawn.send_signal(signal.SIGTERM)  # nspawn asks the container's systemd to halt
            try:
                self.nspawn.wait(HALT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill(self.nspawn, self.init_pid)


def boot(root: Path, share: Path, log: Path, host_network: bool = False, binds: tuple[Path, ...] = ()) -> Container:
    """Boot `root` as a container with `share` visible read-only inside; console output goes to `log`.

    `host_network` shares the host's network namespace instead of a private
    one (a container engine of the host then serves its ports where the
    booted system sees them); each of `binds` is a host path bound at the
    same path inside, writable (an engine's socket, a directory both sides
    must see alike).
    """
    with open(log, "wb") as console:
        nspawn = subprocess.Popen(
            [
                "systemd-nspawn",
                "--register=no",
                "--keep-unit",
                "--quiet",
                "--volatile=overlay",
                *([] if host_network else ["--private-network"]),
                f"--machine=gb10d-test-{os.getpid()}-{share.name[-8:]}",
                f"--bind-ro={share}:{SHARE_IN_CONTAINER}",
                *(f"--bind={path}" for path in binds),
                "-D",
                str(root),
                "-b",
            ],
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_halt_with_parent,
        )
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        init_pid = None
        while init_pid is None:
            if nspawn.poll() is not None:
                raise BootFailed(f"systemd-nspawn exited {nspawn.returncode} before booting:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise BootFailed(f"the container's systemd did not appear within {BOOT_TIMEOUT_S:.0f} s:\n{_tail(log)}")
            init_pid = _container_init(nspawn.pid)
        box = Container(nspawn, init_pid, share, log)
        # --wait returns once boot has finished ("degraded": a unit failed, but
        # it booted). Before that, "offline" or "Failed to connect to bus" mean
        # systemd does not answer yet: PID 1 is still nspawn's own setup, or
        # systemd has not opened its socket.
        booted = ("running", "degraded")
        state = ""
        while state not in booted and time.monotonic() < deadline:
            state = box.run("systemctl", "is-system-running", "--wait", check=False, timeout=BOOT_TIMEOUT_S).stdout.strip()
        if state not in booted:
            raise BootFailed(f"the container did not finish booting (state {state!r}):\n{_tail(log)}")
        return box
    except BaseException:
        _kill(nspawn, None)
        raise


def _halt_with_parent() -> None:
    """In the nspawn child: get SIGTERM (nspawn's "halt the container") if the test run itself is killed.

    Without it a SIGKILLed pytest would leave the container running, since no
    teardown code gets to run.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-3000:]


def _kill(nspawn: subprocess.Popen[bytes], init_pid: int | None) -> None:
    """SIGKILL the container: its PID 1 (which takes its whole PID namespace along) and nspawn."""
    if init_pid is not None:
        try:
            os.kill(init_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(nspawn.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    nspawn.wait(HALT_TIMEOUT_S)
