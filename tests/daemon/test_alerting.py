"""[alerts]: which journal events go out, in which body, and delivery to real local HTTP receivers.

The receivers are real HTTP servers on loopback: one that answers, one that
answers 500, one that hangs until the test lets it go.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gb10d.base.command import url_shown
from gb10d.base.config import AlertsSection, Webhook
from gb10d.daemon.alerting import AlertSender, alert_for, expand, render
from harness import Daemon, NotifySocket, Setup, wait_until

GAVE_UP = "giving up after 3 failed starts (last: CUDA out of memory); fix the cause, then: systemctl restart gb10d"


@dataclass
class Receiver:
    """A loopback HTTP server that records each POST and answers `status`, or hangs until `release` is set."""

    status: int = 200
    hang: bool = False
    posts: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    arrived: threading.Event = field(default_factory=threading.Event)

    def start(self) -> str:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append((self.path, dict(self.headers), body))
                receiver.arrived.set()
                if receiver.hang:
                    receiver.release.wait(30)
                self.send_response(receiver.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for receiver in made:
        receiver.stop()


def receiver(receivers: list[Receiver], **kwargs: object) -> tuple[Receiver, str]:
    made = Receiver(**kwargs)  # type: ignore[arg-type]
    receivers.append(made)
    return made, made.start()


@pytest.mark.parametrize(
    ("kind", "fields", "name"),
    [
        ("gave_up", {"exit_status": 75}, "gave_up"),
        ("gave_up", {"exit_status": 76}, "memory_not_returned"),
        ("stall_detected", {"attempt": 1}, "stall"),
        ("load_strategy_changed", {"attempt": 1, "cause": "stall"}, None),
        ("engine_hung", {"attempt": 1}, "stall"),
        ("driver_oom", {"attempt": 1}, "driver_oom"),
        ("gpu_xid", {"xid": 13}, "gpu_xid"),
        ("ready", {"attempt": 2}, "recovered"),
        ("ready", {"attempt": 1}, None),
        ("free_memory_retry", {"attempt": 1}, None),
    ],
)
def test_the_journal_events_that_are_alerts(kind: str, fields: dict[str, object], name: str | None) -> None:
    alert = alert_for(kind, "the journal's line", fields, "chat", "spark-1", 100.0)
    assert (alert.name if alert else None) == name


def test_each_format_carries_the_journal_line_with_the_cause_the_numbers_and_the_fix() -> None:
    alert = alert_for("gave_up", GAVE_UP, {"exit_status": 75, "attempt": 3, "cause": None}, "chat", "spark-1", 100.0)
    assert alert is not None
    headers, body = render(alert, "json")
    assert headers["Content-Type"] == "application/json"
    assert json.loads(body) == {
        "alert": "gave_up", "title": "gb10d on spark-1: gave up", "message": GAVE_UP, "instance": "chat", "host": "spark-1",
        "time": 100.0, "fields": {"exit_status": 75, "attempt": 3},
    }
    headers, body = render(alert, "ntfy")
    assert (headers["Title"], headers["Priority"], body.decode()) == ("gb10d on spark-1: gave up", "high", GAVE_UP)
    headers, body = render(alert, "slack")
    assert json.loads(body) == {"text": f"*gb10d on spark-1: gave up*\n{GAVE_UP}"}


def test_a_webhook_is_shown_without_the_tokens_in_its_path_query_or_user() -> None:
    assert url_shown("https://user:pw@hooks.slack.com:8443/services/T0/B0/s3cret?token=t0k") == "https://hooks.slack.com:8443/…"


def test_variables_come_from_the_environment_and_unknown_ones_stay_as_written() -> None:
    assert expand("Bearer ${ALERT_TOKEN} ${MISSING}", {"ALERT_TOKEN": "t0k"}) == "Bearer t0k ${MISSING}"


def sender(hooks: list[Webhook], dropped: list[str], environ: dict[str, str] | None = None, **section: object) -> AlertSender:
    config = AlertsSection(webhooks=hooks, timeout_s=0.5, retries=2, retry_initial_s=0.05, **section)  # type: ignore[arg-type]
    return AlertSender(config, "chat", lambda: environ or {}, dropped.append)


def test_an_alert_reaches_every_webhook_in_its_format_with_a_token_from_the_environment(receivers: list[Receiver]) -> None:
    plain, plain_url = receiver(receivers)
    ntfy, ntfy_url = receiver(receivers)
    dropped: list[str] = []
    hooks = [
        Webhook(url=plain_url + "/hook", headers={"Authorization": "Bearer ${ALERT_TOKEN}"}),
        Webhook(url=ntfy_url + "/${TOPIC}", format="ntfy"),
    ]
    alerts = sender(hooks, dropped, {"ALERT_TOKEN": "t0k", "TOPIC": "gb10"})
    alerts.journaled("driver_oom", "the NVIDIA driver ran out of memory; restarting with 0.75", {"attempt": 1})
    alerts.close(30)
    assert [(p, h["Authorization"], json.loads(b)["alert"]) for p, h, b in plain.posts] == [("/hook", "Bearer t0k", "driver_oom")]
    assert [(p, h["Title"]) for p, h, _ in ntfy.posts] == [("/gb10", f"gb10d on {json.loads(plain.posts[0][2])['host']}: NVIDIA driver out of memory")]
    assert dropped == []


def test_a_receiver_that_answers_500_is_retried_then_dropped_with_one_line_that_shows_no_token(receivers: list[Receiver]) -> None:
    failing, url = receiver(receivers, status=500)
    dropped: list[str] = []
    alerts = sender([Webhook(url=url + "/services/s3cret")], dropped)
    alerts.journaled("gave_up", GAVE_UP, {"exit_status": 75})
    alerts.close(30)
    assert len(failing.posts) == 3, "the first try and two retries"
    assert dropped == [f"alert gave_up not delivered to {url}/… after 3 tries (last: HTTP 500); dropped"]
    assert "s3cret" not in dropped[0]


def test_a_hanging_receiver_never_holds_up_the_caller_and_times_out(receivers: list[Receiver]) -> None:
    hanging, url = receiver(receivers, hang=True)
    dropped: list[str] = []
    alerts = sender([Webhook(url=url)], dropped)
    alerts.journaled("gpu_xid", "NVIDIA Xid 13", {"xid": 13})
    assert hanging.arrived.wait(30)
    alerts.journaled("gpu_xid", "NVIDIA Xid 31", {"xid": 31})
    # Both calls returned while the receiver holds the first request: a caller that waited would have seen it dropped.
    assert dropped == []
    alerts.close(30)
    assert [line.split(" (last: ")[1] for line in dropped] == ["ReadTimeout); dropped", "ReadTimeout); dropped"]


@pytest.mark.slow
def test_gb10d_run_alerts_a_recovery_and_memory_that_was_not_returned(
    tmp_path: Path, notify: NotifySocket, daemons: list[Daemon], receivers: list[Receiver]
) -> None:
    hook, url = receiver(receivers)
    env_file = tmp_path / "vllm.env"
    env_file.write_text("ALERT_TOKEN=t0k\n")
    setup = Setup(
        tmp_path, free_gib=103.45, utilization=0.92,
        extra={"memory.preflight": False, "vllm.env_file": str(env_file),
               "alerts": {"webhooks": [{"url": url + "/gb10d", "headers": {"Authorization": "Bearer ${ALERT_TOKEN}"}}]}},
    )
    daemon = Daemon(setup, notify)
    daemons.append(daemon)
    notify.wait_for(lambda m: m.get("READY") == "1", 90)
    wait_until(lambda: len(hook.posts) == 1, 30, "the recovery's alert")
    path, headers, body = hook.posts[0]
    alert = json.loads(body)
    assert (path, headers["Authorization"], alert["alert"], alert["fields"]["attempt"]) == ("/gb10d", "Bearer t0k", "recovered", 2)
    assert daemon.stop() == 0

    setup.scenario = "cuda_oom_during=profile,leak_gib=40"
    setup.extra["memory.recovery_timeout_s"] = 2.0
    setup.write_config()
    again = Daemon(setup, notify)
    daemons.append(again)
    assert again.wait_exit(120) == 76
    # Sent before gb10d exited: the give-up's alert is not lost with the process.
    names = [json.loads(b)["alert"] for _, _, b in hook.posts]
    assert names == ["recovered", "memory_not_returned"]
    assert "memory was not returned after vLLM exited" in json.loads(hook.posts[1][2])["message"]
    assert "t0k" not in "".join(again.lines + daemon.lines) and "t0k" not in setup.state_file.read_text()
