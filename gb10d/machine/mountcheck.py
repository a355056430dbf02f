"""What vLLM in a container will find: every path it reads, resolved through the container's mounts to this host.

A path in the config of an image is a path inside the container. The model
directory, the Hugging Face cache the image's environment points to, and
every absolute path among `vllm.args` are looked up on this host through
the mounts gb10d gives the container (`command.container_mounts`); what no
mount shows, or what the mount shows missing, vLLM will not find. Access
rights are not checked: the engine mounts as root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..base.command import HF_CACHE_VARIABLES, container_mounts, host_path
from ..base.config import Config
from ..base.hfcache import cached_snapshot, hub_cache, hub_cache_source, is_repo_id, offline


@dataclass(frozen=True)
class Unseen:
    """Something vLLM will not find in the container: the key that names it, why, and whether the start cannot succeed."""

    key: str
    message: str
    fatal: bool


def unseen_in_container(config: Config, env: Mapping[str, str]) -> list[Unseen]:
    """What vLLM will not find through the container's mounts; `env` is vLLM's environment (env_additions)."""
    vllm = config.vllm
    found: list[Unseen] = []
    if vllm.model.startswith("/"):
        found += _path(config, "vllm.model", vllm.model, "the model directory")
    elif is_repo_id(vllm.model) and vllm.arg("download-dir") is None:
        found += _hub(config, env)
    for key, value in vllm.args.items():
        if isinstance(value, str) and value.startswith("/"):
            found += _path(config, f"vllm.args.{key}", value, f"--{key}")
    return found


def _mount_list(config: Config) -> str:
    return ", ".join(m.split(":")[1] for m in container_mounts(config))


def _host_side(inside: str) -> str:
    """The host side to suggest for a mount: the same path when this host has it, else a placeholder."""
    return inside if os.path.lexists(inside) else "HOST_PATH"


def _path(config: Config, key: str, inside: str, what: str) -> list[Unseen]:
    host = host_path(config, inside)
    if host is None:
        return [Unseen(key, f"{what} {inside} is in none of the container's mounts ({_mount_list(config)}), so vLLM will not find it; "
                            f"add \"{_host_side(inside)}:{inside}:ro\" to container.mounts", True)]
    if not os.path.lexists(host):
        return [Unseen(key, f"{what} {inside} is {host} on this host, through the container's mounts, and that does not exist", True)]
    return []


def _hub(config: Config, env: Mapping[str, str]) -> list[Unseen]:
    """The Hugging Face cache inside the container: shown by a mount, and holding the model when vLLM may not download."""
    model = config.vllm.model
    inside_env = {name: env[name] for name in HF_CACHE_VARIABLES if name in env}
    inside = hub_cache(inside_env, "/root")
    source = hub_cache_source(inside_env)
    key = f"vllm.env.{source}" if source in config.vllm.env else "vllm.model"
    host = host_path(config, inside)
    if host is None:
        if offline(env):
            return [Unseen(key, f"vLLM looks for {model} in {inside} inside the container ({source}), which none of its mounts "
                                f"({_mount_list(config)}) shows, and HF_HUB_OFFLINE=1 keeps it from downloading: it will not find the model; "
                                f"mount the cache that holds it there: add \"{_host_side(inside)}:{inside}:ro\" to container.mounts", True)]
        return [Unseen(key, f"vLLM downloads {model} into {inside} inside the container, which none of its mounts shows: "
                            "the download is lost with the container, at every start", False)]
    if offline(env) and cached_snapshot(host, model) is None:
        return [Unseen(key, f"{model} is not in {host}, the cache vLLM sees as {inside} in the container, and HF_HUB_OFFLINE=1 "
                            "keeps it from downloading; download it there first, or mount the cache that has it", True)]
    return []
