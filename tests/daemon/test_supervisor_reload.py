"""`systemctl reload gb10d` (SIGHUP), edits seen on disk, and learned settings, against the real `gb10d run`.

What needs a real process stays here: the file watcher (inotify and its
debounce), settings learned by one run of gb10d used by the next, and a
pair's Ray restarted by gb10d (and told as every decision is). What a reload applies to vLLM and in which
order is tested in one process in test_shell_reload.
"""

from __future__ import annotations

import os
import re
import signal
import tomllib
from pathlib import Path

import pytest

from gb10d.machine.statefile import read_state
from harness import Daemon, NotifySocket, Setup, wait_until

pytestmark = pytest.mark.slow


def serving(setup: Setup, notify: NotifySocket, daemons: list[Daemon]) -> Daemon:
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    notify.wait_for(lambda m: m.get("READY") == "1", 90)
    return daemon


def hup(daemon: Daemon) -> None:
    os.kill(daemon.proc.pid, signal.SIGHUP)


def test_a_burst_of_editor_writes_is_validated_once(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup = Setup(tmp_path, extra={"daemon.watch_config": True})
    daemon = serving(setup, notify, daemons)
    text = setup.config.read_text()
    for n in range(5):  # what editors do: write a temporary file, rename it over the original
        tmp = setup.config.with_name(f".gb10d.toml.swp{n}")
        tmp.write_text(text.replace("max_attempts = 3", "max_attempts = 4"))
        tmp.replace(setup.config)
    line = daemon.wait_line(r"gb10d: .* changed on disk, not applied")
    assert line.string.endswith(
        f"gb10d: {setup.config} changed on disk, not applied (1 key changed: restart.max_attempts 3 -> 4); apply it with: systemctl reload gb10d"
    ), line.string
    # Quiet afterwards: the debounce gave one validation for the whole burst, seen by waiting for the next.
    setup.config.write_text(text)
    daemon.wait_line(r"changed on disk; it is valid and nothing gb10d uses differs")
    assert sum("changed on disk, not applied" in line for line in daemon.own_lines()) == 1
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
    assert learned["learned"]["reason"].startswith("free memory "), learned  # the failure the lower value answered

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


def pair_head(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon], ray_says: str = "", **extra: object) -> tuple[Setup, Daemon]:
    """The head of a pair whose Ray is a program that exits at once (after printing `ray_says`): gb10d starts it again and again."""
    ray = tmp_path / "ray"
    ray.write_text(f"#!/bin/sh\n{ray_says}\nexit 3\n")
    ray.chmod(0o755)
    cluster = {"cluster.role": "head", "cluster.head_address": "127.0.0.1", "cluster.interface": "lo", "cluster.ray": str(ray)}
    setup = Setup(tmp_path, extra={**cluster, **extra})
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    return setup, daemon


def after_reload(daemon: Daemon) -> int:
    """The index of the line after gb10d's `reload requested`: what it says from there on, it says with the new config."""
    daemon.wait_line(r"gb10d: reload requested")
    return next(i for i, line in enumerate(daemon.lines) if "gb10d: reload requested" in line) + 1


def test_a_reload_of_the_back_off_reaches_the_restarts_of_a_pairs_ray(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]) -> None:
    setup, daemon = pair_head(tmp_path, notify, daemons, **{"restart.backoff_initial_s": 0.1, "restart.backoff_max_s": 0.1})
    daemon.wait_line(r"gb10d: Ray on this machine exited with status 3; starting it again in 0\.1 s")
    setup.extra.update({"restart.backoff_initial_s": 30.0, "restart.backoff_max_s": 30.0})
    setup.write_config()
    hup(daemon)
    since = after_reload(daemon)
    restarted = daemon.wait_line(r"gb10d: Ray on this machine exited with status 3; starting it again in .*", since=since)
    assert restarted.group(0).endswith("starting it again in 30 s"), daemon.tail()


def test_a_pairs_ray_gets_the_env_file_as_last_reloaded_and_an_edit_alone_changes_nothing(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    env_file = tmp_path / "vllm.env"
    env_file.write_text("GB10D_MARK=first\n")
    extra = {"vllm.env_file": str(env_file), "restart.backoff_initial_s": 0.2, "restart.backoff_max_s": 0.2}
    _, daemon = pair_head(tmp_path, notify, daemons, 'echo "mark=$GB10D_MARK"', **extra)
    daemon.wait_line(r"\(ray\) mark=first")
    env_file.write_text("GB10D_MARK=edited\n")
    # An edit alone is not applied: Ray, started again and again meanwhile, keeps the env_file as read.
    edited = len(daemon.lines)
    for _ in range(2):
        daemon.wait_line(r"gb10d: Ray on this machine exited", since=len(daemon.lines))
    marks = re.findall(r"\(ray\) mark=(\w+)", "\n".join(daemon.lines[edited:]))
    assert marks and set(marks) == {"first"}, daemon.tail()
    hup(daemon)
    since = after_reload(daemon)
    daemon.wait_line(r"\(ray\) mark=edited", timeout=30, since=since)


def test_a_pairs_ray_exits_are_decisions_like_any_other_the_front_sees_them_in_the_state_file(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    setup, daemon = pair_head(tmp_path, notify, daemons, "echo starting ray", **{"restart.backoff_initial_s": 0.2, "restart.backoff_max_s": 0.2})
    daemon.wait_line(r"gb10d: Ray on this machine exited with status 3; starting it again in 0\.2 s")
    daemon.wait_line(r"\(ray\) starting ray")  # Ray's own output still reaches the journal, at its own priority

    def told(event: str) -> bool:
        record = read_state(setup.state_file)
        return record is not None and any(d.event == event for d in record.decisions)

    # Ray's lines go through the same door as gb10d's other decisions: the page's latest decisions carry them.
    wait_until(lambda: told("ray_started") and told("ray_exited"), what="Ray's start and exit among the state file's decisions")
    assert daemon.stop() == 0
