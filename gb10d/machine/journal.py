"""What gb10d tells journald: vLLM's lines with a level prefix, and gb10d's own decisions.

vLLM's lines go to stdout as `<N>text`; with systemd's default
`StandardOutput=journal` and `SyslogLevelPrefix=yes` the `<N>` becomes the
entry's priority, so `journalctl -u gb10d -p warning` shows only problems.

gb10d's own decisions are events with a kind. When journald's native socket
exists they are sent there only (never also on stdout, or the journal would
hold them twice), carrying `MESSAGE_ID` and `GB10D_*` fields that
`journalctl -x` explains from `gb10d.catalog` and that `journalctl
GB10D_EVENT=stall_detected` can filter on. Without the socket (a terminal, a
container) they go to stdout as `<N>gb10d: message`, a form no vLLM line has.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import Iterable
from typing import TextIO

from ..base.levels import PRIORITY_INFO
from ..vllm import failures

DEFAULT_SOCKET_PATH = "/run/systemd/journal/socket"

# One id per event kind, fixed forever: dashboards, alerts and the catalog key on them. Those that tell of a
# failure are declared with their kind in gb10d.vllm.failures.
MESSAGE_IDS: dict[str, str] = {
    "starting": "03604dd3b760464589f2447e902c6cd6",
    "ready": "2f292b387efe48d5a5f218d076a8c072",
    "phase": "290d49ba4de74e799e44b00893a695ad",
    "preflight_lowered": "b3b5c9eba24343a1b249bc9861698ef6",
    "page_cache_evicted": "3dfa3ecd54654bc6a895e183781fd9c3",
    "stall_detected": "d44442b9f6d84526964eb3a7663b51b9",
    "backoff": "ee63665b0ecf491691a4da5471edec73",
    "gave_up": "f05434347ead402f888a879b3f769617",
    "memory_not_returned": "80838952fbff4318bcdfd1f38634b10b",
    "served_name_mismatch": "65a0d5e6758d49afa4e7709679a9b830",
    "stopping": "164d80b1a1fb45e9970600b18f8658c5",
    "stopped": "9a34d6c4afa941a1808d55cc244d1ccc",
    "reload_requested": "54a659c07c214464842d7561fe12fa50",
    "reload_invalid": "adace34da6344f8e99fdcddd440e2c66",
    "reload_applied": "8a33a62c8f184267a88841a3626576d5",
    "config_changed_on_disk": "e8ad9eee7fe74bc9a7e7fdc38468e7ca",
    "learned_applied": "012e3ad9dee44073b8c4c112c3fa5806",
    "learned_discarded": "296dbcdac4494dc196be9d4ff67544dd",
    "memory_fragmented": "a54337f4b77f4557b8d0f9932663d517",
    "program_rolled_back": "6fb28d11458241cc9feb2bfcb3920513",
    "program_accepted": "cf5f547683b54f8b90d51a6cb0b3e6fc",
    "watchdog": "7bd32869937d497aa80a773e54774e5a",
    "metrics_unavailable": "958de32b9fa441da862ec844d80f022a",
    "state_file_unwritable": "6d9cac02417f4be9bbd44881e24b34b5",
    "alert_dropped": "39282eff2155483abea1339ed3766b9c",
    "cluster_link": "131cce89442d49289781fc992824c039",
    "cluster_waiting": "2480bc9b57b440b5b28b9b5e8865a2f3",
    "cluster_whole": "3a6f68dfdd334fb59168521dc4c64630",
    "cluster_joined": "4d442eaab3ad44979c71ad5957805c90",
    "cluster_left": "5bb058d373934df0b339fd663b505fa0",
    "node_lost": "c1029d80980a488cb0221199ac3fc91a",
    "ray_started": "23c321ba45e648de8156d74505d83cd8",
    "ray_exited": "fbafdec63f78484fae0de397fa3460ef",
    "ray_watch": "3c86849a36f141ceac4381f4f25f8fff",
    "host": "199742f100b04de5a80cbd6bbd96b337",
    "host_warning": "4e9ad9f9ce1b497fbf1e0f1e24f2a8cc",
    "gpu_xid": "5540f0d2e67148758e4f82a520b4dbf1",
    "shm_removed": "eb974528cdf74a88a20b334b880fb17f",
    "kernel_log": "69a385c2f39548478c3bb694a441cfdd",
    "memory_wait": "0bb3e03be1b94daeb90d30b8404d063e",
    "memory_admitted": "9a4669c3d93340b39cdee08885efeb56",
    "memory_ledger": "79fd0205c95b4bdbb97117329cbdbce4",
    "image": "8468e725c0ed4df085b26ba6672302bd",
    "image_moved": "65d3d8c8e4a7477d8a67a73ce2f6db91",
    "container_removed": "f61d1c6e6cd447c08b1840ed652e8a92",
    "parked": "673575428b97495994e1aff34f7d320b",
    "woke": "697ff073e8d74b50ad8196d9b668ef51",
    "wake_failed": "2131134a0eb049dd82f40840b6f3c3b4",
    "park_failed": "e3e0c439f866438ba5222223d9442e38",
    "park_ignored": "5957d2dabf2744b39c1ee64f2b9d78f4",
    "slept_unasked": "b0fff6f454774467bfad4d5ace31ef47",
    "parked_stopped": "0fb6db7d4c234c74b400ccc5e551d6e6",
    "unparking": "fcd4104011d344b1ab47668ae056fc62",
    "restart_asked": "5bb5f226db564ad3b02417441d355a30",
    "restart_ignored": "f248e4c5518d4285835a043189442b36",
    "control_socket_unavailable": "262fb9852b4f448b8a7276805555a50c",
    "parked_short_of_memory": "d14e4c27d2494c52afcf3f645264bcab",
    **{kind: event.message_id for kind, event in failures.journal_events().items()},
}


def message_id_of(kind: str) -> str | None:
    """The MESSAGE_ID of an event kind, a failure kind's taught since the start included; None for an unknown kind."""
    known = MESSAGE_IDS.get(kind)
    if known is not None:
        return known
    told = failures.journal_events().get(kind)
    return told.message_id if told is not None else None


