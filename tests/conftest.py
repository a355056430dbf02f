"""Fixtures shared by the tests that run the real `gb10d run` against gb10d.sim."""

from __future__ import annotations

from typing import Iterator

import pytest

from harness import Daemon, NotifySocket


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    """A real sd_notify receiver, bound for the test and closed after it."""
    sock = NotifySocket()
    yield sock
    sock.close()


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    """Daemons a test starts; whatever happened, none of them (nor their vLLM) outlives it."""
    started: list[Daemon] = []
    yield started
    for daemon in started:
        daemon.kill_everything()
