"""This machine's Ray node, kept running, and the watcher that reports the cluster's node table.

On both machines of a pair gb10d runs `ray start --block` as a process group
of its own (the same `process.ProcessGroup` vLLM runs in) and forwards its
output to the journal. When it exits, Ray is started again after a capped
back-off (restart.backoff_*), for as long as gb10d runs: the other machine
may come back at any time. Its environment and back-off are asked for at
each start, so a reload in between reaches the next one. Beside it runs
gb10d/launch/raywatch.py under Ray's own Python, which prints the head's node table
whenever it changes. Both report through one callback taking a
`cluster.View` (posted to the fact loop): a table, or an error saying why
there is none (Ray exited here, the GCS does not answer). What a view means
is decided by `Pair` with gb10d.core.cluster; this module only keeps the two
processes running. What it says, and Ray's own output, goes through the
daemon's door (`Teller`: the Reporter), as everything gb10d says does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Mapping, Protocol, Sequence

from ..base.errors import SpawnError
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..core.cluster import View, parse_view
from ..core.outcome import describe_exit
from ..vllm.logparse import Classifier, Line, LineFramer
from .process import ProcessGroup

# Ray that ran this long was working: its next exit starts the back-off afresh.
STEADY_S = 60.0
# `ray start --block` on SIGTERM stops its processes one by one, taking tens of seconds; then SIGKILL.
STOP_GRACE_S = 10.0
# A watcher that exits (Ray not importable, killed) is started again after this long.
WATCHER_RESTART_S = 5.0


class Teller(Protocol):
    """Where the Ray node's words go: the daemon's decision lines (journal, alerts, state file) and Ray's output."""

    def say(self, kind: str, message: str, priority: int = ..., **fields: object) -> None: ...

    def forward(self, lines: Sequence[tuple[str, int]]) -> None:
        """Lines of Ray's own output, each at its priority, in the journal at once."""


class RayNode:
    """Keeps `ray start --block` and the node-table watcher running until `close()`."""

    def __init__(
        self,
        ray_argv: Sequence[str],
        watcher_argv: Sequence[str],
        env: Callable[[], Mapping[str, str]],
        teller: Teller,
        report: Callable[[View], None],
        backoff: Callable[[int], float],
    ) -> None:
        self._ray_argv = list(ray_argv)
        self._watcher_argv = list(watcher_argv)
        self._env = env  # asked at each start: a reload in between reaches the next one
        self._teller = teller
        self._report = report
        self._backoff = backoff
        self._tasks: list[asyncio.Task[None]] = []
        self.process: ProcessGroup | None = None
        # When the latest `ray start` was spawned (Unix time): its node registers after that.
        self.started_at = 0.0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._keep_ray()), asyncio.create_task(self._keep_watcher())]

    async def close(self) -> None:
        """Stop the watcher, then Ray (SIGTERM, STOP_GRACE_S, SIGKILL to its group)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.process is not None and not await self.process.stop(STOP_GRACE_S):
            self._teller.say("crashed", f"processes of Ray's group {self.process.pgid} survived SIGKILL", PRIORITY_ERR)

    async def _keep_ray(self) -> None:
        exits = 0
        while True:
            started = time.monotonic()
            self.started_at = time.time()
            try:
                process = await ProcessGroup.spawn(self._ray_argv, self._env(), name="Ray", key="cluster.ray")
            except SpawnError as exc:
                status_text = str(exc)
            else:
                self.process = process
                self._teller.say("ray_started", f"started Ray as pid {process.pid}: {' '.join(self._ray_argv)}", PRIORITY_INFO, ray_pid=process.pid)
                streams = [_RayOutput(self._teller) for _ in range(2)]
                readers = asyncio.gather(*process.readers(streams[0].feed, streams[1].feed))
                try:
                    status = await process.wait()
                    await asyncio.wait_for(asyncio.shield(readers), 2.0)
                except asyncio.TimeoutError:
                    pass  # Ray's own children may hold the pipes; the exit is what counts
                finally:
                    for stream in streams:
                        stream.finish()
                    if not readers.done():
                        readers.cancel()
                status_text = f"Ray on this machine {describe_exit(status)}"
                # `ray start --block` leaves the rest of its processes behind when one of them died.
                await process.kill()
                self.process = None
            exits = 0 if time.monotonic() - started >= STEADY_S else exits + 1
            delay = self._backoff(exits)
            self._teller.say("ray_exited", f"{status_text}; starting it again in {delay:g} s", PRIORITY_WARNING)
            self._report(View(error=status_text))
            await asyncio.sleep(delay)

    async def _keep_watcher(self) -> None:
        python = self._watcher_argv[0]
        while True:
            try:
                ended = describe_exit(await self._watch())
            except OSError as exc:
                ended = f"cannot be started ({exc.strerror or exc}); cluster.ray must be the ray program of vLLM's venv, with its python3 beside it"
            text = f"the Ray cluster watcher ({python}) {ended}"
            self._teller.say("ray_watch", f"{text}; starting it again in {WATCHER_RESTART_S:g} s", PRIORITY_WARNING)
            self._report(View(error=text))
            await asyncio.sleep(WATCHER_RESTART_S)

    async def _watch(self) -> int:
        """One run of the watcher: each line it prints is reported; returns its exit status."""
        watcher = await asyncio.create_subprocess_exec(
            *self._watcher_argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,  # Ray's C++ client retries noisily; the lines say what matters
            env=dict(self._env()),
            start_new_session=True,
        )
        assert watcher.stdout is not None
        try:
            while line := await watcher.stdout.readline():
                try:
                    self._report(parse_view(line.decode("utf-8", "replace")))
                except ValueError as exc:
                    self._teller.say("ray_watch", f"the Ray watcher printed something unexpected: {exc}", PRIORITY_WARNING)
            return await watcher.wait()
        finally:
            if watcher.returncode is None:
                watcher.kill()
                await watcher.wait()


class _RayOutput:
    """One of Ray's pipes, forwarded line by line to the journal with a `(ray)` tag."""

    def __init__(self, teller: Teller) -> None:
        self._teller = teller
        self._framer = LineFramer()
        self._classifier = Classifier()

    def feed(self, chunk: bytes) -> None:
        self._forward(self._framer.feed(chunk))

    def finish(self) -> None:
        self._forward(self._framer.flush())

    def _forward(self, lines: list[Line]) -> None:
        self._teller.forward([(f"(ray) {line.text}", self._classifier.classify(line.text).priority) for line in lines])
