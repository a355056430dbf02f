"""Alerts gb10d sends itself, for a machine that no Prometheus watches: `[alerts]` webhooks.

The core is pure: which journal events are alerts (`alert_for`), what a
webhook receives in each format (`render`); `url_shown` (gb10d.base.command)
shows a URL without its secrets. The shell, `AlertSender`, posts from a thread of its
own: supervision only puts an alert on a queue and never waits for a
receiver, and a receiver that hangs or fails costs retries in that thread,
then one journal line.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from ..base.backoff import pauses
from ..base.command import url_shown
from ..base.config import AlertsSection, Webhook

# The journal's event kinds that are alerts, with the name an alert goes out under.
ALERT_KINDS: Mapping[str, str] = {
    "gave_up": "gave_up",
    "stall_detected": "stall",
    "engine_hung": "stall",
    "driver_oom": "driver_oom",
    "gpu_xid": "gpu_xid",
}
# gb10d's exit status when memory was not returned after vLLM exited (gb10d.base.errors.EXIT_MEMORY_NOT_RETURNED).
_MEMORY_NOT_RETURNED = 76
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class Alert:
    """One alert: what happened (the journal's line: cause, numbers, fix), where, and its figures."""

    name: str
    message: str
    instance: str
    host: str
    at: float
    fields: tuple[tuple[str, object], ...] = ()


def alert_for(kind: str, message: str, fields: Mapping[str, object], instance: str, host: str, now: float) -> Alert | None:
    """The alert a journal event raises, or None: a give-up (memory not returned named as such), a stall,
    a driver out-of-memory or Xid, and ready again on a later attempt (after a recovery)."""
    if kind == "ready":
        attempt = fields.get("attempt")
        name = "recovered" if isinstance(attempt, int) and attempt > 1 else None
    elif kind == "gave_up" and fields.get("exit_status") == _MEMORY_NOT_RETURNED:
        name = "memory_not_returned"
    else:
        name = ALERT_KINDS.get(kind)
    if name is None:
        return None
    kept = tuple((key, value) for key, value in fields.items() if value is not None)
    return Alert(name, message, instance, host, now, kept)


def title(alert: Alert) -> str:
    words = {
        "gave_up": "gave up", "memory_not_returned": "memory not returned", "stall": "vLLM stalled",
        "driver_oom": "NVIDIA driver out of memory", "gpu_xid": "NVIDIA Xid", "recovered": "ready again after a recovery",
    }
    return f"gb10d on {alert.host}: {words.get(alert.name, alert.name)}"


def render(alert: Alert, style: str) -> tuple[dict[str, str], bytes]:
    """The headers and body a webhook of this format receives: plain JSON, ntfy (text with a title), or Slack's {"text"}."""
    if style == "ntfy":
        priority = "default" if alert.name == "recovered" else "high"
        tags = "white_check_mark" if alert.name == "recovered" else "warning"
        return {"Title": title(alert), "Priority": priority, "Tags": tags, "Content-Type": "text/plain; charset=utf-8"}, alert.message.encode()
    if style == "slack":
        return {"Content-Type": "application/json"}, json.dumps({"text": f"*{title(alert)}*\n{alert.message}"}).encode()
    body = {
        "alert": alert.name, "title": title(alert), "message": alert.message, "instance": alert.instance,
        "host": alert.host, "time": alert.at, "fields": dict(alert.fields),
    }
    return {"Content-Type": "application/json"}, json.dumps(body, default=str).encode()


def expand(text: str, environ: Mapping[str, str]) -> str:
    """`${NAME}` from gb10d's environment (systemd's EnvironmentFile=, or vllm.env_file); unknown names stay as written."""
    return _VARIABLE.sub(lambda m: environ.get(m.group(1), m.group(0)), text)


def retry_delays(retries: int, first_s: float) -> list[float]:
    """The pauses before each retry: doubling from `first_s`."""
    return list(itertools.islice(pauses(first_s), retries))


class AlertSender:
    """Posts alerts to the configured webhooks from one background thread; `send` never blocks."""

    def __init__(self, section: AlertsSection, instance: str, environ: Callable[[], Mapping[str, str]], on_drop: Callable[[str], None]) -> None:
        self.section = section
        self.instance = instance
        self._environ = environ
        self._on_drop = on_drop
        self._queue: queue.SimpleQueue[Alert | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending = 0
        self._idle = threading.Condition()
        # A dropped alert's journal line is written on the supervisor's thread (the journal is not thread-safe):
        # through its event loop while one runs, else by close().
        self._dropped: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None

    def journaled(self, kind: str, message: str, fields: Mapping[str, object]) -> None:
        """A journal event happened: queue its alert, if it is one and any webhook listens."""
        if not self.section.webhooks:
            return
        alert = alert_for(kind, message, fields, self.instance, socket.gethostname(), time.time())
        if alert is None:
            return
        with self._idle:
            self._pending += 1
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                pass
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gb10d-alerts", daemon=True)
            self._thread.start()
        self._queue.put(alert)

    def close(self, timeout: float) -> None:
        """Give queued alerts up to `timeout` seconds to go out (a give-up's alert is sent as gb10d exits)."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
        if self._thread is not None:
            self._queue.put(None)
        self._report_drops()

    def _report_drops(self) -> None:
        while True:
            try:
                text = self._dropped.get_nowait()
            except queue.Empty:
                return
            self._on_drop(text)

    def _run(self) -> None:
        while (alert := self._queue.get()) is not None:
            for hook in self.section.webhooks:
                self._deliver(alert, hook)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _deliver(self, alert: Alert, hook: Webhook) -> None:
        environ = self._environ()
        headers, body = render(alert, hook.format)
        headers.update({name: expand(value, environ) for name, value in hook.headers.items()})
        url = expand(hook.url, environ)
        problem = ""
        for pause in [0.0, *retry_delays(self.section.retries, self.section.retry_initial_s)]:
            time.sleep(pause)
            try:
                response = httpx.post(url, content=body, headers=headers, timeout=self.section.timeout_s, trust_env=False)
            except httpx.HTTPError as exc:
                problem = type(exc).__name__
                continue
            if response.status_code < 300:
                return
            problem = f"HTTP {response.status_code}"
        self._dropped.put(f"alert {alert.name} not delivered to {url_shown(hook.url)} after {self.section.retries + 1} tries (last: {problem}); dropped")
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._report_drops)
            except RuntimeError:
                pass  # the loop closed meanwhile: close() reports it

