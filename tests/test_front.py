"""`gb10d front` before real `gb10d run` instances over gb10d.sim, through real sockets.

Each test starts what it needs: instances (alpha, beta) whose configs sit in the front's instances_dir, and the
front as a child process. The sim streams completions token by token, so a stream is long enough to leave or
break half-way.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gb10d.front.lab import FrontChild
from gb10d.lab import wait_until
from gb10d.statefile import read_state
from harness import Daemon, Setup, free_port

pytestmark = pytest.mark.slow


class Deployment:
    """A front and its instances' configs; instances are started by the test that needs them running."""

    def __init__(
        self, root: Path, front: dict[str, object] | None = None, on_demand: dict[str, object] | None = None, scenario: str = "healthy",
        extra: dict[str, object] | None = None,
    ) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = {**({"on_demand": on_demand} if on_demand is not None else {}), **(extra or {})}
        self.setups = {name: Setup(root / name, served_name=name, utilization=0.3, extra=extra, scenario=scenario) for name in ("alpha", "beta")}
        (root / "instances").mkdir()
        for name, setup in self.setups.items():
            (root / "instances" / f"{name}.toml").write_text(setup.config.read_text())
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        settings = {
            "listen": f"127.0.0.1:{self.port}", "metrics_listen": self.metrics_url.split("/")[2], "instances_dir": str(root / "instances"),
            "hold_timeout_s": 60.0, **(front or {}),
        }
        lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
        (root / "front.toml").write_text("[front]\n" + lines)
        self.daemons: list[Daemon] = []
        self.front = FrontChild(root / "front.toml")
        self.front.wait_line(r"serving alpha, beta on ")

    def start(self, name: str, serving: bool = True) -> Daemon:
        daemon = Daemon(self.setups[name], None)
        self.daemons.append(daemon)
        if serving:
            daemon.wait_line(r"ready|serving")
            self.wait_state(name, "serving")
        return daemon

    def wait_state(self, name: str, state: str) -> None:
        def there() -> bool:
            record = read_state(self.setups[name].state_file)
            return record is not None and record.state is not None and record.state.value == state
        assert wait_until(there, 60) is not None, f"{name} never reached {state}"

    def metric(self, sample: str) -> float:
        """One sample of the front's metrics (0 when absent), e.g. 'gb10d_front_requests_total{instance="alpha"}'."""
        for line in httpx.get(self.metrics_url).text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        self.front.close()
        for daemon in self.daemons:
            daemon.kill_everything()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    yield d
    d.close()


def completion(model: str, tokens: int = 8, stream: bool = False) -> dict[str, object]:
    return {"model": model, "prompt": "hello", "max_tokens": tokens, "stream": stream}


def events(text: str) -> list[str]:
    return [line for line in text.split("\n\n") if line.strip()]


def test_streams_pass_through_event_by_event_and_models_list_every_model_with_its_state(deployment: Deployment) -> None:
    deployment.start("alpha")
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        pieces: list[bytes] = []
        with client.stream("POST", "/v1/completions", json=completion("alpha", 40, stream=True)) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            pieces.extend(response.iter_raw())
        text = b"".join(pieces).decode()
        assert len(events(text)) == 41 and events(text)[-1] == "data: [DONE]"
        assert len(pieces) > 1, "the stream arrived in one piece: the front buffered it"
        plain = client.post("/v1/chat/completions", json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}]})
        assert plain.status_code == 200 and plain.json()["model"] == "alpha"
        listed = {m["id"]: m["gb10d_state"] for m in client.get("/v1/models").json()["data"]}
        assert listed == {"alpha": "serving", "beta": "not running (no state file)"}


def test_bad_requests_get_a_clear_json_error_and_never_reach_an_instance(tmp_path: Path) -> None:
    key = "front-key-0123456789"
    deployment = Deployment(tmp_path, {"max_body_bytes": 4096, "api_keys": [key]})
    try:
        with httpx.Client(base_url=deployment.url, timeout=60) as client:
            keyless = client.post("/v1/chat/completions", json={"model": "alpha", "messages": []})
            assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "AuthenticationError"
            client.headers["authorization"] = f"Bearer {key}"
            answers = {
                "unknown": client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": []}),
                "malformed": client.post("/v1/chat/completions", content=b'{"model": "alpha",', headers={"content-type": "application/json"}),
                "no model": client.post("/v1/completions", json={"prompt": "x"}),
                "too large": client.post("/v1/completions", json={"model": "alpha", "prompt": "x" * 5000}),
                "stopped": client.post("/v1/completions", json=completion("beta")),
            }
        expected = {"unknown": 404, "malformed": 400, "no model": 400, "too large": 413, "stopped": 503}
        assert {k: r.status_code for k, r in answers.items()} == expected
        assert "`gpt-4` does not exist" in answers["unknown"].json()["error"]["message"]
        assert "front.max_body_bytes" in answers["too large"].json()["error"]["message"]
        assert answers["stopped"].headers["retry-after"] == "5"
        deployment.front.wait_line(r"rejected a request for beta \(503\): beta is not running")
        assert not deployment.front.out.find(key), "the front logged an API key"
        assert deployment.metric('gb10d_front_rejected_requests_total{instance="beta",status="503"}') == 1
    finally:
        deployment.close()


