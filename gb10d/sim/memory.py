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


def _lock_path(meminfo: Path) -> Path:
    return meminfo.with_name(f".{meminfo.name}.lock")


def adjust(meminfo: Path, delta_bytes: int, need_bytes: int = 0, page_cache: bool = False) -> int | None:
    """Add `delta_bytes` (negative: take memory) to MemFree and MemAvailable, never above MemTotal nor below 0.

    A take larger than MemFree reclaims the page cache (Cached) for the
    rest, as the kernel does. With `page_cache`, the delta is page cache
    instead: taking fills it (MemFree falls, Cached grows, MemAvailable
    stays), giving back drops it. With `need_bytes`, take only if
    MemAvailable has that much; returns None when it did, else the
    MemAvailable that was short. Raises SettingsError when the file cannot
    be changed.
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
        _replace(meminfo, _changed(text, _new_values(values, delta_bytes, page_cache)), mode)
        return None
    finally:
        os.close(lock)


def _new_values(values: dict[str, int], delta_bytes: int, page_cache: bool) -> dict[str, int]:
    """The fields `adjust` changes, in kB, after adding `delta_bytes` (see there)."""
    top = values.get("MemTotal", 1 << 72) // KB
    free, available, cached = (values.get(name, 0) // KB for name in ("MemFree", "MemAvailable", "Cached"))
    delta = delta_bytes // KB
    if page_cache:
        moved = max(delta, -free) if delta < 0 else min(delta, cached)
        return {"MemFree": free + moved, "Cached": cached - moved}
    reclaimed = min(max(-delta - free, 0), cached)
    return {
        "MemFree": min(max(free + delta, 0), top),
        "MemAvailable": min(max(available + delta, 0), top),
        "Cached": cached - reclaimed,
    }


def _changed(text: str, new: dict[str, int]) -> str:
    """`text` with the fields in `new` replaced (fields it lacks stay lacking)."""
    lines = []
    for line in text.splitlines(keepends=True):
        name, _, rest = line.partition(":")
        words = rest.split()
        if name in new and words and words[0].isdigit():
            line = f"{name}:{' ' * max(1, 15 - len(name))}{new[name]} kB\n"
        lines.append(line)
    return "".join(lines)


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
    """What this EngineCore holds of the simulated memory; given back when it ends, by itself or by its keeper.

    With `page_cache`, what it holds is page cache its load filled (`adjust`), dropped when it ends: the
    checkpoint's pages, which a supervisor such as gb10d evicts before the next start.
    """

    def __init__(self, meminfo: Path, page_cache: bool = False) -> None:
        self.meminfo = meminfo
        self.held = 0
        asks_r, self._asks = os.pipe()
        self._answers, answers_w = os.pipe()
        self._keeper = os.fork()
        if self._keeper == 0:
            os.close(self._asks)
            os.close(self._answers)
            _keep(meminfo, asks_r, answers_w, page_cache)
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


def _keep(meminfo: Path, asks: int, answers: int, page_cache: bool) -> None:
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
                    short = adjust(meminfo, held - wanted, 0 if page_cache else max(wanted - held, 0), page_cache)
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
                adjust(meminfo, held, page_cache=page_cache)
            except SettingsError:
                pass
        os._exit(0)


def trap(settings: SimSettings) -> None:
    """leak_gib: memory a crashed engine never gives back (GB10's crashed-CUDA-process trap), taken for good.

    Only the simulated meminfo file shows it; without one there is nothing to show.
    """
    if settings.meminfo is not None and settings.scenario.leak_gib:
        adjust(settings.meminfo, -int(settings.scenario.leak_gib * GIB) // KB * KB)
