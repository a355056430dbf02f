"""The instance's control socket: the front asks a gb10d with `on_demand` to park or wake its vLLM, and the front's
page asks any gb10d to restart it.

One line per connection (`park`, `wake` or `restart`), one line back (`ok` once the fact is queued, or why not). The
supervisor does the work; the front learns the result from the state file, as it learns everything else. The
socket is mode 0660, so the front needs the instance's group, no root and no D-Bus rights.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Callable

from ..core.facts import Fact, ParkAsked, RestartAsked, WakeAsked

COMMANDS: dict[bytes, Fact] = {b"park": ParkAsked(), b"wake": WakeAsked(), b"restart": RestartAsked()}
# An instance without [on_demand] is never parked or woken: it takes only these.
PINNED_COMMANDS = frozenset({b"restart"})
SOCKET_MODE = 0o660


class ControlSocket:
    def __init__(self, path: Path, post: Callable[[Fact], None], on_demand: bool = True) -> None:
        self.path = path
        self.post = post
        self.server: asyncio.AbstractServer | None = None
        self.commands = COMMANDS if on_demand else {k: v for k, v in COMMANDS.items() if k in PINNED_COMMANDS}
        understood = " or ".join(", ".join(c.decode() for c in self.commands).rsplit(", ", 1))
        pinned = "" if on_demand else " (without [on_demand] it is never parked or woken)"
        self.unknown = f"unknown command: say {understood}{pinned}\n".encode()

    async def start(self) -> None:
        """Listen; a socket a dead gb10d left is replaced (nothing else may own this path: it is beside our state file)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.server = await asyncio.start_unix_server(self._client, str(self.path))
        os.chmod(self.path, SOCKET_MODE)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), 5.0)).strip()
            fact = self.commands.get(line)
            if fact is not None:
                self.post(fact)
            writer.write(b"ok\n" if fact is not None else self.unknown)
            await writer.drain()
        except (OSError, asyncio.TimeoutError, ValueError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


async def ask(path: Path, command: str, timeout_s: float = 2.0) -> str:
    """The front's side: send one command, return the answer line ('' when nobody answered)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return ""
    try:
        writer.write(command.encode() + b"\n")
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), timeout_s)).decode(errors="replace").strip()
    except (OSError, asyncio.TimeoutError):
        return ""
    finally:
        writer.close()
