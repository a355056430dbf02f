"""This machine's network interfaces and routes read from the kernel, for `gb10d.launch.interfaces.choose`."""

from __future__ import annotations

import array
import errno
import fcntl
import os
import socket
import struct
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path
from typing import Literal

from .interfaces import Choice, Interface, choose

# <linux/sockios.h> and <net/if.h>
_SIOCGIFCONF = 0x8912
_SIOCGIFFLAGS = 0x8913
_SIOCGIFNETMASK = 0x891B
_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8
_IFF_RUNNING = 0x40
_IFNAMSIZ = 16
# struct ifreq is the name followed by a union whose largest member is struct ifmap.
_IFREQ_SIZE = _IFNAMSIZ + struct.calcsize("LLHBBB0L")
_IFCONF = "iP"  # struct ifconf: int ifc_len; then the buffer pointer


def read_interfaces(sys_class_net: Path = Path("/sys/class/net")) -> list[Interface]:
    """Read this network namespace's interfaces, sorted by name.

    Addresses come from ioctl(SIOCGIFCONF) and SIOCGIFNETMASK rather than
    from `ip`, so gb10d needs no iproute2. SIOCGIFCONF lists every IPv4
    address, secondaries and labelled aliases ("eth0:1") included; labelled
    ones are filed under their device. IPv6 is not read: head_address is
    IPv4. `sys_class_net` supplies names, drivers and speeds; it must belong
    to the same namespace as the process (`ip netns exec` remounts /sys,
    plain `nsenter --net` does not).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        addresses = _addresses(sock)
        found: list[Interface] = []
        for name in sorted(os.listdir(sys_class_net)):
            entry = sys_class_net / name
            if not entry.is_dir():  # bonding_masters is a file in the same directory
                continue
            try:
                flags = _flags(sock, name)
            except OSError as exc:
                if exc.errno == errno.ENODEV:  # went away while we looked
                    continue
                raise
            found.append(Interface(
                name=name,
                addresses=tuple(addresses.get(name, ())),
                up=flags & (_IFF_UP | _IFF_RUNNING) == _IFF_UP | _IFF_RUNNING,
                driver=_driver(entry),
                speed_mbps=_speed(entry),
                loopback=bool(flags & _IFF_LOOPBACK),
            ))
    return found


def route_source(head_address: IPv4Address) -> IPv4Address | None:
    """The source address the kernel would use to reach the head; None without a route.

    Connecting a UDP socket only looks up the route: no packet is sent.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((str(head_address), 9))
        except OSError:
            return None
        return IPv4Address(sock.getsockname()[0])


def find(role: Literal["head", "worker"], head_address: IPv4Address, requested: str | None) -> Choice:
    """Choose the cluster interface from this machine's real interfaces and routes."""
    return choose(read_interfaces(), role, head_address, requested, route_source(head_address))


def _addresses(sock: socket.socket) -> dict[str, list[IPv4Interface]]:
    """Every IPv4 address with its prefix, by device name."""
    entries = _ifconf(sock)
    found: dict[str, list[IPv4Interface]] = {}
    for i in range(0, len(entries), _IFREQ_SIZE):
        ifreq = entries[i:i + _IFREQ_SIZE]
        label = ifreq[:_IFNAMSIZ].split(b"\0", 1)[0].decode()
        address = socket.inet_ntoa(ifreq[20:24])  # sockaddr_in: family, port, then the address
        # Passing back the whole ifreq makes the kernel match the address, not just the label,
        # so each secondary address gets its own netmask.
        try:
            netmask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFNETMASK, ifreq)[20:24])
        except OSError as exc:
            if exc.errno in (errno.ENODEV, errno.EADDRNOTAVAIL):  # removed since SIOCGIFCONF
                continue
            raise
        found.setdefault(label.split(":", 1)[0], []).append(IPv4Interface(f"{address}/{netmask}"))
    return found


def _ifconf(sock: socket.socket) -> bytes:
    """The ifreq array of SIOCGIFCONF, grown until it is not full (addresses may appear meanwhile)."""
    size = struct.unpack(_IFCONF, fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, struct.pack(_IFCONF, 0, 0)))[0]
    while True:
        size += 8 * _IFREQ_SIZE
        buffer = array.array("B", bytes(size))
        result = fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, struct.pack(_IFCONF, size, buffer.buffer_info()[0]))
        used = struct.unpack(_IFCONF, result)[0]
        if used < size:
            return buffer.tobytes()[:used]


def _flags(sock: socket.socket, name: str) -> int:
    ifreq = struct.pack(f"{_IFNAMSIZ}s{_IFREQ_SIZE - _IFNAMSIZ}x", name.encode())
    return int(struct.unpack_from("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, ifreq), _IFNAMSIZ)[0])


def _driver(entry: Path) -> str | None:
    try:
        return os.path.basename(os.readlink(entry / "device" / "driver"))
    except OSError:  # virtual devices have no device link
        return None


def _speed(entry: Path) -> int | None:
    try:
        speed = int((entry / "speed").read_text().strip())
    except (OSError, ValueError):  # EINVAL while the link is down, or for lo
        return None
    return speed if speed > 0 else None
