"""Fixtures for the stand-in's tests: every started sim's process group is killed afterwards."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from sim_support import Sim, start_sim


@pytest.fixture
def sim() -> Iterator[Callable[..., Sim]]:
    """Start gb10d.sim processes; their whole process groups are SIGKILLed at teardown."""
    started: list[Sim] = []

    def start(*args: str, **kwargs: Any) -> Sim:
        process = start_sim(list(args), **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill_group()
