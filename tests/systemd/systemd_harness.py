"""The container harness behind tests/systemd: cached Debian roots and a booted systemd.

A root is made by debootstrap once per machine (keyed by a hash of what goes
into it) and booted with `systemd-nspawn --volatile=overlay`, so every boot
starts from the pristine cache and nothing the tests do is written back. The
container has its own network namespace (only loopback), so vLLM's port and
the metrics port never meet the host's. Commands run inside it through
`nsenter` into the namespaces of its systemd; no system bus is needed on the
host.

A root of another architecture (arm64 on an x86_64 machine) runs under
qemu-user through binfmt_misc: debootstrap's second stage, the container's
systemd and everything it starts are emulated. The handler must be registered
with the F flag, so that the kernel uses the emulator it opened at
registration and the root needs no copy of it.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MIRROR = os.environ.get("GB10D_DEBIAN_MIRROR", "http://deb.debian.org/debian")
CACHE_DIR = Path(os.environ.get("GB10D_CI_CACHE", "/var/cache/gb10d-ci"))
SHARE_IN_CONTAINER = "/srv/gb10d-test"
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

BOOT_TIMEOUT_S = 120.0
COMMAND_TIMEOUT_S = 120.0
HALT_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
BINFMT_MISC = Path("/proc/sys/fs/binfmt_misc")
# Debian architecture -> the machine name qemu and the kernel use.
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}

# Only in an emulated root. qemu-user refuses clone() with CLONE_NEWNS, which is
# how systemd forks the helper that mounts a unit's credentials directory: every
# unit with ImportCredential= or LoadCredential= (journald, sysusers, tmpfiles,
# the gettys) fails with status 243/CREDENTIALS. None of the tests uses
# credentials, and gb10d.service has none; this drop-in for all services lets
# the root's own units start.
EMULATION_FILES = (
    (
        "etc/systemd/system/service.d/10-qemu-user-no-credentials.conf",
        "# qemu-user cannot fork into a new mount namespace, which setting up credentials needs.\n"
        "[Service]\nImportCredential=\nLoadCredential=\nSetCredential=\n",
    ),
)


# How many times longer a Python program takes to start under qemu-user than
# natively: gb10d's first STATUS= came 6-8 s after ExecStart on a busy 2-core
# x86_64 machine, against under 2 s natively. Timings in the tests scale by it.
QEMU_SLOWDOWN = 4.0
# The oldest qemu-user seen to run Debian 13's systemd with sandboxed units:
# 7.2 (Debian 12) cannot spawn any unit, 10.0 (bookworm-backports) no unit
# with a mount namespace.
QEMU_MINIMUM = (11, 1)


@dataclass(frozen=True)
class Debian:
    """A Debian release on one architecture, as a container root with the packages the tests need."""

    name: str
    suite: str
    arch: str
    python: str  # its python3's minor version, which the package must be built for
    packages: tuple[str, ...]

    def emulated(self) -> bool:
        """Whether this machine runs the root's programs through qemu-user rather than natively."""
        return MACHINES[self.arch] != platform.machine()

    def time_scale(self) -> float:
        """The factor by which a test stretches the times it allows for a start here."""
        return QEMU_SLOWDOWN if self.emulated() else 1.0


# systemd and dbus to boot; python3 and procps (/bin/kill for ExecReload)
# because the package depends on them and dpkg -i resolves nothing; man-db
# because `systemd-analyze verify` runs `man` for Documentation=man:gb10d(8).
DEBIAN_12_AMD64 = Debian("debian12-amd64", "bookworm", "amd64", "3.11", ("systemd", "dbus", "python3", "procps", "man-db"))
# The package GB10 owners install, on the nearest release to DGX OS 7 that
# boots here (systemd 257 and Python 3.13; Ubuntu 24.04 has 255 and 3.12).
# No man-db: under emulation its triggers would slow every dpkg run.
DEBIAN_13_ARM64 = Debian("debian13-arm64", "trixie", "arm64", "3.13", ("systemd", "dbus", "python3", "procps"))


def missing_tools(*names: str) -> list[str]:
    """The programs among `names` that are not on PATH."""
    return [name for name in names if shutil.which(name) is None]


def gb10d_version() -> str:
    """The version build-deb puts in the file name, read the way build-deb reads it."""
    for line in (REPO / "gb10d" / "__init__.py").read_text().splitlines():
        if line.startswith("__version__ = "):
            return line.split('"')[1]
    raise AssertionError("gb10d/__init__.py has no __version__ line")


