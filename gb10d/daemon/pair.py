"""This machine's part in a pair of GB10s: the link, its Ray node, the cluster's node table, and what they mean.

Both machines find their ConnectX-7 link and keep `ray start --block`
running (`raynode`). The head also decides, from the node table, whether
the cluster is whole enough to start vLLM and whether a machine vLLM was
placed on has left (which ends the attempt, uncounted). What a table means
is decided by the pure `cluster` module; this object holds the latest
tables and says it in the journal, STATUS= and the state file.
"""

from __future__ import annotations

import time
from typing import Callable

from ..base.config import ClusterSection
from ..base.errors import EXIT_GAVE_UP, GiveUp
from ..base.levels import PRIORITY_ERR, PRIORITY_INFO, PRIORITY_WARNING
from ..core import policy
from ..core.cluster import (
    LINK_WAIT_S,
    View,
    cluster_env,
    death_notice_s,
    interpreter,
    is_whole,
    lost_since,
    lost_text,
    ray_argv,
    ray_program,
    view_state,
    view_text,
    waiting_text,
    waits_for_link,
    watcher_argv,
)
from ..core.facts import ClusterSeen, Fact
from ..core.outcome import Failed, NodeLost, describe_exit
from ..core.statefile import DaemonState
from ..launch.interfaces import Choice, InterfaceError
from ..launch.netifs import find
from ..launch.raynode import RayNode
from .keeper import ConfigKeeper
from .loop import FactLoop, Handler
from .reporter import Reporter

# While a machine of a pair waits for the other, it asks systemd for this much more start time, a third of it at a time.
CLUSTER_EXTEND_S = 90.0
# No event tells of an address appearing on an interface: look again this often.
LINK_POLL_S = 2.0


