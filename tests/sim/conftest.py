"""Fixtures for the stand-in's tests: every started sim's process group is killed afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from sim_support import Sim, start_sim


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs the stand-in as real processes: all of them are slow."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


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
