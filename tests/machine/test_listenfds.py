"""Socket activation as systemd does it: a real listening socket passed to a real child as fd 3, with the variables.

The child is started the way systemd starts a service: the sockets moved to
fds 3, 4, ... before exec, `LISTEN_FDS` and `LISTEN_FDNAMES` in its
environment and `LISTEN_PID` set to its own pid (by the shell it execs from,
whose pid it keeps). It reports what `passed_sockets` gave it and what a
child of its own inherits, then answers one connection on each socket.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_CONFIG
from gb10d.machine.listenfds import ListenFdsError, listen_sockets, listening_address, passed_fds

CHILD = r"""
import json, os, subprocess, sys
from gb10d.machine.listenfds import ListenFdsError, listening_address, passed_sockets

try:
    passed = passed_sockets(os.environ)
except ListenFdsError as exc:
    print(json.dumps({"error": str(exc), "environ": sorted(k for k in os.environ if k.startswith("LISTEN_"))}), flush=True)
    sys.exit(exc.exit_status)
# close_fds=False: only what is not close-on-exec reaches the grandchild.
grandchild = subprocess.run(
    [sys.executable, "-c", "import json, os, stat\n"
     "try:\n    socket_at_3 = stat.S_ISSOCK(os.fstat(3).st_mode)\nexcept OSError:\n    socket_at_3 = False\n"
     "print(json.dumps({'environ': sorted(k for k in os.environ if k.startswith('LISTEN_')), 'socket_at_3': socket_at_3}))"],
    capture_output=True, text=True, close_fds=False, check=True,
).stdout
report = {
    "sockets": [
        {"name": p.name, "fd": p.sock.fileno(), "address": listening_address(p.sock), "blocking": p.sock.getblocking(),
         "inheritable": p.sock.get_inheritable()}
        for p in passed
    ],
    "environ": sorted(k for k in os.environ if k.startswith("LISTEN_")),
    "grandchild": json.loads(grandchild),
}
print(json.dumps(report), flush=True)
for p in passed:
    p.sock.setblocking(True)
    connection, _ = p.sock.accept()
    connection.sendall(f"answered on {p.name}".encode())
    connection.close()
"""

# What systemd does between fork and exec: LISTEN_PID is the pid that then execs the service.
AS_SYSTEMD = 'LISTEN_PID=$$; export LISTEN_PID; exec "$@"'


def activate(listeners: list[socket.socket], names: str | None, script: str = AS_SYSTEMD) -> subprocess.Popen[str]:
    """Start CHILD with `listeners` as fds 3, 4, ... and the LISTEN_ variables (LISTEN_PID from `script`)."""

    def move_to_3() -> None:
        # Out of the way first (above any fd the moves could overwrite), then into place, inheritable.
        high = [fcntl.fcntl(sock.fileno(), fcntl.F_DUPFD_CLOEXEC, 100) for sock in listeners]
        for index, fd in enumerate(high):
            os.dup2(fd, 3 + index)

    env = {key: value for key, value in os.environ.items() if not key.startswith("LISTEN_")}
    env["LISTEN_FDS"] = str(len(listeners))
    if names is not None:
        env["LISTEN_FDNAMES"] = names
    return subprocess.Popen(
        ["sh", "-c", script, "sh", sys.executable, "-c", CHILD],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        close_fds=False,
        preexec_fn=move_to_3,
    )


def report_of(child: subprocess.Popen[str]) -> dict[str, object]:
    """The child's one-line JSON report (it then waits for connections, or has exited)."""
    assert child.stdout is not None and child.stderr is not None
    line = child.stdout.readline()
    if not line:
        child.wait(30)
        pytest.fail(f"the child exited {child.returncode} without a report:\n{child.stderr.read()}")
    report: dict[str, object] = json.loads(line)
    return report


