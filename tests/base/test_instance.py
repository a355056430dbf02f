"""Instances that would collide: each instance's own defaults, and a second one refused what a living one holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gb10d.base.config import Config
from gb10d.base.errors import EXIT_CONFIG
from gb10d.base.instance import clashes, derived_defaults, fill_defaults, holds, instance_of, metrics_port
from harness import Daemon, NotifySocket, Setup, free_port


def test_only_a_config_of_etc_gb10d_is_an_instance_of_its_own() -> None:
    assert instance_of(Path("/etc/gb10d/embed.toml")) == "embed"
    assert instance_of(Path("/etc/gb10d.toml")) is None
    assert instance_of(Path("/srv/chat.toml")) is None


def test_an_instance_gets_its_own_state_files_and_metrics_port_by_default() -> None:
    assert derived_defaults("embed") == {
        ("daemon", "state_file"): "/run/gb10d-embed/state.json",
        ("daemon", "learned_file"): "/var/lib/gb10d/embed/state.toml",
        ("metrics", "listen"): f"127.0.0.1:{metrics_port('embed')}",
    }
    assert 9401 <= metrics_port("embed") <= 9499 and metrics_port("embed") != metrics_port("small")


def test_what_a_file_sets_stays_and_only_the_rest_is_derived() -> None:
    data = {"vllm": {"model": "m"}, "daemon": {"state_file": "/run/mine.json"}}
    filled = fill_defaults(data, Path("/etc/gb10d/embed.toml"))
    assert filled == {"daemon.learned_file": "default of the instance embed", "metrics.listen": "default of the instance embed"}
    assert data["daemon"] == {"state_file": "/run/mine.json", "learned_file": "/var/lib/gb10d/embed/state.toml"}
    untouched = {"vllm": {"model": "m"}}
    assert fill_defaults(untouched, Path("/etc/gb10d.toml")) == {} and untouched == {"vllm": {"model": "m"}}


def held(**vllm: object) -> dict[str, str]:
    config = Config.model_validate({"vllm": {"executable": "/usr/bin/vllm", "model": "m", **vllm}})
    return holds(config, Path("/etc/gb10d/second.toml"))


def test_a_config_copied_from_the_first_clashes_on_everything_it_holds_and_names_both() -> None:
    first = held()
    found = clashes(held(), [("gb10d", "/etc/gb10d.toml", 42, first)])
    assert [c.key for c in found] == ["vllm.port", "daemon.state_file", "daemon.learned_file", "metrics.listen"]
    text = found[1].describe("gb10d@second", own_default=True)
    assert text == ("/run/gb10d/state.json of gb10d@second is held by the running instance gb10d (/etc/gb10d.toml, pid 42); "
                    "two instances would write one state file, and gb10d status would show the wrong one; set daemon.state_file "
                    "to one of its own or leave it out (each instance has its own by default)")
    assert "leave it out" not in found[0].describe("gb10d@second", own_default=True)


@pytest.mark.parametrize(("mine", "theirs", "clash"), [
    ("0.0.0.0:8000", "127.0.0.1:8000", True), ("127.0.0.1:8000", "127.0.0.2:8000", False), ("127.0.0.1:8001", "127.0.0.1:8000", False),
])
def test_an_address_on_every_interface_clashes_with_any_on_its_port(mine: str, theirs: str, clash: bool) -> None:
    assert bool(clashes({"vllm.port": mine}, [("a", "/a.toml", 1, {"vllm.port": theirs})])) is clash


def _written_by(state_file: Path) -> dict[str, object]:
    """Whose state the file holds: what a second gb10d that took it over would change (the running one keeps adding
    its own updates after READY: its recent decisions, the phase times of its start)."""
    data = json.loads(state_file.read_text())
    return {k: data.get(k) for k in ("pid", "started_at", "vllm_pid", "url", "state", "instance", "config")}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GB10D_CONFIG", "NOTIFY_SOCKET")}
    return subprocess.run([sys.executable, "-m", "gb10d", *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_a_second_config_copied_from_the_first_is_refused_and_the_first_status_stays_right(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    setup = Setup(tmp_path / "first", extra={"memory.ledger_dir": str(ledger), "metrics.listen": f"127.0.0.1:{free_port()}"})
    first = Daemon(setup, notify)
    daemons.append(first)
    notify.wait_for(lambda m: m.get("READY") == "1", 120)
    before = _written_by(setup.state_file)
    copy = tmp_path / "second" / "gb10d.toml"
    copy.parent.mkdir()
    copy.write_text(setup.config.read_text())

    checked = run("check-config", "--config", str(copy))
    assert checked.returncode == EXIT_CONFIG, checked.stdout + checked.stderr
    assert (f"{copy}:37: daemon.state_file: {setup.state_file} of {copy} is held by the running instance {setup.config} "
            f"(pid {first.proc.pid})") in checked.stderr

    second = run("run", "--config", str(copy))
    assert second.returncode == EXIT_CONFIG, second.stdout + second.stderr
    assert f"daemon.state_file {setup.state_file} of {copy} is held by the running instance {setup.config}" in second.stdout
    assert _written_by(setup.state_file) == before, "the refused second gb10d wrote the first one's state file"
    status = run("status", "--json", "--config", str(setup.config))
    assert status.returncode == 0, status.stdout + status.stderr
    assert json.loads(status.stdout)["pid"] == first.proc.pid
    assert first.stop() == 0
