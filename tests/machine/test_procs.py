"""The one walk of /proc that the process group, the memory report, the shm cleanup and the test lab share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gb10d.launch.process import group_members
from gb10d.machine.procs import processes, stat_fields


def test_the_walk_lists_this_process_with_its_proc_directory() -> None:
    walked = dict(processes())
    assert walked[os.getpid()] == Path("/proc") / str(os.getpid())


def test_stat_fields_start_after_a_command_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "stat").write_bytes(b"4242 (vllm (x) y) S 1 4242 4242 0 -1\n")
    assert stat_fields(tmp_path)[:3] == [b"S", b"1", b"4242"]


def test_a_proc_root_that_cannot_be_listed_yields_no_process(tmp_path: Path) -> None:
    assert list(processes(tmp_path / "absent")) == []


def test_a_process_group_started_in_a_new_session_lists_exactly_its_members() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, start_new_session=True)
    try:
        assert group_members(child.pid) == [child.pid]
    finally:
        child.communicate(b"")
    assert group_members(child.pid) == []