def emulation_missing(debian: Debian) -> str | None:
    """Why this machine cannot run the root's programs, or None when it can (natively or through qemu-user)."""
    if not debian.emulated():
        return None
    machine = MACHINES[debian.arch]
    handler = BINFMT_MISC / f"qemu-{machine}"
    fix = f"install qemu-user and register {handler.name} with the F flag (.ci/run does both)"
    try:
        lines = handler.read_text().splitlines()
    except OSError:
        return f"{debian.arch} programs cannot run on this {platform.machine()} machine: binfmt_misc has no {handler} handler; {fix}"
    fields = dict(line.split(" ", 1) for line in lines if " " in line)
    flags = fields.get("flags:", "")
    if "enabled" not in lines or "F" not in flags:
        return f"{handler} is not enabled with the F flag (flags: {flags!r}), so programs in the {debian.suite} root cannot find qemu; {fix}"
    interpreter = fields.get("interpreter", "")
    version = subprocess.run([interpreter, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"version (\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) < QEMU_MINIMUM:
        said = version.splitlines()[0] if version else "no version"
        return (
            f"{interpreter} says {said!r}: the systemd of the {debian.suite} root needs qemu {QEMU_MINIMUM[0]}.{QEMU_MINIMUM[1]} or later "
            f"(older ones refuse clone() with a pidfd or drop statx's mount ID, so no sandboxed unit starts); {fix}"
        )
    return None


def cached_root(debian: Debian) -> Path:
    """A debootstrapped root of `debian` with systemd, made once per machine and reused.

    The key covers the suite, the architecture, the mirror, the package list
    and the files added under emulation, so changing any of them makes a new
    root instead of reusing a stale one. A lock keeps two test runs (or
    workers, or .ci/run's early build) from debootstrapping into the same
    place at once. For a foreign architecture
    debootstrap runs its second stage (dpkg and the maintainer scripts) in the
    root under qemu-user, which makes it the slowest step of a cold run.
    """
    reason = emulation_missing(debian)
    if reason is not None:
        raise BootFailed(reason)
    extra = EMULATION_FILES if debian.emulated() else ()
    key = hashlib.sha256(repr((debian.suite, debian.arch, MIRROR, debian.packages, extra)).encode()).hexdigest()[:16]
    root = CACHE_DIR / f"{debian.suite}-{debian.arch}-{key}"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # One lock per root: a run waiting for the emulated root (minutes) does not hold up the other.
    with open(CACHE_DIR / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / "usr" / "lib" / "systemd" / "systemd").exists():
            return root
        partial = CACHE_DIR / f"{root.name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        command = ["debootstrap", f"--arch={debian.arch}", "--variant=minbase", f"--include={','.join(debian.packages)}"]
        result = subprocess.run(
            [*command, debian.suite, str(partial), MIRROR], capture_output=True, text=True, timeout=2400
        )
        if result.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            raise AssertionError(f"debootstrap failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        for path, text in extra:
            (partial / path).parent.mkdir(parents=True, exist_ok=True)
            (partial / path).write_text(text)
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
    """A booted Debian system container; `run` executes a command inside it as root."""

    nspawn: subprocess.Popen[bytes]
    init_pid: int
    share: Path
    log: Path
    cgroups: list[Path]

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

    def journal_mark(self) -> int:
        """Where the journal ends now, as its sequence number: a test reads only what comes after.

        A cursor combined with a field match is not used anywhere: systemd 252's
        journalctl (Debian 12) drops the first matching entry after the cursor
        when a match such as `_PID=` is added. The sequence number inside the
        cursor (`i=`) orders entries on every systemd, so the tests filter on it.
        """
        cursor = self.run("journalctl", "-n", "0", "--show-cursor").stdout.split("cursor: ")[-1].strip()
        fields = dict(part.split("=", 1) for part in cursor.split(";") if "=" in part)
        return int(fields.get("i", "0"), 16)

    def entries(self, unit: str, after: int = 0, **match: str) -> list[dict[str, str]]:
        """The unit's journal entries after a mark, as journalctl -o json gives them, that carry every field in `match`."""
        out = self.run("journalctl", "--no-pager", "-o", "json", "-u", unit).stdout
        found = []
        for line in out.splitlines():
            entry = json.loads(line)
            seqnum = int(dict(p.split("=", 1) for p in entry["__CURSOR"].split(";"))["i"], 16)
            if seqnum > after and all(str(entry.get(key)) == value for key, value in match.items()):
                found.append(entry)
        return found

    def messages(self, unit: str, after: int = 0, **match: str) -> str:
        """The MESSAGEs of `entries`, one per line, as `journalctl -o cat` shows them."""
        return "".join(f"{entry.get('MESSAGE', '')}\n" for entry in self.entries(unit, after, **match))

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
        """Shut the container down, escalating to SIGKILL of its PID namespace if it does not halt.

        The container's own systemctl asks for the power-off. SIGTERM to nspawn
        would send SIGRTMIN+3 to the container's systemd, which under qemu-user
        never arrives: qemu numbers the real-time signals of the emulated
        program differently from the host's.
        """
        if self.nspawn.poll() is None:
            self.run("systemctl", "poweroff", "--no-block", check=False)
            try:
                self.nspawn.wait(HALT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill(self.nspawn, self.init_pid)
        _remove_cgroups(self.cgroups)


def _cgroup_hierarchies() -> list[Path]:
    """The cgroup hierarchies a container's systemd manages: name=systemd (cgroup v1) and the unified one (v2).

    Each as the directory of this process's own cgroup in it.
    """
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        if controllers == "name=systemd":
            base = Path("/sys/fs/cgroup/systemd")
        elif number == "0" and controllers == "":
            unified = Path("/sys/fs/cgroup/unified")
            base = unified if unified.is_dir() else Path("/sys/fs/cgroup")
        else:
            continue
        if (base / "cgroup.procs").exists():
            found.append(base / path.lstrip("/"))
    return found


def own_cgroups(name: str) -> list[Path]:
    """A cgroup of the container's own in each hierarchy its systemd manages, made empty.

    With --keep-unit --register=no nspawn leaves the container in its
    caller's cgroup, and the container's systemd makes its units' cgroups
    under it. Two containers booted from one cgroup would share
    system.slice/gb10d.service, and stopping the unit in one kills the
    other's gb10d: each container gets its own.
    """
    made = []
    for hierarchy in _cgroup_hierarchies():
        group = hierarchy / name
        group.mkdir(exist_ok=True)
        made.append(group)
    return made


def _enter(cgroups: list[Path]) -> None:
    """In the nspawn child, before exec: move into the container's own cgroups."""
    for group in cgroups:
        (group / "cgroup.procs").write_text("0")


def _remove_cgroups(cgroups: list[Path]) -> None:
    """Remove a container's cgroups once it is gone, deepest first; one still busy is left."""
    for group in cgroups:
        for directory in sorted((d for d in group.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True) + [group]:
            try:
                directory.rmdir()
            except OSError:
                pass


def boot(root: Path, share: Path, log: Path, timeout_s: float, host_network: bool = False, binds: tuple[Path, ...] = ()) -> Container:
    """Boot `root` as a container with `share` visible read-only inside; console output goes to `log`.

    `host_network` shares the host's network namespace instead of a private
    one (a container engine of the host then serves its ports where the
    booted system sees them); each of `binds` is a host path bound at the
    same path inside, writable (an engine's socket, a directory both sides
    must see alike).
    """
    machine = f"gb10d-test-{os.getpid()}-{share.name[-8:]}"
    cgroups = own_cgroups(machine)
    with open(log, "wb") as console:
        nspawn = subprocess.Popen(
            [
                "systemd-nspawn",
                "--register=no",
                "--keep-unit",
                "--quiet",
                "--volatile=overlay",
                *([] if host_network else ["--private-network"]),
                f"--machine={machine}",
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
            preexec_fn=lambda: (_halt_with_parent(), _enter(cgroups)),
        )
    try:
        deadline = time.monotonic() + timeout_s
        init_pid = None
        while init_pid is None:
            if nspawn.poll() is not None:
                raise BootFailed(f"systemd-nspawn exited {nspawn.returncode} before booting:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise BootFailed(f"the container's systemd did not appear within {timeout_s:.0f} s:\n{_tail(log)}")
            init_pid = _container_init(nspawn.pid)
        box = Container(nspawn, init_pid, share, log, cgroups)
        # --wait returns once boot has finished ("degraded": a unit failed, but
        # it booted). Before that, "offline" or "Failed to connect to bus" mean
        # systemd does not answer yet: PID 1 is still nspawn's own setup, or
        # systemd has not opened its socket.
        booted = ("running", "degraded")
        state = ""
        while state not in booted and time.monotonic() < deadline:
            state = box.run("systemctl", "is-system-running", "--wait", check=False, timeout=timeout_s).stdout.strip()
        if state not in booted:
            raise BootFailed(f"the container did not finish booting (state {state!r}):\n{_tail(log)}")
        return box
    except BaseException:
        _kill(nspawn, None)
        _remove_cgroups(cgroups)
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


if __name__ == "__main__":
    # `python3 tests/systemd/systemd_harness.py`: make the cached roots now, side by side (.ci/run does, before
    # the tests that boot them: a cold root takes minutes, more than a test's timeout).
    import sys
    import threading

    def make(debian: Debian) -> None:
        reason = emulation_missing(debian)
        if reason is not None:
            print(f"{debian.name}: not built: {reason}", file=sys.stderr, flush=True)
            return
        started = time.monotonic()
        print(f"{debian.name}: {cached_root(debian)} ({time.monotonic() - started:.0f} s)", flush=True)

    builders = [threading.Thread(target=make, args=(debian,)) for debian in (DEBIAN_12_AMD64, DEBIAN_13_ARM64)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
