"""sd_notify as systemd receives it: datagrams on a real AF_UNIX socket bound as NOTIFY_SOCKET."""

from __future__ import annotations

from gb10d.daemon.lab import NotifyReceiver
from gb10d.machine.notify import Notifier


def test_status_is_sent_only_when_it_changes() -> None:
    receiver = NotifyReceiver()
    try:
        notifier = Notifier(socket_path=receiver.path)
        assert notifier.status("loading weights")
        assert not notifier.status("loading weights"), "systemd shows it already"
        assert notifier.status("compiling")
        assert notifier.ready("serving")
        assert not notifier.status("serving"), "READY=1 carried it"
        assert notifier.status("loading weights")
        notifier.close()
        last = receiver.wait(lambda fields: fields.get("STATUS") == "loading weights", timeout=10, since=1)
        assert last is not None
        assert [fields["STATUS"] for _, fields in receiver.messages] == ["loading weights", "compiling", "serving", "loading weights"]
    finally:
        receiver.close()
