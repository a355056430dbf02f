"""The vLLM command line and environment built from the config, and how they are shown."""

from __future__ import annotations

import json
import shlex
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from config_support import make_config
from gb10d.base.command import (
    CHILD_DEFAULTS,
    CONTAINER_CACHE_ENV,
    Engine,
    Tunables,
    build_argv,
    build_env,
    container_argv,
    container_name,
    engine_client,
    env_additions,
    read_env_file,
    redact_argv,
    redact_setting,
    shell_line,
)
from gb10d.base.config import Config, VllmSection
from gb10d.base.errors import ConfigError


def vllm(**fields: Any) -> VllmSection:
    return Config.model_validate({"vllm": {"venv": "/opt/vllm-env", "model": "Qwen/Qwen3.6-27B-FP8", **fields}}).vllm


def test_argv_starts_with_program_serve_model() -> None:
    assert build_argv(vllm())[:3] == ["/opt/vllm-env/bin/vllm", "serve", "Qwen/Qwen3.6-27B-FP8"]


def test_executable_is_run_as_given() -> None:
    section = Config.model_validate({"vllm": {"executable": "/usr/local/bin/vllm", "model": "m"}}).vllm
    assert build_argv(section)[0] == "/usr/local/bin/vllm"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"enable-prefix-caching": True}, ["--enable-prefix-caching"]),
        ({"enable_prefix_caching": False}, ["--no-enable-prefix-caching"]),
        ({"speculative-config": {"method": "mtp", "num_speculative_tokens": 3}}, ["--speculative-config", '{"method":"mtp","num_speculative_tokens":3}']),
        ({"allowed-origins": ["a", "b"]}, ["--allowed-origins", "a", "b"]),
        ({"max_num_batched_tokens": 8192}, ["--max-num-batched-tokens", "8192"]),
        ({"speculative-config.num_speculative_tokens": 2}, ["--speculative-config.num_speculative_tokens", "2"]),
    ],
)
def test_args_table_follows_vllm_flag_conventions(args: dict[str, Any], words: list[str]) -> None:
    argv = build_argv(vllm(args=args))
    start = argv.index(words[0])
    assert argv[start : start + len(words)] == words


def test_first_class_keys_become_their_flags() -> None:
    argv = build_argv(vllm(host="127.0.0.1", port=8001, served_model_name=["a", "b"], gpu_memory_utilization=0.85))
    line = " ".join(argv)
    assert "--served-model-name a b" in line
    assert "--host 127.0.0.1 --port 8001" in line
    assert "--gpu-memory-utilization 0.85" in line


def test_utilization_written_as_080_is_shown_as_the_same_readable_value() -> None:
    argv = build_argv(vllm(gpu_memory_utilization=0.80))
    value = argv[argv.index("--gpu-memory-utilization") + 1]
    assert value == "0.8"
    assert float(value) == float("0.80")


def test_tunables_replace_what_the_config_asks_for() -> None:
    section = vllm(args={"max_model_len": 131072, "safetensors-load-strategy": "eager"})
    argv = build_argv(section, Tunables.from_config(section).with_(gpu_memory_utilization=0.71, load_strategy="lazy"))
    assert argv.count("--max-model-len") == 1
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.71"
    assert argv[argv.index("--safetensors-load-strategy") + 1] == "lazy"


def test_extra_args_come_last_as_written() -> None:
    assert build_argv(vllm(extra_args=["--foo.bar=1", "-O3"]))[-2:] == ["--foo.bar=1", "-O3"]


def test_shell_line_pastes_back_to_the_same_argv() -> None:
    argv = build_argv(vllm(args={"speculative-config": {"method": "mtp"}, "chat-template": "/srv/t m'l.jinja"}))
    assert shlex.split(shell_line(argv)) == argv


@pytest.mark.parametrize(
    ("fields", "secret"),
    [
        ({"args": {"api-key": ["sk-live-1", "sk-live-0"]}}, "sk-live-1"),
        ({"args": {"hf_token": "hf_abc"}}, "hf_abc"),
        ({"extra_args": ["--api-key=sk-live-2"]}, "sk-live-2"),
        ({"extra_args": ["--api-key", "sk-live-3"]}, "sk-live-3"),
    ],
)
def test_secret_flag_values_are_masked_in_every_form(fields: dict[str, Any], secret: str) -> None:
    line = shell_line(build_argv(vllm(**fields)))
    assert secret not in line
    assert "***" in line


@pytest.mark.parametrize("key", ["sk-live-1", ["sk-live-1"]])
def test_an_api_key_in_args_reaches_vllm_as_vllm_api_key_never_in_its_argv(key: str | list[str]) -> None:
    section = vllm(args={"api_key": key}, env={"VLLM_API_KEY": "sk-older"})
    assert not any("api" in word or "sk-live" in word for word in build_argv(section))
    assert env_additions(section)["VLLM_API_KEY"] == "sk-live-1"
    assert "sk-live-1" not in shell_line(build_argv(section), env_additions(section))


