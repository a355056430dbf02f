"""The stand-in's own memory, shown in the simulated /proc/meminfo (GB10D_SIM_MEMINFO) as vLLM's shows in the real one.

On GB10 vLLM's memory comes out of the MemFree and MemAvailable every
process sees: the weights shard by shard, the profile run's activations,
then the KV cache up to gpu_memory_utilization x MemTotal. The kernel gives
it all back when the process ends, however it ends. The stand-in does the
same in its meminfo file, so several stand-ins on one file see each other:
vLLM's free-memory check fails when another took the memory, and taking
more than MemAvailable holds fails as CUDA's allocator does (out of memory).

The kernel's part, giving back on any end of the process (kill -9
included), is played by a keeper: a small process, in a session of its own
so that a signal to vLLM's process group does not reach it, that the
EngineCore tells over a pipe how much it holds. It changes the file and
answers; when the pipe's last writer is gone (the EngineCore ended) it
gives back what is left and exits. Every change of the file is one
read-modify-write under an flock on a lock file beside it, replaced
atomically, because several stand-ins and their keepers write it.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from .settings import GIB, SettingsError, SimSettings, parse_meminfo

KB = 1024
# The fields a process's memory comes out of (the page cache is not given back).
TAKEN_FROM = ("MemFree", "MemAvailable")


def _lock_path(meminfo: Path) -> Path:
    return meminfo.with_name(f".{meminfo.name}.lock")


def adjust(meminfo: Path, delta_bytes: int, need_bytes: int = 0) -> int | None:
    """Add `delta_bytes` (negative: take memory) to MemFree and MemAvailable, never above MemTotal nor below 0.

    With `need_bytes`, take only if MemAvailable has that much; returns
    None when it did, else the MemAvailable that was short. Raises
    SettingsError when the file cannot be changed.
    """
    try:
        lock = os.open(_lock_path(meminfo), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise SettingsError(f"GB10D_SIM_MEMINFO: cannot lock {meminfo}: {exc.strerror}") from None
    try:
        # Whoever comes next may run as another user: the lock file is everyone's.
        try:
            os.fchmod(lock, 0o666)
        except PermissionError:
            pass
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = meminfo.read_text(encoding="ascii")
            mode = meminfo.stat().st_mode & 0o777
        except OSError as exc:
            raise SettingsError(f"GB10D_SIM_MEMINFO: cannot read {meminfo}: {exc.strerror}") from None
        values = parse_meminfo(text)
        if need_bytes and values.get("MemAvailable", 0) < need_bytes:
            return values.get("MemAvailable", 0)
        total = values.get("MemTotal")
        lines = []
        for line in text.splitlines(keepends=True):
            name, _, rest = line.partition(":")
            words = rest.split()
            if name in TAKEN_FROM and words and words[0].isdigit():
                value = min(max(int(words[0]) + delta_bytes // KB, 0), total // KB if total else 1 << 62)
                line = f"{name}:{' ' * max(1, 15 - len(name))}{value} kB\n"
            lines.append(line)
        _replace(meminfo, "".join(lines), mode)
        return None
    finally:
        os.close(lock)


def _replace(meminfo: Path, text: str, mode: int) -> None:
    """Readers see the old file or the new one, never a part; the new one keeps the old one's mode."""
    try:
        fd, temporary = tempfile.mkstemp(dir=meminfo.parent, prefix=f".{meminfo.name}.")
        try:
            with os.fdopen(fd, "w", encoding="ascii") as out:
                out.write(text)
                os.fchmod(out.fileno(), mode)
            os.replace(temporary, meminfo)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError as exc:
        raise SettingsError(f"GB10D_SIM_MEMINFO: cannot update {meminfo}: {exc.strerror}") from None


class Hold:
    """What this EngineCore holds of the simulated memory; given back when it ends, by itself or by its keeper."""

    def __init__(self, meminfo: Path) -> None:
        self.meminfo = meminfo
        self.held = 0
        asks_r, self._asks = os.pipe()
        self._answers, answers_w = os.pipe()
        self._keeper = os.fork()
        if self._keeper == 0:
            os.close(self._asks)
            os.close(self._answers)
            _keep(meminfo, asks_r, answers_w)
        os.close(asks_r)
        os.close(answers_w)

    def take(self, total_bytes: int) -> int | None:
        """Hold `total_bytes` from now on (more or less than before); None when done, else the MemAvailable that
        was too little for the increase (nothing changed then)."""
        total_bytes = total_bytes // KB * KB  # the file counts kB: what is taken is exactly what comes back
        os.write(self._asks, f"{total_bytes}\n".encode())
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = os.read(self._answers, 64)
            if not chunk:
                raise SettingsError(f"GB10D_SIM_MEMINFO: the keeper of this process's memory in {self.meminfo} is gone")
            answer += chunk
        word, _, value = answer.decode().strip().partition(" ")
        if word == "ok":
            self.held = total_bytes
            return None
        if word == "short":
            return int(value)
        raise SettingsError(value)

    def release(self) -> None:
        """Give everything back before exiting, and let the keeper go (it is this process's child: reap it)."""
        try:
            self.take(0)
        finally:
            os.close(self._asks)
            os.close(self._answers)
            os.waitpid(self._keeper, 0)


def _keep(meminfo: Path, asks: int, answers: int) -> None:
    """The keeper: apply each new total the EngineCore asks for; at the end of the pipe give the rest back."""
    os.setsid()  # a signal to vLLM's process group must not end the kernel's part too
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    low, high = sorted((asks, answers))
    os.closerange(3, low)
    os.closerange(low + 1, high)
    os.closerange(high + 1, os.sysconf("SC_OPEN_MAX"))
    held = 0
    buffered = b""
    try:
        while True:
            chunk = os.read(asks, 4096)
            if not chunk:
                break
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                wanted = int(line)
                try:
                    short = adjust(meminfo, held - wanted, need_bytes=wanted - held if wanted > held else 0)
                except SettingsError as exc:
                    os.write(answers, f"error {exc}\n".encode())
                    continue
                if short is None:
                    held = wanted
                    os.write(answers, b"ok\n")
                else:
                    os.write(answers, f"short {short}\n".encode())
    finally:
        if held:
            try:
                adjust(meminfo, held)
            except SettingsError:
                pass
        os._exit(0)


def trap(settings: SimSettings) -> None:
    """leak_gib: memory a crashed engine never gives back (GB10's crashed-CUDA-process trap), taken for good.

    Only the simulated meminfo file shows it; without one there is nothing to show.
    """
    if settings.meminfo is not None and settings.scenario.leak_gib:
        adjust(settings.meminfo, -int(settings.scenario.leak_gib * GIB) // KB * KB)