# journald drops a datagram larger than its receive buffer; a field this long is
# a runaway traceback or command line, and its head is what the operator needs.
MAX_FIELD_BYTES = 48 * 1024
_TRUNCATED = b" [truncated by gb10d]"

# Enough lines that a burst costs one write() per batch, few enough that a
# missing flush() delays the journal by a screenful at most.
_BATCH_LINES = 512


def field_name(key: str) -> str:
    """The journal field for one keyword of `Journal.event` (`attempt` -> `GB10D_ATTEMPT`).

    journald accepts only `[A-Z0-9_]` names not starting with `_` or a digit,
    at most 64 characters; anything else is folded to `_` so a field is never
    silently rejected by journald.
    """
    cleaned = "".join(c if c.isascii() and c.isalnum() else "_" for c in key.upper())
    return ("GB10D_" + cleaned.strip("_"))[:64]


def _field_value(value: object) -> bytes:
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        text = " ".join(str(v) for v in value)
    elif isinstance(value, bytes):
        return value
    else:
        text = str(value)
    return text.encode("utf-8", errors="replace")


def _truncate(value: bytes) -> bytes:
    if len(value) <= MAX_FIELD_BYTES:
        return value
    return value[: MAX_FIELD_BYTES - len(_TRUNCATED)] + _TRUNCATED


def encode_native(fields: Iterable[tuple[str, bytes]]) -> bytes:
    """One datagram of journald's native protocol for these (NAME, value) pairs.

    A value with a newline cannot use `NAME=value`, so it takes the binary
    form `NAME\\n` + little-endian uint64 length + bytes + `\\n`.
    """
    parts: list[bytes] = []
    for name, value in fields:
        value = _truncate(value)
        key = name.encode("ascii")
        if b"\n" in value:
            parts.append(key + b"\n" + struct.pack("<Q", len(value)) + value + b"\n")
        else:
            parts.append(key + b"=" + value + b"\n")
    return b"".join(parts)


def _clamp_priority(priority: int) -> int:
    return min(max(int(priority), 0), 7)


