"""The one walk of /proc that the process group, the memory report, the shm cleanup and the test lab share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gb10d.daemon.preflight import top_memory_users
from gb10d.launch.process import group_members
from gb10d.machine.procs import cpu_seconds, kib, processes, rss_kib, stat_fields, status_fields


def test_the_walk_lists_this_process_with_its_proc_directory() -> None:
    walked = dict(processes())
    assert walked[os.getpid()] == Path("/proc") / str(os.getpid())


def test_stat_fields_start_after_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "stat").write_bytes(b"4242 (vllm (x) y) S 1 4242 4242 0 -1\n")
    assert stat_fields(tmp_path)[:3] == [b"S", b"1", b"4242"]


def test_cpu_seconds_of_an_exited_child_are_all_it_used_until_it_is_reaped() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie, as the bench reads it
    try:
        assert 0.25 <= cpu_seconds(child.pid) < 5  # clock ticks: a little less may be counted
    finally:
        child.wait()


def test_status_fields_give_sizes_in_kib_and_none_where_a_process_has_no_memory(tmp_path: Path) -> None:
    (tmp_path / "status").write_text("Name:\tvllm: api (x)\nState:\tZ (zombie)\nVmHWM:\t  2048 kB\nVmRSS:\t  1234 kB\n")
    fields = status_fields(tmp_path)
    assert fields["Name"] == "vllm: api (x)" and kib(fields, "VmRSS") == 1234 and kib(fields, "VmHWM") == 2048
    assert kib({"Name": "kthreadd"}, "VmRSS") is None
    assert (rss_kib(os.getpid()) or 0) > 0
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert rss_kib(child.pid) is None  # reaped: gone


def test_the_largest_memory_users_are_named_with_pid_and_size_this_process_among_them() -> None:
    every = top_memory_users(10**6)
    assert every.startswith("largest processes: ") and f"(pid {os.getpid()}) " in every
    assert top_memory_users(2).count("(pid ") == 2


def test_a_proc_root_that_cannot_be_listed_yields_no_process(tmp_path: Path) -> None:
    assert list(processes(tmp_path / "absent")) == []


def test_a_process_group_started_in_a_new_session_lists_exactly_its_members() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True)
    try:
        assert group_members(child.pid) == [child.pid]
    finally:
        child.communicate(b"")
    assert group_members(child.pid) == []
