"""The Ray side of a pair of GB10s: the `ray start` command, the variables both machines need, and what the cluster's node table means.

Pure: it takes the `[cluster]` table and the interface chosen for the link
(gb10d.launch.interfaces) and returns argv and environment; it reads the node
table the watcher (gb10d/launch/raywatch.py) reports and answers "is the cluster
whole?", "has this machine joined?" and "who left, and why?". vLLM's workers inherit
their environment from the Ray node they run on, so the same interface
variables go to `ray start` on both machines and to `vllm serve` on the head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..base.config import ClusterSection, VllmSection
from .statefile import ClusterRecord, NodeRecord

# Where NCCL, Gloo, PyTorch's TensorPipe, UCX and Open MPI send traffic between the machines:
# all of them must use the ConnectX-7 link, or tensor-parallel traffic crawls over the management port.
INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES", "OMPI_MCA_btl_tcp_if_include")


# Ray's defaults for the GCS's health checks of its nodes (src/ray/common/ray_config_def.h), overridable
# through these variables in Ray's environment.
HEALTH_CHECK_DEFAULTS = {"RAY_health_check_period_ms": 3000, "RAY_health_check_timeout_ms": 10000, "RAY_health_check_failure_threshold": 5}


# A link still coming up at boot (the port's carrier, NetworkManager's address) is waited for this long; then the
# refusal stands and gb10d exits 78.
LINK_WAIT_S = 120.0


def waits_for_link(waited_s: float) -> bool:
    """Whether a link that is not there yet is still waited for, or its absence is the answer."""
    return waited_s < LINK_WAIT_S


def death_notice_s(env: Mapping[str, str]) -> float:
    """How long to wait for the head's Ray to declare a machine dead, under the health checks `env` sets.

    The GCS marks a node dead after `failure_threshold` checks in a row fail,
    `period_ms` apart, the last one timing out: 25 s with Ray's defaults. Twice
    that, plus the watcher's poll and a margin, covers a check cycle that had
    just begun.
    """
    knob = {}
    for name, default in HEALTH_CHECK_DEFAULTS.items():
        try:
            knob[name] = max(0, int(env.get(name, default)))
        except ValueError:
            knob[name] = default
    one_detection_ms = knob["RAY_health_check_period_ms"] * knob["RAY_health_check_failure_threshold"] + knob["RAY_health_check_timeout_ms"]
    return 2 * one_detection_ms / 1000 + 5.0


def ray_program(cluster: ClusterSection, vllm: VllmSection) -> Path:
    """`cluster.ray`, or the `ray` next to the vllm program: Ray must be the one vLLM imports."""
    return cluster.ray or vllm.program.parent / "ray"


def ray_argv(cluster: ClusterSection, vllm: VllmSection, node_ip: str) -> list[str]:
    """`ray start ... --block`: it stays in the foreground and exits when any of its processes dies."""
    argv = [str(ray_program(cluster, vllm)), "start", "--block", f"--node-ip-address={node_ip}"]
    if cluster.role == "head":
        argv += ["--head", f"--port={cluster.port}", "--include-dashboard=false"]
    else:
        argv += [f"--address={cluster.head_address}:{cluster.port}"]
    return argv + ["--disable-usage-stats", *cluster.ray_args]


def cluster_env(cluster: ClusterSection, interface: str, node_ip: str) -> dict[str, str]:
    """The variables for `ray start` on both machines and for `vllm serve` on the head."""
    env = {name: interface for name in INTERFACE_VARIABLES}
    env.update(
        VLLM_HOST_IP=node_ip,
        MASTER_ADDR=str(cluster.head_address),
        RAY_ADDRESS=f"{cluster.head_address}:{cluster.port}",
        # Ray's memory monitor counts GB10's page cache as used memory and kills vLLM's workers.
        RAY_memory_monitor_refresh_ms="0",
        # The journal wants plain text, and every worker's line, not one per group of look-alikes.
        RAY_COLOR_PREFIX="0",
        RAY_DEDUP_LOGS="0",
    )
    return env


def vllm_flags(cluster: ClusterSection) -> list[str]:
    """What the head adds to `vllm serve`: one tensor-parallel rank per machine (one GPU each), over Ray."""
    if cluster.role != "head":
        return []
    return ["--tensor-parallel-size", str(cluster.nodes), "--distributed-executor-backend", "ray"]


# --- what the cluster looks like (from gb10d/launch/raywatch.py's lines) ---------------


@dataclass(frozen=True)
class Node:
    """One entry of the head's node table (Ray's GCS), as the watcher reported it."""

    node_id: str
    ip: str
    alive: bool
    head: bool
    gpus: float
    death: str = ""  # Ray's own words for why a dead node died
    started: float = 0.0  # when its raylet registered (Unix time, that machine's clock)

    def named(self) -> str:
        return f"the {'head' if self.head else 'worker'} {self.ip}"


@dataclass(frozen=True)
class View:
    """The node table at one moment, or why it could not be read (`error`)."""

    nodes: tuple[Node, ...] = ()
    error: str | None = None

    def serving_nodes(self) -> list[Node]:
        """Alive machines with a GPU: those vLLM can place a rank on."""
        return [node for node in self.nodes if node.alive and node.gpus >= 1]


def parse_view(line: str) -> View:
    """One watcher line; ValueError for anything else (the shell logs and ignores it)."""
    try:
        data = json.loads(line)
        if "error" in data:
            return View(error=str(data["error"]))
        return View(tuple(
            Node(str(n["id"]), str(n["ip"]), bool(n["alive"]), bool(n["head"]), float(n["gpus"]), str(n.get("death") or ""), float(n.get("started") or 0))
            for n in data["nodes"]
        ))
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a node table: {line[:200]!r} ({exc})") from None


def is_whole(view: View | None, cluster: ClusterSection) -> bool:
    """Whether the head can start vLLM: `nodes` machines with a GPU are alive."""
    return view is not None and len(view.serving_nodes()) >= cluster.nodes


def has_joined(view: View | None, node_ip: str, since: float) -> bool:
    """Whether the head's table lists this machine's Ray, started at `since` or later, alive with its GPU.

    The worker's readiness. `since` tells this Ray from the one before it:
    the head lists a Ray that was killed as alive for a few seconds more,
    until its health checks fail.
    """
    return view is not None and any(node.ip == node_ip and node.started >= since for node in view.serving_nodes())


def departed(before: View | None, after: View) -> list[Node]:
    """Machines that served in `before` and do not in `after`, with Ray's reason where it gave one."""
    if before is None:
        return []
    now_serving = {node.node_id for node in after.serving_nodes()}
    latest = {node.node_id: node for node in after.nodes}
    return [latest.get(node.node_id, node) for node in before.serving_nodes() if node.node_id not in now_serving]


