"""Picking the cluster interface: the rules on constructed interfaces, then the real kernel.

The rule tests assert the exact sentence the operator reads in the journal
or on stderr. The kernel tests build two network namespaces joined by a veth
pair on a private test subnet (10.213.7.0/24, nothing leaves the machine)
and run `find` inside them through `ip netns exec`, which also gives the
child a /sys of that namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from ipaddress import IPv4Address, IPv4Interface
from typing import Any, Callable, Iterator

import pytest

from gb10d.base.errors import EXIT_CONFIG, Gb10dError
from gb10d.launch.interfaces import Choice, Interface, InterfaceError, choose

HEAD = IPv4Address("10.0.0.1")
SLOW = "; it is not a ConnectX-7 port (a virtual device with no driver), so NCCL traffic between the machines will be slow"


def iface(name: str, *addresses: str, up: bool = True, driver: str | None = "mlx5_core",
          speed: int | None = 200000, loopback: bool = False) -> Interface:
    return Interface(name, tuple(IPv4Interface(a) for a in addresses), up, driver, speed, loopback)


LO = iface("lo", "127.0.0.1/8", driver=None, speed=None, loopback=True)
ETH = iface("enP7s7", "192.168.1.20/24", driver="r8169", speed=1000)
CX_HEAD = iface("enp1s0f0np0", "10.0.0.1/24")
CX_WORKER = iface("enp1s0f0np0", "10.0.0.2/24")


def picked(choice: Choice) -> tuple[str, str, str]:
    return choice.interface.name, str(choice.address), choice.reason


def refusal(call: Callable[[], Choice]) -> InterfaceError:
    with pytest.raises(InterfaceError) as caught:
        call()
    return caught.value


# The head.

def test_head_picks_the_interface_carrying_head_address() -> None:
    assert picked(choose([ETH, CX_HEAD, LO], "head", HEAD, None, None)) == (
        "enp1s0f0np0", "10.0.0.1", "it carries cluster.head_address 10.0.0.1")


def test_head_on_a_port_that_is_not_connectx_is_chosen_with_a_caution() -> None:
    veth = iface("veth0", "10.0.0.1/24", driver=None, speed=10000)
    assert picked(choose([veth], "head", HEAD, None, None))[2] == "it carries cluster.head_address 10.0.0.1" + SLOW
    eth = iface("eno1", "10.0.0.1/24", driver="igb", speed=1000)
    assert choose([eth], "head", HEAD, None, None).reason == (
        "it carries cluster.head_address 10.0.0.1; it is not a ConnectX-7 port (driver igb), "
        "so NCCL traffic between the machines will be slow")


def test_head_address_that_is_not_on_this_machine_is_refused_with_the_list() -> None:
    error = refusal(lambda: choose([CX_WORKER, ETH, LO], "head", HEAD, None, None))
    assert error.key == "cluster.head_address"
    assert str(error) == (
        'cluster.head_address: 10.0.0.1 is not an address of this machine, so it cannot be the head; '
        "set cluster.head_address to this machine's address on the ConnectX-7 link (see below), "
        'or set cluster.role = "worker" if this machine is a worker\n'
        "interfaces found on this machine:\n"
        "  enp1s0f0np0: 10.0.0.2/24 (up, driver mlx5_core, 200 Gb/s)\n"
        "  enP7s7: 192.168.1.20/24 (up, driver r8169, 1 Gb/s)\n"
        "  lo: 127.0.0.1/8 (up, loopback)")


def test_head_address_on_a_down_port_is_refused_with_how_to_bring_it_up() -> None:
    down = iface("enp1s0f0np0", "10.0.0.1/24", up=False, speed=None)
    assert str(refusal(lambda: choose([down, ETH], "head", HEAD, None, None))).splitlines() == [
        "cluster.head_address: 10.0.0.1 is on enp1s0f0np0, which is down (switched off, or no link to the "
        "other machine); check the cable and run `ip link set enp1s0f0np0 up`",
        "interfaces found on this machine:",
        "  enp1s0f0np0: 10.0.0.1/24 (down, driver mlx5_core)",
        "  enP7s7: 192.168.1.20/24 (up, driver r8169, 1 Gb/s)",
    ]


def test_head_address_on_loopback_is_refused_because_the_worker_cannot_reach_it() -> None:
    error = refusal(lambda: choose([LO, CX_HEAD], "head", IPv4Address("127.0.0.1"), None, None))
    assert str(error).splitlines()[0] == (
        "cluster.head_address: 127.0.0.1 is on the loopback interface lo, which the worker cannot reach; "
        "set cluster.head_address to this machine's address on the ConnectX-7 link (see below)")


def test_head_address_on_two_ports_prefers_the_connectx_one_and_says_so() -> None:
    bridge = iface("br0", "10.0.0.1/24", driver=None, speed=None)
    assert picked(choose([bridge, CX_HEAD], "head", HEAD, None, None)) == (
        "enp1s0f0np0", "10.0.0.1", "it carries cluster.head_address 10.0.0.1, and it was preferred over br0 "
        "because it is a ConnectX-7 port (driver mlx5_core)")


# The worker, on the head's subnet.

def test_worker_picks_the_interface_on_the_heads_subnet_and_its_address_there() -> None:
    cx = iface("enp1s0f0np0", "10.9.0.2/24", "10.0.0.2/24")
    assert picked(choose([ETH, cx, LO], "worker", HEAD, None, IPv4Address("192.168.1.20"))) == (
        "enp1s0f0np0", "10.0.0.2", "the head 10.0.0.1 is on its subnet 10.0.0.0/24")


def test_worker_on_the_heads_subnet_through_a_virtual_port_gets_the_caution() -> None:
    veth = iface("veth0", "10.0.0.2/24", driver=None, speed=10000)
    assert choose([veth], "worker", HEAD, None, None).reason == "the head 10.0.0.1 is on its subnet 10.0.0.0/24" + SLOW


def test_worker_prefers_a_connectx_port_over_a_faster_other_one() -> None:
    fast = iface("bond0", "10.0.0.3/24", driver=None, speed=400000)
    assert picked(choose([fast, CX_WORKER], "worker", HEAD, None, None)) == (
        "enp1s0f0np0", "10.0.0.2", "the head 10.0.0.1 is on its subnet 10.0.0.0/24, and it was preferred "
        "over bond0 because it is a ConnectX-7 port (driver mlx5_core)")


def test_worker_prefers_the_fastest_connectx_port() -> None:
    slow = iface("enp1s0f0np0", "10.0.0.2/24", speed=100000)
    fast = iface("enP2p1s0f0np0", "10.0.0.3/24", speed=200000)
    unknown = iface("enP2p1s0f1np1", "10.0.0.4/24", speed=None)
    assert picked(choose([slow, unknown, fast], "worker", HEAD, None, None)) == (
        "enP2p1s0f0np0", "10.0.0.3", "the head 10.0.0.1 is on its subnet 10.0.0.0/24, and it was preferred "
        "over enp1s0f0np0, enP2p1s0f1np1 because it is the fastest (200 Gb/s)")


def test_worker_breaks_a_tie_by_name_order() -> None:
    second = iface("enp1s0f1np1", "10.0.0.3/24")
    first = iface("enP2p1s0f0np0", "10.0.0.2/24")
    assert picked(choose([second, first], "worker", HEAD, None, None)) == (
        "enP2p1s0f0np0", "10.0.0.2", "the head 10.0.0.1 is on its subnet 10.0.0.0/24, and it was preferred "
        "over enp1s0f1np1 because of name order (same driver and speed)")


def test_worker_never_picks_a_down_port_on_the_heads_subnet_and_does_not_fall_back_to_a_slow_route() -> None:
    down = iface("enp1s0f0np0", "10.0.0.2/24", up=False, speed=None)
    error = refusal(lambda: choose([down, ETH], "worker", HEAD, None, IPv4Address("192.168.1.20")))
    assert error.key == "cluster.head_address"
    assert str(error).splitlines()[0] == (
        "cluster.head_address: the head 10.0.0.1 is on the subnet of enp1s0f0np0, which is down (switched off, "
        "or no link to the other machine); check the cable and run `ip link set enp1s0f0np0 up`")


def test_worker_with_an_up_port_on_the_subnet_ignores_a_down_one_there() -> None:
    down = iface("enp1s0f0np0", "10.0.0.2/24", up=False, speed=None)
    up = iface("enp1s0f1np1", "10.0.0.3/24")
    assert picked(choose([down, up], "worker", HEAD, None, None))[:2] == ("enp1s0f1np1", "10.0.0.3")


def test_worker_never_picks_loopback_even_when_its_subnet_holds_the_head() -> None:
    error = refusal(lambda: choose([LO], "worker", IPv4Address("127.0.0.53"), None, IPv4Address("127.0.0.1")))
    assert str(error).splitlines()[0] == (
        "cluster.head_address: no interface of this machine is on the subnet of the head 127.0.0.53, and the "
        "route to it uses the source address 127.0.0.1, which is on no interface that is up and not loopback; "
        "set cluster.head_address to the head's address on the ConnectX-7 link, "
        "or give this machine's ConnectX-7 port an address on the head's subnet")


def test_worker_that_carries_head_address_is_told_to_fix_role_or_address() -> None:
    error = refusal(lambda: choose([CX_HEAD, ETH], "worker", HEAD, None, None))
    assert str(error).splitlines()[0] == (
        'cluster.head_address: 10.0.0.1 is an address of this machine (on enp1s0f0np0), but cluster.role is '
        "\"worker\"; on a worker, set cluster.head_address to the head machine's address on the link, "
        'or set cluster.role = "head" if this machine is the head')
    assert refusal(lambda: choose([CX_HEAD], "worker", HEAD, "enp1s0f0np0", None)).key == "cluster.head_address"


# The worker, through a route.

def test_worker_off_the_heads_subnet_follows_the_route_to_the_head() -> None:
    cx = iface("enp1s0f0np0", "10.1.0.2/24")
    assert picked(choose([ETH, cx, LO], "worker", HEAD, None, IPv4Address("10.1.0.2"))) == (
        "enp1s0f0np0", "10.1.0.2", "the route to the head 10.0.0.1 leaves through it")


def test_worker_whose_route_leaves_through_the_management_port_is_cautioned() -> None:
    assert choose([ETH, LO], "worker", HEAD, None, IPv4Address("192.168.1.20")).reason == (
        "the route to the head 10.0.0.1 leaves through it; it is not a ConnectX-7 port (driver r8169), "
        "so NCCL traffic between the machines will be slow")


def test_worker_without_subnet_or_route_is_refused_with_the_list() -> None:
    error = refusal(lambda: choose([ETH, LO], "worker", HEAD, None, None))
    assert error.key == "cluster.head_address"
    assert str(error).splitlines() == [
        "cluster.head_address: no interface of this machine is on the subnet of the head 10.0.0.1, and there is "
        "no route to it; set cluster.head_address to the head's address on the ConnectX-7 link, "
        "or give this machine's ConnectX-7 port an address on the head's subnet",
        "interfaces found on this machine:",
        "  enP7s7: 192.168.1.20/24 (up, driver r8169, 1 Gb/s)",
        "  lo: 127.0.0.1/8 (up, loopback)",
    ]


def test_worker_whose_route_source_is_on_a_down_port_is_refused() -> None:
    down = iface("enp1s0f0np0", "10.1.0.2/24", up=False, speed=None)
    error = refusal(lambda: choose([down], "worker", HEAD, None, IPv4Address("10.1.0.2")))
    assert "the route to it uses the source address 10.1.0.2, which is on no interface that is up" in str(error)


# cluster.interface.

def test_requested_interface_wins_over_the_preference_and_says_so() -> None:
    veth = iface("veth0", "10.0.0.3/24", driver=None, speed=10000)
    assert picked(choose([CX_WORKER, veth], "worker", HEAD, "veth0", None)) == (
        "veth0", "10.0.0.3", "set by cluster.interface" + SLOW)


def test_requested_interface_uses_its_address_on_the_heads_subnet() -> None:
    cx = iface("enp1s0f0np0", "10.9.0.2/24", "10.0.0.2/24")
    assert picked(choose([cx], "worker", HEAD, "enp1s0f0np0", None)) == (
        "enp1s0f0np0", "10.0.0.2", "set by cluster.interface")


def test_requested_interface_off_the_heads_subnet_uses_its_first_address_and_says_so() -> None:
    cx = iface("enp1s0f0np0", "10.9.0.2/24", "10.8.0.2/24")
    assert picked(choose([cx], "worker", HEAD, "enp1s0f0np0", None)) == (
        "enp1s0f0np0", "10.9.0.2", "set by cluster.interface, although none of its addresses is on the "
        "subnet of the head 10.0.0.1, so gb10d uses its first")


def test_requested_interface_on_the_head_uses_head_address() -> None:
    cx = iface("enp1s0f0np0", "10.9.0.1/24", "10.0.0.1/24")
    assert picked(choose([cx, ETH], "head", HEAD, "enp1s0f0np0", None)) == (
        "enp1s0f0np0", "10.0.0.1", "set by cluster.interface")


def test_requested_interface_that_does_not_exist_is_refused_with_the_list() -> None:
    error = refusal(lambda: choose([CX_WORKER, LO], "worker", HEAD, "enp9s0", None))
    assert error.key == "cluster.interface"
    assert str(error).splitlines() == [
        "cluster.interface: no interface named 'enp9s0' on this machine; set cluster.interface to one of the "
        "interfaces below, or remove it to let gb10d pick the one on the head's subnet",
        "interfaces found on this machine:",
        "  enp1s0f0np0: 10.0.0.2/24 (up, driver mlx5_core, 200 Gb/s)",
        "  lo: 127.0.0.1/8 (up, loopback)",
    ]


def test_requested_interface_that_is_down_is_refused() -> None:
    down = iface("enp1s0f0np0", "10.0.0.2/24", up=False, speed=None)
    assert str(refusal(lambda: choose([down], "worker", HEAD, "enp1s0f0np0", None))).splitlines()[0] == (
        "cluster.interface: enp1s0f0np0 is down (switched off, or no link to the other machine); check the cable "
        "and run `ip link set enp1s0f0np0 up`, or set cluster.interface to another interface")


def test_requested_interface_without_ipv4_is_refused_with_what_to_give_it() -> None:
    bare = iface("enp1s0f0np0")
    assert str(refusal(lambda: choose([bare], "worker", HEAD, "enp1s0f0np0", None))).splitlines()[:3] == [
        "cluster.interface: enp1s0f0np0 has no IPv4 address; give it an address on the head's subnet, "
        "or set cluster.interface to the interface that has one",
        "interfaces found on this machine:",
        "  enp1s0f0np0: no IPv4 address (up, driver mlx5_core, 200 Gb/s)",
    ]
    assert str(refusal(lambda: choose([bare], "head", HEAD, "enp1s0f0np0", None))).splitlines()[0] == (
        "cluster.interface: enp1s0f0np0 has no IPv4 address; give it cluster.head_address 10.0.0.1, "
        "or set cluster.interface to the interface that has one")


def test_requested_interface_on_the_head_must_carry_head_address() -> None:
    assert str(refusal(lambda: choose([CX_WORKER, ETH], "head", HEAD, "enp1s0f0np0", None))).splitlines()[0] == (
        "cluster.interface: enp1s0f0np0 does not carry cluster.head_address 10.0.0.1 (it has 10.0.0.2/24); "
        "on the head, cluster.interface must be the interface with head_address: correct one of the two keys, "
        "or remove cluster.interface")


# What every refusal has in common.

EVERY_REFUSAL: list[tuple[str, list[Interface], str, str | None, IPv4Address | None]] = [
    ("head, address elsewhere", [CX_WORKER, ETH], "head", None, None),
    ("head, port down", [iface("cx0", "10.0.0.1/24", up=False), ETH], "head", None, None),
    ("head, on loopback", [iface("lo", "10.0.0.1/8", loopback=True, driver=None), ETH], "head", None, None),
    ("worker, own head address", [CX_HEAD, ETH], "worker", None, None),
    ("worker, subnet port down", [iface("cx0", "10.0.0.2/24", up=False), ETH], "worker", None, None),
    ("worker, no route", [ETH], "worker", None, None),
    ("requested, missing", [CX_WORKER, ETH], "worker", "cx9", None),
    ("requested, down", [iface("cx0", "10.0.0.2/24", up=False), ETH], "worker", "cx0", None),
    ("requested, no address", [iface("cx0"), ETH], "head", "cx0", None),
    ("requested, head without head address", [CX_WORKER, ETH], "head", "enp1s0f0np0", None),
]


@pytest.mark.parametrize(("interfaces", "role", "requested", "source"),
                         [case[1:] for case in EVERY_REFUSAL], ids=[case[0] for case in EVERY_REFUSAL])
def test_every_refusal_names_the_key_says_the_fix_lists_the_interfaces_and_exits_78(
        interfaces: list[Interface], role: Any, requested: str | None, source: IPv4Address | None) -> None:
    error = refusal(lambda: choose(interfaces, role, HEAD, requested, source))
    first, heading, *listed = str(error).splitlines()
    assert error.key in ("cluster.interface", "cluster.head_address")
    assert first.startswith(f"{error.key}: ")
    assert any(fix in first for fix in (" set cluster.", " give it ", "run `ip link set ", "correct one of")), first
    assert heading == "interfaces found on this machine:"
    assert [line.split(":")[0].strip() for line in listed] == [i.name for i in interfaces]
    assert isinstance(error, Gb10dError) and error.exit_status == EXIT_CONFIG


def test_a_refusal_on_a_machine_without_interfaces_says_none_were_found() -> None:
    assert str(refusal(lambda: choose([], "worker", HEAD, None, None))).splitlines()[1] == (
        "no network interfaces were found on this machine")


def test_the_listing_shows_speeds_as_an_operator_reads_them() -> None:
    interfaces = [iface("a", "10.5.0.1/24", speed=2500, driver="igc"), iface("b", "10.6.0.1/24", speed=100, driver="x")]
    assert str(refusal(lambda: choose(interfaces, "head", HEAD, None, None))).splitlines()[2:] == [
        "  a: 10.5.0.1/24 (up, driver igc, 2.5 Gb/s)",
        "  b: 10.6.0.1/24 (up, driver x, 100 Mb/s)",
    ]


# The real kernel: two namespaces, a veth pair between them.

NEEDS_ROOT_AND_IP = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="the namespace tests create network namespaces and veth pairs: they need root and iproute2's `ip`",
)

IN_NAMESPACE = """
import json, sys
from ipaddress import IPv4Address
from gb10d.launch.interfaces import InterfaceError
from gb10d.launch.netifs import find, read_interfaces
if sys.argv[1] == "read":
    print(json.dumps([{"name": i.name, "addresses": [str(a) for a in i.addresses], "up": i.up,
                       "driver": i.driver, "speed_mbps": i.speed_mbps, "loopback": i.loopback}
                      for i in read_interfaces()]))
    sys.exit()
