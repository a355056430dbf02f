"""A state file that cannot be written for a while is written again once it can, without waiting for the next change.

The front and `gb10d status` read it. Found by `python -m bench soak`: a state directory made unwritable while vLLM
became ready left `restarting: loading_weights 2/4` in the file for good (nothing changed after ready), so the
front held every request for the model until its hold timeout, and answered 503, for as long as vLLM then served.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gb10d.machine.statefile import read_state
from harness import Daemon, Setup, wait_until

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def unwritable(directory: Path) -> Iterator[None]:
    """`directory` unwritable: chattr +i for root, whom a mode does not stop; mode 0500 for anyone else."""
    root = os.geteuid() == 0
    if root:
        if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i does not work on this file system")
    else:
        directory.chmod(0o500)
    try:
        yield
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        else:
            directory.chmod(0o755)


def test_a_state_that_changed_while_the_file_was_unwritable_is_written_once_it_can_be(tmp_path: Path) -> None:
    gate = tmp_path / "load-gate"
    setup = Setup(tmp_path, sim_env={"GB10D_SIM_LOAD_GATE": str(gate)})
    daemon = Daemon(setup, None)
    try:
        daemon.wait_line(r"started vLLM as pid")
        wait_until(lambda: (r := read_state(setup.state_file)) is not None and r.state is not None and r.state.value == "starting",
                   what="starting in the state file")
        with unwritable(setup.state_file.parent):
            gate.touch()  # vLLM loads and becomes ready while the state cannot be written
            daemon.wait_line(r"vLLM is ready after")
            daemon.wait_line(r"cannot write the state file .*: (Operation not permitted|Permission denied)")
            record = read_state(setup.state_file)
            assert record is not None and record.state is not None and record.state.value == "starting"
        wait_until(lambda: (r := read_state(setup.state_file)) is not None and r.state is not None and r.state.value == "serving",
                   timeout=10, what="serving in the state file once it can be written")
        daemon.wait_line(r"wrote the state file .* again")
        assert daemon.stop() == 0
    finally:
        daemon.kill_everything()
