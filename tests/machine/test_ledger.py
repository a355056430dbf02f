"""The memory ledger on disk: real files, real flocks, real processes that die by kill -9."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from gb10d.base.errors import EXIT_CONFIG, GiveUp
from gb10d.base.units import GIB
from gb10d.core.budget import Admit, Reservation, Stage, Wait
from gb10d.core.memory import MemInfo
from gb10d.machine.ledger import Booking, instance_name, open_booking, read_ledger, record_path
from gb10d.vllm.sleepmode import wake_refusal

MEM = MemInfo(total=int(121.69 * GIB), free=int(100 * GIB), available=int(110 * GIB), cached=0)
SHARE = int(49.68 * GIB)

# A process that takes a record and decides once, says what it got, and holds the record until stdin closes.
HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from gb10d.core.budget import Stage
    from gb10d.machine.ledger import Booking
    from gb10d.core.memory import MemInfo
    from gb10d.base.units import GIB

    directory, name = Path(sys.argv[1]), sys.argv[2]
    booking = Booking.open(directory, name, "/etc/gb10d/" + name + ".toml", print)
    sys.stdin.readline()  # go
    mem = MemInfo(total=int(121.69 * GIB), free=int(100 * GIB), available=int(110 * GIB), cached=0)
    decision = booking.decide(0.4, int(49.68 * GIB), Stage.STARTING, mem, "wait")
    print(type(decision).__name__, flush=True)
    sys.stdin.read()
    """
)


