"""Liveness against gb10d.sim: a hung engine is found, a busy one is left alone, a dead one at once.

`watch_liveness()` runs in an asyncio loop of the test against the real stand-in on
a real loopback port; the sim's clock and the liveness limits are scaled by
the same factor, so seconds of test model minutes of a 27B model on GB10.
The last test blocks the real `gb10d run` on purpose (SIGSTOP) and listens
for its WATCHDOG=1 pings on a real notify socket.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from gb10d.base.config import LivenessSection
from gb10d.base.tasks import COMPLETIONS, Probe
from gb10d.core.facts import ADMISSION_REFUSED, ProbeKind, ProbeResult
from gb10d.core.liveness import Dead, Hung, death
from gb10d.daemon.probe import Prober
from gb10d.daemon.probing import watch_liveness
from harness import Daemon, NotifySocket, Setup, free_port, wait_until

pytestmark = pytest.mark.slow

# Wall seconds per simulated second, for the sim and the limits alike.
SPEED = 0.1
DEFAULTS = LivenessSection()
LIMITS = LivenessSection(
    health_interval_s=DEFAULTS.health_interval_s * SPEED,
    progress_timeout_s=DEFAULTS.progress_timeout_s * SPEED,
    idle_probe_interval_s=DEFAULTS.idle_probe_interval_s * SPEED,
    probe_timeout_s=DEFAULTS.probe_timeout_s * SPEED,
)
MODEL = "tiny"
# Room for a loaded 2-core machine on top of the bounds the rules promise.
SLACK_S = 15.0
# The bound: a hang is found within progress_timeout + one probe interval.
DETECTION_BOUND_S = LIMITS.progress_timeout_s + LIMITS.idle_probe_interval_s + SLACK_S


@dataclass
class Sim:
    """`python -m gb10d.sim serve` as a child in its own process group (EngineCore included)."""

    root: Path
    scenario: str = "healthy"
    port: int = field(default_factory=free_port)
    version: str = "0.23.0"
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GB10D_SIM_")}
        # One shard and no compile: the startup is not what these tests are about.
        env.update(GB10D_SIM_SPEED=str(SPEED), GB10D_SIM_SCENARIO=self.scenario, GB10D_SIM_SHARDS="1", PYTHONUNBUFFERED="1",
                   GB10D_SIM_VERSION=self.version)
        self.log = self.root / "sim.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gb10d.sim", "serve", "tiny-llama", "--host", "127.0.0.1", "--port", str(self.port),
                 "--served-model-name", MODEL, "--enforce-eager", *self.flags],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self) -> float:
        """Wait until /health answers 200 (the sim is serving); returns when it did."""

        def healthy() -> bool:
            assert self.proc.poll() is None, f"the sim exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
            try:
                return httpx.get(self.url + "/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, "the sim answering /health 200")
        return time.monotonic()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[list[Sim]]:
    started: list[Sim] = []
    yield started
    for sim in started:
        sim.kill()


def start_sim(tmp_path: Path, sims: list[Sim], scenario: str) -> Sim:
    sim = Sim(tmp_path, scenario)
    sims.append(sim)
    sim.wait_healthy()
    return sim


@dataclass
class Load:
    """A bounded client loop on loopback: `streams` concurrent streaming completions, again and again."""

    url: str
    streams: int
    max_tokens: int
    tokens: int = 0
    completed: int = 0
    last_token_at: float | None = None

    async def run(self, until: float) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(10.0, read=None), trust_env=False,
                                     limits=httpx.Limits(max_connections=self.streams)) as client:
            await asyncio.gather(*(self._stream(client, until) for _ in range(self.streams)))

    async def _stream(self, client: httpx.AsyncClient, until: float) -> None:
        body = {"model": MODEL, "prompt": "Tell a long story about a calm engine", "max_tokens": self.max_tokens, "stream": True}
        while time.monotonic() < until:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        self.tokens += 1
                        self.last_token_at = time.monotonic()
            self.completed += 1


@dataclass
class Watched:
    """What one run of `watch_liveness()` gave: its verdicts, when the first came, whether it was still watching at the end."""

    verdicts: list[Hung | Dead] = field(default_factory=list)
    found_at: float | None = None
    still_watching: bool = False


def run_watch(sim: Sim, limit_s: float, load: Load | None = None, load_s: float | None = None) -> Watched:
    """Run `watch_liveness()` until its verdict or `limit_s`; a load runs alongside for `load_s` (None: throughout)."""
    watched = Watched()

    def post(kind: ProbeKind, detail: str = "", label: str = "") -> None:
        # The verdict as the liveness core gave it: its evidence and its metrics label.
        watched.verdicts.append(Hung(detail, label) if kind is ProbeKind.HUNG else Dead(detail, label))
        watched.found_at = watched.found_at or time.monotonic()

    async def main() -> None:
        prober = Prober(sim.url, timeout_s=LIMITS.probe_timeout_s)
        watcher = asyncio.create_task(watch_liveness(prober, LIMITS, post, model=MODEL, probe=Probe(COMPLETIONS)))
        clients = None
        if load is not None:
            clients = asyncio.create_task(load.run(time.monotonic() + (limit_s if load_s is None else load_s)))
        try:
            await asyncio.wait({watcher}, timeout=limit_s)
            watched.still_watching = not watcher.done()
        finally:
            # Streams to a hung engine never end: cancelling them is the only way out.
            for task in (watcher, clients):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (watcher, clients) if t is not None), return_exceptions=True)
            await prober.close()
        for task in (watcher, clients):
            if task is not None and not task.cancelled() and (error := task.exception()) is not None:
                raise error

    asyncio.run(main())
    return watched


def test_idle_hung_engine_is_found_by_the_idle_probe(tmp_path: Path, sims: list[Sim]) -> None:
    sim = start_sim(tmp_path, sims, "hang_after=30")
    healthy_at = time.monotonic()
    watched = run_watch(sim, limit_s=30 * SPEED + DETECTION_BOUND_S)
    assert len(watched.verdicts) == 1, watched
    hung = watched.verdicts[0]
    assert isinstance(hung, Hung), hung
    assert hung.cause == "probe_timeout"
    assert "the idle probe (a 1-token completion)" in hung.evidence
    assert "did not finish within liveness.probe_timeout_s 6" in hung.evidence
    assert "generation token counter at" in hung.evidence and "request(s) running" in hung.evidence
    assert watched.found_at is not None and watched.found_at - healthy_at >= 30 * SPEED, "a verdict before the hang began"


def test_busy_hung_engine_is_found_by_the_stuck_token_counter(tmp_path: Path, sims: list[Sim]) -> None:
    sim = start_sim(tmp_path, sims, "hang_after=40")
    # Completions far longer than the run, so requests are in the engine when it hangs.
    load = Load(sim.url, streams=2, max_tokens=100_000)
    watched = run_watch(sim, 40 * SPEED + DETECTION_BOUND_S, load)
    found_at = watched.found_at
    assert len(watched.verdicts) == 1, watched
    hung = watched.verdicts[0]
    assert isinstance(hung, Hung), hung
    assert hung.cause == "hung"
    assert load.tokens > 0 and load.last_token_at is not None
    assert found_at is not None and found_at > load.last_token_at, "the verdict came before the engine stopped generating"
    assert found_at - load.last_token_at <= DETECTION_BOUND_S
    assert "2 request(s) running" in hung.evidence
    assert "liveness.progress_timeout_s 12" in hung.evidence
    assert "generation token counter at" in hung.evidence and "last moved" in hung.evidence


def test_saturating_load_gives_no_verdict(tmp_path: Path, sims: list[Sim]) -> None:
    sim = start_sim(tmp_path, sims, "healthy")
    # Five simulated minutes of 16 concurrent 200-token streams, then idle for a few probes.
    load_s = 300 * SPEED
    idle_s = LIMITS.idle_probe_interval_s + LIMITS.probe_timeout_s
    load = Load(sim.url, streams=16, max_tokens=200)
    watched = run_watch(sim, load_s + idle_s, load, load_s)
    assert watched.verdicts == []
    assert watched.still_watching
    assert load.completed >= 2 * load.streams, f"only {load.completed} completions finished: the load did not run"


def test_engine_death_is_dead_at_once(tmp_path: Path, sims: list[Sim]) -> None:
    sim = start_sim(tmp_path, sims, "engine_dies_after=30")
    watched = run_watch(sim, 30 * SPEED + LIMITS.health_interval_s + SLACK_S)
    assert len(watched.verdicts) == 1, watched
    dead = watched.verdicts[0]
    assert isinstance(dead, Dead), dead
    # Whether the 503 moment or the closed port is seen first depends on when the sample falls.
    assert "503" in dead.reason or "no longer listens" in dead.reason
    assert dead.cause == "health"


def _process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_blocked_main_loop_stops_its_watchdog_pings(tmp_path: Path) -> None:
    notify = NotifySocket()
    setup = Setup(tmp_path)
    # WATCHDOG_USEC 0.4 s: gb10d pings every 0.2 s while its loop runs.
    daemon = Daemon(setup, notify, env={"WATCHDOG_USEC": "400000"})
    pid = daemon.proc.pid
    pings = lambda: notify.count("WATCHDOG", "1")  # noqa: E731 - tiny local view
    try:
        notify.wait_for(lambda m: m.get("READY") == "1", 90)
        before = pings()
        wait_until(lambda: pings() >= before + 5, 30, "WATCHDOG=1 pings while serving")

        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: _process_state(pid) == "T", 10, "gb10d stopped")
        stopped_at = time.monotonic()
        # Silence can only be seen by listening for a while: 3 s is 15 ping intervals.
        time.sleep(3.0)
        # Pings sent just before the stop may still be read in the first moments.
        late = [t for t, m in notify.messages if m.get("WATCHDOG") == "1" and t > stopped_at + 1.0]
        assert late == [], f"{len(late)} WATCHDOG=1 pings while gb10d's main loop was stopped"

        resumed = pings()
        os.kill(pid, signal.SIGCONT)
        wait_until(lambda: pings() >= resumed + 3, 30, "WATCHDOG=1 pings after SIGCONT")
        assert daemon.stop() == 0
    finally:
        if daemon.proc.poll() is None:
            os.kill(pid, signal.SIGCONT)
        daemon.kill_everything()
        notify.close()


def test_a_probe_refused_by_vllms_full_request_queue_is_told_from_a_dead_engine(tmp_path: Path, sims: list[Sim]) -> None:
    # vLLM 0.34 answers 503 for a request beyond --max-num-queued-reqs, as /health does for a dead engine.
    sim = Sim(tmp_path, version="0.34.0", flags=("--max-num-queued-reqs", "1"))
    sims.append(sim)
    sim.wait_healthy()
    body = {"model": MODEL, "prompt": "Tell a long story", "max_tokens": 100_000, "stream": True}

    async def main() -> tuple[ProbeResult, str]:
        prober = Prober(sim.url, timeout_s=10.0)
        async with httpx.AsyncClient(base_url=sim.url, timeout=httpx.Timeout(10.0, read=None), trust_env=False) as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # the one request the queue takes is in the engine
                result = await prober.send(Probe(COMPLETIONS), MODEL, timeout_s=10.0)
        await prober.close()
        return result, (await asyncio.to_thread(httpx.get, sim.url + "/health")).reason_phrase

    result, health = asyncio.run(main())
    assert (result.status, result.reason) == (503, ADMISSION_REFUSED)
    assert death(result, "the idle probe") is None and health == "OK"
