"""The stand-in's own memory in the simulated /proc/meminfo: taken over its phases, given back at any end.

Several stand-ins on one meminfo file see each other as vLLMs on one GB10
do: vLLM's free-memory check fails when another took the memory, and an
allocation beyond MemAvailable fails as CUDA's does.
"""

from __future__ import annotations

import math
import os
import re
import signal
from pathlib import Path

from gb10d.base.units import GIB
from gb10d.machine.memory import read_meminfo
from gb10d.sim.memory import adjust
from harness import meminfo_text, wait_until
from sim_support import Sim, StartSim, physical_lines

KB = 1024
FREE_MEMORY = re.compile(r"ValueError: Free memory on device cuda:0 \(([\d.]+)/121\.69 GiB\) on startup is less than desired GPU memory utilization \(0\.5, ([\d.]+) GiB\)")
WEIGHTS = int(27.32 * GIB) // KB * KB  # the default checkpoint's weights, as the file counts them


def machine(tmp_path: Path, free_gib: float = 100.0) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(meminfo_text(121.69, free_gib, free_gib + 12))
    return path


def taken(meminfo: Path, before: tuple[int, int]) -> tuple[int, int]:
    """(MemFree, MemAvailable) taken since `before`, in bytes."""
    now = read_meminfo(meminfo)
    return before[0] - now.free, before[1] - now.available


def test_a_start_takes_its_weights_then_its_whole_share_and_gives_all_back_when_it_stops(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    start = read_meminfo(meminfo)
    before = (start.free, start.available)
    s = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo)})
    s.wait_text("Loading weights took")
    assert taken(meminfo, before) == (WEIGHTS, WEIGHTS)
    s.wait_ready()
    share = math.floor(start.total * 0.5) // KB * KB  # gpu_memory_utilization x MemTotal: the KV cache fills the rest
    assert taken(meminfo, before) == (share, share)
    s.process.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    s.drain()
    assert taken(meminfo, before) == (0, 0)
    assert meminfo.read_text() == meminfo_text(121.69, 100.0, 112.0), "the file is as it was, field for field"


def test_kill_9_of_the_whole_group_gives_the_memory_back_as_the_kernel_would(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    start = read_meminfo(meminfo)
    s = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo)})
    s.wait_ready()
    assert taken(meminfo, (start.free, start.available))[1] > 60 * GIB
    os.killpg(s.process.pid, signal.SIGKILL)
    s.wait_exit()
    wait_until(lambda: taken(meminfo, (start.free, start.available)) == (0, 0), what="the memory of the killed stand-in given back")


def test_without_holding_the_stand_in_reads_the_file_for_its_check_and_leaves_it_as_it_was(sim: StartSim, tmp_path: Path) -> None:
    # For a stand-in in a container, whose engine kills its keeper with it: the file is only read.
    meminfo = machine(tmp_path, free_gib=50.0)
    too_much = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo), "GB10D_SIM_MEMINFO_HOLD": "0"})
    assert too_much.wait_exit() == 1, "50 GiB free is less than 0.5 of 121.69 GiB: the check reads the file"
    meminfo.write_text(meminfo_text(121.69, 100.0, 112.0))
    s = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo), "GB10D_SIM_MEMINFO_HOLD": "0"})
    s.wait_ready()
    assert meminfo.read_text() == meminfo_text(121.69, 100.0, 112.0)


def test_a_second_stand_in_fails_vllms_free_memory_check_when_the_first_holds_the_memory(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    first = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo)})
    first.wait_ready()
    second = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo)})
    assert second.wait_exit() == 1
    second.drain()
    found = [m for line in physical_lines(bytes(second.stdout)) if (m := FREE_MEMORY.search(line))]
    assert found, physical_lines(bytes(second.stdout))[-5:]
    free, requested = float(found[-1].group(1)), float(found[-1].group(2))
    assert abs(free + requested - 100.0) <= 0.02  # the 100 GiB that were free, less the first one's share


def test_memory_taken_by_another_process_during_the_load_fails_the_cache_allocation_as_cuda_does(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)
    start = read_meminfo(meminfo)
    s = sim("m", "--gpu-memory-utilization", "0.5", env={"GB10D_SIM_MEMINFO": str(meminfo), "GB10D_SIM_SCENARIO": "slow_shards=200"})
    s.wait_text("Loading safetensors checkpoint shards:", "stderr")
    adjust(meminfo, -int(60 * GIB))  # another model's start takes 60 GiB meanwhile
    assert s.wait_exit() == 1
    s.drain()
    lines = physical_lines(bytes(s.stdout))
    assert any("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in line for line in lines), lines[-5:]
    assert any("initialize_kv_cache" in line for line in physical_lines(bytes(s.stderr)))
    # What it held until it failed is back; the other process's 60 GiB are still taken.
    wait_until(lambda: taken(meminfo, (start.free, start.available)) == (60 * GIB, 60 * GIB), what="the failed start's memory given back")


def kv_available(s: Sim) -> float:
    found = [m for line in physical_lines(bytes(s.stdout)) if (m := re.search(r"Available KV cache memory: (-?[\d.]+) GiB", line))]
    assert found, physical_lines(bytes(s.stdout))[-5:]
    return float(found[-1].group(1))


def test_034s_extensible_kv_cache_is_sized_from_memfree_after_the_load_where_the_page_cache_counts_as_used(sim: StartSim, tmp_path: Path) -> None:
    meminfo = machine(tmp_path)  # 100 GiB free, 12 GiB of page cache
    start = read_meminfo(meminfo)
    env = {"GB10D_SIM_MEMINFO": str(meminfo), "GB10D_SIM_VERSION": "0.34.0", "GB10D_SIM_SCENARIO": "page_cache_gib=50"}
    extensible = sim("m", "--gpu-memory-utilization", "0.5", env=env)
    extensible.wait_ready()
    extensible.process.send_signal(signal.SIGTERM)
    assert extensible.wait_exit() == 0
    extensible.drain()
    # What was free after the load: 100 GiB less the 50 GiB the load left in the page cache, less its own use.
    assert kv_available(extensible) == 19.59  # 100 - 50 - 27.32 - 2.48 - 0.61
    wait_until(lambda: read_meminfo(meminfo).available == start.available, what="everything given back")
    budget = sim("m", "--gpu-memory-utilization", "0.5", "--no-enable-extensible-kv-cache", env=env)
    budget.wait_ready()
    budget.process.send_signal(signal.SIGTERM)
    assert budget.wait_exit() == 0
    budget.drain()
    # The budget's share less the weights, activations and graphs; the page cache was reclaimed for it.
    assert kv_available(budget) == 30.43  # 0.5 x 121.69 - 27.32 - 2.48 - 0.61
    wait_until(lambda: read_meminfo(meminfo).available == start.available, what="everything given back")
    # The page cache the budget's allocation reclaimed stays free; the rest of it is dropped when it ends.
    assert read_meminfo(meminfo).free >= start.free
