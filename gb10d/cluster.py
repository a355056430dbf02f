"""The Ray side of a pair of GB10s: the `ray start` command and the variables both machines need.

Pure: it takes the `[cluster]` table and the interface chosen for the link
(gb10d.interfaces) and returns argv and environment. vLLM's workers inherit
their environment from the Ray node they run on, so the same interface
variables go to `ray start` on both machines and to `vllm serve` on the head.
"""

from __future__ import annotations

from pathlib import Path

from .config import ClusterSection, VllmSection

# Where NCCL, Gloo, PyTorch's TensorPipe, UCX and Open MPI send traffic between the machines:
# all of them must use the ConnectX-7 link, or tensor-parallel traffic crawls over the management port.
INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES", "OMPI_MCA_btl_tcp_if_include")


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
