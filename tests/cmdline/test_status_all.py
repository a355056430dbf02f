"""`gb10d status --all`: every gb10d instance of the machine, from the memory ledger, and its exit statuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomli_w

from gb10d.base.units import GIB
from gb10d.cmdline.status import render, render_all
from gb10d.core.budget import Reservation, Stage
from gb10d.core.memory import MemInfo
from gb10d.core.statefile import DaemonState, StateRecord
from gb10d.machine.statefile import write_state
from harness import meminfo_text

NOW = 5000.0
MEM = MemInfo(total=int(121.69 * GIB), free=int(8 * GIB), available=int(22.81 * GIB), cached=int(14 * GIB))


def record(name: str, stage: Stage, share_gib: float, since: float, **fields: object) -> Reservation:
    values: dict[str, object] = dict(
        name=name, config=f"/etc/gb10d/{name}.toml", pid=1000, stage=stage, bytes=int(share_gib * GIB), utilization=0.4,
        asked_at=since, since=since, progress_at=since,
    )
    values.update(fields)
    return Reservation(**values)  # type: ignore[arg-type]


RECORDS = [
    record("gb10d@small", Stage.WAITING, 37.51, NOW - 45, waiting_for=("gb10d@embed",)),
    record("gb10d", Stage.SERVING, 98.35, NOW - 7380, phase="ready", real_use=int(96.12 * GIB), asked_at=NOW - 7500),
    record("gb10d@embed", Stage.STARTING, 13.17, NOW - 62, phase="loading_weights", asked_at=NOW - 70),
]


def test_every_instance_in_the_order_they_asked_with_reservation_real_use_and_the_memory_left() -> None:
    assert render_all(RECORDS, MEM, NOW, Path("/run/gb10d-ledger")) == textwrap.dedent(
        """\
        3 gb10d instances on this machine (memory ledger /run/gb10d-ledger)
        INSTANCE     STATE     PHASE            RESERVED   REAL USE   IN STATE  WAITS FOR
        gb10d        serving   ready            98.35 GiB  96.12 GiB  2h 3min
        gb10d@embed  starting  loading_weights  13.17 GiB  -          1min 2s
        gb10d@small  waiting   -                37.51 GiB  -          45s       gb10d@embed
        Memory: 121.69 GiB total, 22.81 GiB available, 8.00 GiB free; 9.64 GiB left for a start beside the reservations of the starts in progress
        """
    )


def test_no_instance_is_one_line() -> None:
    assert render_all([], MEM, NOW, Path("/run/gb10d-ledger")) == "no gb10d instance is running on this machine (memory ledger /run/gb10d-ledger)\n"


def test_the_single_status_names_the_ledger_share_and_whom_a_waiting_start_waits_for() -> None:
    waiting = StateRecord(
        pid=4242, state=None, instance="gb10d@small", reservation_bytes=int(37.51 * GIB),
        waiting_for=("gb10d@embed (13.17 GiB, starting: loading_weights)",), status_text="waiting for memory: ...",
    )
    lines = render(waiting, NOW, alive=True).splitlines()
    assert "     Ledger: gb10d@small: 37.5 GiB reserved in the machine's memory ledger (gb10d status --all shows every instance)" in lines
    assert "Waiting for: gb10d@embed (13.17 GiB, starting: loading_weights)" in lines


# --- the command --------------------------------------------------------------

HOLD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from gb10d.core.budget import Stage
    from gb10d.machine.ledger import Booking
    from gb10d.machine.memory import read_meminfo

    directory, name, utilization, meminfo = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), Path(sys.argv[4])
    booking = Booking.open(directory, name, "/etc/gb10d/" + name + ".toml", print)
    mem = read_meminfo(meminfo)
    decision = booking.decide(utilization, int(mem.total * utilization) + (1 << 30), Stage.STARTING, mem, "wait")
    print(type(decision).__name__, flush=True)
    sys.stdin.read()
    """
)


