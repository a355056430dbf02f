"""Following the kernel's messages for the NVIDIA driver's: out of memory, and Xid errors.

On GB10 the driver can run out of memory while MemAvailable still looks
fine, and a freeze of the whole machine may follow within seconds, with no
OOM kill and nothing in pstore. The only warning is one kernel line
(`NVRM: ... Out of memory [NV_ERR_NO_MEMORY]`), so gb10d follows the
kernel's messages for as long as it runs and posts each driver message it
recognises (`kernel.parse_kernel_line`) to the supervisor as a fact.

The service runs unprivileged, and Ubuntu sets kernel.dmesg_restrict=1, so
/dev/kmsg is out of reach. The default source is therefore journald's
kernel stream (`journalctl --dmesg`), which members of the systemd-journal
group may read; the unit adds the service to that group
(`SupplementaryGroups=systemd-journal`). `[daemon] kernel_log` picks
another source: `kmsg` (where the service may read /dev/kmsg), `none`, or
the path of a file to follow (a site that forwards kernel logs elsewhere;
the tests).
"""

from __future__ import annotations

import asyncio
from typing import Callable

from ..core.facts import KernelSaid
from ..vllm.events import DriverOutOfMemory, GpuXid
from ..vllm.kernel import parse_kernel_line

# A source that stopped (journald restarted, a file replaced) is started again after this long.
RESTART_S = 30.0
# journalctl's stderr when the user may not read the system journal: it then shows nothing at all.
_NO_PERMISSION = ("not seeing messages from other users and the system", "insufficient permissions")


def source_argv(source: str) -> list[str] | None:
    """The command that prints new kernel messages, one per line, from now on; None for `none`."""
    if source == "none":
        return None
    if source == "journal":
        # From now on by time, not `--lines=0`: with a match (`--dmesg` is one),
        # systemd 252's journalctl (Debian 12) drops the first matching entry
        # after the position it starts from, so the first driver line would be lost.
        return ["journalctl", "--dmesg", "--follow", "--since=now", "--output=cat", "--no-pager", "--quiet"]
    if source == "kmsg":
        return ["dmesg", "--follow-new", "--notime"]
    return ["tail", "--follow=name", "--retry", "--lines=0", source]


class KernelLog:
    """Keeps the kernel-message source running and posts the driver's messages it shows."""

    def __init__(self, source: str, post: Callable[[KernelSaid], None], warn: Callable[[str], None]) -> None:
        """`post` hands each driver message to the fact loop; `warn` tells the journal of trouble with the source."""
        self.source = source
        self._post = post
        self._tell = warn
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()

    def start(self) -> None:
        argv = source_argv(self.source)
        if argv is not None:
            self._task = asyncio.create_task(self._keep(argv))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _keep(self, argv: list[str]) -> None:
        while True:
            try:
                ended = await self._follow(argv)
            except OSError as exc:
                ended = f"cannot be started ({exc.strerror or exc})"
            self._warn(
                "ended",
                f"the kernel log source ({' '.join(argv)}) {ended}; the NVIDIA driver's out-of-memory and Xid messages "
                f"are not followed until it runs again (in {RESTART_S:g} s; daemon.kernel_log picks the source)",
            )
            await asyncio.sleep(RESTART_S)

    async def _follow(self, argv: list[str]) -> str:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        assert process.stdout is not None and process.stderr is not None
        errors = asyncio.create_task(self._watch_errors(process.stderr))
        try:
            while line := await process.stdout.readline():
                event = parse_kernel_line(line.decode("utf-8", "replace"))
                if isinstance(event, (DriverOutOfMemory, GpuXid)):
                    self._post(KernelSaid(event))
            status = await process.wait()
            return f"exited with status {status}"
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            await asyncio.gather(errors, return_exceptions=True)

    async def _watch_errors(self, stderr: asyncio.StreamReader) -> None:
        while line := await stderr.readline():
            text = line.decode("utf-8", "replace").strip()
            if any(words in text for words in _NO_PERMISSION):
                self._warn(
                    "permission",
                    "cannot read the kernel's messages in the journal: the service user is not in the systemd-journal group "
                    "(the shipped unit sets SupplementaryGroups=systemd-journal; a drop-in that replaces it must keep it), "
                    "so the NVIDIA driver's out-of-memory and Xid messages go unnoticed",
                )

    def _warn(self, kind: str, message: str) -> None:
        """Each kind of trouble with the source is told once: it may repeat every RESTART_S."""
        if kind not in self._warned:
            self._warned.add(kind)
            self._tell(message)
