"""The fact loop: deadlines on the monotonic clock, stop signals as facts, the watchdog as a timer of its own."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from gb10d.core.facts import Edited, Reload, Stop
from gb10d.daemon.loop import FactLoop
from gb10d.machine.notify import Notifier
from harness import NotifySocket


class SkewedLoop(asyncio.SelectorEventLoop):
    """An event loop whose own clock is far ahead of time.monotonic(), as another loop implementation's may be."""

    def time(self) -> float:
        return super().time() + 10_000.0


def test_a_deadline_on_the_monotonic_clock_holds_whatever_clock_the_event_loop_keeps() -> None:
    async def main() -> tuple[object, float]:
        facts = FactLoop(Notifier(socket_path=""))
        started = time.monotonic()
        fact = await facts.next(started + 0.3)
        return fact, time.monotonic() - started

    loop = SkewedLoop()
    try:
        fact, waited = loop.run_until_complete(main())
    finally:
        loop.close()
    assert fact is None
    assert waited >= 0.3


def test_a_fact_already_queued_is_taken_even_after_its_deadline() -> None:
    async def main() -> object:
        facts = FactLoop(Notifier(socket_path=""))
        facts.post(Edited())
        return await facts.next(time.monotonic() - 1.0)

    assert asyncio.run(main()) == Edited()


def test_signals_arrive_as_facts() -> None:
    async def main() -> list[object]:
        facts = FactLoop(Notifier(socket_path=""))
        facts.install()
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)
            return [await facts.next(time.monotonic() + 10), await facts.next(time.monotonic() + 10)]
        finally:
            await facts.remove()

    assert asyncio.run(main()) == [Reload(), Stop("SIGTERM")]


def test_a_pause_ends_early_when_its_handler_sees_a_stop() -> None:
    async def main() -> tuple[bool, float]:
        facts = FactLoop(Notifier(socket_path=""))
        asyncio.get_running_loop().call_later(0.1, facts.post, Stop("SIGINT"))
        started = time.monotonic()
        stopped = await facts.pause(30.0, lambda fact: isinstance(fact, Stop))
        return stopped, time.monotonic() - started

    stopped, waited = asyncio.run(main())
    assert stopped and waited < 10


@pytest.mark.slow
def test_the_watchdog_is_pinged_while_the_daemon_awaits_something_else() -> None:
    receiver = NotifySocket()
    os.environ["WATCHDOG_USEC"] = "400000"
    try:
        notifier = Notifier(socket_path=receiver.path)
    finally:
        del os.environ["WATCHDOG_USEC"]

    async def main() -> object:
        facts = FactLoop(notifier)
        facts.install()
        try:
            # Not waiting on the queue at all: awaiting the receiver's thread until the fifth ping (one every 0.2 s).
            return await asyncio.to_thread(receiver.wait, lambda m: receiver.count("WATCHDOG", "1") >= 5, 10)
        finally:
            await facts.remove()

    try:
        pinged = asyncio.run(main())
        assert pinged is not None, receiver.keys()
    finally:
        receiver.close()
