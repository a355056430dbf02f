"""A pair's head in one process and virtual time: when vLLM may start, and a machine that leaves.

The head's Pair, Supervisor and Reporter are gb10d's own, and its link is
found on this machine's loopback interface; Ray is scripted (`ScriptedRay`):
the test says what Ray's node table shows. Ray itself, the worker's side
and the link between two network namespaces stay in test_pair.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.core.cluster import View
from harness import Setup
from shell_support import Script, Shell, VirtualClock, finish, healthy_start, node, run_virtual, start_shell

HEALTHY = healthy_start()
HEAD = node("127.0.0.1", head=True)
WORKER = node("10.0.0.2")


def head(tmp_path: Path) -> Setup:
    """The head of a pair of two, on loopback; its Ray program is never run (the table is scripted)."""
    ray = tmp_path / "ray"
    ray.write_text("#!/bin/sh\n")
    cluster = {"cluster.role": "head", "cluster.head_address": "127.0.0.1", "cluster.interface": "lo", "cluster.ray": str(ray)}
    return Setup(tmp_path, extra=cluster)


async def waiting(shell: Shell) -> None:
    await shell.until(lambda: bool(shell.said(r"waiting for the Ray cluster")), "the head waiting for the cluster")


def test_the_head_waits_for_the_worker_then_starts_vllm_across_the_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(head(tmp_path), [Script(HEALTHY)], clock)
        try:
            await waiting(shell)
            assert shell.said(r"^<6>gb10d: cluster head: using lo \(127\.0\.0\.1\)")
            shell.ray.table(View((HEAD,)))
            await shell.until(lambda: any("1 of 2 machines" in s for s in shell.notify.statuses()), "STATUS= following the table")
            assert not shell.launcher.argvs, "no start before the cluster is whole"
            # The wait may be long (the other machine is off): systemd's start timeout is extended meanwhile.
            clock_before = clock.now
            await shell.until(lambda: clock.now - clock_before > 120, "two minutes of waiting", within_s=200)
            assert shell.notify.count("EXTEND_TIMEOUT_USEC") >= 4 and not shell.launcher.argvs
            shell.ray.table(View((HEAD, WORKER)))
            await shell.ready()
            own = shell.own()
            whole = shell.said(r"the Ray cluster is whole \(2 of 2 machines with a GPU up: 127\.0\.0\.1 \(head\), 10\.0\.0\.2\); starting vLLM")
            started = shell.said(r"started vLLM as pid")
            assert whole and own.index(whole[0]) < own.index(started[0])
            argv = " ".join(shell.launcher.argvs[0])
            assert "--distributed-executor-backend ray" in argv, argv
            assert shell.launcher.envs[0].get("NCCL_SOCKET_IFNAME") == "lo", shell.launcher.envs[0]
            assert shell.metric("gb10d_cluster_nodes_up") == 2.0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)


def test_a_machine_that_leaves_stops_vllm_and_it_starts_again_uncounted_once_the_pair_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main(clock: VirtualClock) -> None:
        shell = await start_shell(head(tmp_path), [Script(HEALTHY)], clock)
        try:
            await waiting(shell)
            shell.ray.table(View((HEAD, WORKER)))
            await shell.ready()
            gone = node("10.0.0.2", alive=False, death="health check failed")
            shell.ray.table(View((HEAD, gone)))
            await shell.until(lambda: not shell.launcher.started[0].alive(), "vLLM stopped")
            assert shell.metric("gb10d_cluster_nodes_up") == 1.0
            lost = shell.said(r"^<3>gb10d: the worker 10\.0\.0\.2 left the Ray cluster \(health check failed\); stopping vLLM \(pid 4243\)")
            assert lost and "not counted as a failed attempt" in lost[0], shell.own()
            assert not shell.launcher.argvs[1:], "no start while the pair is not whole"
            shell.ray.table(View((HEAD, WORKER)))
            await shell.ready(2)
            assert shell.said(r"started vLLM as pid 4244 \(attempt 1/3,"), "the loss spent no attempt"
            assert shell.metric("gb10d_restarts_total", cause="node_lost") == 1.0
            assert shell.metric("gb10d_cluster_nodes_up") == 2.0
        finally:
            await finish(shell)

    run_virtual(monkeypatch, main)
