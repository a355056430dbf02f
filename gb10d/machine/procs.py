"""The one walk of /proc: each process this user can see, as its pid and its /proc directory.

Four readers need the processes of the machine: the members of vLLM's process group, the largest memory users
named when memory is not given back, the shared-memory segments still in use, and the processes a test lab left.
Each reads only the files it needs from the directory given here. A process can end between the listing and the
read: that is the reader's OSError, and the process is simply gone for it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

PROC = Path("/proc")


def processes(root: Path = PROC) -> Iterator[tuple[int, Path]]:
    """(pid, /proc/PID) of each process present at the listing, in /proc's order."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name), root / name


def stat_fields(directory: Path) -> list[bytes]:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, ...); OSError if the process is gone.

    The command name may contain spaces and parentheses, so the fields start after the last ')'.
    """
    stat = directory.joinpath("stat").read_bytes()
    return stat[stat.rfind(b")") + 2 :].split()


def status_fields(directory: Path) -> dict[str, str]:
    """/proc/PID/status as name and value (`VmRSS` -> `1234 kB`); OSError if the process is gone."""
    lines = directory.joinpath("status").read_text().splitlines()
    return {name: value.strip() for name, _, value in (line.partition(":") for line in lines) if value}


def kib(fields: dict[str, str], name: str) -> int | None:
    """A size of /proc/PID/status in KiB (`VmRSS`, `VmHWM`), or None where the process has none (a zombie)."""
    value = fields.get(name, "").split()
    return int(value[0]) if value and value[0].isdigit() else None


def rss_kib(pid: int) -> int | None:
    """The process's resident memory (VmRSS) in KiB; None once it is gone or holds none."""
    try:
        return kib(status_fields(PROC / str(pid)), "VmRSS")
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far, every thread's (utime + stime of /proc/PID/stat, a
    zombie's too); OSError once it is reaped."""
    fields = stat_fields(PROC / str(pid))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (owned by anyone)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
