"""Edits seen on disk and learned settings, against gb10d.sim and the real `gb10d run`.

What needs a real process stays here: the file watcher (inotify and its
debounce) and settings learned by one run of gb10d used by the next. What a
reload (SIGHUP) applies and in which order is tested in one process in
test_shell_reload; the real signal's path is in test_supervisor_order.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from harness import Daemon, NotifySocket, Setup

pytestmark = pytest.mark.slow


def serving(setup: Setup, notify: NotifySocket, daemons: list[Daemon]) -> Daemon:
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    notify.wait_for(lambda m: m.get("READY") == "1", 90)
    return daemon


def test_a_burst_of_editor_writes_is_validated_once(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, extra={"daemon.watch_config": True})
    daemon = serving(setup, notify, daemons)
    text = setup.config.read_text()
    for n in range(5):  # what editors do: write a temporary file, rename it over the original
        tmp = setup.config.with_name(f".gb10d.toml.swp{n}")
        tmp.write_text(text.replace("max_attempts = 3", "max_attempts = 4"))
        tmp.replace(setup.config)
    daemon.wait_line(r"gb10d: config changed \(1 keys\); run systemctl reload gb10d to apply: .*restart.max_attempts 3 -> 4")
    # Quiet afterwards: the debounce gave one validation for the whole burst, seen by waiting for the next.
    setup.config.write_text(text)
    daemon.wait_line(r"changed on disk; it is valid and nothing gb10d uses differs")
    assert sum("config changed (" in line for line in daemon.own_lines()) == 1
    assert notify.count("RELOADING") == 0
    daemon.stop()


def test_learned_utilization_is_used_at_the_next_start_and_dropped_when_the_config_changes(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    setup = Setup(tmp_path, free_gib=103.45, utilization=0.92, extra={"memory.preflight": False})

    def serving(setup: Setup, _: NotifySocket, daemons: list[Daemon]) -> Daemon:
        # A fresh socket per daemon, as systemd gives each start its own view.
        sock = NotifySocket()
        try:
            daemon = Daemon(setup, sock)
            daemons.append(daemon)
            sock.wait_for(lambda m: m.get("READY") == "1", 90)
        finally:
            sock.close()
        return daemon

    first = serving(setup, notify, daemons)
    assert first.stop() == 0
    learned = tomllib.loads((tmp_path / "lib" / "state.toml").read_text())
    assert learned["learned"]["gpu_memory_utilization"] == 0.84

    second = serving(setup, notify, daemons)
    starts = [line for line in second.own_lines() if "started vLLM as pid" in line]
    assert len(starts) == 1 and "--gpu-memory-utilization 0.84" in starts[0], "one start, already fitting"
    assert any("starting from the settings learned for this config" in line for line in second.own_lines())
    assert second.stop() == 0

    setup.utilization = 0.5
    setup.write_config()
    third = serving(setup, notify, daemons)
    assert any("discarding the settings learned" in line and "vllm.gpu_memory_utilization" in line for line in third.own_lines())
    starts = [line for line in third.own_lines() if "started vLLM as pid" in line]
    assert "--gpu-memory-utilization 0.5" in starts[0]
    third.stop()
