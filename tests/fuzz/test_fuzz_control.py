"""Fuzzing the instance's control socket: a real ControlSocket on a Unix socket in an event loop, and clients that
send raw bytes (long lines, no newline, NUL, junk), half-close, hang up, or stay silent, many at once. Each client
that waits gets an answer line or a close, never a hang; the server never fails; the front's next `park` is served."""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import JUNK, budget
from gb10d.core.facts import Fact, ParkAsked, RestartAsked, WakeAsked
from gb10d.daemon.control import ControlSocket, ask

_ANSWERS = {b"ok\n", b"unknown command: say park, wake or restart\n", b""}
_REPLY_S = 3.0  # generous: the server answers at once, or closes


@dataclass(frozen=True)
class Client:
    """One connection: what it sends, then how it ends (`newline`, `half`: shutdown of its writing side, `hangup`, `silent`)."""

    payload: bytes
    ending: str


_PAYLOADS = st.one_of(
    st.sampled_from([b"park", b"wake", b"restart", b"PARK", b" park ", b"park\r", b"park\x00", b"wake\nwake", b"", b"\n", b"park park"]),
    st.binary(max_size=64),
    st.builds(lambda unit, count: unit * count, JUNK | st.sampled_from([b"a", b"park", b"\x00"]), st.integers(1, 100_000)),
)
_CLIENTS = st.builds(Client, _PAYLOADS, st.sampled_from(["newline", "half", "hangup", "silent"]))


async def _client(path: Path, client: Client) -> bytes | None:
    """The answer the client read (b"" for a close), or None for one that does not wait for it."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(client.payload + (b"\n" if client.ending == "newline" else b""))
        if client.ending == "half":
            writer.write_eof()
        if client.ending in ("hangup", "silent"):
            if client.ending == "hangup":
                writer.transport.abort()
            return None
        try:
            await writer.drain()
        except ConnectionError:
            return b""  # the server closed on a line too long while we were still writing it
        return await asyncio.wait_for(reader.read(), _REPLY_S)
    except ConnectionError:
        return b""
    finally:
        if client.ending != "silent":
            writer.close()


async def _scenario(path: Path, clients: list[Client]) -> tuple[list[bytes | None], str, list[Fact], list[dict[str, Any]]]:
    posted: list[Fact] = []
    failures: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: failures.append(context))
    control = ControlSocket(path, posted.append)
    await control.start()
    try:
        answers = await asyncio.gather(*(_client(path, c) for c in clients))
        served = await ask(path, "park", timeout_s=_REPLY_S)
    finally:
        await control.close()
    return list(answers), served, posted, failures


@given(clients=st.lists(_CLIENTS, min_size=1, max_size=24))
@budget(ci=60, long=2000)
def test_any_bytes_get_an_answer_or_a_close_and_the_next_park_is_served(clients: list[Client]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        answers, served, posted, failures = asyncio.run(_scenario(Path(tmp) / "state.sock", clients))
    assert not failures, failures
    assert served == "ok"
    for client, answer in zip(clients, answers):
        if answer is None:
            continue
        event("answered" if answer else "closed")
        assert answer in _ANSWERS, (client, answer)
        if answer == b"ok\n":
            assert client.payload.split(b"\n")[0].strip() in (b"park", b"wake", b"restart"), (client, answer)
    assert set(posted) <= {ParkAsked(), WakeAsked(), RestartAsked()} and posted[-1] == ParkAsked()
