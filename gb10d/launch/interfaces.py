"""Which network interface carries the cluster traffic, and this machine's address on it.

Two GB10 machines talk over a ConnectX-7 link (driver mlx5_core); Ray, Gloo
and NCCL must use that link and not the 1 GbE management port, or tensor
parallel traffic crawls. `choose` is the pure decision over a list of
`Interface` readings; `gb10d.launch.netifs` reads the kernel and joins
them (`find`). Every choice comes with a one-sentence reason for the
journal, and every refusal is an `InterfaceError` that names the config key,
says what to change, and lists what this machine has.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface
from typing import Literal, Sequence

from ..base.errors import EXIT_CONFIG, Gb10dError

_CONNECTX_DRIVER = "mlx5_core"

@dataclass(frozen=True)
class Interface:
    """One network interface as the kernel reports it.

    `up` is IFF_UP and IFF_RUNNING: switched on, and the kernel's operstate
    is "up" or "unknown" (drivers that cannot tell). A veth whose peer is
    down ("lowerlayerdown") or a port without carrier ("down") is not up.
    """

    name: str
    addresses: tuple[IPv4Interface, ...]
    up: bool
    driver: str | None  # None for virtual devices (veth, bridge, lo)
    speed_mbps: int | None  # None while the link is down, or for devices without one
    loopback: bool


@dataclass(frozen=True)
class Choice:
    """The interface for cluster traffic, this machine's address on it, and why."""

    interface: Interface
    address: IPv4Address
    reason: str  # a clause that reads after "because", one sentence with its caution


class InterfaceError(Gb10dError):
    """No usable interface for the cluster link; nothing was started.

    Not a ConfigError: that one points at a line of the file and ends with
    "check again with gb10d check-config", but here the file may be right and
    the machine wrong (a port down, an address missing), so the message says
    which key and which fact disagree. The exit status is still EX_CONFIG, so
    systemd does not restart into the same refusal.
    """

    exit_status = EXIT_CONFIG

    def __init__(self, key: str, problem: str, interfaces: Sequence[Interface]) -> None:
        self.key = key
        lines = [f"{key}: {problem}"]
        if interfaces:
            lines.append("interfaces found on this machine:")
            lines.extend(f"  {_describe(i)}" for i in interfaces)
        else:
            lines.append("no network interfaces were found on this machine")
        super().__init__("\n".join(lines))


def choose(
    interfaces: Sequence[Interface],
    role: Literal["head", "worker"],
    head_address: IPv4Address,
    requested: str | None,
    route_source: IPv4Address | None,
) -> Choice:
    """Pick the cluster interface; raise InterfaceError when none is right.

    `route_source` is the kernel's source address for a route to the head;
    it is only used by a worker that has no interface on the head's subnet.
    Traffic to the other machine cannot use loopback or a down interface, so
    down ones are never picked and loopback only when cluster.interface
    names it.
    """
    if role == "worker":
        _refuse_own_head_address(interfaces, head_address)
    if requested is not None:
        return _requested(interfaces, role, head_address, requested)
    if role == "head":
        return _head(interfaces, head_address)
    return _worker(interfaces, head_address, route_source)


# The rules.

def _refuse_own_head_address(interfaces: Sequence[Interface], head: IPv4Address) -> None:
    owner = next((i for i in interfaces if _carries(i, head)), None)
    if owner is not None:
        raise InterfaceError(
            "cluster.head_address",
            f"{head} is an address of this machine (on {owner.name}), but cluster.role is \"worker\"; "
            "on a worker, set cluster.head_address to the head machine's address on the link, "
            "or set cluster.role = \"head\" if this machine is the head",
            interfaces,
        )


def _requested(interfaces: Sequence[Interface], role: str, head: IPv4Address, name: str) -> Choice:
    iface = next((i for i in interfaces if i.name == name), None)
    if iface is None:
        raise InterfaceError(
            "cluster.interface",
            f"no interface named {name!r} on this machine; set cluster.interface to one of the "
            "interfaces below, or remove it to let gb10d pick the one on the head's subnet",
            interfaces,
        )
    if not iface.up:
        raise InterfaceError("cluster.interface", f"{name} is {_down_fix(name)}, "
                             "or set cluster.interface to another interface", interfaces)
    if not iface.addresses:
        wanted = f"cluster.head_address {head}" if role == "head" else "an address on the head's subnet"
        raise InterfaceError(
            "cluster.interface",
            f"{name} has no IPv4 address; give it {wanted}, or set cluster.interface to the interface that has one",
            interfaces,
        )
    if role == "head":
        if not _carries(iface, head):
            raise InterfaceError(
                "cluster.interface",
                f"{name} does not carry cluster.head_address {head} (it has {_addresses_text(iface)}); "
                "on the head, cluster.interface must be the interface with head_address: "
                "correct one of the two keys, or remove cluster.interface",
                interfaces,
            )
        return _choice(iface, head, "set by cluster.interface")
    on_subnet = _address_on_subnet(iface, head)
    if on_subnet is not None:
        return _choice(iface, on_subnet.ip, "set by cluster.interface")
    return _choice(iface, iface.addresses[0].ip, f"set by cluster.interface, although none of its addresses "
                   f"is on the subnet of the head {head}, so gb10d uses its first")