def test_secret_environment_values_are_masked_and_others_shown() -> None:
    env = {"HF_TOKEN": "hf_1", "MY_API_KEY": "k", "DB_PASSWORD": "p", "CLIENT_SECRET": "s", "CUDA_VISIBLE_DEVICES": "0"}
    line = shell_line(["vllm"], env)
    assert not any(v in shlex.split(line) for v in ("hf_1", "k", "p", "s"))
    assert "HF_TOKEN='***'" in line and "CUDA_VISIBLE_DEVICES=0" in line


def test_redact_leaves_other_flags_alone() -> None:
    assert redact_argv(["--api-key", "x", "--port", "1", "--api_key=y"]) == ["--api-key", "***", "--port", "1", "--api_key=***"]


def test_redacted_settings_for_explain() -> None:
    assert redact_setting("vllm.env.HF_TOKEN", "hf_1") == "***"
    assert redact_setting("vllm.args.api_key", "k") == "***"
    assert redact_setting("vllm.extra_args", ["--api-key", "k"]) == ["--api-key", "***"]
    assert redact_setting("vllm.env.CUDA_VISIBLE_DEVICES", "0") == "0"


def test_path_prefix_keeps_the_callers_path() -> None:
    line = shell_line(["vllm"], path_prefix=Path("/opt/vllm-env/bin"))
    assert line.startswith('PATH=/opt/vllm-env/bin:"$PATH" ')


