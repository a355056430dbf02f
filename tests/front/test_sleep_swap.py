"""Parking by sleep end to end: `gb10d front` before real `gb10d run` instances with `[on_demand]` over gb10d.sim.

An idle instance is parked by vLLM's level-2 sleep (its memory comes back in the simulated meminfo) and the next
request wakes it and is answered as before. A wake that cannot be trusted (the memory it needs was taken, or the
check generation answers empty text) makes gb10d stop vLLM and start it cold, and the held request is still
answered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gb10d.base.units import GIB
from gb10d.machine.memory import read_meminfo
from gb10d.machine.statefile import read_state
from gb10d.sim.memory import adjust
from harness import vllm_groups
from test_front import Deployment, completion

pytestmark = pytest.mark.slow

IDLE_S = 1.0
SLEEP = {"park": "sleep", "idle_timeout_s": IDLE_S}


@pytest.fixture
def swapping(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path, on_demand=SLEEP)
    yield deployment
    deployment.close()


def text_of(client: httpx.Client, model: str) -> str:
    reply = client.post("/v1/completions", json=completion(model, 6))
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["text"])


def status_of(config: Path) -> str:
    return subprocess.run([sys.executable, "-m", "gb10d", "--config", str(config), "status"], capture_output=True, text=True, timeout=60).stdout


def test_an_idle_instance_sleeps_gives_its_memory_back_and_the_next_request_wakes_it(swapping: Deployment) -> None:
    alpha = swapping.start("alpha")
    started = alpha.wait_line(r"started vLLM as .*")
    assert started[0].endswith("--enable-sleep-mode")
    alpha.wait_line(r"SECURITY WARNING: Development endpoints are enabled!")  # VLLM_SERVER_DEV_MODE=1 reached vLLM
    meminfo = swapping.setups["alpha"].meminfo
    with httpx.Client(base_url=swapping.url, timeout=60) as client:
        before = text_of(client, "alpha")
        awake = read_meminfo(meminfo).available
        swapping.front.wait_line(r"parking alpha: no request for \d+ s")
        swapping.wait_state("alpha", "asleep")
        parked = alpha.wait_line(r"vLLM sleeps \(level 2\) after [\d.]+ s: ([\d.]+) GiB given back, 1\.66 GiB still in use")
        assert read_meminfo(meminfo).available - awake > 30 * GIB, "the sleep gave the weights and the KV cache back"
        assert float(parked[1]) > 30
        assert "asleep: parked by vLLM's level-2 sleep" in status_of(swapping.setups["alpha"].config)
        listed = {m["id"]: m["gb10d_state"] for m in client.get("/v1/models").json()["data"]}
        assert listed["alpha"] == "asleep"
        assert text_of(client, "alpha") == before, "the request that woke it is answered as before the sleep"
    swapping.front.wait_line(r"waking alpha: 1 request\(s\) wait for it")
    alpha.wait_line(r"woke vLLM in [\d.]+ s \(weights, reload_weights, kv_cache\) and checked it")
    assert read_meminfo(meminfo).available == awake, "the wake took the same memory back"
    assert swapping.metric('gb10d_front_swaps_total{instance="alpha",kind="wake"}') == 1
    assert swapping.metric('gb10d_front_swaps_total{instance="alpha",kind="park"}') >= 1
    assert len([line for line in alpha.lines if "started vLLM as" in line]) == 1, "no cold start"


def test_a_wake_whose_check_generation_answers_empty_text_starts_vllm_cold(tmp_path: Path) -> None:
    swapping = Deployment(tmp_path, on_demand=SLEEP, scenario="bad_wake")
    try:
        alpha = swapping.start("alpha")
        with httpx.Client(base_url=swapping.url, timeout=90) as client:
            before = text_of(client, "alpha")
            swapping.wait_state("alpha", "asleep")
            assert text_of(client, "alpha") == before, "the held request is answered by the cold start"
        alpha.wait_line(r"the wake looked fine but the check generation answered with empty text \(weights not loaded\); stopping vLLM and starting it cold")
        alpha.wait_line(r"started vLLM as .*attempt 1/")
        assert len([line for line in alpha.lines if "started vLLM as" in line]) == 2
    finally:
        swapping.close()


def test_a_wake_whose_memory_was_taken_meanwhile_starts_vllm_cold_once_it_is_back(swapping: Deployment) -> None:
    alpha = swapping.start("alpha")
    meminfo = swapping.setups["alpha"].meminfo
    with httpx.Client(base_url=swapping.url, timeout=90) as client:
        before = text_of(client, "alpha")
        swapping.wait_state("alpha", "asleep")
        taken = (read_meminfo(meminfo).available - 5 * GIB) // 1024 * 1024
        adjust(meminfo, -taken)  # another process takes what the sleep gave back
        answer: list[str] = []
        asker = threading.Thread(target=lambda: answer.append(text_of(client, "alpha")))
        asker.start()
        alpha.wait_line(r"not waking vLLM: MemAvailable is [\d.]+ GiB, less than the [\d.]+ GiB the sleep gave back plus the 2\.00 GiB margin")
        adjust(meminfo, taken)  # the other process ends
        asker.join(90)
    assert answer == [before]
    assert len([line for line in alpha.lines if "started vLLM as" in line]) == 2


def test_stopping_a_sleeping_instance_whose_vllm_ignores_sigterm_ends_in_sigkill_and_leaves_nothing(tmp_path: Path) -> None:
    # Measured on vLLM 0.26: a SIGTERM can leave the engine a zombie and the API server running. A frozen vLLM
    # (SIGSTOP) takes no SIGTERM at all; the stop ladder must still end it.
    swapping = Deployment(tmp_path, on_demand=SLEEP, extra={"daemon.stop_timeout_s": 2.0})
    try:
        alpha = swapping.start("alpha")
        swapping.wait_state("alpha", "asleep")
        group = next(vllm_groups(alpha.lines))
        os.killpg(group, signal.SIGSTOP)
        assert alpha.stop() == 0
        alpha.wait_line(r"vLLM did not exit within daemon.stop_timeout_s 2 s; sending SIGKILL")
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    finally:
        swapping.close()


def test_a_sleeping_vllm_is_not_taken_for_hung_though_it_generates_nothing(tmp_path: Path) -> None:
    # Asleep, vLLM holds every completion until a wake: the liveness watch's idle probe would time out and call it
    # hung. With probes every 0.5 s timing out after 1 s, a few seconds asleep are many missed probes.
    liveness = {"liveness.idle_probe_interval_s": 0.5, "liveness.probe_timeout_s": 1.0, "liveness.health_interval_s": 0.5}
    swapping = Deployment(tmp_path, on_demand=SLEEP, extra=liveness)
    try:
        alpha = swapping.start("alpha")
        swapping.wait_state("alpha", "asleep")
        asleep_at = len(alpha.lines)
        with httpx.Client(base_url=swapping.url, timeout=60) as client:
            assert text_of(client, "alpha")  # held only until the wake, not until a restart
            swapping.wait_state("alpha", "asleep")  # idle again, parked again
            swapping.front.wait_line(r"parking alpha", timeout=30)
        alpha.wait_line(r"vLLM sleeps \(level 2\)", since=asleep_at)
        time.sleep(4.0)  # not a sync: four probe timeouts in which a restart for "hung" would have happened
        assert _state(swapping) == "asleep"
        assert not [line for line in alpha.lines if "hung" in line or "liveness" in line.lower()], alpha.tail()
        assert len([line for line in alpha.lines if "started vLLM as" in line]) == 1
    finally:
        swapping.close()


def _state(deployment: Deployment) -> str | None:
    record = read_state(deployment.setups["alpha"].state_file)
    return record.state.value if record is not None and record.state is not None else None