role, head, requested = sys.argv[1], IPv4Address(sys.argv[2]), sys.argv[3] or None
try:
    choice = find(role, head, requested)
except InterfaceError as exc:
    print(json.dumps({"error": str(exc), "key": exc.key, "exit_status": exc.exit_status}))
else:
    print(json.dumps({"name": choice.interface.name, "address": str(choice.address), "reason": choice.reason}))
"""


class Link:
    """Head and worker namespaces: what each test needs to run code inside them."""

    def __init__(self, head: str, worker: str) -> None:
        self.head = head
        self.worker = worker

    def run(self, namespace: str, *args: str) -> Any:
        done = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", IN_NAMESPACE, *args],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def find(self, namespace: str, role: str, head: str, requested: str = "") -> Any:
        return self.run(namespace, role, head, requested)


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def _wait_for_carrier(namespace: str, device: str) -> None:
    """A veth reports its link up a moment after both ends are up (the kernel's linkwatch)."""
    deadline = time.monotonic() + 10
    while json.loads(_ip("-n", namespace, "-j", "link", "show", "dev", device))[0]["operstate"] != "UP":
        assert time.monotonic() < deadline, f"{device} in {namespace} never reported its link up"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    """head: hveth 10.213.7.1/24 <-> worker: wveth 10.213.7.2/24 (+ .3 secondary).

    The head also has hmgmt 10.213.8.1/24 and 10.213.9.1/24 (reached by the
    worker only through a route via 10.213.7.1); the worker also has wmgmt
    10.213.10.2/24 and wdown 10.213.11.2/24, which stays down.
    """
    names = Link(f"gb10d-test-{os.getpid()}-head", f"gb10d-test-{os.getpid()}-worker")
    try:
        h, w = names.head, names.worker
        for ns in (h, w):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", h, "link", "add", "hveth", "type", "veth", "peer", "name", "wveth", "netns", w)
        _ip("-n", h, "link", "add", "hmgmt", "type", "veth", "peer", "name", "hmgmt-peer")
        _ip("-n", w, "link", "add", "wmgmt", "type", "veth", "peer", "name", "wmgmt-peer")
        _ip("-n", w, "link", "add", "wdown", "type", "veth", "peer", "name", "wdown-peer")
        for ns, dev, address in [(h, "hveth", "10.213.7.1/24"), (h, "hmgmt", "10.213.8.1/24"),
                                 (h, "hmgmt", "10.213.9.1/24"), (w, "wveth", "10.213.7.2/24"),
                                 (w, "wveth", "10.213.7.3/24"), (w, "wmgmt", "10.213.10.2/24"),
                                 (w, "wdown", "10.213.11.2/24")]:
            _ip("-n", ns, "addr", "add", address, "dev", dev)
        for ns, dev in [(h, "hveth"), (h, "hmgmt"), (h, "hmgmt-peer"), (w, "wveth"), (w, "wmgmt"),
                        (w, "wmgmt-peer")]:
            _ip("-n", ns, "link", "set", dev, "up")
        for ns, dev in [(h, "hveth"), (h, "hmgmt"), (w, "wveth"), (w, "wmgmt")]:
            _wait_for_carrier(ns, dev)
        _ip("-n", w, "route", "add", "10.213.9.0/24", "via", "10.213.7.1")
        yield names
    finally:
        for ns in (names.head, names.worker):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)



