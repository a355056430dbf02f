"""The listening sockets systemd passes to a socket-activated service (sd_listen_fds(3)), and where each listens.

With gb10d-front.socket, systemd binds and listens on the public port
itself and starts gb10d-front.service with the socket already open as
fd 3 (then 4, ... for more `Listen*=` lines), saying so in three variables:
`LISTEN_PID` (the pid they are meant for), `LISTEN_FDS` (how many) and
`LISTEN_FDNAMES` (each one's `FileDescriptorName=`, colon-separated). The
socket outlives the service, so while the front restarts the kernel keeps
queueing connections in its backlog instead of refusing them.

The decision is pure (`passed_fds`: are these variables ours, how many fds,
what are they called); `listen_sockets` and `passed_sockets` then wrap the
fds, as libsystemd's sd_listen_fds_with_names(unset_environment=1) does:
the variables are removed in every case (also when meant for another pid),
so that no child started later believes the sockets are its own, and each
fd is made close-on-exec, so that no child keeps the public port open after
the front is gone. Each socket is made non-blocking for asyncio.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from gb10d.base.errors import EXIT_CONFIG, Gb10dError

SD_LISTEN_FDS_START = 3  # sd-daemon.h: the first fd systemd passes
VARIABLES = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# What sd_listen_fds_with_names(3) calls an fd when LISTEN_FDNAMES is not set.
UNNAMED = "unknown"
_SOCKET_TYPES = {socket.SOCK_STREAM: "stream", socket.SOCK_DGRAM: "datagram", socket.SOCK_SEQPACKET: "seqpacket"}


class ListenFdsError(Gb10dError):
    """systemd passed listening sockets that cannot be served; nothing was served."""

    exit_status = EXIT_CONFIG


@dataclass(frozen=True)
class PassedSocket:
    """One listening socket systemd passed: its `FileDescriptorName=` (or "unknown") and the socket, non-blocking."""

    name: str
    sock: socket.socket


def passed_fds(environ: Mapping[str, str], pid: int) -> list[tuple[int, str]]:
    """The (fd, name) pairs the variables in `environ` pass to process `pid`; [] when they are absent or for another pid.

    Raises ListenFdsError when they are meant for `pid` but malformed: a count
    that is not a number, or a different number of names than of fds.
    """
    if environ.get("LISTEN_PID", "").strip() != str(pid) or "LISTEN_FDS" not in environ:
        return []
    count_text = environ["LISTEN_FDS"].strip()
    if not count_text.isdigit():
        raise ListenFdsError(f"systemd passed LISTEN_FDS={count_text!r}, not a number of sockets; check the unit's .socket file (systemctl cat)")
    count = int(count_text)
    names_text = environ.get("LISTEN_FDNAMES")
    names = names_text.split(":") if names_text else [UNNAMED] * count
    if len(names) != count:
        raise ListenFdsError(
            f"systemd passed {count} socket(s) but {len(names)} name(s) in LISTEN_FDNAMES={names_text!r}; "
            "check FileDescriptorName= in the unit's .socket file (systemctl cat)"
        )
    return [(SD_LISTEN_FDS_START + index, name) for index, name in enumerate(names)]


def passed_sockets(environ: MutableMapping[str, str] = os.environ) -> list[PassedSocket]:
    """The listening stream sockets systemd passed to this process, with their names; [] when it passed none.

    The three variables are removed from `environ` (os.environ: children do not
    inherit them). Raises ListenFdsError, naming the fd and the socket unit's
    setting, for an fd that is not a listening stream socket (a `ListenDatagram=`
    or `ListenFIFO=` line, say).
    """
    try:
        fds = passed_fds(environ, os.getpid())
    finally:
        for name in VARIABLES:
            environ.pop(name, None)
    passed = []
    for fd, name in fds:
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ListenFdsError(f"systemd passed fd {fd} ({name}) but it is not a socket ({exc.strerror}); use ListenStream= in the .socket unit") from None
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            kind = _SOCKET_TYPES.get(sock.type, str(sock.type))
            sock.detach()  # the fd stays systemd's to explain; only this wrapper goes
            raise ListenFdsError(
                f"systemd passed fd {fd} ({name}) as a {kind} socket that does not accept connections; use ListenStream= in the .socket unit"
            )
        sock.set_inheritable(False)
        sock.setblocking(False)
        passed.append(PassedSocket(name, sock))
    return passed


def listen_sockets(environ: MutableMapping[str, str] = os.environ) -> list[socket.socket]:
    """The listening stream sockets systemd passed to this process, in fd order; [] when it passed none (see `passed_sockets`)."""
    return [passed.sock for passed in passed_sockets(environ)]


def listening_address(sock: socket.socket) -> str:
    """Where a socket listens, as an operator writes it: `0.0.0.0:8000`, `[::]:8000`, a path, or `@name` (abstract)."""
    address = sock.getsockname()
    if sock.family == socket.AF_INET:
        host, port = address
        return f"{host}:{port}"
    if sock.family == socket.AF_INET6:
        host, port = address[:2]
        return f"[{host}]:{port}"
    if sock.family == socket.AF_UNIX:
        if isinstance(address, bytes):  # an abstract name, which Python returns as bytes starting with NUL
            return "@" + address[1:].decode(errors="replace")
        return str(address) or "(unnamed unix socket)"
    return str(address)
