"""[cluster]: the table both machines of a Ray pair carry, and the commands gb10d derives from it.

The config is validated with located errors, `gb10d print-command` shows
each machine's `ray start` with the interface variables and the head's
`vllm serve` with its parallel flags, and check-config wants the `ray`
program. How `gb10d run` drives the pair: tests/daemon/test_pair.py.
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from config_support import make_config, write_config
from gb10d.base.command import build_argv
from gb10d.base.configload import parse_config
from gb10d.base.errors import ConfigError
from gb10d.core.cluster import (
    INTERFACE_VARIABLES,
    LINK_WAIT_S,
    Node,
    View,
    cluster_env,
    death_notice_s,
    departed,
    has_joined,
    interpreter,
    is_whole,
    lost_since,
    lost_text,
    parse_view,
    ray_argv,
    ray_program,
    view_state,
    view_text,
    vllm_flags,
    waiting_text,
    waits_for_link,
    watcher_argv,
)
from gb10d.core.statefile import StateRecord

config = partial(make_config, {
    "vllm": {"venv": "/opt/vllm", "model": "Qwen/Qwen3-235B-A22B-FP8"},
    "cluster": {"role": "head", "head_address": "10.0.0.1"},
})


def problems(data: dict[str, object], text: str = "") -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "/etc/gb10d.toml", text)
    return [str(p) for p in caught.value.problems]


def test_a_single_machine_config_has_no_cluster() -> None:
    assert parse_config({"vllm": {"venv": "/opt/vllm", "model": "m"}}).cluster is None


def test_ray_comes_from_the_same_venv_as_vllm_unless_set() -> None:
    c = config()
    assert c.cluster is not None
    assert ray_program(c.cluster, c.vllm) == Path("/opt/vllm/bin/ray")
    other = config(cluster={"ray": "/opt/ray/bin/ray"})
    assert other.cluster is not None and ray_program(other.cluster, other.vllm) == Path("/opt/ray/bin/ray")


def test_the_head_runs_a_blocking_ray_head_on_its_link_address() -> None:
    c = config(cluster={"ray_args": ["--num-gpus=1"]})
    assert c.cluster is not None
    assert ray_argv(c.cluster, c.vllm, "10.0.0.1") == [
        "/opt/vllm/bin/ray", "start", "--block", "--node-ip-address=10.0.0.1",
        "--head", "--port=6379", "--include-dashboard=false", "--disable-usage-stats", "--num-gpus=1",
    ]


def test_the_worker_joins_the_head_address_and_port() -> None:
    c = config(cluster={"role": "worker", "port": 6380})
    assert c.cluster is not None
    assert ray_argv(c.cluster, c.vllm, "10.0.0.2") == [
        "/opt/vllm/bin/ray", "start", "--block", "--node-ip-address=10.0.0.2", "--address=10.0.0.1:6380", "--disable-usage-stats",
    ]


def test_both_machines_pin_every_transport_to_the_link_and_switch_off_rays_memory_monitor() -> None:
    c = config(cluster={"role": "worker"})
    assert c.cluster is not None
    env = cluster_env(c.cluster, "enp1s0f0np0", "10.0.0.2")
    assert {name: env[name] for name in INTERFACE_VARIABLES} == dict.fromkeys(INTERFACE_VARIABLES, "enp1s0f0np0")
    assert (env["VLLM_HOST_IP"], env["MASTER_ADDR"], env["RAY_ADDRESS"]) == ("10.0.0.2", "10.0.0.1", "10.0.0.1:6379")
    assert env["RAY_memory_monitor_refresh_ms"] == "0"


def test_the_head_serves_with_one_tensor_parallel_rank_per_machine_over_ray() -> None:
    c = config(cluster={"nodes": 2})
    assert c.cluster is not None
    argv = build_argv(c.vllm, cluster_flags=vllm_flags(c.cluster))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
    worker = config(cluster={"role": "worker"})
    assert worker.cluster is not None and vllm_flags(worker.cluster) == []


def test_a_parallel_size_in_vllm_args_on_the_head_is_refused_at_its_line() -> None:
    text = '[vllm]\nvenv = "/opt/vllm"\nmodel = "m"\n[vllm.args]\ntensor-parallel-size = 2\n[cluster]\nrole = "head"\nhead_address = "10.0.0.1"\n'
    found = problems({"vllm": {"venv": "/opt/vllm", "model": "m", "args": {"tensor-parallel-size": 2}},
                      "cluster": {"role": "head", "head_address": "10.0.0.1"}}, text)
    assert found == ["/etc/gb10d.toml:5: vllm.args.tensor-parallel-size: is set by gb10d on the cluster head "
                     "(--tensor-parallel-size 2 from cluster.nodes, --distributed-executor-backend ray); remove it"]


def test_a_malformed_head_address_is_refused_with_an_example() -> None:
    (found,) = problems({"vllm": {"venv": "/opt/vllm", "model": "m"}, "cluster": {"role": "worker", "head_address": "10.0.0"}})
    assert "cluster.head_address: must be the head's IPv4 address on the link between the machines, e.g. \"10.0.0.1\" (got '10.0.0')" in found


def test_ray_args_may_not_repeat_what_gb10d_derives() -> None:
    (found,) = problems({"vllm": {"venv": "/opt/vllm", "model": "m"},
                         "cluster": {"role": "worker", "head_address": "10.0.0.1", "ray_args": ["--address=10.0.0.9:6379"]}})
    assert "cluster.ray_args: --address is set by gb10d from cluster.role, cluster.head_address and cluster.port" in found


def test_an_unknown_role_and_a_one_machine_cluster_are_refused() -> None:
    found = problems({"vllm": {"venv": "/opt/vllm", "model": "m"}, "cluster": {"role": "master", "head_address": "10.0.0.1", "nodes": 1}})
    assert any(p.startswith("/etc/gb10d.toml: cluster.role:") for p in found)
    assert any(p.startswith("/etc/gb10d.toml: cluster.nodes:") for p in found)


# --- through the CLI ----------------------------------------------------------

def cluster_config(tmp_path: Path, role: str) -> Path:
    """A gb10d.toml for this role whose vLLM is a stub in tmp_path/bin (the ray program beside it is not there)."""
    vllm = tmp_path / "bin" / "vllm"
    vllm.parent.mkdir(exist_ok=True)
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    return write_config(
        tmp_path / f"{role}.toml",
        vllm={"executable": str(vllm), "model": "m"},
        cluster={"role": role, "head_address": "10.213.60.1", "ray_args": ["--num-gpus=1"]},
    )


def gb10d(*args: str, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, sys.executable, "-m", "gb10d", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_check_config_wants_the_ray_program_beside_vllm(tmp_path: Path) -> None:
    done = gb10d("check-config", "--config", str(cluster_config(tmp_path, "worker")))
    assert done.returncode == 78
    assert f"vllm.executable: {tmp_path / 'bin' / 'ray'} does not exist; is that the path of the ray program?" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_print_command_shows_each_machines_ray_start_on_the_link_and_says_why(tmp_path: Path, link: tuple[str, str]) -> None:
    head_ns, worker_ns = link
    head = gb10d("print-command", "--config", str(cluster_config(tmp_path, "head")), netns=head_ns)
    assert head.returncode == 0, head.stderr
    ray_line, vllm_line = head.stdout.splitlines()
    assert "NCCL_SOCKET_IFNAME=gb10c-h" in ray_line and "VLLM_HOST_IP=10.213.60.1" in ray_line
    assert ray_line.endswith("ray start --block --node-ip-address=10.213.60.1 --head --port=6379 --include-dashboard=false --disable-usage-stats --num-gpus=1")
    assert "RAY_ADDRESS=10.213.60.1:6379" in vllm_line
    assert vllm_line.endswith("--tensor-parallel-size 2 --distributed-executor-backend ray")
    assert "cluster head: using gb10c-h (10.213.60.1) because it carries cluster.head_address 10.213.60.1" in head.stderr

    worker = gb10d("print-command", "--config", str(cluster_config(tmp_path, "worker")), netns=worker_ns)
    assert worker.returncode == 0, worker.stderr
    (line,) = worker.stdout.splitlines()
    assert "VLLM_HOST_IP=10.213.60.2" in line and line.endswith("--address=10.213.60.1:6379 --disable-usage-stats --num-gpus=1")
    assert "because the head 10.213.60.1 is on its subnet 10.213.60.0/24" in worker.stderr


@pytest.mark.slow
def test_print_command_on_a_machine_without_the_head_address_says_which_interfaces_it_has(tmp_path: Path, link: tuple[str, str]) -> None:
    _, worker_ns = link
    done = gb10d("print-command", "--config", str(cluster_config(tmp_path, "head")), netns=worker_ns)
    assert done.returncode == 78
    assert "cluster.head_address: 10.213.60.1 is not an address of this machine" in done.stderr
    assert "gb10c-w: 10.213.60.2/24" in done.stderr


# --- the node table -----------------------------------------------------------

HEAD = Node("a1", "10.0.0.1", True, True, 1.0, started=100.0)
WORKER = Node("b2", "10.0.0.2", True, False, 1.0, started=200.0)
WHOLE = View((HEAD, WORKER))


def test_the_watchers_line_becomes_a_node_table_and_anything_else_is_refused() -> None:
    line = ('{"nodes": [{"id": "a1", "ip": "10.0.0.1", "alive": true, "head": true, "gpus": 1.0, "death": "", "started": 100.0}, '
            '{"id": "b2", "ip": "10.0.0.2", "alive": true, "head": false, "gpus": 1.0, "started": 200.0}]}')
    assert parse_view(line) == WHOLE
    assert parse_view('{"error": "GCS does not answer (timeout)"}').error == "GCS does not answer (timeout)"
    for garbage in ("", "Traceback (most recent call last):", '{"nodes": [{"ip": "10.0.0.1"}]}', "[1, 2]"):
        with pytest.raises(ValueError, match="not a node table"):
            parse_view(garbage)


def test_the_cluster_is_whole_with_as_many_machines_alive_with_a_gpu_as_nodes() -> None:
    cluster = config().cluster
    assert cluster is not None
    assert is_whole(WHOLE, cluster)
    assert not is_whole(None, cluster) and not is_whole(View(error="unreachable"), cluster)
    assert not is_whole(View((HEAD, Node("b2", "10.0.0.2", True, False, 0.0))), cluster)  # a Ray started without its GPU
    assert not is_whole(View((HEAD, Node("b2", "10.0.0.2", False, False, 1.0))), cluster)


def test_the_worker_has_joined_only_when_the_ray_it_started_last_is_listed() -> None:
    assert has_joined(WHOLE, "10.0.0.2", since=200.0)
    # The head still lists the Ray that was killed (started at 200) for a few seconds; it is not the new one.
    assert not has_joined(WHOLE, "10.0.0.2", since=250.0)
    assert not has_joined(WHOLE, "10.0.0.3", since=0.0) and not has_joined(None, "10.0.0.2", since=0.0)


def test_a_departed_machine_is_named_with_rays_reason() -> None:
    cluster = config().cluster
    assert cluster is not None
    dead = View((HEAD, Node("b2", "10.0.0.2", False, False, 1.0, "health check failed due to missing too many heartbeats")))
    assert departed(WHOLE, dead) == [dead.nodes[1]]
    assert lost_text(WHOLE, dead, cluster) == "the worker 10.0.0.2 left the Ray cluster (health check failed due to missing too many heartbeats)"
    assert lost_text(WHOLE, View((HEAD,)), cluster) == "the worker 10.0.0.2 left the Ray cluster"
    assert lost_text(None, View((HEAD,)), cluster) == "only 1 of 2 machines with a GPU are in the Ray cluster"
    assert lost_text(WHOLE, View(error="GCS does not answer"), cluster) == "GCS does not answer"


def test_vllm_placed_on_a_machine_that_left_cannot_serve_even_when_another_took_its_place() -> None:
    cluster = config().cluster
    assert cluster is not None
    assert not lost_since(WHOLE, WHOLE, cluster)
    assert lost_since(WHOLE, View((HEAD,)), cluster)
    rejoined = View((HEAD, Node("c3", "10.0.0.2", True, False, 1.0, started=300.0), Node("b2", "10.0.0.2", False, False, 1.0)))
    assert is_whole(rejoined, cluster) and lost_since(WHOLE, rejoined, cluster)
    assert not lost_since(rejoined, rejoined, cluster)


def test_status_texts_say_what_each_machine_waits_for() -> None:
    head, worker = config().cluster, config(cluster={"role": "worker"}).cluster
    assert head is not None and worker is not None
    assert view_text(WHOLE, head) == "2 of 2 machines with a GPU up: 10.0.0.1 (head), 10.0.0.2"
    assert view_text(None, head) == "the Ray cluster's node table is not read yet"
    assert waiting_text(View((HEAD,)), head) == (
        "waiting for the Ray cluster: 1 of 2 machines with a GPU up: 10.0.0.1 (head); start gb10d on the other machine(s)"
    )
    assert waiting_text(View(error="GCS does not answer"), worker) == "waiting to join the Ray cluster at 10.0.0.1:6379: GCS does not answer"


def test_the_state_file_lists_the_machines_serving_for_gb10d_status() -> None:
    cluster = config(cluster={"role": "worker"}).cluster
    assert cluster is not None
    record = StateRecord(cluster=view_state(View((HEAD, Node("b2", "10.0.0.2", False, False, 1.0))), cluster, "10.0.0.2", "enp1s0f0np0"))
    assert record.to_json()["cluster"] == {
        "role": "worker",
        "head_address": "10.0.0.1:6379",
        "node_ip": "10.0.0.2",
        "interface": "enp1s0f0np0",
        "nodes_wanted": 2,
        "error": None,
        "nodes": [{"ip": "10.0.0.1", "head": True, "gpus": 1.0}],
    }


@pytest.mark.slow
def test_the_watcher_runs_in_rays_own_python_isolated_from_gb10d() -> None:
    cluster = config().cluster
    assert cluster is not None
    ray = Path("/opt/vllm/bin/ray")
    assert interpreter("#!/opt/vllm/bin/python3.12\nimport sys\n", ray) == Path("/opt/vllm/bin/python3.12")
    # pip's trampoline for long paths, and `env`, name no usable interpreter: the venv's python3 is it.
    assert interpreter("#!/bin/sh\n'''exec' \"/very/long/venv/bin/python3\" \"$0\" \"$@\"\n", ray) == Path("/opt/vllm/bin/python3")
    assert interpreter("#!/usr/bin/env python3\n", ray) == Path("/opt/vllm/bin/python3")
    argv = watcher_argv(Path("/opt/vllm/bin/python3"), cluster)
    assert argv[:2] == ["/opt/vllm/bin/python3", "-I"] and argv[2].endswith("gb10d/launch/raywatch.py") and argv[3] == "10.0.0.1:6379"


def test_the_wait_for_rays_verdict_on_a_machine_follows_its_health_check_settings() -> None:
    assert death_notice_s({}) == 55.0  # Ray's defaults: 5 checks 3 s apart, the last timing out after 10 s
    fast = {"RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "1000", "RAY_health_check_failure_threshold": "3"}
    assert death_notice_s(fast) == 10.0
    assert death_notice_s({"RAY_health_check_period_ms": "soon"}) == 55.0


def test_a_link_not_up_yet_is_waited_for_two_minutes_then_its_absence_is_the_answer() -> None:
    assert LINK_WAIT_S == 120.0
    assert waits_for_link(0.0) and waits_for_link(119.9)
    assert not waits_for_link(120.0)
