"""Models on demand end to end: `gb10d front` before real `gb10d run` instances with `[on_demand]` (park = "stop",
the default) over gb10d.sim.

An on-demand instance runs parked: gb10d is active for systemd, vLLM is not started until a request for its model
arrives, and it is stopped again after idle_timeout_s. Two models that do not fit together swap on alternating
requests (the least recently used one parked, its memory back before the other starts); a pinned instance is never
parked, and a model that could never fit beside it is refused at once with the numbers.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gb10d.daemon.lab import wait_until, write_meminfo
from gb10d.machine.memory import read_meminfo
from harness import NotifySocket
from test_front import Deployment, completion

pytestmark = pytest.mark.slow

IDLE_S = 1.0
TOTAL_GIB = 121.69


def status_of(config: Path, *flags: str) -> str:
    return subprocess.run([sys.executable, "-m", "gb10d", "--config", str(config), "status", *flags], capture_output=True, text=True, timeout=60).stdout


def one_machine(root: Path) -> dict[str, object]:
    """Both instances on one memory: one meminfo file their stand-ins take from, and one ledger."""
    meminfo, ledger = root / "machine-meminfo", root / "ledger"
    write_meminfo(meminfo, TOTAL_GIB, 110.0)
    ledger.mkdir()
    return {"memory.meminfo_path": str(meminfo), "vllm.env.GB10D_SIM_MEMINFO": str(meminfo), "memory.ledger_dir": str(ledger)}


@pytest.fixture
def parked(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path, on_demand={"idle_timeout_s": IDLE_S})
    yield deployment
    deployment.close()


def answered(client: httpx.Client, model: str) -> None:
    reply = client.post("/v1/completions", json=completion(model, 4))
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == model


def starts(daemon_lines: list[str]) -> int:
    return len([line for line in daemon_lines if "started vLLM as" in line])


def test_a_parked_instance_starts_on_the_first_request_serves_it_and_parks_again_when_idle(parked: Deployment, notify: NotifySocket) -> None:
    alpha = parked.start("alpha", serving=False, notify=notify)
    ready = notify.wait_for(lambda m: m.get("READY") == "1")
    assert ready["STATUS"].startswith("parked: starts on the first request"), "active for systemd, vLLM not started"
    parked.wait_state("alpha", "parked")
    assert starts(alpha.lines) == 0
    assert "parked: starts on the first request" in status_of(parked.setups["alpha"].config)
    meminfo = parked.setups["alpha"].meminfo
    idle = read_meminfo(meminfo).available
    with httpx.Client(base_url=parked.url, timeout=60) as client:
        assert {m["id"]: m["gb10d_state"] for m in client.get("/v1/models").json()["data"]}["alpha"] == "parked"
        answered(client, "alpha")
    parked.front.wait_line(r"waking alpha: 1 request\(s\) wait for it; it needs [\d.]+ GiB, [\d.]+ GiB is free")
    alpha.wait_line(r"starting vLLM: the front asked for it, a request waits")
    alpha.wait_line(r"vLLM is ready after")
    # Idle for idle_timeout_s: the front parks it, gb10d stops vLLM cleanly and gives its memory back.
    parked.front.wait_line(r"parking alpha: no request for \d+ s \(on_demand.idle_timeout_s\)")
    alpha.wait_line(r"parking: stopping vLLM \(.*\) after \d+ s serving, as the front asked")
    parked.wait_state("alpha", "parked")
    assert read_meminfo(meminfo).available == idle, "the park gave back all the start took"
    # The state file is written before STATUS= goes out: the second "parked" may still be on its way.
    assert wait_until(lambda: len([s for s in notify.statuses() if s.startswith("parked: starts on the first request")]) == 2, 30) is not None, notify.statuses()
    assert starts(alpha.lines) == 1, "a park is not a failure: nothing restarts vLLM"
    assert not [line for line in alpha.own_lines() if re.search(r"restart|fail|gave up", line, re.I)], alpha.tail()
    assert parked.metric('gb10d_front_swaps_total{instance="alpha",kind="wake"}') == 1
    assert parked.metric('gb10d_front_swaps_total{instance="alpha",kind="park"}') == 1
    assert parked.metric('gb10d_front_swap_seconds_count{instance="alpha"}') == 1
    assert parked.metric('gb10d_front_hold_seconds_count{instance="alpha"}') == 1
    assert alpha.stop() == 0, "a parked instance stops cleanly"


def test_two_on_demand_models_that_do_not_fit_together_swap_on_alternating_requests(tmp_path: Path) -> None:
    # Each reserves 0.5 x 121.69 + 1 = 61.84 GiB: one fits in 110 GiB, two do not.
    swapping = Deployment(tmp_path, on_demand={"idle_timeout_s": 600.0}, extra={**one_machine(tmp_path), "vllm.gpu_memory_utilization": 0.5})
    try:
        alpha, beta = swapping.start("alpha", serving=False), swapping.start("beta", serving=False)
        swapping.wait_state("alpha", "parked")
        swapping.wait_state("beta", "parked")
        everything = status_of(swapping.setups["alpha"].config, "--all")
        assert re.search(r"alpha/gb10d.toml +parked", everything) and re.search(r"beta/gb10d.toml +parked", everything), everything
        with httpx.Client(base_url=swapping.url, timeout=90) as client:
            for model in ("alpha", "beta", "alpha"):
                answered(client, model)
        decisions = [line.split("gb10d-front: ", 1)[1] for line in swapping.front.out.texts() if re.search(r"gb10d-front: (waking|evicting)", line)]
        assert [d.split(":")[0] for d in decisions] == [
            "waking alpha", "evicting alpha to make room for beta", "waking beta", "evicting beta to make room for alpha", "waking alpha",
        ], decisions
        for decision in decisions:
            if decision.startswith("waking"):  # started only once the memory is back: it fits, by the ledger's count
                need, free = map(float, re.findall(r"it needs ([\d.]+) GiB, ([\d.]+) GiB is free", decision)[0])
                assert need == pytest.approx(61.84, abs=0.01) and free >= need, decision
        assert "the least recently used idle on-demand model" in decisions[1]
        for daemon in (alpha, beta):
            assert not [line for line in daemon.own_lines() if "lowering" in line or "does not fit" in line], daemon.tail()
        # The ledger after the last swap: alpha serves, beta parked reserves nothing (61.84 GiB is what it would).
        after = status_of(swapping.setups["alpha"].config, "--all")
        assert re.search(r"alpha/gb10d.toml +serving", after) and re.search(r"beta/gb10d.toml +parked +- +61.84 GiB", after), after
        assert (starts(alpha.lines), starts(beta.lines)) == (2, 1)
        assert swapping.metric('gb10d_front_swaps_total{instance="alpha",kind="evict"}') == 1
        assert swapping.metric('gb10d_front_swaps_total{instance="beta",kind="evict"}') == 1
    finally:
        swapping.close()


def test_a_model_with_steady_traffic_is_drained_after_its_turn_for_one_whose_requests_wait_and_none_is_cut(tmp_path: Path) -> None:
    """alpha never idles (five clients of different lengths, each sending its next request as the last is answered):
    once it has served a turn and beta's request has waited one, alpha's requests in flight finish, its new ones
    wait, it parks, beta serves; then beta is idle and alpha comes back. Before turns, beta's request waited out the
    hold timeout."""
    swapping = Deployment(
        tmp_path, on_demand={"idle_timeout_s": 600.0}, extra={**one_machine(tmp_path), "vllm.gpu_memory_utilization": 0.5},
        front={"hold_timeout_s": 120.0},
    )

    async def traffic() -> tuple[list[int], int, list[str]]:
        codes: list[int] = []
        done = asyncio.Event()

        async def steady(client: httpx.AsyncClient, tokens: int, after_s: float) -> None:
            # Requests of 1.4-2.4 s (1.25 ms a token at this speed), started apart and of lengths apart: they never
            # all end together, so alpha is never idle at the front's poll, however slowly this process runs.
            await asyncio.sleep(after_s)
            while not done.is_set():
                reply = await client.post("/v1/completions", json=completion("alpha", tokens))
                codes.append(reply.status_code)

        async with httpx.AsyncClient(base_url=swapping.url, timeout=180) as client:
            first = await client.post("/v1/completions", json=completion("alpha", 4))
            assert first.status_code == 200, first.text
            clients = [asyncio.ensure_future(steady(client, tokens, i * 0.3)) for i, tokens in enumerate((1100, 1300, 1500, 1700, 1900))]
            # beta's request comes once the five are passed on to alpha (the first request and theirs): alpha is busy.
            passed = 'gb10d_front_requests_total{instance="alpha"}'
            assert await asyncio.to_thread(wait_until, lambda: swapping.metric(passed) >= 6, 60) is not None
            beta = await client.post("/v1/completions", json=completion("beta", 4))
            # beta served, so alpha was parked: its clients go on until it serves again, beta idle.
            await asyncio.to_thread(swapping.wait_state, "alpha", "serving")
            done.set()
            await asyncio.gather(*clients)
        return codes, beta.status_code, swapping.front.out.texts()

    try:
        swapping.start("alpha", serving=False), swapping.start("beta", serving=False)
        swapping.wait_state("alpha", "parked")
        swapping.wait_state("beta", "parked")
        codes, beta_status, front_lines = asyncio.run(traffic())
        assert beta_status == 200
        assert codes and set(codes) == {200}, Counter(codes)
        drained = [line for line in front_lines if "draining alpha to make room for beta" in line]
        assert drained and re.search(r"its requests waited \d+ s and alpha has served for \d+ s \(a turn is 10 s\)", drained[0]), drained
    finally:
        swapping.close()


def test_a_pinned_instance_is_never_parked_and_a_model_that_cannot_fit_beside_it_is_refused_at_once(tmp_path: Path) -> None:
    # alpha has no [on_demand]: pinned, 61.84 GiB. beta (on demand) needs 0.6 x 121.69 + 1 = 74.01 GiB: parking
    # alpha would make room, but alpha is pinned.
    deployment = Deployment(
        tmp_path, extra=one_machine(tmp_path),
        each={"alpha": {"vllm.gpu_memory_utilization": 0.5}, "beta": {"vllm.gpu_memory_utilization": 0.6, "on_demand": {"idle_timeout_s": IDLE_S}}},
    )
    try:
        alpha = deployment.start("alpha")
        deployment.start("beta", serving=False)
        deployment.wait_state("beta", "parked")
        with httpx.Client(base_url=deployment.url, timeout=5) as client:  # at once: no hold, no start
            reply = client.post("/v1/completions", json=completion("beta"))
            assert reply.status_code == 503, reply.text
            message = reply.json()["error"]["message"]
            assert re.match(
                r"beta can never fit: it needs 74\.01 GiB, the machine has 121\.69 GiB \(MemTotal\) and pinned instances hold "
                r"61\.84 GiB \(alpha\), which leaves 59\.84 GiB", message,
            ), message
            answered(client, "alpha")
        deployment.front.wait_line(r"rejected a request for beta \(503\): beta can never fit")
        deployment.wait_state("beta", "parked")
        assert not [line for line in deployment.front.out.texts() if re.search(r"(parking|evicting) alpha", line)]
        assert not [line for line in alpha.own_lines() if "parking" in line]
        assert starts(alpha.lines) == 1
        assert deployment.metric('gb10d_front_rejected_requests_total{instance="beta",status="503"}') == 1
    finally:
        deployment.close()


def test_a_thousand_requests_at_once_for_a_parked_model_start_it_once_and_the_rest_are_held_or_refused_by_the_bound(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path, front={"queue_limit": 100}, on_demand={"idle_timeout_s": 600.0})
    try:
        alpha = deployment.start("alpha", serving=False)
        deployment.wait_state("alpha", "parked")

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
            async with httpx.AsyncClient(base_url=deployment.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=completion("alpha", 2)) for _ in range(1000)))

        replies = asyncio.run(burst())
        counted = Counter(r.status_code for r in replies)
        assert set(counted) == {200, 503} and counted[200] >= 1, counted
        refused = {r.json()["error"]["message"].split(", and")[1] for r in replies if r.status_code == 503}
        assert refused == {" 100 requests already wait for it (front.queue_limit)"}, refused
        assert starts(alpha.lines) == 1
        assert len([line for line in deployment.front.out.texts() if "waking alpha" in line]) == 1
        assert deployment.metric('gb10d_front_rejected_requests_total{instance="alpha",status="503"}') == counted[503]
        assert deployment.metric('gb10d_front_requests_total{instance="alpha"}') == counted[200]
    finally:
        deployment.close()


def test_a_model_parked_by_sleep_is_evicted_for_one_parked_by_stop_and_woken_back(tmp_path: Path) -> None:
    """alpha parks by sleep, beta by stop, and they do not fit together: a request for beta evicts alpha (its
    sleep gives the memory back), beta starts; the next request for alpha evicts beta and wakes alpha from sleep."""
    swapping = Deployment(
        tmp_path, extra={**one_machine(tmp_path), "vllm.gpu_memory_utilization": 0.5},
        each={"alpha": {"on_demand": {"idle_timeout_s": 600.0, "park": "sleep"}}, "beta": {"on_demand": {"idle_timeout_s": 600.0}}},
    )
    try:
        beta = swapping.start("beta", serving=False)
        swapping.wait_state("beta", "parked")
        alpha = swapping.start("alpha")
        with httpx.Client(base_url=swapping.url, timeout=120) as client:
            for model in ("alpha", "beta", "alpha"):
                answered(client, model)
        decisions = [line.split("gb10d-front: ", 1)[1].split(":")[0] for line in swapping.front.out.texts() if re.search(r"gb10d-front: (waking|evicting)", line)]
        assert decisions == ["evicting alpha to make room for beta", "waking beta", "evicting beta to make room for alpha", "waking alpha"], decisions
        assert starts(alpha.lines) == 1, "alpha was woken from sleep, never started cold"
        assert not [line for line in alpha.own_lines() if "not waking vLLM" in line or "does not fit" in line], alpha.tail()
        assert starts(beta.lines) == 1
        swapping.wait_state("beta", "parked")
    finally:
        swapping.close()
