"""Thousands of client connections held open to a real `gb10d front` (a client between requests, a slow one, a
connection flood): accepting one more must cost what it costs with none open, or a burst stalls every request."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from gb10d.front.door import raise_open_files
from gb10d.front.lab import FrontChild
from gb10d.machine.procs import cpu_seconds
from harness import Setup, free_port

pytestmark = pytest.mark.slow

BATCH = 2000
HELD = 10000


def health(port: int) -> bytes:
    """The status line of GET /health on a new connection: the front answers it itself, after every connection
    accepted before this one."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


def test_accepting_a_connection_costs_no_more_with_thousands_already_open(tmp_path: Path) -> None:
    open_files = raise_open_files()
    if open_files < HELD + 512:
        pytest.skip(f"this process may open {open_files} files, fewer than the {HELD} connections the test holds (raise the hard limit: ulimit -Hn)")
    setup = Setup(tmp_path / "alpha", served_name="alpha", utilization=0.3)
    (tmp_path / "instances").mkdir()
    (tmp_path / "instances" / "alpha.toml").write_text(setup.config.read_text())
    port = free_port()
    settings = {"listen": f"127.0.0.1:{port}", "metrics_listen": "", "instances_dir": str(tmp_path / "instances"), "state_file": str(tmp_path / "front-state.json")}
    (tmp_path / "front.toml").write_text("[front]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    held: list[socket.socket] = []
    with FrontChild(tmp_path / "front.toml") as front:
        front.wait_line("serving alpha on")

        def open_more(count: int) -> float:
            """Open `count` idle connections; the front's CPU seconds until it has taken them all."""
            before = cpu_seconds(front.proc.pid)
            held.extend(socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(count))
            assert health(port) == b"HTTP/1.1 200 OK"
            return cpu_seconds(front.proc.pid) - before

        try:
            first = open_more(BATCH)
            open_more(HELD - 2 * BATCH)
            last = open_more(BATCH)
        finally:
            for sock in held:
                sock.close()
    # The same work per connection: the same CPU, give or take a loaded machine. Walking every open connection at
    # each accept made the last batch cost about three times the first.
    assert last < 1.5 * first + 0.1, f"{BATCH} connections cost the front {first:.2f} s of CPU with none open, {last:.2f} s with {HELD - BATCH} open"
