"""Shared memory that dead vLLM processes left in /dev/shm, and removing it before the next start.

A killed vLLM leaves its segments behind: Python's multiprocessing
semaphores (`sem.mp-*`) and shared memory (`psm_*`, which vLLM's message
queues use), PyTorch's (`torch_*`) and vLLM's own (`vllm_*`). /dev/shm is
memory, and on GB10 the same memory vLLM needs; some reports link the
leftovers to engines that die hours later. Before each start, when no
process of the instance is alive, gb10d removes the segments that are its
own user's, carry those names, and that no living process has open or
mapped: a segment another process still uses, or another user's, is never
touched.

`leftovers` decides from a listing and the set of segments in use (pure);
`scan`, `in_use` and `remove` read and change the file system.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..base.units import gib
from .procs import processes

SHM = Path("/dev/shm")
# Names of the segments vLLM's processes create: multiprocessing, PyTorch, vLLM's own.
PATTERNS = ("psm_*", "sem.mp-*", "torch_*", "vllm_*")


@dataclass(frozen=True)
class Segment:
    """One entry of /dev/shm: its name, owner, size and identity (device, inode)."""

    name: str
    uid: int
    size: int
    ident: tuple[int, int]


def leftovers(segments: list[Segment], uid: int, used: set[tuple[int, int]]) -> list[Segment]:
    """The segments to remove: `uid`'s, named like vLLM's, and open or mapped by no living process."""
    return [
        s for s in segments
        if s.uid == uid and s.ident not in used and any(fnmatch.fnmatchcase(s.name, pattern) for pattern in PATTERNS)
    ]


def describe(removed: list[Segment]) -> str:
    """`removed 3 shared memory segments (1.50 GiB) that dead vLLM processes left in /dev/shm: psm_1a2b, ...`."""
    total = sum(s.size for s in removed)
    names = ", ".join(s.name for s in removed[:5]) + (", ..." if len(removed) > 5 else "")
    return (
        f"removed {len(removed)} shared memory segment{'s' if len(removed) != 1 else ''} ({gib(total)}) "
        f"that dead vLLM processes left in {SHM}: {names}"
    )


# --- the file system -----------------------------------------------------------------


def scan(directory: Path = SHM) -> list[Segment]:
    """The regular files of `directory` (a missing directory has none)."""
    found: list[Segment] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            found.append(Segment(entry.name, st.st_uid, st.st_size, (st.st_dev, st.st_ino)))
    return found


def in_use(directory: Path = SHM) -> set[tuple[int, int]]:
    """(device, inode) of every file under `directory` that a process this user can see has open or mapped.

    The processes of other users cannot be inspected, but their segments are
    not this user's to remove either.
    """
    prefix = str(directory).rstrip("/") + "/"
    used: set[tuple[int, int]] = set()
    for _pid, directory in processes():
        try:
            maps = directory.joinpath("maps").read_text(errors="replace")
        except OSError:
            maps = ""
        for line in maps.splitlines():
            fields = line.split(None, 5)  # address perms offset dev inode [path]
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith(prefix):
                _add(used, path.removesuffix(" (deleted)"))
        try:
            fds = os.listdir(directory / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(directory / "fd" / fd)
            except OSError:
                continue
            if target.startswith(prefix):
                _add(used, target)
    return used


def _add(used: set[tuple[int, int]], path: str) -> None:
    try:
        st = os.stat(path)
    except OSError:
        return
    used.add((st.st_dev, st.st_ino))


def remove(segments: list[Segment], directory: Path = SHM) -> list[Segment]:
    """Unlink each segment; those already gone or not removable are left out of the answer."""
    removed: list[Segment] = []
    for segment in segments:
        try:
            os.unlink(directory / segment.name)
        except OSError:
            continue
        removed.append(segment)
    return removed
