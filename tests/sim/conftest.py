"""Fixtures for the stand-in's tests: every started sim's process group is killed afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from sim_support import Sim, StartSim, start_sim


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs the stand-in as real processes: all of them are slow."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def sim() -> Iterator[StartSim]:
    """Start gb10d.sim processes; their whole process groups are SIGKILLed at teardown."""
    started: list[Sim] = []

    def start(*args: str, env: dict[str, str] | None = None, port: int | None = None, speed: str = "0.01") -> Sim:
        process = start_sim(list(args), env=env, port=port, speed=speed)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill_group()
