"""The vLLM command line and environment built from the config, and how they are shown."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from gb10d.command import (
    CHILD_DEFAULTS,
    Tunables,
    build_argv,
    build_env,
    env_additions,
    read_env_file,
    redact_argv,
    redact_setting,
    shell_line,
)
from gb10d.config import Config, VllmSection
from gb10d.errors import ConfigError


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
        ({"args": {"api-key": "sk-live-1"}}, "sk-live-1"),
        ({"args": {"hf_token": "hf_abc"}}, "hf_abc"),
        ({"extra_args": ["--api-key=sk-live-2"]}, "sk-live-2"),
        ({"extra_args": ["--api-key", "sk-live-3"]}, "sk-live-3"),
    ],
)
def test_secret_flag_values_are_masked_in_every_form(fields: dict[str, Any], secret: str) -> None:
    line = shell_line(build_argv(vllm(**fields)))
    assert secret not in line
    assert "***" in line


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
