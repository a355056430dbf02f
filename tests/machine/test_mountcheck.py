"""check-config for an image: every path vLLM reads is looked up through the container's mounts, and what it will not find is said."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gb10d.base.command import env_additions
from gb10d.base.configload import parse_config
from gb10d.machine.mountcheck import Unseen, unseen_in_container
from hub_support import populate_hub

IMAGE = "nvcr.io/nvidia/vllm:26.05-py3"
MODEL = "Qwen/Qwen2.5-Math-1.5B-Instruct"


def unseen(vllm: dict[str, Any], container: dict[str, Any] | None = None) -> list[Unseen]:
    config = parse_config({"vllm": {"image": IMAGE, **vllm}, "container": container or {}})
    return unseen_in_container(config, env_additions(config.vllm))


def test_a_local_model_is_found_through_a_mount_of_its_parent(tmp_path: Path) -> None:
    (tmp_path / "q").mkdir()
    assert unseen({"model": "/models/q"}, {"mounts": [f"{tmp_path}:/models:ro"]}) == []
    found = unseen({"model": "/models/r"}, {"mounts": [f"{tmp_path}:/models:ro"]})
    assert found == [Unseen("vllm.model", f"the model directory /models/r is {tmp_path}/r on this host, through the container's mounts, "
                                          "and that does not exist", True)]


def test_a_path_among_the_args_that_no_mount_shows_is_named_with_its_key(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ x }}")
    found = unseen({"model": MODEL, "args": {"chat-template": str(template)}})
    assert [(u.key, u.fatal) for u in found] == [("vllm.args.chat-template", True)]
    assert found[0].message.startswith(f"--chat-template {template} is in none of the container's mounts (/root/.cache)")
    assert f'add "{template}:{template}:ro" to container.mounts' in found[0].message
    assert unseen({"model": MODEL, "args": {"chat-template": str(template)}}, {"mounts": [f"{template}:{template}:ro"]}) == []


def test_an_offline_model_in_the_mounted_cache_is_found_and_one_missing_from_it_is_not(tmp_path: Path) -> None:
    populate_hub(tmp_path / "hub", MODEL)
    mounts = {"mounts": [f"{tmp_path}:/root/.cache/huggingface"]}
    assert unseen({"model": MODEL, "env": {"HF_HUB_OFFLINE": "1"}}, mounts) == []
    found = unseen({"model": "Qwen/Other", "env": {"HF_HUB_OFFLINE": "1"}}, mounts)
    assert [(u.key, u.fatal) for u in found] == [("vllm.model", True)]
    assert found[0].message.startswith(f"Qwen/Other is not in {tmp_path}/hub, the cache vLLM sees as /root/.cache/huggingface/hub in the container")


def test_a_download_into_a_cache_no_mount_shows_is_a_warning_not_an_error() -> None:
    found = unseen({"model": MODEL, "env": {"HF_HUB_CACHE": "/hub"}})
    assert [(u.key, u.fatal) for u in found] == [("vllm.env.HF_HUB_CACHE", False)]
    assert "the download is lost with the container, at every start" in found[0].message
