"""The worker machine of a pair (`[cluster] role = "worker"`): it runs Ray, and no vLLM.

Its whole job is to keep this machine's Ray joined to the head's cluster:
READY=1 once the head lists this machine alive with its GPU, STATUS= and an
extended start timeout while it waits, a journal line whenever it leaves
or rejoins. Ray itself is kept running by `raynode`, restarted with
back-off when it exits; the head's gb10d runs vLLM across both machines.
"""

from __future__ import annotations

from ..base.errors import EXIT_OK
from ..base.levels import PRIORITY_INFO
from ..core.cluster import View, has_joined, lost_text, view_text
from ..core.facts import ClusterSeen, Edited, Fact, KernelSaid, Reload, Stop
from .keeper import ConfigKeeper
from .loop import FactLoop
from .pair import CLUSTER_EXTEND_S, Pair
from .reporter import Reporter


class WorkerDaemon:
    """Keeps this machine in the head's Ray cluster until stopped; `serve()` returns the exit status."""

    def __init__(self, keeper: ConfigKeeper, reporter: Reporter, loop: FactLoop, pair: Pair) -> None:
        self.keeper = keeper
        self.reporter = reporter
        self.loop = loop
        self.pair = pair
        self.joined = False

    def _handle(self, fact: Fact) -> bool:
        """A fact while waiting; True for a stop signal."""
        if isinstance(fact, Stop):
            self.reporter.say("stopping", f"received {fact.signame} while {self.reporter.situation.doing()}; stopping", PRIORITY_INFO)
            return True
        if isinstance(fact, (Reload, Edited)):
            self.keeper.take(requested=isinstance(fact, Reload))
        elif isinstance(fact, ClusterSeen):
            self.pair.seen(fact.view)
        elif isinstance(fact, KernelSaid):
            self.reporter.kernel(fact.event)
        return False

    async def serve(self) -> int:
        """Start Ray, then follow the node table until a stop signal; exit 0 after stopping Ray."""
        if not await self.pair.start(self._handle):
            await self._follow()
        self.reporter.stopping("stopping Ray")
        await self.pair.close()
        self.reporter.say("stopped", "Ray stopped; no process of its group is left", PRIORITY_INFO)
        self.reporter.stopped()
        return EXIT_OK

    async def _follow(self) -> None:
        pair, cluster = self.pair, self.pair.cluster
        ray = pair.ray
        assert ray is not None
        me = pair.address

        def changed() -> bool:
            return has_joined(pair.view, me, ray.started_at) != self.joined

        pair.seen(pair.view or View())
        while True:
            if not self.joined:
                self.reporter.extend(CLUSTER_EXTEND_S)
            if await self.loop.pause(CLUSTER_EXTEND_S / 3, self._handle, until=changed):
                return
            if not changed():
                continue
            self.joined = not self.joined
            if self.joined:
                self.reporter.joined(
                    f"joined the Ray cluster at {cluster.head_address}:{cluster.port} as {me} with its GPU ({view_text(pair.view, cluster)})"
                )
            else:
                self.reporter.left_cluster(
                    f"this machine ({me}) is no longer in the Ray cluster: {lost_text(pair.previous_view, pair.view or View(), cluster)}; "
                    "Ray here is restarted until it joins again"
                )
                pair.seen(pair.view or View())
