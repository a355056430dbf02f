"""`gb10d front` tried as the network tries an endpoint: a port that refuses while its state says serving, idle
connections past the open-file limit, a taken port, vLLM's admin routes, held streams, request shapes, a SIGTERM
under load. Real processes throughout: the front, `gb10d run` instances over gb10d.sim, raw sockets.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gb10d.daemon.lab import wait_until
from gb10d.machine.procs import cpu_seconds
from gb10d.machine.statefile import read_state
from test_front import Deployment, completion

pytestmark = pytest.mark.slow


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    yield d
    d.close()


def test_a_port_that_refuses_while_the_state_says_serving_costs_no_cpu_and_the_request_is_answered_once_it_serves(deployment: Deployment) -> None:
    """vLLM died and its gb10d has not written yet (here: gb10d stopped by SIGSTOP): the held request retries with
    a back-off, the front's CPU over 5 s stays under 0.5 s, and the answer comes once gb10d has restarted vLLM."""
    daemon = deployment.start("alpha")
    record = read_state(deployment.setups["alpha"].state_file)
    assert record is not None and record.vllm_pid is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        os.killpg(record.vllm_pid, signal.SIGKILL)
        assert wait_until(lambda: not _listening(deployment.setups["alpha"].port), 30) is not None
        answers: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answers.append(httpx.post(f"{deployment.url}/v1/completions", json=completion("alpha", 2), timeout=120)))
        asking.start()
        deployment.front.wait_line(r"holding requests for alpha: it is restarting: its address refused")
        before = cpu_seconds(deployment.front.proc.pid)
        asking.join(5)
        spent = cpu_seconds(deployment.front.proc.pid) - before
        assert asking.is_alive(), "the request was answered while vLLM was down"
        assert spent < 0.5, f"the front spent {spent:.2f} CPU-seconds in 5 s on a port that refuses"
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    asking.join(120)
    assert [a.status_code for a in answers] == [200], [a.text for a in answers]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_idle_connections_past_the_open_file_limit_never_stop_a_new_request(tmp_path: Path) -> None:
    """1,100 idle client connections to a front whose open-file limit is 1,024: the oldest idle ones are closed to
    make room, a request is still answered, and the journal says so in a few lines, not a line per connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    deployment = Deployment(tmp_path, front_nofile=1024)
    idle: list[socket.socket] = []
    try:
        deployment.start("alpha")
        line = deployment.front.wait_line(r"up to (\d+) connections \(open-file limit 1024\)")
        cap = int(re.search(r"up to (\d+) connections", line).group(1))  # type: ignore[union-attr]
        assert cap < 1024
        for _ in range(1100):
            idle.append(socket.create_connection(("127.0.0.1", deployment.port)))
        started = time.monotonic()
        answer = httpx.post(f"{deployment.url}/v1/completions", json=completion("alpha", 2), timeout=30)
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started < 10
        deployment.front.wait_line(r"closed the oldest idle connection to make room")
        assert wait_until(lambda: deployment.front.out.find(r"more like this") is not None or len(deployment.front.out.texts()) < 50, 15) is not None
        assert len(deployment.front.out.texts()) < 50, deployment.front.out.tail()
        assert not deployment.front.out.find("Traceback") and not deployment.front.out.find("Too many open files")
    finally:
        for sock in idle:
            sock.close()
        deployment.close()


def test_a_taken_port_is_one_line_naming_its_holder_and_exit_75_not_a_traceback(tmp_path: Path) -> None:
    instances = tmp_path / "instances"
    instances.mkdir()
    (instances / "alpha.toml").write_text('[vllm]\nmodel = "m"\nexecutable = "/bin/true"\nport = 8101\n')
    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        (tmp_path / "front.toml").write_text(f'[front]\nlisten = "127.0.0.1:{port}"\ninstances_dir = "{instances}"\nmetrics_listen = ""\n')
        done = subprocess.run([sys.executable, "-m", "gb10d", "--config", str(tmp_path / "front.toml"), "front"], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 75, out
    assert "Traceback" not in out
    lines = [line for line in out.splitlines() if "cannot listen" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and f"pid {os.getpid()}" in lines[0], out


ADMIN = ["/sleep?level=1", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/v1/load_lora_adapter", "/start_profile", "/is_sleeping"]


def test_vllms_admin_routes_are_answered_by_the_front_and_never_reach_vllm(tmp_path: Path) -> None:
    """With park = "sleep" vLLM runs with its development routes on; through the front, /sleep and the others get
    403 and vLLM never sees them: it still serves, awake."""
    deployment = Deployment(tmp_path, on_demand={"idle_timeout_s": 600.0, "park": "sleep"})
    try:
        deployment.start("alpha")
        with httpx.Client(base_url=deployment.url, timeout=30) as client:
            for path in ADMIN:
                answer = client.post(path, json={"model": "alpha", "method": "reload_weights", "lora_name": "x", "lora_path": "/x"})
                assert answer.status_code == 403, (path, answer.text)
                assert "admin routes" in answer.json()["error"]["message"]
            unknown = client.get("/docs")
            assert unknown.status_code == 404 and "not a route this endpoint serves" in unknown.json()["error"]["message"]
            assert client.post("/v1/completions", json=completion("alpha", 2)).status_code == 200
        direct = httpx.get(f"http://127.0.0.1:{deployment.setups['alpha'].port}/is_sleeping", timeout=30)
        assert direct.json() == {"is_sleeping": False}
        record = read_state(deployment.setups["alpha"].state_file)
        assert record is not None and record.state is not None and record.state.value == "serving"
        seen = "\n".join(deployment.daemons[0].lines)
        for path in ADMIN:
            assert f'"POST {path.split("?")[0]}' not in seen, f"vLLM saw {path}"
    finally:
        deployment.close()


def test_a_held_stream_gets_its_head_at_once_and_a_comment_naming_the_phase(tmp_path: Path) -> None:
    """A `stream: true` request for a model that is starting gets 200 and an SSE comment while it waits, then
    vLLM's events: clients and proxies before the front see it alive."""
    gate = tmp_path / "load-gate"
    deployment = Deployment(tmp_path, sim_env={"GB10D_SIM_LOAD_GATE": str(gate)}, extra={"startup.stall_timeout_s": 600.0})
    try:
        deployment.start("beta", serving=False)
        assert wait_until(lambda: read_state(deployment.setups["beta"].state_file) is not None, 60) is not None
        with httpx.Client(base_url=deployment.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json=completion("beta", 4, stream=True)) as response:
                assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
                lines = response.iter_lines()
                first = next(lines)
                assert re.match(r": beta is (starting|waiting)", first), first
                gate.touch()
                rest = [line for line in lines if line]
        comments = [line for line in rest if line.startswith(":")]
        events = [line for line in rest if not line.startswith(":")]
        assert all(re.match(r": beta is ", line) for line in comments), comments
        assert events[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in events) and len(events) == 5, rest
    finally:
        deployment.close()