@NEEDS_ROOT_AND_IP
def test_kernel_worker_picks_the_veth_on_the_heads_subnet(link: Link) -> None:
    assert link.find(link.worker, "worker", "10.213.7.1") == {
        "name": "wveth", "address": "10.213.7.2", "reason": "the head 10.213.7.1 is on its subnet 10.213.7.0/24" + SLOW}


@NEEDS_ROOT_AND_IP
def test_kernel_head_picks_the_interface_carrying_head_address(link: Link) -> None:
    assert link.find(link.head, "head", "10.213.7.1") == {
        "name": "hveth", "address": "10.213.7.1", "reason": "it carries cluster.head_address 10.213.7.1" + SLOW}


@NEEDS_ROOT_AND_IP
def test_kernel_head_address_not_on_the_machine_is_refused_with_the_list(link: Link) -> None:
    refused = link.find(link.head, "head", "10.213.7.99")
    assert (refused["key"], refused["exit_status"]) == ("cluster.head_address", EXIT_CONFIG)
    assert refused["error"].splitlines()[1:] == [
        "interfaces found on this machine:",
        "  hmgmt: 10.213.8.1/24, 10.213.9.1/24 (up, virtual, 10 Gb/s)",
        "  hmgmt-peer: no IPv4 address (up, virtual, 10 Gb/s)",
        "  hveth: 10.213.7.1/24 (up, virtual, 10 Gb/s)",
        "  lo: 127.0.0.1/8 (up, loopback)",
    ]


