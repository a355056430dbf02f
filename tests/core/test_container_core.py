"""vLLM in a container, in the pure core: what each fact about an image or a container leads to, in milliseconds.

The container's init that cannot run `vllm`, a stalled pull, Triton's ptxas
in an image, settings learned with another image, a reload that changes the
image or the container, the model's files on the host side of the mounts,
what `gb10d status` shows, and which engine error needs the operator.
"""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest

from config_support import make_config
from gb10d.base.command import Tunables, container_mounts, host_path, model_on_host
from gb10d.base.config import Config
from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP
from gb10d.cmdline.status import render
from gb10d.core.advice import status_of_give_up
from gb10d.core.learned import LearnedState, applicable, remember
from gb10d.core.outcome import Cause, Failed
from gb10d.core.policy import GiveUp, History, Retry, after_failure, classify, event_kind, failure_line, next_attempt
from gb10d.core.reload import ConfigSnapshot, diff_configs
from gb10d.core.statefile import StateRecord
from gb10d.daemon.reporter import STATUS_MAX
from gb10d.launch.engine import unreachable_status
from gb10d.vllm.events import ProgramNotRun, PtxasArchUnsupported
from gb10d.vllm.logparse import parse_line

IMAGE = "nvcr.io/nvidia/vllm:26.05-py3"
OLD = "sha256:" + "a" * 64
NEW = "sha256:" + "b" * 64


config = partial(make_config, {"vllm": {"image": IMAGE, "gpu_memory_utilization": 0.8}, "restart": {"max_attempts": 3}})


# --- an image without vllm ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "event"),
    [
        ("[FATAL tini (7)] exec vllm failed: No such file or directory", ProgramNotRun("vllm", "No such file or directory")),
        ("[FATAL tini (7)] exec vllm failed: Permission denied", ProgramNotRun("vllm", "Permission denied")),
        ("ERROR (catatonit:6): failed to exec pid1: No such file or directory", ProgramNotRun(None, "No such file or directory")),
    ],
)
def test_the_containers_init_saying_it_cannot_run_vllm_is_read_from_its_output(line: str, event: ProgramNotRun) -> None:
    # docker's init (tini) exits 127, podman's (catatonit) 1; either way only its words say why.
    assert parse_line(line) == [event]


@pytest.mark.parametrize("status", [127, 1])
def test_an_image_without_vllm_is_a_config_error_that_names_the_image(status: int) -> None:
    outcome = classify([ProgramNotRun("vllm", "No such file or directory")], status, False)
    assert outcome.cause is Cause.NO_PROGRAM
    history, decision = after_failure(outcome, Tunables(0.8), History(1), config())
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_CONFIG
    assert failure_line(outcome, decision, history, config()) == (
        f"the image {IMAGE} cannot run vllm (No such file or directory): it has no vllm program on its PATH; set vllm.image "
        "to a vLLM image (NVIDIA's is nvcr.io/nvidia/vllm:TAG); docker run --rm IMAGE vllm --version checks one"
    )
    assert event_kind(outcome.cause) == "config_error"


@pytest.mark.parametrize(("engine", "program"), [("podman", "vllm"), ("podman", None), ("auto", None)])
def test_under_podman_the_advice_for_an_image_without_vllm_names_podman(engine: str, program: str | None) -> None:
    outcome = classify([ProgramNotRun(program, "No such file or directory")], 1, False)
    _, decision = after_failure(outcome, Tunables(0.8), History(1), config(container={"engine": engine}))
    assert isinstance(decision, GiveUp)
    assert decision.message.endswith("; podman run --rm IMAGE vllm --version checks one")


def test_status_of_a_give_up_is_the_cause_and_a_pointer_to_the_journal_never_cut_mid_word() -> None:
    outcome = classify([ProgramNotRun(None, "No such file or directory")], 1, False)
    _, decision = after_failure(outcome, Tunables(0.8), History(1), config(container={"engine": "podman"}))
    assert isinstance(decision, GiveUp) and len(decision.message) > STATUS_MAX
    shown = status_of_give_up(decision.message, STATUS_MAX)
    assert shown == f"failed: the image {IMAGE} cannot run vllm (No such file or directory): it has no vllm program on its PATH; the journal says how to fix it"
    long = "word " * 80
    shown = status_of_give_up(long + "; advice", STATUS_MAX)
    assert len(shown) <= STATUS_MAX and shown.isascii() and shown.endswith("word...; the journal says how to fix it")


