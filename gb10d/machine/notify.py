"""sd_notify: tell systemd about readiness, status, reloads and liveness.

Outside systemd (`NOTIFY_SOCKET` unset) every call is a no-op. Inside
systemd a broken socket must not be swallowed the way the sdnotify package
does by default: a lost `READY=1` only shows up as a start timeout minutes
later, so failures are reported through `on_error` (the journal) once per
kind of failure, and the notifier keeps trying on later messages.
"""

from __future__ import annotations

import os
import time
from typing import Callable

import sdnotify

ErrorHandler = Callable[[str], None]


def _ascii(text: str) -> str:
    """sdnotify encodes as latin-1 and drops the datagram on failure; keep texts plain ASCII."""
    return text.encode("ascii", "replace").decode("ascii").replace("\n", " ")


class Notifier:
    """Sends sd_notify messages to `$NOTIFY_SOCKET`, or nothing when it is unset."""

    def __init__(self, socket_path: str | None = None, on_error: ErrorHandler | None = None) -> None:
        self.socket_path = socket_path if socket_path is not None else os.environ.get("NOTIFY_SOCKET")
        self._on_error = on_error or (lambda message: None)
        self._reported: set[str] = set()
        self._notifier: sdnotify.SystemdNotifier | None = None
        self._status: str | None = None  # the STATUS= systemd last received
        watchdog = os.environ.get("WATCHDOG_USEC")
        watchdog_pid = os.environ.get("WATCHDOG_PID")
        self.watchdog_usec: int | None = None
        if watchdog and watchdog.isdigit() and (not watchdog_pid or watchdog_pid == str(os.getpid())):
            self.watchdog_usec = int(watchdog)

    @property
    def enabled(self) -> bool:
        """True when running under a service manager that listens."""
        return bool(self.socket_path)

    def _connect(self) -> sdnotify.SystemdNotifier | None:
        if self._notifier is None and self.socket_path:
            saved = os.environ.get("NOTIFY_SOCKET")
            os.environ["NOTIFY_SOCKET"] = self.socket_path
            try:
                self._notifier = sdnotify.SystemdNotifier(debug=True)
            except Exception as exc:  # sdnotify raises whatever socket.connect raised
                self._report("connect", f"cannot connect to NOTIFY_SOCKET {self.socket_path}: {exc}")
            finally:
                if saved is None:
                    os.environ.pop("NOTIFY_SOCKET", None)
                else:
                    os.environ["NOTIFY_SOCKET"] = saved
        return self._notifier

    def _report(self, kind: str, message: str) -> None:
        if kind not in self._reported:
            self._reported.add(kind)
            self._on_error(message + "; systemd will not see gb10d's state (start may time out)")

    def send(self, **fields: object) -> bool:
        """Send one datagram of KEY=value lines; returns whether it was sent."""
        if not self.enabled:
            return False
        notifier = self._connect()
        if notifier is None:
            return False
        payload = "\n".join(f"{key.upper()}={_ascii(str(value))}" for key, value in fields.items())
        try:
            notifier.notify(payload)
        except Exception as exc:  # socket errors, reported rather than swallowed
            self._report("send", f"sd_notify failed on {self.socket_path}: {exc}")
            self._notifier = None
            return False
        if "status" in fields:
            self._status = _ascii(str(fields["status"]))
        return True

    def close(self) -> None:
        """Close the socket once nothing more will be said (a daemon run in-process leaves none open)."""
        if self._notifier is not None and self._notifier.socket is not None:
            self._notifier.socket.close()
        self._notifier = None

    def ready(self, status: str) -> bool:
        """READY=1 with the serving STATUS= line."""
        return self.send(ready=1, status=status)

    def status(self, status: str) -> bool:
        """STATUS=, shown by `systemctl status gb10d`; a text systemd already shows is not sent again (False)."""
        if _ascii(status) == self._status:
            return False
        return self.send(status=status)

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC=: only on real progress, so a stuck start still times out."""
        return self.send(extend_timeout_usec=int(seconds * 1_000_000))

    def reloading(self) -> bool:
        """RELOADING=1 with MONOTONIC_USEC=, as Type=notify-reload (253+) requires; harmless on 252."""
        return self.send(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str) -> bool:
        """STOPPING=1 at the start of shutdown."""
        return self.send(stopping=1, status=status)

    def watchdog(self) -> bool:
        """WATCHDOG=1, only when systemd asked for it."""
        if self.watchdog_usec is None:
            return False
        return self.send(watchdog=1)