@NEEDS_ROOT_AND_IP
def test_kernel_requested_interface_that_is_down_is_refused(link: Link) -> None:
    refused = link.find(link.worker, "worker", "10.213.7.1", "wdown")
    assert refused["key"] == "cluster.interface"
    assert refused["error"].splitlines()[0] == (
        "cluster.interface: wdown is down (switched off, or no link to the other machine); check the cable "
        "and run `ip link set wdown up`, or set cluster.interface to another interface")
    assert "  wdown: 10.213.11.2/24 (down, virtual)" in refused["error"].splitlines()


@NEEDS_ROOT_AND_IP
def test_kernel_worker_follows_the_route_when_the_head_is_on_another_subnet(link: Link) -> None:
    assert link.find(link.worker, "worker", "10.213.9.1") == {
        "name": "wveth", "address": "10.213.7.2", "reason": "the route to the head 10.213.9.1 leaves through it" + SLOW}


@NEEDS_ROOT_AND_IP
def test_kernel_worker_without_a_route_to_the_head_is_refused(link: Link) -> None:
    refused = link.find(link.worker, "worker", "10.213.99.1")
    assert "and there is no route to it;" in refused["error"].splitlines()[0]


@NEEDS_ROOT_AND_IP
def test_kernel_read_interfaces_sees_secondary_addresses_state_and_speed(link: Link) -> None:
    seen = {i["name"]: i for i in link.run(link.worker, "read")}
    assert sorted(seen) == ["lo", "wdown", "wdown-peer", "wmgmt", "wmgmt-peer", "wveth"]
    assert seen["wveth"] == {"name": "wveth", "addresses": ["10.213.7.2/24", "10.213.7.3/24"], "up": True,
                             "driver": None, "speed_mbps": 10000, "loopback": False}
    assert (seen["wdown"]["up"], seen["wdown"]["addresses"]) == (False, ["10.213.11.2/24"])
    assert (seen["lo"]["loopback"], seen["lo"]["up"]) == (True, True)
