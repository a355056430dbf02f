"""import-script: a hand-written start script becomes a gb10d.toml that runs the same vLLM.

The round trips go script -> gb10d.toml text -> load_config -> build_argv,
and compare flags by value: `0.80` and `0.8` are the same utilization, and
the speculative config is the same JSON object however it is spaced.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gb10d.base.command import build_argv
from gb10d.base.configload import load_config
from gb10d.base.errors import ConfigError
from gb10d.base.flags import normalize_flag
from gb10d.vllm.importscript import ScriptOwner, import_script, read_script, render

SCRIPTS = Path(__file__).parent.parent / "fixtures" / "scripts"

# The command of the reference script in issue 2, word by word, as the shell passes it to vllm.
REFERENCE_ARGV = [
    "/home/hayashi/vllm-pip-env/bin/vllm", "serve", "Qwen/Qwen3.6-27B-FP8",
    "--served-model-name", "Qwen3.6-27B-FP8-Agent",
    "--language-model-only",
    "--max-model-len", "131072",
    "--reasoning-parser", "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser", "qwen3_xml",
    "--enable-prefix-caching",
    "--kv-cache-dtype", "fp8",
    "--mamba-cache-dtype", "float16",
    "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
    "--max-num-batched-tokens", "8192",
    "--gpu-memory-utilization", "0.80",
    "--safetensors-load-strategy", "eager",
    "--host", "0.0.0.0",
    "--port", "8000",
]


def _by_value(word: str) -> Any:
    if word.startswith("{"):
        return json.loads(word)
    if re.fullmatch(r"-?\d+(\.\d+)?", word):
        return float(word)
    return word


def flags(argv: list[str]) -> dict[str, tuple[Any, ...]]:
    """Each flag after `serve MODEL` with its values, compared by value; `--x=v` is `--x v`."""
    result: dict[str, tuple[Any, ...]] = {}
    current = ""
    for word in argv[3:]:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            current = normalize_flag(name)
            result[current] = (_by_value(value),) if eq else ()
        else:
            result[current] += (_by_value(word),)
    return result


def import_script_file(path: Path) -> str:
    """What `gb10d import-script FILE` prints: the gb10d.toml of the script in `path`."""
    text, shown = read_script(path)
    return render(import_script(text, shown), shown)


def imported_argv(tmp_path: Path, script_text: str) -> tuple[list[str], str]:
    """Import a script, save the result as a config, and build the command it gives."""
    script = tmp_path / "start.sh"
    script.write_text(script_text)
    toml_text = import_script_file(script)
    config = tmp_path / "gb10d.toml"
    config.write_text(toml_text)
    return build_argv(load_config(config).vllm), toml_text


def test_reference_script_round_trips_to_the_same_flags(tmp_path: Path) -> None:
    argv, _ = imported_argv(tmp_path, (SCRIPTS / "reference.sh").read_text())
    assert argv[:3] == REFERENCE_ARGV[:3]
    assert flags(argv) == flags(REFERENCE_ARGV)


def test_reference_script_gives_venv_and_first_class_keys() -> None:
    data = import_script((SCRIPTS / "reference.sh").read_text()).data["vllm"]
    assert data["venv"] == "/home/hayashi/vllm-pip-env"
    assert data["model"] == "Qwen/Qwen3.6-27B-FP8"
    assert data["served_model_name"] == "Qwen3.6-27B-FP8-Agent"
    assert (data["host"], data["port"], data["gpu_memory_utilization"]) == ("0.0.0.0", 8000, 0.8)
    assert data["args"]["speculative-config"] == {"method": "mtp", "num_speculative_tokens": 3}


def test_reference_script_explains_nohup_redirection_and_background(tmp_path: Path) -> None:
    imported = import_script((SCRIPTS / "reference.sh").read_text())
    notes = "\n".join(imported.notes)
    assert "line 5: nohup not needed" in notes
    assert 'line 5: > "$LOG_FILE" 2>&1 not needed: vLLM\'s output goes to the journal now (journalctl -u gb10d)' in notes
    assert "line 5: & not needed: systemd runs gb10d in the background" in notes
    assert imported.warnings == []


def test_output_is_toml_with_a_comment_header(tmp_path: Path) -> None:
    _, text = imported_argv(tmp_path, (SCRIPTS / "reference.sh").read_text())
    assert text.startswith("# gb10d.toml imported from ")
    assert "gb10d check-config" in text
    assert tomllib.loads(text)["vllm"]["model"] == "Qwen/Qwen3.6-27B-FP8"


VARIANTS = {
    "defaults_and_equals_forms": (
        'MODEL=${MODEL:-Qwen/Qwen3.6-27B-FP8}\nUTIL="${UTIL:-0.80}"\nsource /opt/vllm-env/bin/activate\n'
        "vllm serve $MODEL --gpu-memory-utilization=$UTIL --max-model-len=32k --port=${PORT-8001}\n",
        ["/opt/vllm-env/bin/vllm", "serve", "Qwen/Qwen3.6-27B-FP8", "--gpu-memory-utilization", "0.80", "--max-model-len", "32k", "--port", "8001"],
    ),
    "dot_activate_and_exec": (
        "cd /srv/llm\n. venv/bin/activate\nexec vllm serve /srv/models/q --enable-prefix-caching --port 8000\n",
        ["/srv/llm/venv/bin/vllm", "serve", "/srv/models/q", "--enable-prefix-caching", "--port", "8000"],
    ),
    "absolute_executable_single_quotes": (
        "/usr/local/bin/vllm serve 'Qwen/Qwen3.6-27B-FP8' --speculative-config '{\"method\":\"mtp\"}' --no-enable-log-requests\n",
        ["/usr/local/bin/vllm", "serve", "Qwen/Qwen3.6-27B-FP8", "--speculative-config", '{"method":"mtp"}', "--no-enable-log-requests"],
    ),
    "old_entry_point": (
        "/opt/env/bin/python3 -m vllm.entrypoints.openai.api_server --model m --served-model-name a b --port 8000 -tp 1\n",
        ["/opt/env/bin/vllm", "serve", "m", "--served-model-name", "a", "b", "--port", "8000", "--tensor-parallel-size", "1"],
    ),
    "unquoted_variable_splits_into_words": (
        'ARGS="--max-model-len 4096 --enable-chunked-prefill"\n/usr/local/bin/vllm serve m $ARGS --port 8000\n',
        ["/usr/local/bin/vllm", "serve", "m", "--max-model-len", "4096", "--enable-chunked-prefill", "--port", "8000"],
    ),
    "continuations_with_comments_and_negative_value": (
        "# start it\n/usr/local/bin/vllm serve m \\\n    --max-model-len -1 \\\n    --port 8000  # main port\n",
        ["/usr/local/bin/vllm", "serve", "m", "--max-model-len", "-1", "--port", "8000"],
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_scripts_round_trip_to_the_same_flags(name: str, tmp_path: Path) -> None:
    script, expected = VARIANTS[name]
    argv, _ = imported_argv(tmp_path, script)
    assert argv[:3] == expected[:3]
    produced = flags(argv)
    for flag, values in flags(expected).items():
        assert produced.get(flag) == values, flag


def test_old_entry_point_is_named_as_such() -> None:
    notes = import_script(VARIANTS["old_entry_point"][0]).notes
    assert any("old entry point" in n for n in notes)


def test_environment_before_the_command_and_exports_go_to_vllm_env() -> None:
    script = (
        "export VLLM_LOGGING_LEVEL=DEBUG\nexport MODEL=m\nexport LOG_DIR=/var/log/x\n"
        "CUDA_VISIBLE_DEVICES=0 /usr/local/bin/vllm serve $MODEL\n"
    )
    imported = import_script(script)
    assert imported.data["vllm"]["env"] == {"VLLM_LOGGING_LEVEL": "DEBUG", "LOG_DIR": "/var/log/x", "CUDA_VISIBLE_DEVICES": "0"}
    assert any("MODEL is used only by the script" in n for n in imported.notes)
    assert any("LOG_DIR is passed to vLLM" in w for w in imported.warnings)


def test_secrets_are_kept_but_flagged_with_env_file_advice() -> None:
    imported = import_script("export HF_TOKEN=hf_x\n/usr/local/bin/vllm serve m --api-key sk\n")
    assert imported.data["vllm"]["env"]["HF_TOKEN"] == "hf_x"
    assert imported.data["vllm"]["args"]["api-key"] == "sk"
    text = "\n".join(imported.warnings)
    assert "HF_TOKEN is a secret" in text and "env_file" in text
    assert "--api-key is a secret" in text


def test_unknown_commands_and_unset_variables_become_warnings_not_silence() -> None:
    script = (
        "ulimit -n 65536\ndocker pull something\nif true; then echo x; fi\n"
        "taskset -c 0-9 /usr/local/bin/vllm serve $MODEL_PATH --download-dir $(pwd)/cache\n"
    )
    text = "\n".join(import_script(script).warnings)
    assert "line 1: 'ulimit -n 65536' is not reproduced" in text
    assert "line 2: 'docker pull something' is not understood" in text
    assert "if true" not in text  # a block of harmless commands is a note, not a warning
    assert "line 4: 'taskset -c 0-9' before vllm is not reproduced" in text
    assert "line 4: $MODEL_PATH is not set in the script" in text
    assert "line 4: $(pwd) cannot be evaluated" in text


def test_set_but_not_exported_relevant_variable_is_flagged() -> None:
    warnings = import_script("CUDA_VISIBLE_DEVICES=1\n/usr/local/bin/vllm serve m\n").warnings
    assert any("CUDA_VISIBLE_DEVICES is set but not exported" in w for w in warnings)


def test_harmless_commands_are_listed_as_ignored() -> None:
    notes = import_script("set -e\nmkdir -p logs\necho starting\n/usr/local/bin/vllm serve m\n").notes
    assert any(n.startswith("ignored, no effect on vLLM under gb10d: set (line 1), mkdir (line 2), echo (line 3)") for n in notes)


def test_bare_vllm_without_venv_asks_for_the_path() -> None:
    imported = import_script("vllm serve m\n")
    assert "venv" not in imported.data["vllm"] and "executable" not in imported.data["vllm"]
    assert any("set vllm.executable" in w for w in imported.warnings)


def test_relative_venv_without_cd_is_flagged() -> None:
    imported = import_script(". venv/bin/activate\nvllm serve m\n")
    assert any("relative to the directory the script was started from" in w for w in imported.warnings)


def test_second_vllm_command_is_not_imported_silently() -> None:
    imported = import_script("/usr/local/bin/vllm serve a\n/usr/local/bin/vllm serve b\n")
    assert imported.data["vllm"]["model"] == "a"
    assert any("line 2: another vLLM command" in w for w in imported.warnings)


def test_script_without_vllm_is_an_error_naming_the_file(tmp_path: Path) -> None:
    script = tmp_path / "start.sh"
    script.write_text("echo hello\n")
    with pytest.raises(ConfigError) as caught:
        import_script_file(script)
    assert caught.value.problems[0].path == str(script)
    assert "no vllm serve" in caught.value.problems[0].message


def test_every_warning_is_written_as_a_comment(tmp_path: Path) -> None:
    _, text = imported_argv(tmp_path, "docker pull x\n/usr/local/bin/vllm serve m\n")
    assert "# warning: line 1: 'docker pull x' is not understood" in text


def test_shipped_config_gives_every_flag_of_the_reference_script() -> None:
    shipped = Path(__file__).parents[2] / "etc" / "gb10d.toml"
    argv = build_argv(load_config(shipped).vllm)
    assert argv[1:3] == REFERENCE_ARGV[1:3]
    assert flags(argv) == flags(REFERENCE_ARGV)


def test_windows_line_endings_are_read_as_newlines_and_said_so(tmp_path: Path) -> None:
    argv, text = imported_argv(tmp_path, "/usr/local/bin/vllm serve m \\\r\n  --port 8000\r\n")
    assert flags(argv)["port"] == (8000.0,)
    assert "Windows line endings" in text


def test_commands_that_only_mention_vllm_do_not_count_as_running_it() -> None:
    imported = import_script("pkill -f vllm\necho vllm serve old\n/usr/local/bin/vllm serve m\n")
    assert imported.data["vllm"]["model"] == "m"
    assert not any("another vLLM command" in w for w in imported.warnings)


def test_json_with_null_stays_a_string_and_escaped_dollar_is_literal(tmp_path: Path) -> None:
    argv, _ = imported_argv(
        tmp_path,
        "/usr/local/bin/vllm serve m --override-generation-config '{\"x\": null}' --chat-template \"/srv/\\$t.jinja\"\n",
    )
    assert flags(argv)["override-generation-config"] == ({"x": None},)
    assert flags(argv)["chat-template"] == ("/srv/$t.jinja",)


def test_unset_variable_in_the_venv_path_is_reported() -> None:
    imported = import_script('source "${ENV_DIR}/bin/activate"\nvllm serve m\n')
    assert imported.warnings == ["line 1: $ENV_DIR is not set in the script; the value was kept as written, replace it"]


def test_a_shell_block_gets_one_note_not_one_warning_per_keyword() -> None:
    imported = import_script(
        'LOG_FILE=/home/alice/vllm.log\nif [ -f "$LOG_FILE" ]; then rm "$LOG_FILE"; fi\n'
        "for i in 1 2 3; do\n  echo waiting $i\n  sleep 1\ndone\n/usr/local/bin/vllm serve m > \"$LOG_FILE\" 2>&1 &\n"
    )
    assert imported.warnings == []
    assert 'line 2: `if [ -f "$LOG_FILE" ]; then rm "$LOG_FILE"; fi` has no effect on vLLM under gb10d; ignored' in imported.notes
    assert "lines 3-6: `for i in 1 2 3; do echo waiting $i; sleep 1; done` has no effect on vLLM under gb10d; ignored" in imported.notes
    assert any(n.endswith("no longer to /home/alice/vllm.log") for n in imported.notes), imported.notes


def test_a_block_with_a_command_gb10d_does_not_run_is_one_warning_naming_it() -> None:
    imported = import_script("if ! nvidia-smi; then\n  modprobe nvidia\n  docker restart x\nfi\n/usr/local/bin/vllm serve m\n")
    assert imported.warnings == [
        "lines 1-4: `if ! nvidia-smi; then modprobe nvidia; docker restart x; fi` is not reproduced (modprobe, docker); "
        "if vLLM depends on it, do it another way (e.g. ExecStartPre= in a systemd drop-in: systemctl edit gb10d)"
    ]


def test_the_vllm_command_inside_a_block_is_imported_and_the_condition_named() -> None:
    imported = import_script('if [ -n "$DEBUG" ]; then\n  export VLLM_LOGGING_LEVEL=DEBUG\nfi\nif true; then\n  /usr/local/bin/vllm serve m --port 9000\nfi\n')
    assert imported.data["vllm"]["port"] == 9000
    assert imported.data["vllm"]["env"] == {"VLLM_LOGGING_LEVEL": "DEBUG"}
    assert any(w.startswith("lines 4-6: the vLLM command is inside `if true; then /usr/local/bin/vllm serve m --port 9000; fi`") for w in imported.warnings)


# --- docker run and compose ---------------------------------------------------------------------------


def test_the_playbooks_docker_run_becomes_an_image_config_that_keeps_its_cache_mount() -> None:
    imported = import_script((SCRIPTS / "playbook.sh").read_text(), owner=ALICE)
    assert imported.data == {"vllm": {"model": "Qwen/Qwen2.5-Math-1.5B-Instruct", "image": "nvcr.io/nvidia/vllm:26.05-py3"},
                             "container": {"mounts": ["/home/alice/.cache/huggingface:/root/.cache/huggingface"]}}
    assert imported.warnings == []
    assert "line 3: -i not needed: vLLM reads no input" in imported.notes
    assert "line 3: -p 8000:8000 not needed: the container uses the host's network, so vllm.port is the host's port" in imported.notes


def test_docker_run_options_become_container_settings_and_warnings_say_what_is_left() -> None:
    imported = import_script((SCRIPTS / "docker-run.sh").read_text())
    assert imported.data == {
        "vllm": {
            "model": "/models/Qwen3-8B", "image": "nvcr.io/nvidia/vllm:26.05-py3", "port": 9000, "gpu_memory_utilization": 0.8,
            "args": {"max-model-len": 32768},
            "env": {"HF_TOKEN": "hf_example", "VLLM_LOGGING_LEVEL": "DEBUG", "HF_HUB_OFFLINE": "$HF_HUB_OFFLINE"},
            "env_file": "/etc/vllm/secrets.env",
        },
        "container": {"shm_size": "16g", "run_args": ["--ulimit=memlock=-1", "--ulimit=stack=67108864"], "mounts": ["/srv/models:/models:ro"]},
    }
    assert "line 5: -p 9000:8000: the container uses the host's network under gb10d, so vLLM listens on 9000 itself" in imported.notes
    assert any(n.startswith("line 5: sudo not needed: the gb10d user is allowed on the engine's socket") for n in imported.notes)
    assert any(w.startswith("line 5: -v ~/.cache/huggingface:/root/.cache/huggingface: the script's cache is not mounted") for w in imported.warnings)
    assert "line 5: -e HF_HUB_OFFLINE passes the script's HF_HUB_OFFLINE, which it does not set; put HF_HUB_OFFLINE=... in vllm.env_file" in imported.warnings


def test_podman_run_chooses_podman() -> None:
    imported = import_script("podman run --device nvidia.com/gpu=all -p 8000:8000 nvcr.io/nvidia/vllm:26.05-py3 vllm serve m\n")
    assert imported.data == {"vllm": {"model": "m", "image": "nvcr.io/nvidia/vllm:26.05-py3"}, "container": {"engine": "podman"}}


def test_an_image_whose_entrypoint_is_vllm_serve_takes_the_words_after_it() -> None:
    imported = import_script("docker run --gpus all -p 8000:8000 vllm/vllm-openai:v0.23.0 Qwen/Qwen3-8B --max-model-len 8192\n")
    assert imported.data["vllm"] == {"model": "Qwen/Qwen3-8B", "image": "vllm/vllm-openai:v0.23.0", "args": {"max-model-len": 8192}}
    assert any("its entrypoint is taken to run `vllm serve`" in n for n in imported.notes)


def test_unknown_run_options_are_kept_in_run_args_with_a_warning() -> None:
    imported = import_script("docker run --cpuset-cpus 0-9 --privileged nvcr.io/nvidia/vllm:26.05-py3 vllm serve m\n")
    assert imported.data["container"] == {"run_args": ["--cpuset-cpus=0-9", "--privileged"]}
    assert "line 1: --cpuset-cpus is not a setting gb10d knows; kept in container.run_args, check it" in imported.warnings


def test_a_compose_file_is_not_supported_and_gets_the_equivalent_config() -> None:
    imported = import_script((SCRIPTS / "compose.yml").read_text(), "compose.yml")
    assert imported.data == {
        "vllm": {"model": "Qwen/Qwen3-8B", "image": "nvcr.io/nvidia/vllm:26.05-py3", "gpu_memory_utilization": 0.8,
                 "env": {"HF_TOKEN": "${HF_TOKEN}", "VLLM_LOGGING_LEVEL": "INFO"}},
        "container": {"mounts": ["/srv/hf:/root/.cache/huggingface"], "run_args": ["--ulimit=memlock=-1", "--ulimit=stack=67108864"]},
    }
    assert imported.warnings[0].startswith("docker compose files are not supported: gb10d runs, restarts and stops the container itself")
    assert imported.warnings[0].endswith("Stop the compose project (docker compose down), then use this config, the equivalent of its service 'vllm'")
    assert "only the service 'vllm' was read; gb10d runs one vLLM per config (webui left out)" in imported.warnings
    assert "service vllm: --restart not needed: gb10d restarts vLLM with corrected settings, and systemd restarts gb10d" in imported.notes


def test_a_compose_file_without_an_image_is_a_clear_error() -> None:
    with pytest.raises(ConfigError) as refused:
        import_script("services:\n  vllm:\n    build: .\n", "compose.yml")
    assert str(refused.value) == "compose.yml: the compose service 'vllm' names no image; gb10d runs vLLM from an image, a venv or an executable"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "shared_memory"),
    [("playbook.sh", "--ipc host"), ("docker-run.sh", "--shm-size 16g"), ("compose.yml", "--ipc host")],
)
def test_imported_container_commands_round_trip_through_print_command(script: str, shared_memory: str, tmp_path: Path) -> None:
    """Script -> config -> print-command's run line -> config -> the same run line, and vLLM gets the script's flags."""
    env = {k: v for k, v in os.environ.items() if k != "GB10D_CONFIG"}

    def gb10d(*argv: str, stdin: str | None = None) -> str:
        done = subprocess.run([sys.executable, "-m", "gb10d", *argv], input=stdin, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        return done.stdout

    config = tmp_path / "gb10d.toml"
    config.write_text(gb10d("import-script", str(SCRIPTS / script)))
    first = gb10d("print-command", "--config", str(config))
    config.write_text(gb10d("import-script", "-", stdin=first))
    assert gb10d("print-command", "--config", str(config)) == first
    words = shlex.split(first)
    image = words.index("nvcr.io/nvidia/vllm:26.05-py3")
    assert words[image + 1 : image + 3] == ["vllm", "serve"] and "--gpus" in words[:image] and f" {shared_memory} " in first


ALICE = ScriptOwner("alice", "/home/alice", {"bob": "/home/bob"}.get)


@pytest.mark.parametrize("name", ["home-tilde.sh", "home-dollar.sh", "home-braces.sh", "home-envdir.sh", "home-cd.sh"])
def test_the_home_in_a_script_is_the_home_of_whoever_owns_it(name: str) -> None:
    imported = import_script((SCRIPTS / name).read_text(), name, ALICE)
    assert imported.data["vllm"]["venv"] == "/home/alice/vllm-pip-env"
    assert imported.data["vllm"].get("args", {}).get("chat-template", "/home/alice/templates/chat.jinja") == "/home/alice/templates/chat.jinja"
    assert imported.warnings == []
    said = [n for n in imported.notes if "as /home/alice" in n]
    assert len(said) == 1 and said[0].endswith("as when alice runs the script: the service has another home")


def test_the_readmes_tilde_script_gives_a_config_that_loads(tmp_path: Path) -> None:
    imported = import_script((SCRIPTS / "home-tilde.sh").read_text(), "start.sh", ALICE)
    path = tmp_path / "gb10d.toml"
    path.write_text(render(imported, "start.sh"))
    assert load_config(path).vllm.venv == Path("/home/alice/vllm-pip-env")


def test_another_users_tilde_is_their_home_and_an_unknown_one_is_reported() -> None:
    assert import_script("source ~bob/v/bin/activate\nvllm serve m\n", owner=ALICE).data["vllm"]["venv"] == "/home/bob/v"
    imported = import_script("source ~nobody/v/bin/activate\nvllm serve m\n", owner=ALICE)
    assert imported.warnings == ["line 1: ~ (the home directory of whoever ran the script) is not set in the script; the value was kept as written, replace it"]


def test_tilde_without_a_known_owner_is_reported_once_and_not_called_relative() -> None:
    imported = import_script((SCRIPTS / "home-tilde.sh").read_text())
    assert not any("relative to the directory" in w for w in imported.warnings)
    assert imported.warnings == ["line 3: ~ (the home directory of whoever ran the script) is not set in the script; the value was kept as written, replace it"]


def test_an_image_or_a_model_from_a_variable_the_script_never_sets_is_a_warning_in_a_docker_run_line() -> None:
    warnings = import_script("docker run --gpus all $IMAGE --model $MODEL --port 9000\n").warnings
    assert "line 1: $IMAGE is not set in the script; the value was kept as written, replace it" in warnings
    assert "line 1: $MODEL is not set in the script; the value was kept as written, replace it" in warnings


@pytest.mark.parametrize("opener", ["<<EOF", "<<'EOF'", '<< "EOF"', "<<-EOF"])
def test_the_lines_of_a_here_document_are_data_not_commands(opener: str) -> None:
    end = "\tEOF" if opener.startswith("<<-") else "EOF"
    script = f"cat {opener} > /etc/x.json\n{{\"a\": \"it's\"}}\nvllm serve fake/model\n{end}\n/opt/v/bin/vllm serve real/model --port 9000 &\n"
    imported = import_script(script)
    assert imported.data["vllm"]["model"] == "real/model"
    assert imported.warnings == []
    assert "line 5: & not needed: systemd runs gb10d in the background, and systemctl start gb10d returns once vLLM serves" in imported.notes


def test_a_value_check_config_would_refuse_is_a_warning_in_the_imported_file() -> None:
    text = render(import_script('/opt/v/bin/vllm serve m --host "a b"\n'), "start.sh")
    assert "# warning: as written, check-config refuses vllm.host: must be an address such as \"0.0.0.0\" or \"127.0.0.1\" (got 'a b')" in text
    assert "refuses" not in render(import_script("/opt/v/bin/vllm serve m --host 127.0.0.1\n"), "start.sh")


def test_a_warning_that_quotes_a_newline_or_a_control_character_stays_one_comment_line_and_the_file_stays_toml() -> None:
    text = render(import_script("docker run h 'quotes and $VARS\n"), "start.sh")
    assert "# warning: line 1: 'quotes and $VARS\\n cannot be evaluated without running it" in text
    assert tomllib.loads(text)["vllm"]["image"] == "h"
    text = render(import_script('if \x1b[31m[ -n "$X" ]; then\n  /opt/v/bin/vllm serve m\nfi\n'), "start.sh")
    assert "`if \\x1b[31m[ -n" in text and tomllib.loads(text)["vllm"]["model"] == "m"