class Pair:
    """The cluster as this machine sees it; `start` before anything else, `close` at the end."""

    def __init__(self, keeper: ConfigKeeper, reporter: Reporter, loop: FactLoop, ray_node: type[RayNode] = RayNode) -> None:
        """`ray_node` runs Ray and reads its node table: processes here, a scripted table in the in-process tests."""
        assert keeper.config.cluster is not None
        # [cluster] itself changes only at a start (the keeper refuses a reload that changes it); the rest
        # (vLLM's environment, the restart back-off) is read from the keeper each time Ray starts.
        self.cluster: ClusterSection = keeper.config.cluster
        self.keeper = keeper
        self.reporter = reporter
        self.loop = loop
        self._ray_node = ray_node
        self.link: Choice | None = None
        self.ray: RayNode | None = None
        self.view: View | None = None
        self.previous_view: View | None = None
        self.death_notice_s = 0.0  # how long Ray may take to declare a machine dead (set with Ray's environment)

    @property
    def address(self) -> str:
        return str(self.link.address) if self.link else ""

    async def start(self, handle: Handler) -> bool:
        """Find the link, then start this machine's Ray and the node-table watcher; True if a stop came first.

        A link still coming up at boot is waited for (LINK_WAIT_S), with STATUS= saying so; after that
        the refusal stands and gb10d exits 78.
        """
        cluster = self.cluster
        started = time.monotonic()
        while True:
            try:
                self.link = find(cluster.role, cluster.head_address, cluster.interface)
                break
            except InterfaceError as exc:
                if not waits_for_link(time.monotonic() - started):
                    raise
                if self.reporter.situation.state is not DaemonState.WAITING_FOR_LINK:
                    self.reporter.say("cluster_waiting", f"waiting up to {LINK_WAIT_S:g} s for the link: {exc}", PRIORITY_WARNING)
                    self.reporter.status(f"waiting for the link: {exc}", DaemonState.WAITING_FOR_LINK)
                if await self.loop.pause(LINK_POLL_S, handle):
                    return True
        self.reporter.waits_for_cluster(DaemonState.WAITING if cluster.role == "head" else DaemonState.JOINING)
        self.reporter.say(
            "cluster_link",
            f"cluster {cluster.role}: using {self.link.interface.name} ({self.link.address}) because {self.link.reason}",
            PRIORITY_INFO,
        )
        config = self.keeper.config
        ray = ray_program(cluster, config.vllm)
        try:
            python = interpreter(ray.read_text(errors="replace")[:512], ray)
        except OSError as exc:
            raise GiveUp(f"cannot start Ray: {ray} cannot be read ({exc.strerror or exc}); check cluster.ray or vllm.venv", EXIT_GAVE_UP) from None
        self.death_notice_s = death_notice_s(self.ray_env())
        post: Callable[[Fact], None] = self.loop.post
        self.ray = self._ray_node(
            ray_argv(cluster, config.vllm, self.address),
            watcher_argv(python, cluster),
            self.ray_env,
            self.reporter,
            lambda view: post(ClusterSeen(view)),
            lambda exits: policy.backoff_delay(self.keeper.config, exits),
        )
        self.ray.start()
        return False

    def env(self) -> dict[str, str]:
        """The link's variables for vLLM and Ray (NCCL_SOCKET_IFNAME and the rest)."""
        if self.link is None:
            return {}
        return cluster_env(self.cluster, self.link.interface.name, self.address)

    def ray_env(self) -> dict[str, str]:
        """Ray's environment: vLLM's as of the config in force (its env_file as last read, never again), and the link's."""
        return {**self.keeper.env(), **self.env()}

    async def close(self) -> None:
        if self.ray is not None:
            self.reporter.say("stopping", "stopping Ray on this machine", PRIORITY_INFO)
            await self.ray.close()
            self.ray = None

    def seen(self, view: View) -> None:
        """Take in a new node table; while waiting, STATUS= and the state file follow it."""
        self.previous_view, self.view = self.view, view
        record = view_state(view, self.cluster, self.address, self.link.interface.name if self.link else "")
        self.reporter.cluster_seen(record, len(view.serving_nodes()), waiting_text(view, self.cluster))

    # --- the head ----------------------------------------------------------------

    async def wait_whole(self, handle: Handler) -> bool:
        """Before each start of vLLM: wait until `nodes` machines with a GPU are up; True if stopped meanwhile."""
        cluster = self.cluster
        if is_whole(self.view, cluster):
            return False
        text = waiting_text(self.view, cluster)
        self.reporter.say("cluster_waiting", text, PRIORITY_INFO)
        self.reporter.status(text, DaemonState.WAITING)
        while not is_whole(self.view, cluster):
            # The wait may be long (the other machine is off): systemd's start timeout must not end it.
            self.reporter.extend(CLUSTER_EXTEND_S)
            if await self.loop.pause(CLUSTER_EXTEND_S / 3, handle, until=lambda: is_whole(self.view, cluster)):
                return True
        self.reporter.say("cluster_whole", f"the Ray cluster is whole ({view_text(self.view, cluster)}); starting vLLM", PRIORITY_INFO)
        return False

    def placement_lost(self, start_view: View | None) -> bool:
        """Whether a machine vLLM was placed on (the table at its start) is gone from the latest table."""
        return lost_since(start_view, self.view, self.cluster)

    def on_view(self, view: View, start_view: View | None, pid: int, ready: bool) -> NodeLost | None:
        """A node table during an attempt: a machine gone means vLLM cannot go on.

        A table that could not be read (the GCS hiccuped, the watcher restarts) says nothing
        about the machines; vLLM's own output and exit tell whether it still serves.
        """
        self.seen(view)
        if view.error or not self.placement_lost(start_view):
            return None
        return self.node_lost(start_view, "", pid, ready)

    def node_lost(self, start_view: View | None, how: str, pid: int, ready: bool) -> NodeLost:
        """Say which machine left and why; `how` tells how vLLM ended, if it already did."""
        why = lost_text(start_view, self.view or View(), self.cluster)
        self.reporter.say(
            "node_lost",
            f"{why}; {how or f'stopping vLLM (pid {pid})'}: it cannot serve without all "
            f"{self.cluster.nodes} machines; it starts again once the cluster is whole (not counted as a failed attempt)",
            PRIORITY_ERR,
        )
        self.reporter.status(f"node lost: {why}")
        return NodeLost(why=why, was_ready=ready)

    def explain_exit(self, outcome: Failed, start_view: View | None, pid: int) -> Failed | NodeLost:
        """vLLM exited: because a machine of the pair left (NodeLost), or for its own reasons."""
        if outcome.exit_status is not None and self.placement_lost(start_view):
            return self.node_lost(start_view, f"vLLM (pid {pid}) {describe_exit(outcome.exit_status)}", pid, outcome.was_ready)
        return outcome

    async def confirm_node_loss(self, outcome: Failed, start_view: View | None, pid: int, handle: Handler) -> Failed | NodeLost | None:
        """vLLM lost a Ray worker: ask the cluster whether its machine left (NodeLost) or only the worker died.

        vLLM notices a dead worker within a second; Ray's GCS marks the machine dead only after its
        health checks fail (seconds to a minute). A machine that left is not vLLM's failure and must
        not spend an attempt; a worker that died on a machine still there is. None: stopped meanwhile.
        """
        where = f" on {outcome.failure.node}" if outcome.failure is not None and outcome.failure.node else ""
        lost = f"vLLM lost a Ray worker{where}"
        waiting = f"waiting up to {self.death_notice_s:g} s for Ray to tell whether its machine left the cluster"
        self.reporter.say("node_lost", f"{lost} ({outcome.detail}); {waiting}", PRIORITY_WARNING)
        self.reporter.status(f"{lost}; {waiting}", DaemonState.RESTARTING)
        if await self.loop.pause(self.death_notice_s, handle, until=lambda: self.placement_lost(start_view)):
            return None
        if self.placement_lost(start_view):
            return self.node_lost(start_view, f"vLLM (pid {pid}) was stopped when it lost its Ray worker there", pid, outcome.was_ready)
        return outcome
