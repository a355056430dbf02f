"""Fuzzing the front's HTTP with raw bytes: request-smuggling pairs (Content-Length beside Transfer-Encoding), bad
chunk sizes, folded and NUL headers, huge heads, each cut or mutated, sent on a connection that then closes its
writing side. What must hold, against a real `gb10d front` before a real instance on gb10d.sim: every such
connection gets a 4xx/5xx answer or a close within a few seconds, never a hang; the front never dies, never leaks a
descriptor, and serves the next good request; vLLM never sees a smuggled request (it stays awake, serving)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import JUNK, budget, mutated_bytes
from gb10d.machine.statefile import read_state
from test_front import Deployment, completion

pytestmark = pytest.mark.slow

_ANSWER_S = 10.0
BODY = b'{"model": "alpha", "prompt": "hi", "max_tokens": 1}'


def _request(head: bytes, body: bytes = b"") -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\n" + head + b"\r\n" + body


SEEDS = [
    # Smuggling pairs: two framings, and a request hidden behind the first one's body.
    _request(b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\nPOST /sleep HTTP/1.1\r\nHost: x\r\n\r\n"),
    _request(b"Transfer-Encoding: chunked\r\nContent-Length: 60\r\n", b"0\r\n\r\nPOST /sleep HTTP/1.1\r\n\r\n"),
    _request(b"Content-Length: 51\r\nContent-Length: 4\r\n", BODY),
    _request(b"Transfer-Encoding: chunked, identity\r\n", b"33\r\n" + BODY + b"\r\n0\r\n\r\n"),
    _request(b"Transfer-Encoding: xchunked\r\n", b"0\r\n\r\n"),
    _request(b"Transfer-Encoding:\tchunked\r\n", b"0\r\n\r\n"),
    _request(b"Transfer-Encoding : chunked\r\n", b"0\r\n\r\n"),
    # Bad chunk sizes.
    _request(b"Transfer-Encoding: chunked\r\n", b"ffffffffffffffffffff\r\n" + BODY + b"\r\n0\r\n\r\n"),
    _request(b"Transfer-Encoding: chunked\r\n", b"-1\r\n" + BODY + b"\r\n0\r\n\r\n"),
    _request(b"Transfer-Encoding: chunked\r\n", b"0x33\r\n" + BODY + b"\r\n0\r\n\r\n"),
    _request(b"Transfer-Encoding: chunked\r\n", b"33;ext=\x00\r\n" + BODY + b"\r\n0\r\n\r\n"),
    # Folded, NUL and odd headers.
    _request(b"X-A: 1\r\n  folded\r\nContent-Length: 51\r\n", BODY),
    _request(b"X-A: a\x00b\r\nContent-Length: 51\r\n", BODY),
    _request(b"Content-Length: 51\r\n\r\n", BODY),
    b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    b"GET /health HTTP/1.0\r\n\r\n",
    b"GET http://evil.example/health HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\r\n\r\nGET /health HTTP/1.1\r\n\r\n",
    b"GET /v1/models/../../sleep HTTP/1.1\r\nHost: x\r\n\r\n",
    # Huge heads.
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\n" + b"X-H: 1\r\n" * 5000 + b"\r\n",
]

_INPUTS = st.one_of(
    st.sampled_from(SEEDS),
    st.sampled_from(SEEDS).flatmap(lambda seed: mutated_bytes(seed)),
    st.lists(JUNK | st.binary(max_size=32), max_size=20).map(b"".join),
)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _exchange(port: int, data: bytes) -> bytes:
    """Send `data`, close the writing side, and read until the front closes or answers and goes quiet."""
    with socket.create_connection(("127.0.0.1", port), timeout=_ANSWER_S) as conn:
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the front closed on a head it refused while the rest was still being sent
        received = b""
        while True:
            try:
                piece = conn.recv(65536)
            except ConnectionResetError:
                return received
            except TimeoutError:
                raise AssertionError(f"no answer and no close within {_ANSWER_S} s for {data[:200]!r}") from None
            if not piece:
                return received
            received += piece


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    # park = "sleep": vLLM runs with its development routes, so a smuggled /sleep would have something to reach.
    deployment = Deployment(Path(tmp_path_factory.mktemp("fuzz-front")), on_demand={"idle_timeout_s": 600.0, "park": "sleep"})
    try:
        deployment.start("alpha")
        yield deployment
    finally:
        deployment.close()


def test_raw_bytes_get_an_answer_or_a_close_and_the_front_serves_on(front: Deployment) -> None:
    pid = front.front.proc.pid
    before = _open_fds(pid)

    @budget(ci=60, long=3000)
    @given(_INPUTS)
    def one(data: bytes) -> None:
        received = _exchange(front.port, data)
        status = received[9:12] if received.startswith(b"HTTP/1.1 ") else b"close"
        event(f"answer {status.decode(errors='replace')}")
        assert front.front.proc.poll() is None, f"the front died on {data[:200]!r}"

    one()
    good = httpx.post(f"{front.url}/v1/completions", json=completion("alpha", 1), timeout=60)
    assert good.status_code == 200, good.text
    assert _open_fds(pid) <= before + 8, f"the front holds {_open_fds(pid) - before} more descriptors than before the fuzzing"
    record = read_state(front.setups["alpha"].state_file)
    assert record is not None and record.state is not None and record.state.value == "serving"
    direct = httpx.get(f"http://127.0.0.1:{front.setups['alpha'].port}/is_sleeping", timeout=30)
    assert direct.json() == {"is_sleeping": False}, "a smuggled /sleep reached vLLM"
    assert not front.front.out.find("Traceback"), front.front.out.tail()