@pytest.fixture
def tcp_listener() -> Iterator[socket.socket]:
    """A listening TCP socket on a free loopback port, as a .socket unit's ListenStream= makes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield sock


def test_the_child_serves_the_socket_systemd_passed_as_fd_3_even_a_connection_queued_before_it_started(tcp_listener: socket.socket) -> None:
    port = tcp_listener.getsockname()[1]
    # Made while no process accepts: the kernel's backlog holds it, as during a restart of the front.
    early = socket.create_connection(("127.0.0.1", port), timeout=30)
    child = activate([tcp_listener], "front")
    try:
        report = report_of(child)
        assert report["sockets"] == [{"name": "front", "fd": 3, "address": f"127.0.0.1:{port}", "blocking": False, "inheritable": False}]
        assert report["environ"] == [], "the variables must go, or a child would take the sockets for its own"
        assert report["grandchild"] == {"environ": [], "socket_at_3": False}
        assert early.recv(100) == b"answered on front"
        assert child.wait(30) == 0
    finally:
        early.close()
        child.kill()
        child.wait()


def test_two_sockets_arrive_in_fd_order_with_their_names(tcp_listener: socket.socket, tmp_path: Path) -> None:
    path = tmp_path / "metrics.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.bind(str(path))
        unix.listen(4)
        child = activate([tcp_listener, unix], "front:metrics")
        try:
            report = report_of(child)
            port = tcp_listener.getsockname()[1]
            assert [(s["name"], s["fd"], s["address"]) for s in report["sockets"]] == [  # type: ignore[attr-defined]
                ("front", 3, f"127.0.0.1:{port}"),
                ("metrics", 4, str(path)),
            ]
            with socket.create_connection(("127.0.0.1", port), timeout=30) as first:
                assert first.recv(100) == b"answered on front"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as second:
                second.settimeout(30)
                second.connect(str(path))
                assert second.recv(100) == b"answered on metrics"
            assert child.wait(30) == 0
        finally:
            child.kill()
            child.wait()


def test_variables_meant_for_another_process_pass_no_socket_and_are_still_removed(tcp_listener: socket.socket) -> None:
    # A service started by a process that was itself socket-activated inherits its parent's variables.
    child = activate([tcp_listener], "front", script='LISTEN_PID=1; export LISTEN_PID; exec "$@"')
    try:
        report = report_of(child)
        # fd 3 is not this process's to take (nor to close): only the variables go.
        assert (report["sockets"], report["environ"], report["grandchild"]["environ"]) == ([], [], [])  # type: ignore[index]
        assert child.wait(30) == 0
    finally:
        child.kill()
        child.wait()


def test_a_datagram_socket_is_refused_as_a_config_error_naming_the_fix() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as datagram:
        datagram.bind(("127.0.0.1", 0))
        child = activate([datagram], "front")
        try:
            report = report_of(child)
            assert child.wait(30) == EXIT_CONFIG
        finally:
            child.kill()
            child.wait()
    assert report["error"] == (
        "systemd passed fd 3 (front) as a datagram socket that does not accept connections; use ListenStream= in the .socket unit"
    )
    assert report["environ"] == []


def test_no_variables_means_no_sockets_and_nothing_else_is_touched() -> None:
    environ = {"PATH": "/usr/bin"}
    assert listen_sockets(environ) == []
    assert environ == {"PATH": "/usr/bin"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, []),
        ({"LISTEN_PID": "4242", "LISTEN_FDS": "1"}, [(3, "unknown")]),
        ({"LISTEN_PID": "4242", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "front:metrics"}, [(3, "front"), (4, "metrics")]),
        ({"LISTEN_PID": "4242", "LISTEN_FDS": "0"}, []),
        ({"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "front"}, []),
        ({"LISTEN_PID": "4242"}, []),
        ({"LISTEN_FDS": "1", "LISTEN_FDNAMES": "front"}, []),
    ],
    ids=["absent", "unnamed", "named", "none", "another-pid", "no-count", "no-pid"],
)
def test_which_fds_the_variables_pass_to_this_pid(environ: dict[str, str], expected: list[tuple[int, str]]) -> None:
    assert passed_fds(environ, pid=4242) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"LISTEN_PID": "4242", "LISTEN_FDS": "one"}, "systemd passed LISTEN_FDS='one', not a number of sockets"),
        ({"LISTEN_PID": "4242", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "front"}, "systemd passed 2 socket(s) but 1 name(s) in LISTEN_FDNAMES='front'"),
    ],
)
def test_malformed_variables_for_this_pid_are_a_config_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ListenFdsError) as raised:
        passed_fds(environ, pid=4242)
    assert str(raised.value).startswith(message) and raised.value.exit_status == EXIT_CONFIG


def test_the_address_reads_as_an_operator_writes_it(tmp_path: Path) -> None:
    cases: list[tuple[socket.socket, str]] = []
    try:
        ipv4 = socket.socket(socket.AF_INET)
        cases.append((ipv4, "0.0.0.0:{port}"))
        ipv4.bind(("0.0.0.0", 0))
        if socket.has_ipv6:
            ipv6 = socket.socket(socket.AF_INET6)
            cases.append((ipv6, "[::]:{port}"))
            try:
                ipv6.bind(("::", 0))
            except OSError:  # IPv6 disabled on this host
                cases.pop()
        unix = socket.socket(socket.AF_UNIX)
        cases.append((unix, str(tmp_path / "front.sock")))
        unix.bind(str(tmp_path / "front.sock"))
        abstract = socket.socket(socket.AF_UNIX)
        cases.append((abstract, f"@gb10d-test-{os.getpid()}"))
        abstract.bind(f"\0gb10d-test-{os.getpid()}")
        for sock, expected in cases:
            if sock.family != socket.AF_UNIX:
                expected = expected.format(port=sock.getsockname()[1])
            assert listening_address(sock) == expected
    finally:
        for sock, _ in cases:
            sock.close()
