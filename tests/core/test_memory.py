"""GB10 unified-memory arithmetic: meminfo parsing, fitting utilizations, preflight decisions, eviction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gb10d.base.errors import MemInfoError
from gb10d.base.units import GIB
from gb10d.core.memory import (
    MemInfo,
    MemoryNotReturned,
    Neighbours,
    Preflight,
    PreflightRefused,
    fits,
    fitting_utilization,
    floor2,
    memory_return,
    memory_returned,
    parse_buddyinfo,
    parse_meminfo,
    preflight,
)
from gb10d.machine.memory import evict_page_cache, safetensors_files
from harness import meminfo_text


def mem(total: float, free: float, available: float, cached: float = 0.0) -> MemInfo:
    return MemInfo(int(total * GIB), int(free * GIB), int(available * GIB), int(cached * GIB))


def test_parse_meminfo_reads_kb_fields_as_bytes() -> None:
    info = parse_meminfo(meminfo_text(121.69, 95.0, 110.0, 14.0))
    assert round(info.total_gib, 2) == 121.69
    assert round(info.free_gib, 2) == 95.0
    assert round(info.available_gib, 2) == 110.0
    assert round(info.cached_gib, 2) == 14.0


def test_parse_meminfo_names_missing_fields() -> None:
    with pytest.raises(MemInfoError, match="MemAvailable"):
        parse_meminfo("MemTotal: 1 kB\nMemFree: 1 kB\n")


@pytest.mark.parametrize(
    ("free", "total", "headroom", "expected"),
    [(103.45, 123.73, 1.0, 0.82), (95.0, 121.7, 1.0, 0.77), (115.0, 121.7, 1.0, 0.93), (0.5, 121.7, 1.0, 0.0)],
)
def test_fitting_utilization_rounds_down_after_headroom(free: float, total: float, headroom: float, expected: float) -> None:
    assert fitting_utilization(free, total, headroom) == expected


def test_floor2_is_robust_to_float_noise() -> None:
    assert floor2(0.83) == 0.83
    assert floor2(0.8299999) == 0.82


def test_fits_mirrors_vllms_ceil_check_with_headroom() -> None:
    total = int(121.69 * GIB)
    assert fits(0.8, int(98.5 * GIB), total, 1.0)
    assert not fits(0.8, int(97.5 * GIB), total, 1.0)


def test_preflight_keeps_a_request_that_fits_memfree() -> None:
    decision = preflight(0.8, mem(121.69, 110, 115), 1.0, 0.3, evicted_already=False, can_evict=True)
    assert decision == Preflight(0.8, False, decision.reason)  # type: ignore[union-attr]


def test_preflight_evicts_page_cache_when_only_memavailable_fits() -> None:
    decision = preflight(0.8, mem(121.69, 80, 110, 30), 1.0, 0.3, evicted_already=False, can_evict=True)
    assert isinstance(decision, Preflight) and decision.evict
    assert "page cache" in decision.reason


def test_preflight_lowers_after_eviction_did_not_help() -> None:
    decision = preflight(0.8, mem(121.69, 80, 110, 30), 1.0, 0.3, evicted_already=True, can_evict=True)
    assert isinstance(decision, Preflight) and not decision.evict
    assert decision.utilization == 0.64  # floor((80 - 1) / 121.69, 2)


def test_preflight_refuses_below_the_minimum() -> None:
    decision = preflight(0.8, mem(121.69, 20, 25), 1.0, 0.3, evicted_already=False, can_evict=False)
    assert isinstance(decision, PreflightRefused)
    assert "minimum gpu_memory_utilization 0.3" in decision.reason


# Another instance's start reserved 49.68 GiB that /proc/meminfo does not show as used yet.
STARTING_BESIDE = Neighbours(int(49.68 * GIB), "gb10d@a", "gb10d@a (49.68 GiB, starting: loading_weights)")


def test_preflight_never_lowers_into_what_another_instances_start_reserved() -> None:
    decision = preflight(0.8, mem(121.69, 110, 112), 1.0, 0.3, evicted_already=False, can_evict=False, neighbours=STARTING_BESIDE)
    assert isinstance(decision, Preflight)
    assert decision.utilization == 0.48  # floor((110 - 49.68 - 1) / 121.69, 2), not 0.8
    assert decision.reason == (
        "gpu_memory_utilization 0.8 (97.35 GiB) does not fit in MemFree 110.00 GiB of 121.69 GiB less 49.68 GiB reserved "
        "by the starts of gb10d@a; starting with 0.48 (58.41 GiB) instead; other gb10d instances here: "
        "gb10d@a (49.68 GiB, starting: loading_weights)"
    )


def test_preflight_refusal_names_the_other_instances_and_their_shares() -> None:
    serving = Neighbours(0, "", "gb10d@a (49.68 GiB, serving), gb10d@b (49.68 GiB, serving)")
    decision = preflight(0.4, mem(121.69, 12, 12.65), 1.0, 0.3, evicted_already=False, can_evict=False, neighbours=serving)
    assert isinstance(decision, PreflightRefused)
    assert decision.reason.endswith(
        "even the minimum gpu_memory_utilization 0.3 would not fit with 1 GiB headroom; other gb10d instances here: "
        "gb10d@a (49.68 GiB, serving), gb10d@b (49.68 GiB, serving)"
    )


def test_preflight_alone_says_what_it_always_said() -> None:
    assert preflight(0.8, mem(121.69, 80, 110, 30), 1.0, 0.3, evicted_already=True, can_evict=True).reason == (  # type: ignore[union-attr]
        "gpu_memory_utilization 0.8 (97.35 GiB) does not fit in MemFree 80.00 GiB of 121.69 GiB; starting with 0.64 (77.88 GiB) instead"
    )


def test_memory_returned_allows_the_tolerance() -> None:
    before = mem(121.69, 100, 110)
    assert memory_returned(before, mem(121.69, 99, 107), 4.0)
    assert not memory_returned(before, mem(121.69, 60, 70), 4.0)


def test_memory_that_comes_back_within_the_tolerance_ends_the_wait_at_once() -> None:
    assert memory_return(mem(121.69, 100, 110), 0, mem(121.69, 99, 107), 4.0, waited_s=0.0, timeout_s=30.0) is True


def test_memory_that_cannot_be_read_does_not_hold_the_restart() -> None:
    assert memory_return(mem(121.69, 100, 110), 0, None, 4.0, waited_s=100.0, timeout_s=30.0) is True


def test_memory_still_missing_before_the_timeout_is_looked_at_again() -> None:
    assert memory_return(mem(121.69, 100, 110), 0, mem(121.69, 60, 70), 4.0, waited_s=29.9, timeout_s=30.0) is False


def test_memory_still_missing_at_the_timeout_is_given_up_with_the_numbers() -> None:
    verdict = memory_return(mem(121.69, 100, 110), 0, mem(121.69, 60, 70), 4.0, waited_s=30.0, timeout_s=30.0)
    assert isinstance(verdict, MemoryNotReturned)
    assert verdict.describe() == (
        "memory was not returned after vLLM exited: MemAvailable is 70.00 GiB, was 110.00 GiB before it started "
        "(40.00 GiB missing) and no vLLM process is left"
    )


def test_memory_another_instance_took_meanwhile_is_not_expected_back() -> None:
    # 30 GiB went to another instance's start: 80 GiB available is all this vLLM can give back.
    assert memory_return(mem(121.69, 100, 110), 30 * GIB, mem(121.69, 70, 80), 4.0, waited_s=0.0, timeout_s=30.0) is True
    verdict = memory_return(mem(121.69, 100, 110), 30 * GIB, mem(121.69, 50, 60), 4.0, waited_s=30.0, timeout_s=30.0)
    assert isinstance(verdict, MemoryNotReturned)
    assert "less 30.00 GiB other gb10d instances' starts took meanwhile (20.00 GiB missing)" in verdict.describe()


def test_safetensors_files_finds_local_and_hub_cache_checkpoints(tmp_path: Path) -> None:
    local = tmp_path / "model"
    local.mkdir()
    (local / "model-00001-of-00002.safetensors").write_bytes(b"x")
    (local / "config.json").write_text("{}")
    assert [p.name for p in safetensors_files(str(local), {})] == ["model-00001-of-00002.safetensors"]
    snapshot = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3.6-27B-FP8" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").write_bytes(b"y")
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    assert len(safetensors_files("Qwen/Qwen3.6-27B-FP8", {"HF_HOME": str(tmp_path / "hf")})) == 1


def test_evict_page_cache_covers_the_files_it_could_open(tmp_path: Path) -> None:
    shard = tmp_path / "a.safetensors"
    shard.write_bytes(os.urandom(4096))
    assert evict_page_cache([shard, tmp_path / "missing.safetensors"]) == 4096


# 4 KiB pages; orders 0..10. A fresh machine has most of its free memory in 4 MiB blocks, a week-old one in 4 KiB pages.
FRESH = ("Node 0, zone      DMA      1      1      0      0      2      1      1      0      1      1      3\n"
         "Node 0, zone   Normal   1024    512    256    128     64     32     16      8      4      2  25000\n")
WORN = ("Node 0, zone      DMA      1      1      0      0      2      1      1      0      1      1      3\n"
        "Node 0, zone   Normal 20000000 1000000 50000  20000   3000    100     10      2      0      0      0\n")


def test_buddyinfo_tells_free_memory_in_large_blocks_from_small_pages() -> None:
    fresh = parse_buddyinfo(FRESH, 4096)
    assert not fresh.fragmented and fresh.large > 0.99 * fresh.free
    worn = parse_buddyinfo(WORN, 4096)
    assert worn.fragmented
    assert round(worn.free / GIB, 2) == 85.51 and round(worn.large / GIB, 3) == 0.014
    assert worn.describe().startswith("unified memory is fragmented: 85.51 GiB free, but only 0.01 GiB of it in blocks of 2 MiB or more")
    assert "reboot recommended" in worn.describe()
    assert not parse_buddyinfo("Node 0, zone   Normal   100 0 0 0 0 0 0 0 0 0 0\n", 4096).fragmented, "too little free to judge"
