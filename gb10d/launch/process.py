"""A supervised process group (vLLM; Ray on a pair): spawn it, read its pipes, signal it, and make sure it is gone.

vLLM's EngineCore has no parent-death detection: if the API server dies,
the engine keeps running and keeps its memory. So gb10d starts vLLM in a
new session (its own process group) and always acts on the whole group,
and "stopped" means no process of the group is left, not just that the
API server exited.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Awaitable, Callable, Mapping, Sequence

from ..base.errors import SpawnError
from ..machine.procs import processes, stat_fields

READ_CHUNK = 1 << 16
_PR_SET_CHILD_SUBREAPER = 36

ChunkHandler = Callable[[bytes], None]


def group_members(pgid: int) -> list[int]:
    """PIDs whose process group is `pgid`, from /proc (zombies included)."""
    members: list[int] = []
    for pid, directory in processes():
        try:
            fields = stat_fields(directory)
        except OSError:
            continue
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(pid)
    return members


def group_alive(pgid: int) -> bool:
    """Whether any process (zombies included) is left in the group."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send `sig` to every process of the group; False when none is left."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


def group_io_bytes(pgid: int) -> int:
    """Bytes read and written so far by the group's processes (/proc/PID/io), a sign of life while loading.

    Counts syscall-level (rchar, wchar) and block-level (read_bytes) I/O so
    that both eager reads from page cache and mmap page faults show up.
    """
    total = 0
    for pid in group_members(pgid):
        try:
            text = Path(f"/proc/{pid}/io").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name in ("rchar", "wchar", "read_bytes", "write_bytes"):
                total += int(value)
    return total


async def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of the group is left, at most `timeout_s`; True if gone.

    Event-driven: waits on a pidfd of each living member (readable when it
    exits) and rescans, because members may fork or be reparented meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        members = group_members(pgid)
        _reap_adopted(members, leader=pgid)
        living = [pid for pid in members if not _is_zombie(pid)]
        if living:
            await _any_exit(living, remaining)
        else:
            # Only zombies are left; their parent (asyncio's child watcher, or init) reaps them
            # within moments, and the kernel offers no event for "reaped".
            await asyncio.sleep(min(0.02, remaining))
    return True


def become_subreaper() -> bool:
    """Make orphaned descendants (vLLM's EngineCore after its API server died) our children.

    The kernel then reparents them to gb10d rather than to PID 1, so gb10d can
    see them, kill them and reap them itself, even where PID 1 is not an init
    that reaps (containers). Returns False where prctl is unavailable.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _reap_adopted(members: list[int], leader: int) -> None:
    """Reap zombies of the group that were reparented to us; the leader is asyncio's to reap."""
    me = os.getpid()
    for pid in members:
        if pid == leader or not _is_zombie(pid) or _parent(pid) != me:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _parent(pid: int) -> int | None:
    try:
        return int(stat_fields(Path(f"/proc/{pid}"))[1])
    except OSError:
        return None