class Journal:
    """The single writer of journal lines: gb10d's stdout and native journal entries, the front's and the command line's lines.

    Writing to stdout blocks when journald's pipe is full (journald
    rate-limited, stopped or overloaded). A blocked write stalls the caller,
    and with it the reading of vLLM's pipes, which in turn blocks vLLM itself
    once its pipe fills. journald normally drains far faster than vLLM prints;
    the batching here keeps the write count low so that stays true.
    """

    def __init__(
        self,
        out: TextIO = sys.stdout,
        socket_path: str | None = DEFAULT_SOCKET_PATH,
        identifier: str = "gb10d",
        levels: bool = True,
    ) -> None:
        """`levels=False`: the program's own lines without their `<N>` (the command line's, in a terminal)."""
        self._out = out
        self._socket_path = socket_path
        self._identifier = identifier
        self._levels = levels
        self._pending: list[str] = []
        self._socket: socket.socket | None = None

    def vllm_line(self, text: str, priority: int) -> None:
        """Queue one line vLLM printed, with its syslog priority, for stdout.

        `text` is one logical line without its newline (logparse frames them).
        Lines are batched; call `flush()` whenever the reader has nothing more
        to read right now, so the journal lags vLLM only while it is busy.
        """
        self._pending.append(f"<{priority}>{text}\n")
        if len(self._pending) >= _BATCH_LINES:
            self.flush()

    def flush(self) -> None:
        """Write every queued line to stdout and push it to journald."""
        if self._pending:
            self._out.write("".join(self._pending))
            self._pending.clear()
        self._out.flush()

    def event(self, kind: str, message: str, priority: int = PRIORITY_INFO, **fields: object) -> None:
        """Record one of gb10d's own decisions.

        `message` is the operator's line (cause, numbers, action). Each keyword
        becomes a `GB10D_<NAME>` field; None values are left out. An unknown
        kind is still logged, just without a MESSAGE_ID. Never raises: if the
        native socket fails, the event goes to stdout instead.
        """
        priority = _clamp_priority(priority)
        # Whatever vLLM printed before this decision must reach the journal first.
        self.flush()
        path = self._socket_path
        if path is not None and os.path.exists(path) and self._send_native(path, kind, message, priority, fields):
            return
        self._write_own(message, priority)

    def say(self, message: str, priority: int = PRIORITY_INFO) -> None:
        """One line of the program's own on its stream, `<N>identifier: message`, with no event kind and no native
        entry (the front's lines, the command line's), after whatever vLLM printed before it."""
        self.flush()
        self._write_own(message, _clamp_priority(priority))

    def _write_own(self, message: str, priority: int) -> None:
        # `<N>identifier: ` on each line: journald files every line at N, and no vLLM line has this form.
        lines = message.splitlines() or [""]
        level = f"<{priority}>" if self._levels else ""
        self._out.write("".join(f"{level}{self._identifier}: {line}\n" for line in lines))
        self._out.flush()

    def close(self) -> None:
        """Flush stdout and release the native socket."""
        try:
            self.flush()
        finally:
            if self._socket is not None:
                self._socket.close()
                self._socket = None

    def _send_native(self, path: str, kind: str, message: str, priority: int, fields: dict[str, object]) -> bool:
        pairs: list[tuple[str, bytes]] = [
            ("MESSAGE", message.encode("utf-8", errors="replace")),
            ("PRIORITY", str(priority).encode()),
            ("SYSLOG_IDENTIFIER", self._identifier.encode("utf-8", errors="replace")),
            ("GB10D_EVENT", kind.encode("utf-8", errors="replace")),
        ]
        message_id = message_id_of(kind)
        if message_id is not None:
            pairs.append(("MESSAGE_ID", message_id.encode()))
        pairs.extend((field_name(k), _field_value(v)) for k, v in fields.items() if v is not None)
        payload = encode_native(pairs)
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.sendto(payload, path)
        except OSError:
            # journald went away, restarted, or found the datagram too large even
            # after truncation: stdout still carries the message, and the next
            # event starts over with a fresh socket.
            if self._socket is not None:
                self._socket.close()
                self._socket = None
            return False
        return True


def connected_to_journal(stream: TextIO) -> bool:
    """Whether systemd connected `stream` to the journal ($JOURNAL_STREAM names its device:inode).

    Only then do gb10d's own events go through the native protocol with their
    structured fields, and error lines carry a `<3>` level prefix; in a
    terminal (or `gb10d demo`) output stays plain.
    """
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return bool(expected) and expected == f"{st.st_dev}:{st.st_ino}"
