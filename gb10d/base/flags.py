"""The flags of the programs gb10d starts that gb10d.toml's keys own: vllm serve's, ray start's, docker run's.

A flag set by a key of its own (`vllm.port` is `--port`), or derived by gb10d
(the head's `--tensor-parallel-size`, the container's `--name`), must not be
set a second time in `vllm.args`, `vllm.extra_args`, `cluster.ray_args` or
`container.run_args`; these tables say which flags those are and why. Apart
from the schema because the command line (command.py), reload and learned
settings read them too, and `normalize_flag` is how every part spells a flag.
"""

from __future__ import annotations

import re

# `docker run` / `podman run` options gb10d sets itself from [container], [vllm] and [daemon]; another
# value in run_args would contradict what gb10d believes (the name it removes, the port it probes).
CONTAINER_OWNED_OPTIONS = {
    "--name": "gb10d names the container after its config (container.name)",
    "--rm": "gb10d removes the container itself, after reading how it ended",
    "-d": "gb10d stays attached to read vLLM's output", "--detach": "gb10d stays attached to read vLLM's output",
    "-i": "vLLM reads no input", "--interactive": "vLLM reads no input",
    "-t": "a terminal would mix vLLM's two streams", "--tty": "a terminal would mix vLLM's two streams",
    "-a": "gb10d attaches stdout and stderr", "--attach": "gb10d attaches stdout and stderr",
    "--network": "the container uses the host's network, so vllm.port is the host's port",
    "--net": "the container uses the host's network, so vllm.port is the host's port",
    "-p": "the container uses the host's network: vllm.port is already the host's port",
    "--publish": "the container uses the host's network: vllm.port is already the host's port",
    "-P": "the container uses the host's network: vllm.port is already the host's port",
    "--publish-all": "the container uses the host's network: vllm.port is already the host's port",
    "--ipc": "set container.shm_size instead of the default --ipc=host",
    "--shm-size": "set container.shm_size",
    "--init": "set container.init",
    "--gpus": "set container.gpu",
    "--pull": "set container.pull",
    "--stop-timeout": "set daemon.stop_timeout_s",
    "--log-driver": "vLLM's output goes to the journal through gb10d",
}

# `ray start` flags gb10d derives from [cluster]; a second value in ray_args would contradict them.
RAY_OWNED_FLAGS = {"--head", "--address", "--port", "--node-ip-address", "--block"}
# vLLM flags the head sets from [cluster]: the tensor-parallel size is the number of machines, the backend Ray.
CLUSTER_VLLM_FLAGS = ("tensor-parallel-size", "distributed-executor-backend")

# Flags owned by a first-class [vllm] key; setting them in args would be ambiguous.
FIRST_CLASS_FLAGS = {
    "host": "host",
    "port": "port",
    "served-model-name": "served_model_name",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "model": "model",
}

# Flags gb10d must know the value of (to probe, to tune), so a raw extra_args
# word would silently override what gb10d believes.
MANAGED_FLAGS = {
    **{flag: f"vllm.{key}" for flag, key in FIRST_CLASS_FLAGS.items()},
    "max-model-len": "vllm.args.max-model-len",
    "safetensors-load-strategy": "vllm.args.safetensors-load-strategy",
}

FLAG_NAME = re.compile(r"[a-z0-9][a-z0-9-]*(\.[A-Za-z0-9_-]+)*")


def normalize_flag(key: str) -> str:
    """`max_model_len`, `max-model-len` and `--max-model-len` all name the flag `max-model-len`.

    Only the part before the first dot is normalised, as vLLM does: in
    `speculative-config.num_speculative_tokens` the part after the dot is a
    JSON field name and keeps its underscores.
    """
    name, dot, rest = key.lstrip("-").partition(".")
    return name.replace("_", "-").lower() + dot + rest
