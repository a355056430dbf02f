"""The instance's control socket, over a real Unix socket: the front's `park` and `wake` and its page's `restart`
become facts on the supervisor's queue; anything else gets a line that says what is understood; a pinned instance
takes only `restart`; a missing socket is no answer."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

from gb10d.core.facts import Fact, ParkAsked, RestartAsked, WakeAsked
from gb10d.daemon.control import ControlSocket, ask


def test_park_wake_and_restart_are_posted_and_anything_else_is_answered_with_what_is_understood(tmp_path: Path) -> None:
    posted: list[Fact] = []
    path = tmp_path / "run" / "state.sock"

    async def scenario() -> list[str]:
        control = ControlSocket(path, posted.append)
        await control.start()
        try:
            assert stat.S_IMODE(path.stat().st_mode) == 0o660
            return [await ask(path, word) for word in ("park", "wake", "restart", "reboot")]
        finally:
            await control.close()

    answers = asyncio.run(scenario())
    assert answers == ["ok", "ok", "ok", "unknown command: say park, wake or restart"]
    assert posted == [ParkAsked(), WakeAsked(), RestartAsked()]
    assert not path.exists(), "the socket goes with its gb10d"


def test_a_socket_left_by_a_dead_gb10d_is_replaced_and_a_missing_one_gets_no_answer(tmp_path: Path) -> None:
    path = tmp_path / "state.sock"
    path.write_text("left over")
    posted: list[Fact] = []

    async def scenario() -> tuple[str, str]:
        control = ControlSocket(path, posted.append)
        await control.start()
        try:
            taken = await ask(path, "park")
        finally:
            await control.close()
        return taken, await ask(path, "park")

    assert asyncio.run(scenario()) == ("ok", "")


def test_a_pinned_instance_takes_a_restart_and_says_it_is_never_parked_or_woken(tmp_path: Path) -> None:
    posted: list[Fact] = []
    path = tmp_path / "state.sock"

    async def scenario() -> list[str]:
        control = ControlSocket(path, posted.append, on_demand=False)
        await control.start()
        try:
            return [await ask(path, word) for word in ("park", "wake", "restart")]
        finally:
            await control.close()

    refused = "unknown command: say restart (without [on_demand] it is never parked or woken)"
    assert asyncio.run(scenario()) == [refused, refused, "ok"]
    assert posted == [RestartAsked()]