async def _any_exit(pids: list[int], timeout_s: float) -> None:
    """Return when any of `pids` exits, or after `timeout_s`."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()
    fds: list[int] = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone
            return
        fds.append(fd)
        loop.add_reader(fd, _settle, exited)
    try:
        await asyncio.wait_for(exited, timeout_s)
    except asyncio.TimeoutError:
        pass
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _is_zombie(pid: int) -> bool:
    try:
        return stat_fields(Path(f"/proc/{pid}"))[0] == b"Z"
    except OSError:
        return True  # gone already: nothing to wait on


class ProcessGroup:
    """One running program (`vllm serve`, `ray start --block`), leader of its own process group.

    Exit and pipe EOF are watched separately on purpose: an orphaned
    EngineCore keeps vLLM's pipes open after the API server died, and the
    supervisor must learn of the exit at once (a pidfd becomes readable),
    not when the last holder of the pipes goes away.
    """

    # What the stop ladder reaches, as the journal says it (`runtime.Runtime.reaches`).
    reaches = "its process group"

    def __init__(self, popen: subprocess.Popen[bytes], argv: Sequence[str], loop: asyncio.AbstractEventLoop) -> None:
        self.popen = popen
        self.argv = argv
        self._loop = loop
        self._exit: asyncio.Future[int] = loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        loop.add_reader(self._pidfd, self._on_exit)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        # start_new_session makes the leader's pid the group id, and it stays so after it dies.
        return self.popen.pid

    @property
    def label(self) -> str:
        return f"pid {self.pid}"

    def alive(self) -> bool:
        """Whether any process of the group is left (zombies included)."""
        return group_alive(self.pgid)

    def io_bytes(self) -> int | None:
        """Bytes the group's processes have read and written (/proc/PID/io)."""
        return group_io_bytes(self.pgid)

    def members(self) -> list[int]:
        return group_members(self.pgid)

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path | None = None,
        name: str = "vLLM",
        key: str = "vllm.executable or vllm.venv",
    ) -> ProcessGroup:
        """Start the program in a new session with both pipes captured and stdin closed.

        `name` and `key` make a SpawnError say what could not start and which setting names it.
        """
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SpawnError(f"cannot start {name}: {argv[0]} does not exist; check {key}") from None
        except PermissionError:
            raise SpawnError(f"cannot start {name}: {argv[0]} is not executable; check {key}") from None
        except OSError as exc:
            raise SpawnError(f"cannot start {name} ({argv[0]}): {exc.strerror or exc}") from None
        return cls(popen, argv, asyncio.get_running_loop())

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.popen.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.popen.pid, 255 << 8
        if pid == 0:
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        code = os.waitstatus_to_exitcode(status)
        self.popen.returncode = code  # reaped here; keeps subprocess from waiting on it again
        if not self._exit.done():
            self._exit.set_result(code)

    def readers(self, on_stdout: ChunkHandler, on_stderr: ChunkHandler) -> list[Awaitable[None]]:
        """Coroutines that drain both pipes until EOF, handing each chunk over at once.

        Reading never waits on anything but the pipe, so vLLM never blocks on
        a full pipe however much it prints.
        """
        assert self.popen.stdout is not None and self.popen.stderr is not None
        return [_drain(self.popen.stdout, on_stdout), _drain(self.popen.stderr, on_stderr)]

    async def wait(self) -> int:
        """The leader's exit status (negative for a signal), as soon as it exits."""
        return await asyncio.shield(self._exit)

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def signal(self, sig: signal.Signals) -> bool:
        """Signal the whole group."""
        return signal_group(self.pgid, sig)

    async def stop(self, grace_s: float, on_escalate: Callable[[list[int]], None] | None = None) -> bool:
        """SIGTERM the group, wait `grace_s`, SIGKILL what remains; True when nothing is left.

        vLLM drains and exits on SIGTERM; the engine is force-killed by vLLM
        itself shortly after, so the grace mostly covers in-flight requests.
        """
        self.signal(signal.SIGTERM)
        if await wait_group_gone(self.pgid, grace_s):
            return True
        return await self.kill(on_escalate)

    async def kill(self, on_escalate: Callable[[list[int]], None] | None = None) -> bool:
        """SIGKILL the whole group and wait (bounded) until the kernel has removed it."""
        if on_escalate is not None:
            on_escalate(group_members(self.pgid))
        self.signal(signal.SIGKILL)
        return await wait_group_gone(self.pgid, 30.0)


async def _drain(pipe: IO[bytes], handle: ChunkHandler) -> None:
    """Read `pipe` without blocking the loop until EOF, passing every chunk to `handle`."""
    loop = asyncio.get_running_loop()
    fd = pipe.fileno()
    os.set_blocking(fd, False)
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        # A few chunks per wake-up: drains a flood quickly without starving the rest of the loop.
        for _ in range(4):
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                loop.remove_reader(fd)
                if not done.done():
                    done.set_result(None)
                return
            handle(chunk)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        pipe.close()
