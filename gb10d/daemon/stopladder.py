"""The stop ladder: how vLLM is stopped, and how gb10d stops.

vLLM is stopped the same way wherever it is (a reload that changes its
command line, a restart asked, a park by stop, gb10d's own stop): SIGTERM
to what it runs as, daemon.stop_timeout_s to exit, then SIGKILL to what is
left, said in the journal. gb10d's own stop adds STOPPING=1 first, a
second stop signal that skips the grace, Ray after vLLM, and the state
file's "stopped" last.
"""

from __future__ import annotations

import asyncio

from ..base.errors import EXIT_OK
from ..base.levels import PRIORITY_INFO, PRIORITY_WARNING
from ..core.facts import Stop
from ..launch.runtime import Runtime
from .attempt import Attempt
from .keeper import ConfigKeeper
from .loop import FactLoop
from .pair import Pair
from .reporter import Reporter


class StopLadder:
    """SIGTERM, daemon.stop_timeout_s, SIGKILL: for one vLLM (`stop`), or for all of gb10d (`stop_all`)."""

    def __init__(self, keeper: ConfigKeeper, reporter: Reporter, loop: FactLoop) -> None:
        self.keeper = keeper
        self.reporter = reporter
        self.loop = loop

    async def stop(self, runtime: Runtime, restarts: bool) -> None:
        """vLLM through the ladder, with the grace of the config in force; gb10d goes on. When vLLM `restarts` (not
        a park), its share in the memory ledger is reserved before its memory comes back, not after: another start
        admitted in between would take it."""
        if restarts:
            self.reporter.keeps_share()
        await runtime.stop(self.keeper.config.daemon.stop_timeout_s, self.escalated)

    async def stop_all(self, attempt: Attempt | None, pair: Pair | None) -> int:
        """gb10d stops: STOPPING=1, SIGTERM the group, grace, SIGKILL, Ray, nothing left; exit 0.

        A second stop signal during the grace skips to SIGKILL.
        """
        grace = self.keeper.config.daemon.stop_timeout_s
        self.reporter.stopping("stopping Ray" if attempt is None and pair is not None else "stopping vLLM")
        if attempt is not None:
            self.reporter.say(
                "stopping",
                f"stopping vLLM ({attempt.runtime.label}): SIGTERM to {attempt.runtime.reaches}, SIGKILL after {grace:g} s",
                PRIORITY_INFO,
            )
            stop = asyncio.create_task(attempt.runtime.stop(grace, self.escalated))
            while not stop.done():
                second = asyncio.create_task(self.loop.queue.get())
                done, _ = await asyncio.wait({stop, second}, return_when=asyncio.FIRST_COMPLETED)
                if second in done and isinstance(second.result(), Stop):
                    self.reporter.say("stopping", f"second stop signal: killing vLLM ({attempt.runtime.reaches}) now", PRIORITY_WARNING)
                    await attempt.runtime.kill()
                if not second.done():
                    second.cancel()
            await stop
        if pair is not None:
            await pair.close()
        left = f"nothing of {attempt.runtime.reaches} is left" if attempt is not None else "nothing of it is left"
        self.reporter.say("stopped", f"vLLM stopped; {left}", PRIORITY_INFO)
        self.reporter.stopped()
        return EXIT_OK

    def escalated(self, pids: list[int]) -> None:
        """vLLM outlived its grace: what is left of it gets SIGKILL."""
        self.reporter.say(
            "stopping",
            f"vLLM did not exit within daemon.stop_timeout_s {self.keeper.config.daemon.stop_timeout_s:g} s; "
            f"sending SIGKILL to {len(pids)} remaining process(es): {pids}",
            PRIORITY_WARNING,
        )