def test_request_shapes_are_routed_json_without_a_content_type_a_model_card_and_a_multipart_form(deployment: Deployment) -> None:
    deployment.start("alpha")
    deployment.start("beta")
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        bare = client.post("/v1/completions", content=json.dumps(completion("beta", 2)).encode(), headers={"content-type": ""})
        assert bare.status_code == 200 and bare.json()["model"] == "beta", bare.text
        card = client.get("/v1/models/alpha")
        assert card.status_code == 200 and card.json()["id"] == "alpha" and card.json()["gb10d_state"] == "serving"
        assert client.get("/v1/models/nope").status_code == 404
        form = client.post("/v1/audio/transcriptions", data={"model": "beta"}, files={"file": ("a.wav", b"RIFF" + b"\0" * 200_000, "audio/wav")})
        # The form's model field routed it to beta's vLLM, which answers for itself: not the front's 400 for a
        # request that names no model among several.
        assert form.status_code != 400 and "names no" not in form.text, form.text
        nameless = client.post("/v1/completions", json={"prompt": "x"})
        assert nameless.status_code == 400 and "serves several" in nameless.json()["error"]["message"]
        head = client.head("/health")
        assert head.status_code == 200
        options = client.options("/v1/completions")
        assert options.status_code == 204 and "POST" in options.headers["allow"]
        assert "access-control-allow-origin" not in options.headers