def test_child_environment_drops_systemd_variables_and_puts_venv_first() -> None:
    env = build_env(vllm(), base={"PATH": "/usr/bin", "NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "1", "LANG": "C.UTF-8"})
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert env["PATH"] == "/opt/vllm-env/bin:/usr/bin"
    assert env["VIRTUAL_ENV"] == "/opt/vllm-env"
    assert env["LANG"] == "C.UTF-8"
    assert {k: env[k] for k in CHILD_DEFAULTS} == CHILD_DEFAULTS


def test_env_table_wins_over_env_file_which_wins_over_defaults(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text('HF_TOKEN="hf_file"\nNO_COLOR=0\nexport SHARED=file\n')
    additions = env_additions(vllm(env_file=str(secrets), env={"SHARED": "table"}))
    assert additions["HF_TOKEN"] == "hf_file"
    assert additions["NO_COLOR"] == "0"
    assert additions["SHARED"] == "table"


def test_env_file_parsing_accepts_comments_quotes_and_export(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_text("# comment\n; also a comment\n\nA=1\nB='two words'\nexport C=\"3\"\n")
    assert read_env_file(path) == {"A": "1", "B": "two words", "C": "3"}


def test_env_file_bad_line_is_located(tmp_path: Path) -> None:
    path = tmp_path / "x.env"
    path.write_text("A=1\n2BAD=x\n")
    with pytest.raises(ConfigError) as caught:
        read_env_file(path)
    assert caught.value.problems[0].line == 2


def test_json_of_a_table_round_trips_by_value() -> None:
    table = {"method": "mtp", "num_speculative_tokens": 3}
    argv = build_argv(vllm(args={"speculative-config": table}))
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == table


# --- vLLM in a container ---------------------------------------------------------------------------

IMAGE = "nvcr.io/nvidia/vllm:26.05-py3"
DOCKER = Engine("docker", ("docker",))


image_config = partial(make_config, {"vllm": {"image": IMAGE}})


def run_line(config: Config, engine: Engine = DOCKER, path: str = "/etc/gb10d.toml") -> list[str]:
    return container_argv(config, Path(path), engine, build_argv(config.vllm), env_additions(config.vllm))


def test_container_command_runs_the_images_vllm_attached_named_and_labelled_after_the_config() -> None:
    config = image_config()
    env = " ".join(f"-e {k}={v}" for k, v in {**CHILD_DEFAULTS, **CONTAINER_CACHE_ENV}.items())
    assert shlex.join(run_line(config)) == (
        "docker run --name gb10d --label gb10d.config=/etc/gb10d.toml --pull never --network host --ipc host --init "
        f"--gpus all --stop-timeout 30 --log-driver none -v /var/cache/gb10d:/root/.cache {env} "
        f"{IMAGE} vllm serve Qwen/Qwen3.6-27B-FP8 --gpu-memory-utilization 0.9 --host 0.0.0.0 --port 8000"
    )


def test_podman_gets_the_gpu_through_cdi_and_the_same_options() -> None:
    argv = run_line(image_config(), Engine("podman", ("podman",)))
    assert argv[:2] == ["podman", "run"]
    assert argv[argv.index("--device") + 1] == "nvidia.com/gpu=all" and "--gpus" not in argv


@pytest.mark.parametrize(
    ("container", "present", "absent"),
    [
        ({"shm_size": "16g"}, ["--shm-size 16g"], ["--ipc"]),
        ({"init": False}, [], ["--init"]),
        ({"gpu": "none"}, [], ["--gpus", "--device"]),
        ({"gpu": "cdi"}, ["--device nvidia.com/gpu=all"], ["--gpus"]),
        ({"cache_dir": "/srv/cache", "mounts": ["/srv/models:/models:ro"]}, ["-v /srv/cache:/root/.cache -v /srv/models:/models:ro"], []),
        ({"run_args": ["--ulimit", "memlock=-1"], "name": "qwen"}, ["--name qwen", f"--ulimit memlock=-1 {IMAGE}"], []),
    ],
)
def test_container_settings_become_their_run_options(container: dict[str, Any], present: list[str], absent: list[str]) -> None:
    argv = run_line(image_config(container=container))
    line = " ".join(argv)
    assert all(f" {words} " in line for words in present), line
    assert all(option not in argv[: argv.index(IMAGE)] for option in absent), line


def test_a_local_model_directory_is_mounted_read_only_at_its_own_path() -> None:
    argv = run_line(image_config(vllm={"model": "/srv/models/Qwen3.6-27B-FP8"}))
    assert "/srv/models/Qwen3.6-27B-FP8:/srv/models/Qwen3.6-27B-FP8:ro" in argv
    assert argv[argv.index(IMAGE) + 3] == "/srv/models/Qwen3.6-27B-FP8"


def test_a_model_in_a_mounted_directory_is_a_path_inside_the_container() -> None:
    argv = run_line(image_config(container={"mounts": ["/srv/models:/models:ro"]}, vllm={"model": "/models/Qwen3-8B"}))
    assert [w for w in argv if w.startswith("/srv/models") or w.startswith("/models")] == ["/srv/models:/models:ro", "/models/Qwen3-8B"]


def test_secrets_are_passed_by_name_only_and_never_appear_in_the_argv(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.env"
    secrets.write_text("HF_TOKEN=hf_live\n")
    config = image_config(vllm={"env": {"VLLM_API_KEY": "sk-1", "VLLM_LOGGING_LEVEL": "DEBUG"}, "env_file": str(secrets)})
    argv = run_line(config)
    assert "-e HF_TOKEN -e VLLM_API_KEY -e VLLM_LOGGING_LEVEL=DEBUG " in " ".join(argv)
    assert "hf_live" not in " ".join(argv) and "sk-1" not in " ".join(argv)


def test_the_tunables_of_an_attempt_reach_vllm_in_the_container() -> None:
    config = image_config()
    argv = container_argv(config, Path("/etc/gb10d.toml"), DOCKER, build_argv(config.vllm, Tunables(0.71, "eager")), {})
    assert argv[argv.index(IMAGE):][-8:] == ["--gpu-memory-utilization", "0.71", "--safetensors-load-strategy", "eager", "--host", "0.0.0.0", "--port", "8000"]


def test_the_container_environment_is_gb10ds_additions_not_the_hosts() -> None:
    env = env_additions(image_config(vllm={"env": {"CUDA_VISIBLE_DEVICES": "0"}}).vllm)
    assert env == {**CHILD_DEFAULTS, **CONTAINER_CACHE_ENV, "CUDA_VISIBLE_DEVICES": "0"}
    assert "VIRTUAL_ENV" not in env and "PATH" not in env


@pytest.mark.parametrize(
    ("path", "name"),
    [("/etc/gb10d.toml", "gb10d"), ("/etc/gb10d/qwen.toml", "gb10d-qwen"), ("/srv/my model.toml", "gb10d-my-model")],
)
def test_the_container_is_named_after_the_config(path: str, name: str) -> None:
    assert container_name(image_config().container, Path(path)) == name
    assert container_name(image_config(container={"name": "mine"}).container, Path(path)) == "mine"


@pytest.mark.parametrize(
    ("kind", "socket", "root", "client"),
    [
        ("docker", None, False, ("docker",)),
        ("docker", "/run/user-docker.sock", False, ("docker", "-H", "unix:///run/user-docker.sock")),
        ("podman", None, True, ("podman",)),
        ("podman", None, False, ("podman", "--remote", "--url", "unix:///run/podman/podman.sock")),
        ("podman", "/srv/podman.sock", True, ("podman", "--remote", "--url", "unix:///srv/podman.sock")),
    ],
)
def test_the_engine_is_reached_through_its_socket(kind: Any, socket: str | None, root: bool, client: tuple[str, ...]) -> None:
    assert engine_client(kind, Path(socket) if socket else None, root).client == client


@pytest.mark.parametrize(
    ("fields", "stop_timeout_s", "expected"),
    [
        ({}, 30.0, ["--shutdown-timeout", "25"]),
        ({}, 5.5, []),  # too short to drain: vLLM aborts its requests, as by default
        ({}, None, []),
        ({"args": {"shutdown_timeout": 60}}, 30.0, ["--shutdown-timeout", "60"]),  # the config's own value, as written
        ({"extra_args": ["--shutdown-timeout=0"]}, 30.0, ["--shutdown-timeout=0"]),
    ],
)
def test_vllm_drains_its_requests_within_gb10ds_stop_timeout(fields: dict[str, Any], stop_timeout_s: float | None, expected: list[str]) -> None:
    argv = build_argv(vllm(**fields), stop_timeout_s=stop_timeout_s)
    found = [word for index, word in enumerate(argv) if word.startswith("--shutdown-timeout") or argv[index - 1] == "--shutdown-timeout"]
    assert found == expected