def lost_since(start: View | None, now: View | None, cluster: ClusterSection) -> bool:
    """Whether a vLLM placed on the machines of `start` cannot serve on `now`.

    It cannot when the cluster is not whole, or when one of those machines
    left even if another joined since: its rank was on the one that left.
    """
    return not is_whole(now, cluster) or (now is not None and bool(departed(start, now)))


def lost_text(before: View | None, after: View, cluster: ClusterSection) -> str:
    """Why vLLM on `before` cannot serve on `after`, for the journal: which machine left and Ray's reason, or the GCS error."""
    if after.error:
        return after.error
    gone = departed(before, after)
    if gone:
        return "; ".join(node.named() + " left the Ray cluster" + (f" ({node.death})" if node.death else "") for node in gone)
    return f"only {len(after.serving_nodes())} of {cluster.nodes} machines with a GPU are in the Ray cluster"


def view_text(view: View | None, cluster: ClusterSection) -> str:
    """`2 of 2 machines up: 10.0.0.1 (head), 10.0.0.2`, for STATUS= and the journal."""
    if view is None:
        return "the Ray cluster's node table is not read yet"
    if view.error:
        return view.error
    up = view.serving_nodes()
    listed = ", ".join(f"{node.ip} (head)" if node.head else node.ip for node in up) or "none"
    return f"{len(up)} of {cluster.nodes} machines with a GPU up: {listed}"


def waiting_text(view: View | None, cluster: ClusterSection) -> str:
    """What this machine waits for, in words an operator acts on."""
    if cluster.role == "head":
        return f"waiting for the Ray cluster: {view_text(view, cluster)}; start gb10d on the other machine(s)"
    return f"waiting to join the Ray cluster at {cluster.head_address}:{cluster.port}: {view_text(view, cluster)}"


def view_state(view: View | None, cluster: ClusterSection, node_ip: str, interface: str) -> ClusterRecord:
    """The `cluster` object of the state file, read by `gb10d status` on either machine."""
    return ClusterRecord(
        role=cluster.role,
        head_address=f"{cluster.head_address}:{cluster.port}",
        node_ip=node_ip,
        interface=interface,
        nodes_wanted=cluster.nodes,
        error=view.error if view else None,
        nodes=tuple(NodeRecord(node.ip, node.head, node.gpus) for node in (view.serving_nodes() if view else [])),
    )


def watcher_argv(python: Path, cluster: ClusterSection) -> list[str]:
    """The node-table watcher (gb10d/launch/raywatch.py), run by Ray's own Python (`-I`: nothing from gb10d's environment leaks in)."""
    raywatch = Path(__file__).parents[1] / "launch" / "raywatch.py"
    return [str(python), "-I", str(raywatch), f"{cluster.head_address}:{cluster.port}"]


def interpreter(ray_script: str, ray: Path) -> Path:
    """The Python that runs the `ray` program: its `#!` line, else the `python3` beside it."""
    words = ray_script.split("\n", 1)[0][2:].split() if ray_script.startswith("#!") else []
    # `#!/usr/bin/env python3` and pip's `#!/bin/sh` trampoline for long paths name no usable path.
    if words and words[0].startswith("/") and "python" in Path(words[0]).name:
        return Path(words[0])
    return ray.with_name("python3")