def test_sigterm_lets_a_stream_in_flight_finish_and_exits_0(deployment: Deployment) -> None:
    deployment.start("alpha")
    with httpx.Client(base_url=deployment.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=completion("alpha", 300, stream=True)) as response:
            chunks = response.iter_raw()
            assert next(chunks).startswith(b"data: ")
            deployment.front.proc.send_signal(signal.SIGTERM)
            rest = b"".join(chunks).decode()
    assert rest.rstrip().endswith("data: [DONE]")
    assert deployment.front.proc.wait(60) == 0
    deployment.front.wait_line(r"stopping: no new connections")
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{deployment.url}/health", timeout=5)


def test_the_instances_key_is_sent_upstream_and_the_clients_credentials_are_not(tmp_path: Path) -> None:
    """The instance's vLLM demands a key only the front holds; clients use the front's own key."""
    front_key, instance_key = "front-key-0123456789", "instance-key-0123456789"
    deployment = Deployment(tmp_path, {"api_keys": [front_key]}, each={"alpha": {"vllm.args.api_key": instance_key}})
    try:
        deployment.start("alpha")
        with httpx.Client(base_url=deployment.url, timeout=60, headers={"authorization": f"Bearer {front_key}"}) as client:
            answer = client.post("/v1/completions", json=completion("alpha", 2))
        assert answer.status_code == 200, answer.text
        refused = httpx.post(f"http://127.0.0.1:{deployment.setups['alpha'].port}/v1/completions", json=completion("alpha", 2), headers={"authorization": f"Bearer {front_key}"})
        assert refused.status_code == 401, "the instance took the front's key: the test proves nothing"
    finally:
        deployment.close()


def test_a_body_is_not_read_before_its_key_is_checked(tmp_path: Path) -> None:
    """401 comes on the headers alone, without `100 Continue`: a client without a key uploads nothing."""
    deployment = Deployment(tmp_path, {"api_keys": ["front-key-0123456789"]})
    try:
        with socket.create_connection(("127.0.0.1", deployment.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 60000000\r\nexpect: 100-continue\r\n\r\n")
            client.settimeout(30)
            answer = client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 401"), answer
        assert b"100 Continue" not in answer
    finally:
        deployment.close()


def test_a_slow_header_sender_is_cut_off_after_the_idle_timeout(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path, {"idle_timeout_s": 1.0})
    try:
        with socket.create_connection(("127.0.0.1", deployment.port)) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            client.settimeout(30)
            started = time.monotonic()
            assert client.recv(65536) == b""
            assert time.monotonic() - started < 15
    finally:
        deployment.close()


def running_requests(port: int) -> float:
    """vllm:num_requests_running as the instance's vLLM reports it."""
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_request_vllm_had_not_answered_when_a_reload_stops_it_is_held_again_and_the_stop_waits_for_nothing(tmp_path: Path) -> None:
    """vLLM (uvicorn) waits at its shutdown for the connections of requests it never answered: a plain completion
    under way when the reload's SIGTERM comes would keep vLLM alive until gb10d's SIGKILL (stop_timeout_s). The
    front drops it as the instance leaves serving and holds it again: vLLM stops at once, the request is answered
    by the new vLLM, and gb10d never escalates to SIGKILL."""
    deployment = Deployment(tmp_path, speed=0.05, extra={"daemon.stop_timeout_s": 120.0})
    try:
        daemon = deployment.start("alpha")
        port = deployment.setups["alpha"].port
        answers: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: answers.append(httpx.post(f"{deployment.url}/v1/completions", json=completion("alpha", 4000), timeout=300)))
        asking.start()
        assert wait_until(lambda: running_requests(port) >= 1, 60) is not None, "the completion never reached vLLM"
        deployment.setups["alpha"].utilization = 0.35
        deployment.setups["alpha"].write_config()
        os.kill(daemon.proc.pid, signal.SIGHUP)
        asking.join(300)
        assert [a.status_code for a in answers] == [200], [a.text[:300] for a in answers]
        lines = "\n".join(daemon.lines)
        assert "sending SIGKILL" not in lines, daemon.tail()
        deployment.front.wait_line(r"alpha left serving before it answered; its requests wait for it again")
    finally:
        deployment.close()