# --- a stalled pull ---------------------------------------------------------------------------------------------


def test_a_stalled_pull_is_pulled_again_after_the_back_off_and_counted() -> None:
    stalled = Failed(cause=Cause.PULL_STALLED, detail=f"stalled while pulling {IMAGE}: 4.10 of 9.80 GB downloaded")
    history, decision = after_failure(stalled, Tunables(0.8), History(1), config())
    assert isinstance(decision, Retry) and decision.delay_s == 5.0 and decision.tunables == Tunables(0.8)
    assert failure_line(stalled, decision, history, config()) == (
        f"pull_stalled: stalled while pulling {IMAGE}: 4.10 of 9.80 GB downloaded; pulling again in 5 s (attempt 2/3)"
    )
    assert event_kind(stalled.cause) == "image_pull"
    _, last = after_failure(stalled, Tunables(0.8), History(3, 2), config())
    assert isinstance(last, GiveUp) and last.exit_status == EXIT_GAVE_UP
    assert last.message.startswith("giving up after 3 failed starts (last: pull_stalled: stalled while pulling")


# --- Triton's ptxas in an image -----------------------------------------------------------------------------------


def test_ptxas_in_an_image_is_not_pointed_at_the_hosts_toolkit() -> None:
    from gb10d.core.host import HostFacts

    outcome = Failed(cause=Cause.PTXAS, failure=PtxasArchUnsupported("sm_121a"))
    decision = next_attempt(outcome, Tunables(0.8), History(1), config(), HostFacts("6.17.0", ptxas="/usr/local/cuda/bin/ptxas"))
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_CONFIG
    assert decision.message.startswith(f"Triton in the image {IMAGE} cannot compile for sm_121a; use an image built for DGX Spark")
    given = next_attempt(outcome, Tunables(0.8), History(1), config(vllm={"env": {"TRITON_PTXAS_PATH": "/opt/cuda/bin/ptxas"}}))
    assert isinstance(given, GiveUp) and given.message.startswith("Triton still fails to compile for sm_121a with TRITON_PTXAS_PATH=/opt/cuda/bin/ptxas")


# --- settings learned with an image -------------------------------------------------------------------------------


def learned_with(image: str) -> LearnedState:
    entry = remember(config(), Tunables(0.72), "free memory short", datetime(2026, 5, 1, tzinfo=UTC), image)
    assert entry is not None and entry.learned_for["image_digest"] == image
    return LearnedState(entry)


def test_what_was_learned_with_an_image_applies_to_the_same_image() -> None:
    verdict = applicable(learned_with(OLD), config(), OLD)
    assert verdict.entry is not None and verdict.entry.gpu_memory_utilization == 0.72


def test_what_was_learned_with_another_image_is_not_applied_and_the_journal_says_why() -> None:
    verdict = applicable(learned_with(OLD), config(), NEW)
    assert verdict.entry is None
    assert verdict.reason == (
        "not applying the settings learned 2026-05-01T00:00:00+00:00 (gpu_memory_utilization 0.72): they were learned with "
        f"the image {IMAGE} as {OLD}, and it is now {NEW}, another vLLM; starting from the config's values (this image's start learns its own)"
    )


def test_another_image_and_another_config_name_every_change() -> None:
    verdict = applicable(learned_with(OLD), config(vllm={"gpu_memory_utilization": 0.9}), NEW)
    assert verdict.entry is None
    assert f'image_digest "{OLD}" -> "{NEW}"' in verdict.reason and "vllm.gpu_memory_utilization 0.8 -> 0.9" in verdict.reason


# --- reloads ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("new", "keys"),
    [
        (config(vllm={"image": "nvcr.io/nvidia/vllm:26.06-py3"}), ("vllm.image",)),
        (config(container={"mounts": ["/srv/models:/models:ro"]}), ("container.mounts",)),
        (config(container={"shm_size": "16g"}), ("container.shm_size",)),
        (config(container={"run_args": ["--ulimit", "nofile=65536:65536"]}), ("container.run_args",)),
        (config(container={"pull": "always"}), ("container.pull",)),
        (config(container={"engine": "podman"}), ("container.engine",)),
    ],
)
def test_a_new_image_or_a_change_of_how_the_container_runs_replaces_the_container(new: Config, keys: tuple[str, ...]) -> None:
    diff = diff_configs(ConfigSnapshot(config()), ConfigSnapshot(new))
    assert diff.needs_vllm_restart and diff.restart_keys == keys and diff.live_keys == ()