def holder(directory: Path, name: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def book(directory: Path, name: str, warnings: list[str] | None = None) -> Booking:
    return Booking.open(directory, name, f"/etc/gb10d/{name}.toml", (warnings if warnings is not None else []).append)


def test_an_admitted_start_is_a_record_the_others_count(tmp_path: Path) -> None:
    a, b = book(tmp_path, "gb10d@a"), book(tmp_path, "gb10d@b")
    assert isinstance(a.decide(0.4, SHARE, Stage.STARTING, MEM, "wait"), Admit)
    seen = b.others()
    assert [(r.name, r.stage, r.bytes, r.pid) for r in seen] == [("gb10d@a", Stage.STARTING, SHARE, os.getpid())]
    on_disk = json.loads(record_path(tmp_path, "gb10d@a").read_text())
    assert on_disk["stage"] == "starting" and on_disk["config"] == "/etc/gb10d/gb10d@a.toml"
    a.close()
    b.close()


def test_the_third_start_waits_for_the_two_before_it_and_keeps_its_place(tmp_path: Path) -> None:
    bookings = [book(tmp_path, f"gb10d@{n}") for n in "abc"]
    decisions = [b.decide(0.4, SHARE, Stage.STARTING, MEM, "wait") for b in bookings]
    assert [type(d) for d in decisions] == [Admit, Admit, Wait]
    third = bookings[2].record
    assert third is not None and third.stage is Stage.WAITING and third.waiting_for == ("gb10d@a", "gb10d@b")
    # A later start that would fit beside one start still queues behind the waiter.
    bookings[0].close()
    late = book(tmp_path, "gb10d@d")
    assert isinstance(late.decide(0.1, int(13 * GIB), Stage.STARTING, MEM, "wait"), Wait)
    # The waiter asked first: with a's share given back it goes now, with its first asking time.
    again = bookings[2].decide(0.4, SHARE, Stage.STARTING, MEM, "wait")
    assert isinstance(again, Admit)
    assert bookings[2].record is not None and bookings[2].record.asked_at == third.asked_at
    for b in (*bookings[1:], late):
        b.close()


def test_simultaneous_starts_never_take_the_same_memory(tmp_path: Path) -> None:
    # Six processes decide at once; 110 GiB hold two shares of 49.68 GiB.
    holders = [holder(tmp_path, f"gb10d@m{i}") for i in range(6)]
    try:
        for h in holders:
            assert h.stdin is not None
            h.stdin.write("go\n")
            h.stdin.flush()
        answers = sorted(h.stdout.readline().strip() for h in holders if h.stdout is not None)
        assert answers == ["Admit", "Admit", "Wait", "Wait", "Wait", "Wait"]
        assert sorted(r.stage.value for r in read_ledger(tmp_path)) == ["starting", "starting", "waiting", "waiting", "waiting", "waiting"]
    finally:
        for h in holders:
            h.kill()
            h.wait()


@pytest.mark.parametrize("stage_before_kill", ["Admit", "Wait"])
def test_kill_9_frees_the_reservation_and_the_next_decision_removes_the_record(tmp_path: Path, stage_before_kill: str) -> None:
    first = book(tmp_path, "gb10d@first")
    if stage_before_kill == "Wait":
        # The holder will wait behind two starts; the waiter's place in the queue is what dies with it.
        assert isinstance(first.decide(0.4, SHARE, Stage.STARTING, MEM, "wait"), Admit)
        second = book(tmp_path, "gb10d@second")
        assert isinstance(second.decide(0.4, SHARE, Stage.STARTING, MEM, "wait"), Admit)
    h = holder(tmp_path, "gb10d@victim")
    assert h.stdin is not None and h.stdout is not None
    h.stdin.write("go\n")
    h.stdin.flush()
    assert h.stdout.readline().strip() == stage_before_kill
    assert "gb10d@victim" in [r.name for r in read_ledger(tmp_path)]
    h.send_signal(signal.SIGKILL)
    h.wait()
    # The kernel let go of its lock: it is dead to every reader at once, and the next decision removes it.
    assert "gb10d@victim" not in [r.name for r in read_ledger(tmp_path)]
    assert record_path(tmp_path, "gb10d@victim").exists()
    newcomer = book(tmp_path, "gb10d@new")
    newcomer.decide(0.1, int(13 * GIB), Stage.STARTING, MEM, "wait")
    assert not record_path(tmp_path, "gb10d@victim").exists()


def test_an_instance_that_stops_removes_its_record(tmp_path: Path) -> None:
    a = book(tmp_path, "gb10d@a")
    a.decide(0.4, SHARE, Stage.STARTING, MEM, "wait")
    a.close()
    assert read_ledger(tmp_path) == [] and not record_path(tmp_path, "gb10d@a").exists()


def test_a_second_gb10d_of_the_same_instance_is_refused_naming_the_first(tmp_path: Path) -> None:
    h = holder(tmp_path, "gb10d@twice")
    try:
        assert h.stdin is not None and h.stdout is not None
        h.stdin.write("go\n")
        h.stdin.flush()
        h.stdout.readline()
        with pytest.raises(GiveUp) as refused:
            book(tmp_path, "gb10d@twice")
        assert refused.value.exit_status == EXIT_CONFIG
        assert f"another gb10d (pid {h.pid}) already runs as gb10d@twice" in refused.value.reason
    finally:
        h.kill()
        h.wait()


def test_the_name_of_a_dead_predecessor_is_taken_over(tmp_path: Path) -> None:
    h = holder(tmp_path, "gb10d@again")
    assert h.stdin is not None and h.stdout is not None
    h.stdin.write("go\n")
    h.stdin.flush()
    h.stdout.readline()
    h.kill()
    h.wait()
    if os.geteuid() == 0:
        # The unit ran as another user then (its User= changed since): a file this one may not write.
        os.chown(record_path(tmp_path, "gb10d@again"), 65534, 65534)
    successor = book(tmp_path, "gb10d@again")
    # A new record: it says who holds it, and no decision yet.
    written = json.loads(record_path(tmp_path, "gb10d@again").read_text())
    assert successor.record is None and written["pid"] == os.getpid() and "stage" not in written
    assert record_path(tmp_path, "gb10d@again").stat().st_uid == os.geteuid()  # a new file, this user's
    successor.close()


def test_records_are_readable_by_anyone_and_the_lock_usable_by_the_group_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        a = book(tmp_path, "/srv/models/gb10d.toml")
        a.decide(0.4, SHARE, Stage.STARTING, MEM, "wait")
    finally:
        os.umask(old)
    # Any instance's unit, whatever its user, locks `.lock` as a member of the directory's group.
    assert stat.S_IMODE((tmp_path / ".lock").stat().st_mode) == 0o664
    assert stat.S_IMODE(record_path(tmp_path, "/srv/models/gb10d.toml").stat().st_mode) == 0o644
    assert record_path(tmp_path, "/srv/models/gb10d.toml").name == "%2Fsrv%2Fmodels%2Fgb10d.toml.json"
    a.close()


def test_a_ledger_directory_that_cannot_be_used_is_one_warning_and_no_booking(tmp_path: Path) -> None:
    warnings: list[str] = []
    assert open_booking(tmp_path / "missing", "gb10d", "/etc/gb10d.toml", warnings.append) is None
    assert len(warnings) == 1
    assert warnings[0].startswith(f"memory ledger {tmp_path / 'missing'} does not exist: this instance starts without counting")
    assert "systemd-tmpfiles --create gb10d.conf" in warnings[0] and "SupplementaryGroups=gb10d" in warnings[0]
    assert open_booking(None, "gb10d", "/etc/gb10d.toml", warnings.append) is None and len(warnings) == 1


def test_a_removed_ledger_directory_is_made_again_with_each_living_instances_record(tmp_path: Path) -> None:
    directory = tmp_path / "ledger"
    directory.mkdir()
    warnings: list[str] = []
    a, b = book(directory, "gb10d@a", warnings), book(directory, "gb10d@b")
    assert isinstance(a.decide(0.4, SHARE, Stage.STARTING, MEM, "wait"), Admit)
    a.serving(None, None)
    shutil.rmtree(directory)  # e.g. an operator cleaning /run by hand
    a.keep()  # what the daemon does every few seconds
    assert [(r.name, r.stage, r.bytes) for r in read_ledger(directory)] == [("gb10d@a", Stage.SERVING, SHARE)]
    assert warnings == [f"memory ledger {directory}: this instance's record had been removed; written again, the other gb10d instances count its share again"]
    assert isinstance(b.decide(0.4, SHARE, Stage.STARTING, MEM, "wait"), Admit)  # b's own decision puts b's back
    assert [(r.name, r.stage) for r in a.others()] == [("gb10d@b", Stage.STARTING)]
    a.keep()
    assert len(warnings) == 1, "a record in place is left alone"
    a.close()
    b.close()
    assert read_ledger(directory) == []


def test_a_ledger_that_fails_later_is_reported_once_and_the_start_goes_on(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "ledger"
    directory.mkdir(parents=True)
    warnings: list[str] = []
    a = book(directory, "gb10d@a", warnings)
    shutil.rmtree(tmp_path / "run")  # the directory cannot be made again where it was
    assert a.decide(0.4, SHARE, Stage.STARTING, MEM, "wait") == Admit(
        True, (), "memory: the ledger cannot be used; starting without counting other instances' starts"
    )
    a.progressed()
    assert a.others() == []
    assert len(warnings) == 1
    assert warnings[0].startswith(f"memory ledger {directory}: No such file or directory; other gb10d instances may not see this one's share")
    a.close()


def test_read_ledger_of_a_missing_directory_says_so(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_ledger(tmp_path / "missing")
    assert read_ledger(tmp_path) == []  # exists, nobody ever wrote a record


def test_the_instance_is_the_unit_only_for_the_units_own_main_process(tmp_path: Path) -> None:
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("0::/system.slice/system-gb10d.slice/gb10d@chat.service\n")
    config = Path("/etc/gb10d/chat.toml")
    assert instance_name(config, {"SYSTEMD_EXEC_PID": str(os.getpid())}, cgroup) == "gb10d@chat"
    # A gb10d started by hand from a shell inside some other service inherits that service's pid.
    assert instance_name(config, {"SYSTEMD_EXEC_PID": "1"}, cgroup) == "/etc/gb10d/chat.toml"
    assert instance_name(config, {}, cgroup) == "/etc/gb10d/chat.toml"


def wake_refused_beside(available: int) -> Callable[[list[Reservation]], str | None]:
    """The wake's own check (what the sleep gave back plus the margin), beside the starts the ledger shows."""
    def refusal_of(others: list[Reservation]) -> str | None:
        starts = [o for o in others if o.stage.pending]
        return wake_refusal(available, int(47.02 * GIB), 2 * GIB, sum(o.bytes for o in starts), ", ".join(o.name for o in starts))
    return refusal_of


@pytest.mark.parametrize("first", ["wake", "start"])
def test_a_wake_and_a_start_decided_one_after_the_other_never_both_count_the_same_memory(tmp_path: Path, first: str) -> None:
    # 60 GiB available: one of a's wake (47.02 + 2 GiB margin) and b's start (49.68 GiB) fits, not both. Decided
    # apart from its record, a wake let the start in between its check and its record, and both came up (soak).
    a, b = book(tmp_path, "gb10d@a"), book(tmp_path, "gb10d@b")
    assert isinstance(a.decide(0.4, SHARE, Stage.STARTING, MEM, "wait"), Admit)
    a.update(stage=Stage.ASLEEP)
    mem = MemInfo(total=MEM.total, free=int(58 * GIB), available=int(60 * GIB), cached=0)
    if first == "wake":
        assert a.wake(wake_refused_beside(mem.available)) is None
        assert [r.stage for r in b.others()] == [Stage.WAKING], "the wake reserves its share as it is allowed"
        assert isinstance(b.decide(0.4, SHARE, Stage.STARTING, mem, "wait"), Wait)
    else:
        assert isinstance(b.decide(0.4, SHARE, Stage.STARTING, mem, "wait"), Admit)
        refusal = a.wake(wake_refused_beside(mem.available))
        assert refusal is not None and "the starts of gb10d@b reserve 49.68 GiB" in refusal, refusal
        assert [r.stage for r in b.others()] == [Stage.ASLEEP], "a refused wake reserves nothing"
    a.close()
    b.close()
