"""[cluster]: the table both machines of a Ray pair carry, and the commands gb10d derives from it.

The config is validated with located errors, `gb10d print-command` shows
each machine's `ray start` with the interface variables and the head's
`vllm serve` with its parallel flags, and check-config wants the `ray`
program. How `gb10d run` drives the pair: tests/test_pair.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gb10d.cluster import INTERFACE_VARIABLES, cluster_env, ray_argv, ray_program, vllm_flags
from gb10d.command import build_argv
from gb10d.config import Config, parse_config
from gb10d.errors import ConfigError


def config(role: str = "head", **cluster: object) -> Config:
    return parse_config({
        "vllm": {"venv": "/opt/vllm", "model": "Qwen/Qwen3-235B-A22B-FP8"},
        "cluster": {"role": role, "head_address": "10.0.0.1", **cluster},
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
    other = config(ray="/opt/ray/bin/ray")
    assert other.cluster is not None and ray_program(other.cluster, other.vllm) == Path("/opt/ray/bin/ray")


def test_the_head_runs_a_blocking_ray_head_on_its_link_address() -> None:
    c = config(ray_args=["--num-gpus=1"])
    assert c.cluster is not None
    assert ray_argv(c.cluster, c.vllm, "10.0.0.1") == [
        "/opt/vllm/bin/ray", "start", "--block", "--node-ip-address=10.0.0.1",
        "--head", "--port=6379", "--include-dashboard=false", "--disable-usage-stats", "--num-gpus=1",
    ]


def test_the_worker_joins_the_head_address_and_port() -> None:
    c = config("worker", port=6380)
    assert c.cluster is not None
    assert ray_argv(c.cluster, c.vllm, "10.0.0.2") == [
        "/opt/vllm/bin/ray", "start", "--block", "--node-ip-address=10.0.0.2", "--address=10.0.0.1:6380", "--disable-usage-stats",
    ]


def test_both_machines_pin_every_transport_to_the_link_and_switch_off_rays_memory_monitor() -> None:
    c = config("worker")
    assert c.cluster is not None
    env = cluster_env(c.cluster, "enp1s0f0np0", "10.0.0.2")
    assert {name: env[name] for name in INTERFACE_VARIABLES} == dict.fromkeys(INTERFACE_VARIABLES, "enp1s0f0np0")
    assert (env["VLLM_HOST_IP"], env["MASTER_ADDR"], env["RAY_ADDRESS"]) == ("10.0.0.2", "10.0.0.1", "10.0.0.1:6379")
    assert env["RAY_memory_monitor_refresh_ms"] == "0"


def test_the_head_serves_with_one_tensor_parallel_rank_per_machine_over_ray() -> None:
    c = config(nodes=2)
    assert c.cluster is not None
    argv = build_argv(c.vllm, cluster_flags=vllm_flags(c.cluster))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"
    worker = config("worker")
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

CLUSTER_TOML = """\
[vllm]
executable = "{vllm}"
model = "m"

[cluster]
role = "{role}"
head_address = "10.213.60.1"
ray_args = ["--num-gpus=1"]
"""


def write_config(tmp_path: Path, role: str) -> Path:
    vllm = tmp_path / "bin" / "vllm"
    vllm.parent.mkdir(exist_ok=True)
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    path = tmp_path / f"{role}.toml"
    path.write_text(CLUSTER_TOML.format(vllm=vllm, role=role))
    return path


def gb10d(*args: str, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, sys.executable, "-m", "gb10d", *args], capture_output=True, text=True, timeout=60)


def test_check_config_wants_the_ray_program_beside_vllm(tmp_path: Path) -> None:
    done = gb10d("check-config", "--config", str(write_config(tmp_path, "worker")))
    assert done.returncode == 78
    assert f"vllm.executable: {tmp_path / 'bin' / 'ray'} does not exist; is that the path of the ray program?" in done.stderr
    assert "Traceback" not in done.stderr


def test_print_command_shows_each_machines_ray_start_on_the_link_and_says_why(tmp_path: Path, link: tuple[str, str]) -> None:
    head_ns, worker_ns = link
    head = gb10d("print-command", "--config", str(write_config(tmp_path, "head")), netns=head_ns)
    assert head.returncode == 0, head.stderr
    ray_line, vllm_line = head.stdout.splitlines()
    assert "NCCL_SOCKET_IFNAME=gb10c-h" in ray_line and "VLLM_HOST_IP=10.213.60.1" in ray_line
    assert ray_line.endswith("ray start --block --node-ip-address=10.213.60.1 --head --port=6379 --include-dashboard=false --disable-usage-stats --num-gpus=1")
    assert "RAY_ADDRESS=10.213.60.1:6379" in vllm_line
    assert vllm_line.endswith("--tensor-parallel-size 2 --distributed-executor-backend ray")
    assert "cluster head: using gb10c-h (10.213.60.1) because it carries cluster.head_address 10.213.60.1" in head.stderr

    worker = gb10d("print-command", "--config", str(write_config(tmp_path, "worker")), netns=worker_ns)
    assert worker.returncode == 0, worker.stderr
    (line,) = worker.stdout.splitlines()
    assert "VLLM_HOST_IP=10.213.60.2" in line and line.endswith("--address=10.213.60.1:6379 --disable-usage-stats --num-gpus=1")
    assert "because the head 10.213.60.1 is on its subnet 10.213.60.0/24" in worker.stderr


def test_print_command_on_a_machine_without_the_head_address_says_which_interfaces_it_has(tmp_path: Path, link: tuple[str, str]) -> None:
    _, worker_ns = link
    done = gb10d("print-command", "--config", str(write_config(tmp_path, "head")), netns=worker_ns)
    assert done.returncode == 78
    assert "cluster.head_address: 10.213.60.1 is not an address of this machine" in done.stderr
    assert "gb10c-w: 10.213.60.2/24" in done.stderr