def gb10d(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}
    return subprocess.run([sys.executable, "-m", "gb10d", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture
def machine(tmp_path: Path) -> tuple[Path, Path]:
    """A ledger directory, a meminfo file and a config naming both: what `--config` points status --all at."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    (tmp_path / "meminfo").write_text(meminfo_text(121.69, 100.0, 110.0))
    config = tmp_path / "gb10d.toml"
    config.write_text(tomli_w.dumps({
        "vllm": {"executable": "/opt/vllm/bin/vllm", "model": "m"},
        "memory": {"ledger_dir": str(ledger), "meminfo_path": str(tmp_path / "meminfo")},
        "daemon": {"state_file": str(tmp_path / "run" / "state.json")},
    }))
    return ledger, config


@pytest.mark.slow
def test_status_all_lists_living_instances_and_exits_0_then_3_once_they_are_gone(machine: tuple[Path, Path]) -> None:
    ledger, config = machine
    holders: list[subprocess.Popen[str]] = []
    answers = []
    try:
        # One after the other, so the queue order is known: c waits for a and b.
        for name in ("gb10d@a", "gb10d@b", "gb10d@c"):
            holders.append(subprocess.Popen([sys.executable, "-c", HOLD, str(ledger), name, "0.4", str(config.parent / "meminfo")],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            answers.append(holders[-1].stdout.readline().strip() if holders[-1].stdout else "")
        assert answers == ["Admit", "Admit", "Wait"]
        shown = gb10d("status", "--all", "--config", str(config))
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0] == f"3 gb10d instances on this machine (memory ledger {ledger})"
        assert [line.split()[:2] for line in lines[2:5]] == [["gb10d@a", "starting"], ["gb10d@b", "starting"], ["gb10d@c", "waiting"]]
        assert lines[4].endswith("gb10d@a, gb10d@b")
        assert lines[5] == (
            "Memory: 121.69 GiB total, 110.00 GiB available, 100.00 GiB free; "
            "10.65 GiB left for a start beside the reservations of the starts in progress"
        )
        answer = json.loads(gb10d("status", "--all", "--json", "--config", str(config)).stdout)
        assert answer["running"] is True and [i["name"] for i in answer["instances"]] == ["gb10d@a", "gb10d@b", "gb10d@c"]
        starting = [i["bytes"] for i in answer["instances"] if i["stage"] == "starting"]
        assert len(starting) == 2 and answer["left_bytes"] == answer["memory"]["available_bytes"] - sum(starting)
        holders[0].kill()
        holders[0].wait()
        assert [line.split()[0] for line in gb10d("status", "--all", "--config", str(config)).stdout.splitlines()[2:4]] == ["gb10d@b", "gb10d@c"]
    finally:
        for h in holders:
            h.kill()
            h.wait()
    gone = gb10d("status", "--all", "--config", str(config))
    assert gone.returncode == 3 and gone.stdout == f"no gb10d instance is running on this machine (memory ledger {ledger})\n"


@pytest.mark.slow
def test_status_all_of_a_machine_without_a_ledger_exits_3_and_of_an_unreadable_one_4(machine: tuple[Path, Path], tmp_path: Path) -> None:
    ledger, config = machine
    ledger.rmdir()
    missing = gb10d("status", "--all", "--config", str(config))
    assert missing.returncode == 3 and missing.stdout == (
        f"the memory ledger {ledger} does not exist (the package creates it at boot: systemd-tmpfiles --create); "
        f"no state file in {config.parent / 'run'} names a running gb10d\n"
    )
    ledger.write_text("not a directory")
    broken = gb10d("status", "--all", "--config", str(config))
    assert broken.returncode == 4 and "Traceback" not in broken.stderr
    assert broken.stderr.startswith(f"gb10d: cannot read the memory ledger {ledger}:")


@pytest.fixture
def serving(machine: tuple[Path, Path]) -> Iterator[tuple[Path, int]]:
    """A running instance's state file beside the config's, and its pid (a real process), and a dead one's."""
    path = machine[1].parent / "run" / "state.json"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        write_state(path, StateRecord(pid=holder.pid, state=DaemonState.SERVING, model="Qwen/Qwen3.6-27B-FP8"))
        write_state(path.with_name("gone.json"), StateRecord(pid=2**22 + 7, state=DaemonState.SERVING, model="m"))
        yield path, holder.pid
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_status_all_without_a_ledger_still_finds_a_running_instance_by_its_state_file(machine: tuple[Path, Path], serving: tuple[Path, int]) -> None:
    (ledger, config), (path, pid) = machine, serving
    ledger.rmdir()
    shown = gb10d("status", "--all", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (
        f"the memory ledger {ledger} does not exist (the package creates it at boot: systemd-tmpfiles --create); "
        f"the state files in {path.parent} name 1 running:\n"
        f"  {path}: serving Qwen/Qwen3.6-27B-FP8, pid {pid}\n"
    )
    answer = json.loads(gb10d("status", "--all", "--json", "--config", str(config)).stdout)
    assert answer["running"] is True and [i["state_file"] for i in answer["instances"]] == [str(path)]


@pytest.mark.slow
def test_status_all_with_the_ledger_off_reads_the_state_files(machine: tuple[Path, Path], serving: tuple[Path, int]) -> None:
    config, path = machine[1], serving[0]
    config.write_text(config.read_text().replace(f'ledger_dir = "{machine[0]}"', 'ledger_dir = ""'))
    shown = gb10d("status", "--all", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(
        'the memory ledger is off in this config (memory.ledger_dir = ""); '
        f"the state files in {path.parent} name 1 running:\n"
    )


@pytest.mark.slow
def test_status_all_shows_an_instance_that_runs_alone_outside_an_empty_ledger(machine: tuple[Path, Path], serving: tuple[Path, int]) -> None:
    # It could not use the ledger (one warning in its journal) and runs alone: still not "no instance".
    (ledger, config), (path, pid) = machine, serving
    shown = gb10d("status", "--all", "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == (
        f"no instance is in the memory ledger {ledger}; the state files in {path.parent} name 1 running:\n"
        f"  {path}: serving Qwen/Qwen3.6-27B-FP8, pid {pid}\n"
    )


@pytest.mark.slow
def test_status_all_without_a_ledger_and_a_state_directory_it_cannot_list_exits_4(machine: tuple[Path, Path]) -> None:
    ledger, config = machine
    ledger.rmdir()
    (config.parent / "run").write_text("not a directory")
    shown = gb10d("status", "--all", "--config", str(config))
    assert shown.returncode == 4 and shown.stdout == "" and "Traceback" not in shown.stderr
    assert shown.stderr.startswith(f"gb10d: the memory ledger {ledger} does not exist")
    assert f"and the state files in {config.parent / 'run'} cannot be listed: " in shown.stderr
