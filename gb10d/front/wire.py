"""HTTP/1.1 over asyncio streams, parsed by h11: one `Peer` per TCP connection, client or server side.

h11 (already installed as httpx's own parser) does all the parsing and framing; this module only moves its bytes
to and from the socket. Every `send` waits for the socket's buffer to drain, so a slow reader slows the writer
instead of growing a buffer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11

READ_SIZE = 65536
# Request line and headers together; a longer head gets 431 from h11.
MAX_HEAD_BYTES = 64 * 1024


class Peer:
    """One HTTP connection: h11's state machine and the asyncio streams under it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: type[h11.CLIENT] | type[h11.SERVER]) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = h11.Connection(role, max_incomplete_event_size=MAX_HEAD_BYTES)

    async def next_event(self) -> Any:
        """The next HTTP event, reading from the socket as h11 needs; the end of the stream is h11's to judge."""
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.reader.read(READ_SIZE))

    async def next_events(self) -> list[Any]:
        """Every event that what has arrived holds, reading from the socket only when it holds none.

        A stream's events are passed on as they come, but those that arrived together leave together: one write
        instead of one per event, which is most of a proxy's cost per event."""
        while True:
            events: list[Any] = []
            while (event := self.conn.next_event()) is not h11.NEED_DATA and event is not h11.PAUSED:
                events.append(event)
                if isinstance(event, h11.ConnectionClosed):
                    break
            if events:
                return events
            self.conn.receive_data(await self.reader.read(READ_SIZE))

    async def send(self, *events: Any) -> None:
        """Write events in one write and wait until the socket has taken them (backpressure)."""
        data = b"".join(self.conn.send(event) or b"" for event in events)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    def close(self) -> None:
        """Drop the connection (an upstream's end: vLLM sees the client leave and stops the request)."""
        self.writer.close()


async def connect(host: str, port: int) -> Peer:
    """A client connection to an instance; OSError when nothing listens there."""
    reader, writer = await asyncio.open_connection(host, port, limit=READ_SIZE)
    return Peer(reader, writer, h11.CLIENT)
