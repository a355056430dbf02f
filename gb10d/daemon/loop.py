"""The daemon's one queue of facts, the signal handlers that feed it, and the watchdog timer beside it.

Signal handlers only record the signal as a fact (`Stop`, `Reload`), as
uvicorn's and gunicorn's do; the daemon acts on it at its next turn. The
watchdog ping is a timer of its own, not a side effect of waiting: whatever
the daemon is awaiting (a stop ladder, a memory gate), systemd keeps
hearing from it, and only a hung event loop stops the pings.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Callable

from ..core.facts import Fact, Reload, Stop
from ..machine.notify import Notifier

# Facts while waiting between attempts: the handler says whether to stop waiting because of a stop signal.
Handler = Callable[[Fact], bool]


class FactLoop:
    """Where every fact reaches the daemon; deadlines are on the monotonic clock."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.queue: asyncio.Queue[Fact] = asyncio.Queue()
        self._watchdog: asyncio.Task[None] | None = None

    def post(self, fact: Fact) -> None:
        self.queue.put_nowait(fact)

    def install(self) -> None:
        """Route SIGTERM/SIGINT (stop) and SIGHUP (reload) to the queue, and start the watchdog timer."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.post, Stop(sig.name))
        loop.add_signal_handler(signal.SIGHUP, self.post, Reload())
        if self.notifier.watchdog_usec is not None:
            self._watchdog = asyncio.create_task(self._ping(self.notifier.watchdog_usec / 2e6))

    async def remove(self) -> None:
        """Put the default signal handling back and stop the watchdog timer."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None

    async def _ping(self, every_s: float) -> None:
        while True:
            self.notifier.watchdog()
            await asyncio.sleep(every_s)

    async def next(self, deadline: float | None) -> Fact | None:
        """The next fact, or None once `deadline` (time.monotonic()) passes."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        if deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            return None

    async def pause(self, seconds: float, handle: Handler, until: Callable[[], bool] | None = None) -> bool:
        """Wait `seconds`, or until `until()` holds after a fact; each fact goes to `handle`.

        True when `handle` says a stop came (the wait is cut short).
        """
        deadline = time.monotonic() + seconds
        while until is None or not until():
            fact = await self.next(deadline)
            if fact is None:
                return False
            if handle(fact):
                return True
        return False