def test_gb10d_own_settings_still_apply_without_replacing_the_container() -> None:
    new = Config.model_validate({**config().model_dump(mode="json", exclude_unset=True), "restart": {"max_attempts": 7}})
    diff = diff_configs(ConfigSnapshot(config()), ConfigSnapshot(new))
    assert not diff.needs_vllm_restart and diff.live_keys == ("restart.max_attempts",)


# --- the model's files on the host side of the mounts ------------------------------------------------------------


def test_the_mounts_are_the_cache_a_local_model_and_the_configs_own() -> None:
    assert container_mounts(config(container={"cache_dir": "/var/cache/gb10d"}, vllm={"model": "/srv/models/qwen"})) == [
        "/var/cache/gb10d:/root/.cache", "/srv/models/qwen:/srv/models/qwen:ro"
    ]
    assert container_mounts(config(container={"mounts": ["/srv/models:/models:ro"]}, vllm={"model": "/models/qwen"})) == [
        "/var/cache/gb10d:/root/.cache", "/srv/models:/models:ro"
    ]


@pytest.mark.parametrize(
    ("inside", "host"),
    [
        ("/models/qwen/model-00001.safetensors", "/srv/models/qwen/model-00001.safetensors"),
        ("/models", "/srv/models"),
        ("/models/extra/a", "/data/extra/a"),  # the deepest mount holds it
        ("/root/.cache/huggingface/hub", "/var/cache/gb10d/huggingface/hub"),
        ("/modelsX/a", None),
        ("/opt/vllm", None),
    ],
)
def test_a_path_inside_the_container_is_found_on_the_host_through_the_deepest_mount(inside: str, host: str | None) -> None:
    cfg = config(container={"mounts": ["/srv/models:/models:ro", "/data/extra:/models/extra"]})
    assert host_path(cfg, inside) == (Path(host) if host else None)


def test_the_model_is_evicted_from_the_hosts_side_of_the_mount() -> None:
    env = {"HF_HOME": "/root/.cache/huggingface", "XDG_CACHE_HOME": "/root/.cache", "PATH": "/usr/bin"}
    assert model_on_host(config(), env) == ("Qwen/Qwen3.6-27B-FP8", {"HF_HUB_CACHE": "/var/cache/gb10d/huggingface/hub"})
    assert model_on_host(config(container={"mounts": ["/srv/models:/models:ro"]}, vllm={"model": "/models/qwen"}), env) == ("/srv/models/qwen", {})
    moved = {**env, "HF_HUB_CACHE": "/hub"}  # a hub the config moved where no mount shows it
    assert model_on_host(config(), moved) is None
    venv = Config.model_validate({"vllm": {"venv": "/opt/vllm", "model": "Qwen/Qwen3.6-27B-FP8"}})
    assert model_on_host(venv, {"HF_HOME": "/var/cache/gb10d/huggingface"}) == ("Qwen/Qwen3.6-27B-FP8", {"HF_HOME": "/var/cache/gb10d/huggingface"})


# --- gb10d status --------------------------------------------------------------------------------------------------


def test_status_names_the_image_its_digest_and_the_container() -> None:
    state = StateRecord(pid=10, state=None, image=IMAGE, image_digest=OLD, container="gb10d", engine="docker", vllm_pid=11)
    text = render(state, 1000.0, alive=True)
    assert f"    Image: {IMAGE} ({OLD})\n" in text
    assert "Container: gb10d (docker)\n" in text
    assert "      PID: 10 (gb10d), 11 (docker run)\n" in text
    assert StateRecord.from_json(state.to_json()) == state


# --- the engine's errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?", EXIT_GAVE_UP),
        ("dial unix /run/podman/podman.sock: connect: no such file or directory", EXIT_GAVE_UP),
        ("dial unix /var/run/docker.sock: connect: permission denied", EXIT_CONFIG),
    ],
)
def test_an_engine_that_may_still_start_is_worth_a_later_try_and_a_permission_is_not(text: str, status: int) -> None:
    assert unreachable_status(text) == status
