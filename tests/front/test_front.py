"""`gb10d front` before real `gb10d run` instances over gb10d.sim, through real sockets.

Each test starts what it needs: instances (alpha, beta) whose configs sit in the front's instances_dir, and the
front as a child process. The sim streams completions token by token, so a stream is long enough to leave or
break half-way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest

from gb10d.base.config import MemorySection
from gb10d.cmdline.status import show_all
from gb10d.daemon.lab import wait_until
from gb10d.front.lab import FrontChild
from gb10d.machine.statefile import read_state
from gb10d.sim.tokens import token_text
from harness import Daemon, NotifySocket, Setup, free_port

pytestmark = pytest.mark.slow

# More than the front reads from vLLM at once: bytes beyond it waiting in the kernel show the front stopped reading.
READ_SIZE = 65536


class Deployment:
    """A front and its instances' configs; instances are started by the test that needs them running."""

    def __init__(
        self, root: Path, front: dict[str, object] | None = None, on_demand: dict[str, object] | None = None,
        extra: dict[str, object] | None = None, each: dict[str, dict[str, object]] | None = None, front_nofile: int | None = None, **setup: Any,
    ) -> None:
        """`on_demand` and `extra` go into both instances' configs, `each` into the one it names."""
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = {**({"on_demand": on_demand} if on_demand is not None else {}), **(extra or {})}
        self.setups = {
            name: Setup(root / name, served_name=name, utilization=0.3, extra={**extra, **(each or {}).get(name, {})}, **setup)
            for name in ("alpha", "beta")
        }
        (root / "instances").mkdir()
        for name, setup in self.setups.items():
            (root / "instances" / f"{name}.toml").write_text(setup.config.read_text())
        self.metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        settings = {
            "listen": f"127.0.0.1:{self.port}", "metrics_listen": self.metrics_url.split("/")[2], "instances_dir": str(root / "instances"),
            "hold_timeout_s": 60.0, "state_file": str(root / "front-state.json"), **(front or {}),
        }
        lines = "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
        (root / "front.toml").write_text("[front]\n" + lines)
        self.daemons: list[Daemon] = []
        self.front = FrontChild(root / "front.toml", front_nofile)
        self.front.wait_line(r"serving alpha, beta on ")

    def start(self, name: str, serving: bool = True, notify: NotifySocket | None = None) -> Daemon:
        daemon = Daemon(self.setups[name], notify)
        self.daemons.append(daemon)
        if serving:
            daemon.wait_line(r"ready|serving")
            self.wait_state(name, "serving")
        return daemon

    def wait_state(self, name: str, state: str) -> None:
        def there() -> bool:
            record = read_state(self.setups[name].state_file)
            return record is not None and record.state is not None and record.state.value == state
        assert wait_until(there, 60) is not None, f"{name} never reached {state}:\n" + "\n".join(d.tail() for d in self.daemons)

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
    key, beta_only = "front-key-0123456789", "beta-only-key-0123456789"
    (tmp_path / "front.keys").write_text(f"# keys restricted to some models\n{beta_only} beta\n")
    deployment = Deployment(tmp_path, {"max_body_bytes": 4096, "api_keys": [key], "api_keys_file": str(tmp_path / "front.keys")})
    try:
        with httpx.Client(base_url=deployment.url, timeout=60) as client:
            keyless = client.post("/v1/chat/completions", json={"model": "alpha", "messages": []})
            assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "AuthenticationError"
            restricted = client.post("/v1/completions", json=completion("alpha"), headers={"x-api-key": beta_only})
            assert restricted.status_code == 403 and restricted.json()["error"]["message"] == "this API key may not use alpha; it may use beta"
            listed = client.get("/v1/models", headers={"x-api-key": beta_only})
            assert [m["id"] for m in listed.json()["data"]] == ["beta"]
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
        assert not deployment.front.out.find(key) and not deployment.front.out.find(beta_only), "the front logged an API key"
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


