"""The journal carries what an operator reads: gb10d's own probe traffic at debug priority, each decision once."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from gb10d.daemon.probe import own_access_line
from harness import Daemon, NotifySocket, Setup, free_port

OWN = '(APIServer pid=812) INFO:     127.0.0.1:51236 - "GET /health?gb10d=probe HTTP/1.1" 200 OK'


@pytest.mark.parametrize(
    ("line", "own"),
    [
        (OWN, True),
        ('(APIServer pid=812) INFO:     172.17.0.1:40112 - "POST /v1/completions?gb10d=probe HTTP/1.1" 200 OK', True),
        ('INFO:     [::1]:40112 - "GET /metrics?gb10d=probe HTTP/1.1" 200 OK', True),
        # A client's own requests, even to the same routes, are the operator's business.
        ('(APIServer pid=812) INFO:     127.0.0.1:51236 - "GET /health HTTP/1.1" 200 OK', False),
        ('(APIServer pid=812) INFO:     127.0.0.1:51236 - "GET /health?gb10d=probe&x=1 HTTP/1.1" 200 OK', False),
        ('(APIServer pid=812) INFO:     127.0.0.1:51236 - "GET /v1/models?q=gb10d=probe HTTP/1.1" 200 OK', False),
        # Not an access log line at all.
        ("(APIServer pid=812) WARNING 12-04 12:00:00 [api.py:1] someone sent gb10d=probe", False),
    ],
)
def test_only_uvicorns_access_lines_for_gb10ds_own_requests_are_its_own(line: str, own: bool) -> None:
    assert own_access_line(line) is own


@pytest.mark.slow
def test_gb10ds_own_probe_traffic_goes_to_the_journal_at_debug_priority_and_a_clients_does_not(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon]
) -> None:
    port = free_port()
    setup = Setup(
        tmp_path,
        extra={"metrics.listen": f"127.0.0.1:{port}", "liveness.health_interval_s": 0.2, "liveness.idle_probe_interval_s": 0.2},
    )
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    notify.wait_for(lambda m: m.get("READY") == "1", 90)
    httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)  # gb10d's listener fetches vLLM's /metrics for it
    httpx.get(f"http://127.0.0.1:{setup.port}/health", timeout=10)  # a client of vLLM's own
    daemon.wait_line(r'^<7>.*"GET /health\?gb10d=probe HTTP/1.1" 200')
    daemon.wait_line(r'^<7>.*"POST /v1/completions\?gb10d=probe HTTP/1.1" 200')
    daemon.wait_line(r'^<7>.*"GET /metrics\?gb10d=probe HTTP/1.1" 200')
    daemon.wait_line(r'^<6>.*"GET /health HTTP/1.1" 200')
    assert not [line for line in daemon.lines if "gb10d=probe" in line and not line.startswith("<7>")]
    assert daemon.stop() == 0


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "words"), [("no_kernel_image", "no kernels for GB10's GPU"), ("kv_insufficient", "KV cache")])
def test_a_fatal_decision_is_told_once(tmp_path: Path, notify: NotifySocket, daemons: list[Daemon], scenario: str, words: str) -> None:
    daemon = Daemon(Setup(tmp_path, scenario=scenario, extra={"restart.max_attempts": 1}), notify)
    daemons.append(daemon)
    assert daemon.wait_exit(90) != 0
    told = [line for line in daemon.own_lines() if words in line and line.startswith("<3>")]
    assert len(told) == 1, "\n".join(daemon.own_lines())
    assert notify.wait_for(lambda m: m.get("STATUS", "").startswith("failed: "))
