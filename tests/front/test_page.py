"""The front's page over HTTP, as a browser and a script reach it: `gb10d front` before real `gb10d run` instances
over gb10d.sim. Its routes and who may use them (the key rules of /v1/models; without keys, actions from this
machine only), the live stream (a change within a second or two, never more than once a second), its recent
decisions, and a stop that an open page does not hold up. The page in a browser: tests/front/test_page_browser.py.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gb10d.core.statefile import DaemonState
from gb10d.daemon.lab import wait_until
from gb10d.machine.statefile import read_state
from harness import free_port
from test_front import Deployment

pytestmark = pytest.mark.slow

KEY = "front-key-for-every-model"
ALPHA_KEY = "front-key-for-alpha-only"
PAGE = {"x-gb10d-page": "1"}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def first_event(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    with httpx.stream("GET", url + "/ui/events", headers=headers, timeout=10) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        for line in stream.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])  # type: ignore[no-any-return]
    raise AssertionError("the stream ended without an event")


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[Deployment]:
    deployment = Deployment(tmp_path, {"api_keys": [KEY, f"{ALPHA_KEY} alpha"]}, each={"alpha": {"on_demand": {"idle_timeout_s": 600}}})
    yield deployment
    deployment.close()


def test_browsers_are_sent_to_the_page_and_its_files_need_no_key(keyed: Deployment) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        sent = client.get("/", headers={"accept": "text/html,application/xhtml+xml"})
        assert sent.status_code == 302 and sent.headers["location"] == "/ui/"
        assert client.get("/").status_code == 404, "a script's GET / is answered as before"
        assert client.get("/ui").headers["location"] == "/ui/"
        page = client.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html") and "/ui/page.js" in page.text
        assert client.get("/ui/page.js").headers["content-type"].startswith("text/javascript")
        assert "set-cookie" not in page.headers


def test_with_keys_the_pages_data_follows_the_key_rules_of_the_model_list(keyed: Deployment) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10) as client:
        assert client.get("/ui/data").status_code == 401
        assert client.get("/ui/events").status_code == 401
        assert client.get("/ui/data", headers=bearer("not-a-key-of-this-front")).status_code == 401
        every = client.get("/ui/data", headers=bearer(KEY)).json()
        assert [c["instance"] for c in every["cards"]] == ["alpha", "beta"] and every["keyed"] is True
        assert every["memory"] is not None
        assert 'Authorization: Bearer $KEY' in every["cards"][0]["curl"]
        alpha = client.get("/ui/data", headers=bearer(ALPHA_KEY)).json()
        assert [c["instance"] for c in alpha["cards"]] == ["alpha"]
        assert alpha["memory"] is None, "the machine's memory shows what every model holds: only for a key that may see them all"
        assert all(d["who"] == "alpha" for d in alpha["decisions"]), "the front's lines name every model"
        assert any(d["who"] == "front" for d in every["decisions"])
        assert [c["instance"] for c in first_event(keyed.url, bearer(ALPHA_KEY))["cards"]] == ["alpha"]
        # With keys, a valid key may act from anywhere; a key for alpha may not act on beta.
        refused = client.post("/ui/actions/beta/wake", headers={**PAGE, **bearer(ALPHA_KEY)})
        assert refused.status_code == 403 and "beta" in refused.json()["error"]["message"]


def test_actions_are_refused_without_the_pages_header_and_for_what_cannot_be_woken(keyed: Deployment) -> None:
    with httpx.Client(base_url=keyed.url, timeout=10, headers=bearer(KEY)) as client:
        assert client.post("/ui/actions/alpha/wake").status_code == 403, "another site's form cannot send the page's header"
        pinned = client.post("/ui/actions/beta/park", headers=PAGE)
        assert pinned.status_code == 409 and "pinned" in pinned.json()["error"]["message"]
        gone = client.post("/ui/actions/beta/restart", headers=PAGE)
        assert gone.status_code == 502 and "systemctl restart gb10d@beta" in gone.json()["error"]["message"], "no gb10d@beta runs"
        assert client.post("/ui/actions/gamma/wake", headers=PAGE).status_code == 404
        assert client.post("/ui/actions/alpha/explode", headers=PAGE).status_code == 404
        assert client.get("/ui/actions/alpha/wake", headers=PAGE).status_code == 404


def this_machines_address() -> str | None:
    """An address of this machine that is not loopback (the one its default route leaves from), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.200", 9))
            address = str(probe.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_without_keys_only_this_machine_may_act_and_a_woken_model_shows_on_the_stream_within_two_seconds(tmp_path: Path) -> None:
    address = this_machines_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    port = free_port()
    deployment = Deployment(tmp_path, {"listen": f"0.0.0.0:{port}"}, each={"alpha": {"on_demand": {"idle_timeout_s": 600}}})
    local, remote = f"http://127.0.0.1:{port}", f"http://{address}:{port}"
    try:
        alpha = deployment.start("alpha", serving=False)
        deployment.wait_state("alpha", "parked")
        # A restart of a parked model has nothing to restart: its gb10d says so, and it stays parked.
        assert httpx.post(local + "/ui/actions/alpha/restart", headers=PAGE, timeout=10).status_code == 202
        alpha.wait_line(r"asked to restart vLLM while parked: no vLLM runs, nothing to restart")
        refused = httpx.post(remote + "/ui/actions/alpha/wake", headers=PAGE, timeout=10)
        assert refused.status_code == 403 and "loopback" in refused.json()["error"]["message"]
        assert httpx.get(remote + "/ui/data", timeout=10).status_code == 200, "the data is as open as /v1/models"

        events: list[tuple[float, dict[str, Any]]] = []
        with httpx.stream("GET", local + "/ui/events", timeout=30) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append((time.monotonic(), json.loads(line[6:])))
                    break
            assert events[0][1]["cards"][0]["state"] == "parked"
            woken = httpx.post(local + "/ui/actions/alpha/wake", headers=PAGE, timeout=10)
            assert woken.status_code == 202, woken.text
            asked = time.monotonic()
            for line in lines:
                assert time.monotonic() - asked < 60, f"alpha was not serving 60 s after the wake: {[e[1]['cards'][0]['state'] for e in events]}"
                if line.startswith("data: "):
                    events.append((time.monotonic(), json.loads(line[6:])))
                    if events[-1][1]["cards"][0]["state"] == "serving":
                        break
        states = [e[1]["cards"][0]["state"] for e in events]
        assert "starting" in states, states
        assert events[-1][0] - asked < 30
        gaps = [b[0] - a[0] for a, b in zip(events, events[1:])]
        assert all(gap >= 0.9 for gap in gaps), f"at most one event a second: {gaps}"
        decisions: list[dict[str, Any]] = []

        def told() -> bool:
            decisions[:] = httpx.get(local + "/ui/data", timeout=10).json()["decisions"]
            return any(d["who"] == "alpha" and d["line"].startswith("vLLM is ready") for d in decisions)

        # The instance's decision that it serves reaches its state file within a second of its journal line.
        assert wait_until(told, 10) is not None, decisions
        assert any(d["who"] == "front" and "asked to wake alpha from the page" in d["line"] for d in decisions), decisions
    finally:
        deployment.close()


def test_a_page_left_open_does_not_hold_up_the_fronts_stop(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path, {"drain_timeout_s": 60.0})
    try:
        with httpx.stream("GET", deployment.url + "/ui/events", timeout=30) as stream:
            next(stream.iter_lines())
            stopped = time.monotonic()
            deployment.front.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: deployment.front.proc.poll() is not None, 20) is not None
            assert deployment.front.proc.returncode == 0
            assert time.monotonic() - stopped < 10
    finally:
        deployment.close()