def upstream_unread_bytes(front_pid: int, port: int) -> int:
    """Bytes an instance sent that wait unread in the kernel on the front's connection to it (ss's Recv-Q)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "dport", f"= :{port}"], capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if f"pid={front_pid}," in line)


def test_a_slow_reader_holds_the_instance_back_instead_of_filling_the_fronts_memory(tmp_path: Path) -> None:
    """A client that stops reading a long stream (8 MB, more than Linux lets a socket buffer: tcp_wmem's 4 MiB): once
    the socket buffers between are full, the front stops reading from vLLM, whose bytes wait unread in the kernel (more
    than the front reads at once), not in the front; when the client reads again, the whole stream arrives, nothing
    lost or reordered."""
    deployment = Deployment(tmp_path, speed=0.002, extra={"vllm.args": {"max_model_len": 65536}})
    try:
        deployment.start("alpha")
        unread = lambda: upstream_unread_bytes(deployment.front.proc.pid, deployment.setups["alpha"].port)  # noqa: E731
        body = json.dumps({**completion("alpha", 40_000, stream=True), "stream_options": {"include_usage": True}}).encode()
        http = h11.Connection(h11.CLIENT)
        head = h11.Request(method="POST", target="/v1/completions", headers=[("host", "x"), ("content-type", "application/json"), ("content-length", str(len(body)))])
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", deployment.port))
            client.sendall(http.send(head) + http.send(h11.Data(data=body)) + http.send(h11.EndOfMessage()))
            assert wait_until(lambda: unread() > READ_SIZE, 60) is not None, f"the front kept reading vLLM's stream for a client that reads nothing ({unread()} bytes unread)"
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            pieces: list[bytes] = []
            while not isinstance(event := http.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    http.receive_data(client.recv(65536))
                elif isinstance(event, h11.Data):
                    pieces.append(event.data)
        received = b"".join(pieces).decode()
    finally:
        deployment.close()
    payloads = [json.loads(line[len("data: "):]) for line in received.split("\n") if line.startswith("data: {")]
    text = "".join(choice["text"] for payload in payloads for choice in payload["choices"])
    tokens = payloads[-1]["usage"]["completion_tokens"]
    assert tokens == 40_000 and text == "".join(token_text(i) for i in range(tokens))


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


@pytest.mark.parametrize("cause", ["crash", "reload"])
def test_a_restart_of_vllm_is_only_a_wait_for_clients(deployment: Deployment, cause: str) -> None:
    """Requests every 50 ms across vLLM's crash and gb10d's restart, or across a reload whose change restarts vLLM
    (gpu_memory_utilization): none refused, none failed."""
    daemon = deployment.start("alpha")
    statuses: list[int] = []
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        record = read_state(deployment.setups["alpha"].state_file)
        assert record is not None and record.vllm_pid is not None
        first_vllm = record.vllm_pid
        if cause == "crash":
            os.killpg(first_vllm, signal.SIGKILL)
        else:
            deployment.setups["alpha"].utilization = 0.35
            deployment.setups["alpha"].write_config()
            os.kill(daemon.proc.pid, signal.SIGHUP)

        def restarted() -> bool:
            statuses.append(client.post("/v1/completions", json=completion("alpha", 2)).status_code)
            now = read_state(deployment.setups["alpha"].state_file)
            return now is not None and now.vllm_pid not in (None, first_vllm) and now.state is not None and now.state.value == "serving"

        assert wait_until(restarted, 90) is not None, daemon.tail()
        statuses.append(client.post("/v1/completions", json=completion("alpha", 2)).status_code)
    assert set(statuses) == {200}, statuses
    deployment.front.wait_line(r"holding requests for alpha")


def test_a_flood_for_a_starting_model_is_held_up_to_the_bound_and_the_rest_refused_at_once(tmp_path: Path) -> None:
    """1,000 requests at once for a model that is starting: one vLLM start, `queue_limit` held (and shown by
    `gb10d status --all`), the rest refused at once; the held ones are answered once it serves."""
    # beta's load waits at this gate until the flood is held: the test, not the machine's speed, decides how long it starts.
    gate = tmp_path / "load-gate"
    # Held there, the load makes no progress: gb10d must not take it for a stall.
    deployment = Deployment(tmp_path, {"queue_limit": 100}, sim_env={"GB10D_SIM_LOAD_GATE": str(gate)}, extra={"startup.stall_timeout_s": 600.0})
    try:
        deployment.start("beta", serving=False)
        assert wait_until(lambda: read_state(deployment.setups["beta"].state_file) is not None, 60) is not None

        async def flood() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=1000)
            async with httpx.AsyncClient(base_url=deployment.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json=completion("beta", 1)) for _ in range(1000)))

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            flooding = pool.submit(asyncio.run, flood())
            assert wait_until(lambda: re.search(r"\nbeta +beta +starting\S* .* 100 +\d+s\n", status_all(tmp_path)) is not None, 60) is not None, status_all(tmp_path)
            gate.touch()
            answers = flooding.result()
        counts = {code: sum(1 for a in answers if a.status_code == code) for code in {a.status_code for a in answers}}
        assert set(counts) <= {200, 503} and counts.get(200, 0) >= 100, counts
        refused = [a for a in answers if a.status_code == 503]
        assert all("front.queue_limit" in a.json()["error"]["message"] and a.headers["retry-after"] for a in refused)
        assert len(deployment.daemons[0].child.vllm_pgids()) == 1, "more than one vLLM start"
        # Hundreds of refusals are one line, then sums with their count: the journal stays readable.
        assert len(deployment.front.out.find(r"rejected a request for beta")) <= 3, deployment.front.out.tail()
    finally:
        deployment.close()


def status_all(root: Path) -> str:
    """What `gb10d status --all` prints for the deployment's front (no instance in a ledger here)."""
    out = io.StringIO()
    show_all(MemorySection(ledger_dir=str(root / "ledger")), root / "run" / "state.json", out=out, front=root / "front-state.json")
    return out.getvalue()