def upstream_connections(front_pid: int, port: int) -> int:
    """The front's open TCP connections to an instance's port."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "dport", f"= :{port}"], capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines() if f"pid={front_pid}," in line)


def test_a_client_that_leaves_mid_stream_closes_the_upstream_request(deployment: Deployment) -> None:
    deployment.start("alpha")
    port = deployment.setups["alpha"].port
    with socket.create_connection(("127.0.0.1", deployment.port)) as client:
        body = json.dumps(completion("alpha", 2000, stream=True)).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert b"200 OK" in client.recv(65536)
        assert upstream_connections(deployment.front.proc.pid, port) == 1
    assert wait_until(lambda: upstream_connections(deployment.front.proc.pid, port) == 0, 2) is not None, "the upstream request outlived its client"


def test_an_instance_that_dies_mid_stream_ends_the_clients_stream_with_an_error_event(deployment: Deployment) -> None:
    deployment.start("alpha")
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=completion("alpha", 2000, stream=True)) as response:
            chunks = response.iter_raw()
            first = next(chunks)
            assert first.startswith(b"data: ")
            record = read_state(deployment.setups["alpha"].state_file)
            assert record is not None and record.vllm_pid is not None
            os.killpg(record.vllm_pid, signal.SIGKILL)
            rest = b"".join(chunks).decode()
    last = events(rest)[-1]
    assert last.startswith("event: error\ndata: ") and "alpha stopped answering mid-stream" in last
    deployment.front.wait_line(r"alpha ended a stream mid-answer")


def test_a_request_for_a_starting_instance_is_held_until_it_serves(deployment: Deployment) -> None:
    daemon = deployment.start("beta", serving=False)
    assert wait_until(lambda: read_state(deployment.setups["beta"].state_file) is not None, 60) is not None, daemon.tail()
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        answer = client.post("/v1/completions", json=completion("beta"))
    assert answer.status_code == 200, answer.text
    deployment.front.wait_line(r"holding requests for beta: it is (starting|waiting)")
    deployment.front.wait_line(r"released the requests held for beta after [0-9.]+ s: it serves")
    assert deployment.metric('gb10d_front_hold_seconds_count{instance="beta"}') == 1
    assert deployment.metric('gb10d_front_requests_total{instance="beta"}') == 1
    assert deployment.metric('gb10d_front_held_requests{instance="beta"}') == 0


def test_a_restart_of_vllm_is_only_a_wait_for_clients(deployment: Deployment) -> None:
    """Requests every 50 ms across vLLM's crash and gb10d's restart: none refused, none failed."""
    deployment.start("alpha")
    statuses: list[int] = []
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        record = read_state(deployment.setups["alpha"].state_file)
        assert record is not None and record.vllm_pid is not None
        first_vllm = record.vllm_pid
        os.killpg(first_vllm, signal.SIGKILL)

        def restarted() -> bool:
            statuses.append(client.post("/v1/completions", json=completion("alpha", 2)).status_code)
            now = read_state(deployment.setups["alpha"].state_file)
            return now is not None and now.vllm_pid not in (None, first_vllm) and now.state is not None and now.state.value == "serving"

        assert wait_until(restarted, 90) is not None
        statuses.append(client.post("/v1/completions", json=completion("alpha", 2)).status_code)
    assert set(statuses) == {200}, statuses
    deployment.front.wait_line(r"holding requests for alpha")


def test_a_flood_for_a_starting_model_is_held_up_to_the_bound_and_the_rest_refused_at_once(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path, {"queue_limit": 100})
    try:
        deployment.start("beta", serving=False)
        assert wait_until(lambda: read_state(deployment.setups["beta"].state_file) is not None, 60) is not None

        async def flood() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=1000)
            async with httpx.AsyncClient(base_url=deployment.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=completion("beta", 1)) for _ in range(1000)))

        answers = asyncio.run(flood())
        counts = {code: sum(1 for a in answers if a.status_code == code) for code in {a.status_code for a in answers}}
        assert set(counts) <= {200, 503} and counts.get(200, 0) >= 100, counts
        refused = [a for a in answers if a.status_code == 503]
        assert all("front.queue_limit" in a.json()["error"]["message"] and a.headers["retry-after"] for a in refused)
        assert len(deployment.daemons[0].child.vllm_pgids()) == 1, "more than one vLLM start"
    finally:
        deployment.close()