def test_a_restart_from_the_page_stops_vllm_and_starts_it_again_without_counting_a_failure(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path)
    try:
        beta = deployment.start("beta")
        before = read_state(deployment.setups["beta"].state_file)
        assert before is not None and before.vllm_pid is not None
        card = httpx.get(deployment.url + "/ui/data", timeout=10).json()["cards"][1]
        assert card["instance"] == "beta" and card["can_restart"] and not card["can_park"], "a pinned instance is restarted, never parked"
        asked = httpx.post(deployment.url + "/ui/actions/beta/restart", headers=PAGE, timeout=10)
        assert asked.status_code == 202, asked.text
        beta.wait_line(r"restarting vLLM \(.*\): asked over the control socket; a new start, no failure counted")
        deployment.front.wait_line(r"asked beta to restart vLLM from the page \(127\.0\.0\.1\)")

        def serving_anew() -> bool:
            state = read_state(deployment.setups["beta"].state_file)
            return state is not None and state.state is DaemonState.SERVING and state.vllm_pid not in (None, before.vllm_pid)

        assert wait_until(serving_anew, 60) is not None, beta.tail()
        after = read_state(deployment.setups["beta"].state_file)
        assert after is not None and after.last_failure is None
        reply = httpx.post(deployment.url + "/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 200
    finally:
        deployment.close()


def test_the_pages_reads_of_vllms_metrics_are_gb10ds_own_and_reach_the_instances_journal_at_debug(tmp_path: Path) -> None:
    # gb10d's own liveness reads of /metrics wait 10 minutes: the reads seen here are the page's.
    quiet = {"liveness.health_interval_s": 600, "liveness.idle_probe_interval_s": 600}
    deployment = Deployment(tmp_path, extra=quiet)
    try:
        alpha = deployment.start("alpha")
        since = len(alpha.lines)
        with httpx.stream("GET", deployment.url + "/ui/events", timeout=30) as stream:
            next(stream.iter_lines())  # an open page reads each serving instance's /metrics at once, then every 10 s
            alpha.wait_line(r'^<\d>.*"GET /metrics[?\w=]* HTTP/1.1" 200', timeout=30, since=since)
        read = [line for line in alpha.lines[since:] if '"GET /metrics' in line]
        assert read and all(line.startswith("<7>") and "/metrics?gb10d=probe " in line for line in read), read
    finally:
        deployment.close()
