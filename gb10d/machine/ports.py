"""Which program listens on a TCP port, from /proc: what a bind that failed with "address in use" tells the operator.

The common case is the first hour with gb10d: the old start script's vLLM still holds port 8000. Naming it (its
pid and command line) saves a search with ss. Another user's processes hide their file descriptors from a
service user, so the answer may be only the port's owner by uid, or nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

from .procs import PROC, processes

_LISTEN = "0A"


def _listening_inodes(port: int, proc: Path) -> dict[str, int]:
    """The socket inodes listening on `port` (IPv4 and IPv6), each with its owner's uid."""
    found: dict[str, int] = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            _, _, hex_port = fields[1].rpartition(":")
            if int(hex_port, 16) == port:
                found[fields[9]] = int(fields[7])
    return found


def holder_of(port: int, proc: Path = PROC) -> str | None:
    """Who listens on `port`: `pid 1234 (vllm serve ...)`, `a process of uid 1000` when its descriptors are hidden
    from us, or None when nothing listens (or /proc says nothing)."""
    inodes = _listening_inodes(port, proc)
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for pid, directory in processes(proc):
        try:
            links = {os.readlink(directory / "fd" / fd) for fd in os.listdir(directory / "fd")}
        except OSError:
            continue
        if links & wanted:
            try:
                command = (directory / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                command = ""
            return f"pid {pid} ({command[:120] or 'no command line'})"
    uids = sorted(set(inodes.values()))
    return f"a process of uid {', '.join(map(str, uids))} (its descriptors are hidden from this user; `sudo ss -ltnp` names it)"