def _head(interfaces: Sequence[Interface], head: IPv4Address) -> Choice:
    owners = [i for i in interfaces if _carries(i, head)]
    if not owners:
        raise InterfaceError(
            "cluster.head_address",
            f"{head} is not an address of this machine, so it cannot be the head; set cluster.head_address "
            "to this machine's address on the ConnectX-7 link (see below), "
            "or set cluster.role = \"worker\" if this machine is a worker",
            interfaces,
        )
    usable = [i for i in owners if i.up and not i.loopback]
    if not usable:
        owner = owners[0]
        problem = (f"{head} is on the loopback interface {owner.name}, which the worker cannot reach; "
                   "set cluster.head_address to this machine's address on the ConnectX-7 link (see below)"
                   if owner.loopback else f"{head} is on {owner.name}, which is {_down_fix(owner.name)}")
        raise InterfaceError("cluster.head_address", problem, interfaces)
    best, preferred = _prefer(usable)
    return _choice(best, head, f"it carries cluster.head_address {head}{preferred}")


def _worker(interfaces: Sequence[Interface], head: IPv4Address, source: IPv4Address | None) -> Choice:
    on_subnet = {i.name: a for i in interfaces if not i.loopback and (a := _address_on_subnet(i, head)) is not None}
    usable = [i for i in interfaces if i.up and i.name in on_subnet]
    if usable:
        best, preferred = _prefer(usable)
        address = on_subnet[best.name]
        return _choice(best, address.ip, f"the head {head} is on its subnet {address.network}{preferred}")
    if on_subnet:
        # Its route is gone while it is down; a route through another port would be a slow surprise.
        down = next(i for i in interfaces if i.name in on_subnet)
        raise InterfaceError(
            "cluster.head_address",
            f"the head {head} is on the subnet of {down.name}, which is {_down_fix(down.name)}",
            interfaces,
        )
    if source is not None:
        owner = next((i for i in interfaces if i.up and not i.loopback and _carries(i, source)), None)
        if owner is not None:
            return _choice(owner, source, f"the route to the head {head} leaves through it")
    route = ("there is no route to it" if source is None
             else f"the route to it uses the source address {source}, which is on no interface that is up "
             "and not loopback")
    raise InterfaceError(
        "cluster.head_address",
        f"no interface of this machine is on the subnet of the head {head}, and {route}; "
        "set cluster.head_address to the head's address on the ConnectX-7 link, "
        "or give this machine's ConnectX-7 port an address on the head's subnet",
        interfaces,
    )


def _prefer(candidates: Sequence[Interface]) -> tuple[Interface, str]:
    """The best candidate, and a clause saying why it beat the others ("" when alone)."""
    ranked = sorted(candidates, key=_rank)
    best = ranked[0]
    if len(ranked) == 1:
        return best, ""
    runner_up = ranked[1]
    if (best.driver == _CONNECTX_DRIVER) != (runner_up.driver == _CONNECTX_DRIVER):
        why = f"it is a ConnectX-7 port (driver {_CONNECTX_DRIVER})"
    elif (best.speed_mbps or 0) != (runner_up.speed_mbps or 0):
        why = f"it is the fastest ({_speed_text(best.speed_mbps or 0)})"
    else:
        why = "of name order (same driver and speed)"
    others = ", ".join(i.name for i in ranked[1:])
    return best, f", and it was preferred over {others} because {why}"


def _rank(iface: Interface) -> tuple[bool, int, str]:
    return iface.driver != _CONNECTX_DRIVER, -(iface.speed_mbps or 0), iface.name


def _choice(iface: Interface, address: IPv4Address, reason: str) -> Choice:
    if iface.driver != _CONNECTX_DRIVER:
        what = f"driver {iface.driver}" if iface.driver else "a virtual device with no driver"
        reason += (f"; it is not a ConnectX-7 port ({what}), "
                   "so NCCL traffic between the machines will be slow")
    return Choice(iface, address, reason)


def _carries(iface: Interface, address: IPv4Address) -> bool:
    return any(a.ip == address for a in iface.addresses)


def _address_on_subnet(iface: Interface, address: IPv4Address) -> IPv4Interface | None:
    return next((a for a in iface.addresses if address in a.network), None)


def _down_fix(name: str) -> str:
    return (f"down (switched off, or no link to the other machine); check the cable "
            f"and run `ip link set {name} up`")


def _describe(iface: Interface) -> str:
    facts = ["up" if iface.up else "down"]
    if iface.loopback:
        facts.append("loopback")
    elif iface.driver:
        facts.append(f"driver {iface.driver}")
    else:
        facts.append("virtual")
    if iface.speed_mbps is not None:
        facts.append(_speed_text(iface.speed_mbps))
    return f"{iface.name}: {_addresses_text(iface)} ({', '.join(facts)})"


def _addresses_text(iface: Interface) -> str:
    return ", ".join(str(a) for a in iface.addresses) or "no IPv4 address"


def _speed_text(mbps: int) -> str:
    if mbps >= 1000:
        return f"{mbps / 1000:g} Gb/s"
    return f"{mbps} Mb/s"
