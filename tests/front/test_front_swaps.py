"""The front's swaps decided on what is true now: each instance's state file read at the moment of the decision.

Real state files, a real meminfo file and a real process for the pinned instance's gb10d; the decision is
`Swaps.room`, the one the front takes for a request that waits for a parked model.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from gb10d.base.config import MemorySection
from gb10d.core.statefile import DaemonState, StateRecord
from gb10d.daemon.lab import write_meminfo
from gb10d.front.core import Instance, StartIt
from gb10d.front.instances import Known
from gb10d.front.journal import FrontJournal
from gb10d.front.metrics import FrontMetrics
from gb10d.front.states import States
from gb10d.front.swaps import Swaps
from gb10d.machine.statefile import write_state


def test_a_pinned_gb10d_killed_since_the_last_poll_keeps_its_share_counted_when_a_parked_model_asks_for_room(tmp_path: Path) -> None:
    # embed (pinned, 0.2 of 121.69 GiB + 1 GiB) serves; beta (on demand, 0.5: 61.84 GiB) is parked. embed's gb10d is
    # killed with its vLLM: its memory is back at once (70 GiB available), and its unit restarts it. Counted as
    # serving from the poll before, that memory looked free and beta was started into it; the pinned instance's
    # restart then found its share taken (soak, seed 7: a pinned instance down for the rest of the hour).
    meminfo = write_meminfo(tmp_path / "meminfo", 121.69, 44.0, 46.0)
    memory = MemorySection(meminfo_path=meminfo, ledger_dir=str(tmp_path / "no-ledger"))
    gb10d, beta_gb10d = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2))
    embed = Known(Instance("embed", ("embed",), "127.0.0.1", 8101), tmp_path / "embed.json", utilization=0.2, memory=memory)
    beta = Known(Instance("beta", ("beta",), "127.0.0.1", 8102), tmp_path / "beta.json", 600.0, tmp_path / "beta.sock", 0.5, memory)
    write_state(embed.state_file, StateRecord(pid=gb10d.pid, state=DaemonState.SERVING))
    write_state(beta.state_file, StateRecord(pid=beta_gb10d.pid, state=DaemonState.PARKED))

    async def decide() -> object:
        states = States([embed, beta], FrontJournal(), 4, 5.0)
        try:
            swaps = Swaps(states, states.journal, FrontMetrics())
            assert states["embed"].ready.serving
            gb10d.kill()
            gb10d.wait()
            write_meminfo(meminfo, 121.69, 68.0, 70.0)
            return swaps.room(states["beta"])
        finally:
            await states.close()

    try:
        decided = asyncio.run(decide())
    finally:
        for process in (gb10d, beta_gb10d):
            process.kill()
            process.wait()
    assert not isinstance(decided, StartIt), decided
