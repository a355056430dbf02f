"""Fuzzing `gb10d import-script`: start scripts from a grammar of what operators write (variables, quoting, escapes,
`~`, here-docs, blocks, `docker run` flags, compose files), sometimes damaged. Never a traceback: either a config
that validates, or a `# warning:` that says what was not understood (or exit 78 naming the script)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tempfile
import tomllib
from pathlib import Path

from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import budget, mutated_bytes
from gb10d.base.configload import parse_config
from gb10d.base.errors import EXIT_CONFIG, ConfigError
from gb10d.cmdline.cli import main

_MODELS = ["Qwen/Qwen3.6-27B-FP8", "meta-llama/Llama-3.1-8B-Instruct", "/srv/models/llama", "./models/x", "~/models/m", "$MODEL", "${MODEL}",
           "${MODEL:-Qwen/Qwen3-8B}", "${MODEL_DIR}/qwen", "$1", "\"$@\""]
_VALUES = ["8000", "0.85", "131072", "-1", "1e3", "auto", "fp8", "\"a b\"", "'x y'", "$PORT", "${PORT:-8001}", "$(nproc)", "`hostname`",
           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'", "{\"a\":null}", "''", "\"\"", "~", "~/x", "a\\ b", "$'\\t'", "\\$HOME"]
_FLAGS = ["--port", "--host", "--gpu-memory-utilization", "--max-model-len", "--served-model-name", "--tensor-parallel-size", "-tp",
          "--api-key", "--hf-token", "--enable-prefix-caching", "--no-enable-prefix-caching", "--trust-remote-code", "--kv-cache-dtype",
          "--speculative-config", "--shutdown-timeout", "--model", "-q", "-x", "--Bad_Flag", "--", "--max-num-seqs", "--enforce-eager"]
_ASSIGN_NAMES = ["MODEL", "PORT", "HF_TOKEN", "VLLM_USE_V1", "CUDA_VISIBLE_DEVICES", "MODEL_DIR", "VIRTUAL_ENV", "PATH", "HF_HOME", "LOG", "X"]
_PROGRAMS = ["vllm serve", "vllm", "/opt/venv/bin/vllm serve", "~/venv/bin/vllm serve", "python -m vllm.entrypoints.openai.api_server",
             "python3 -m vllm.entrypoints.cli.main serve", "/usr/bin/python3 -m vllm.entrypoints.openai.api_server", "$VENV/bin/vllm serve",
             "python -m other.module", "./vllm serve"]
_WRAPPERS = ["", "", "nohup ", "exec ", "env VLLM_LOGGING_LEVEL=DEBUG ", "taskset -c 0-9 ", "sudo ", "CUDA_VISIBLE_DEVICES=0 ", "time "]
_ENDINGS = ["", "", " > vllm.log 2>&1 &", " &> $LOG", " 2>&1 | tee log.txt", " &", " >> ~/log 2>&1", " || exit 1", " && echo done"]
_DOCKER_OPTIONS = ["--gpus all", "--gpus=all", "--runtime nvidia", "-p 8000:8000", "--publish=8001:8000", "-v ~/.cache/huggingface:/root/.cache/huggingface",
                   "-v /srv/models:/models:ro", "-v models:/models", "--ipc=host", "--ipc private", "--shm-size 16g", "-e HF_TOKEN=$HF_TOKEN",
                   "--env VLLM_USE_V1=1", "--env-file .env", "--name vllm", "--rm", "-d", "-it", "--restart unless-stopped", "--network host",
                   "--ulimit memlock=-1", "--privileged", "--device nvidia.com/gpu=all", "--pull always", "--user 1000:1000", "-l a=b", "--init",
                   "--entrypoint vllm", "--label gb10d.config=/x", "-w /work", "--cpus"]
_IMAGES = ["vllm/vllm-openai:latest", "nvcr.io/nvidia/vllm:26.05-py3", "$IMAGE", "vllm/vllm-openai", "localhost:5000/vllm:dev"]
_OTHER_LINES = ["set -euo pipefail", "source ~/venv/bin/activate", ". /opt/venv/bin/activate", "source ./env.sh", "cd /srv/vllm", "cd models",
                "cd ~", "pkill -f 'vllm serve' || true", "sleep 5", "echo 3 | sudo tee /proc/sys/vm/drop_caches", "ulimit -n 65536",
                "mkdir -p ~/logs", "trap 'kill 0' EXIT", "wait", "nvidia-smi", "deactivate", "curl -s localhost:8000/health", "conda activate vllm",
                "declare -x VLLM_X=1", "readonly A=1", "export PATH=/opt/venv/bin:$PATH", "umask 022", "exit 0", "function f() { echo; }",
                "if [ -z \"$MODEL\" ]; then echo no; exit 1; fi", "for i in 1 2; do echo $i; done", "while true; do sleep 1; done",
                "case $1 in a) MODEL=x;; esac", "{ echo a; echo b; } > f", "( cd /tmp && ls )", "echo \"unterminated", "echo 'also", "x=$((1+2))",
                "arr=(a b c)", "echo ${arr[@]}", "echo ${#MODEL}", "echo ${MODEL/Qwen/qwen}", "[[ -f x ]] && echo y", "cat <<'JSON' > c.json",
                "docker compose up -d", "docker stop vllm", "docker rm -f vllm"]
# A model no command of the grammar names: only a here-document's body has it.
_DECOY = "decoy/model-in-a-here-document"
_HEREDOC_BODIES = ['{"a": 1}', f"vllm serve {_DECOY} --port 9", "it's \"quoted", "$(rm -rf /)", " EOF", "EOF2", "  indented"]


def _quoted(word: str, how: int) -> str:
    if how == 1:
        return shlex.quote(word)
    if how == 2:
        return '"' + word.replace('"', '\\"') + '"'
    return word


@st.composite
def _vllm_line(draw: st.DrawFn) -> str:
    words = [draw(st.sampled_from(_PROGRAMS))]
    if draw(st.integers(0, 5)):
        words.append(_quoted(draw(st.sampled_from(_MODELS)), draw(st.integers(0, 2))))
    for _ in range(draw(st.integers(0, 6))):
        flag = draw(st.sampled_from(_FLAGS))
        value = draw(st.sampled_from(_VALUES + [""] * 4))
        if value and draw(st.booleans()):
            words.append(f"{flag}={value}")
        else:
            words += [flag, value] if value else [flag]
    joiner = draw(st.sampled_from([" ", " ", " \\\n  ", "  "]))
    return draw(st.sampled_from(_WRAPPERS)) + joiner.join(words) + draw(st.sampled_from(_ENDINGS))


@st.composite
def _docker_line(draw: st.DrawFn) -> str:
    engine = draw(st.sampled_from(["docker", "podman", "sudo docker", "/usr/bin/docker"]))
    options = draw(st.lists(st.sampled_from(_DOCKER_OPTIONS), max_size=8))
    after = draw(st.sampled_from(["", "vllm serve ", "--model ", "python3 -m vllm.entrypoints.openai.api_server --model "]))
    tail = draw(_vllm_line()).split(" ", 2)[-1] if draw(st.booleans()) else draw(st.sampled_from(_MODELS))
    joiner = draw(st.sampled_from([" ", " \\\n  "]))
    return joiner.join([f"{engine} run", *options, draw(st.sampled_from(_IMAGES)), after + tail])


@st.composite
def _assignment(draw: st.DrawFn) -> str:
    name = draw(st.sampled_from(_ASSIGN_NAMES))
    value = _quoted(draw(st.sampled_from(_MODELS + _VALUES)), draw(st.integers(0, 2)))
    return draw(st.sampled_from(["", "export ", "local ", "declare -x "])) + f"{name}={value}"


@st.composite
def _heredoc(draw: st.DrawFn) -> str:
    marker = draw(st.sampled_from(["EOF", "'EOF'", "\"EOF\"", "-EOF"]))
    body = "\n".join(draw(st.lists(st.sampled_from(_HEREDOC_BODIES), max_size=3)))
    return f"cat <<{marker} > /tmp/x\n{body}\n{marker.strip(chr(39) + chr(34) + '-')}"


@st.composite
def scripts(draw: st.DrawFn) -> str:
    """A start script: a shebang, assignments, other commands, here-docs and blocks, around one (or no, or two) vLLM commands."""
    lines = [draw(st.sampled_from(["#!/bin/bash", "#!/usr/bin/env bash", "#!/bin/sh", ""]))]
    pieces = st.one_of(_assignment(), st.sampled_from(_OTHER_LINES), _heredoc(), st.just("# a comment with 'quotes and $VARS"))
    lines += draw(st.lists(pieces, max_size=6))
    for _ in range(draw(st.sampled_from([1, 1, 1, 0, 2]))):
        command = draw(_docker_line() if draw(st.integers(0, 3)) == 0 else _vllm_line())
        if draw(st.integers(0, 5)) == 0:
            command = f"if [ -n \"$X\" ]; then\n  {command}\nfi"
        lines.insert(draw(st.integers(1, len(lines))), command)
    lines += draw(st.lists(pieces, max_size=2))
    return draw(st.sampled_from(["\n", "\n", "\r\n"])).join(lines) + draw(st.sampled_from(["\n", "", " \\"]))


@st.composite
def compose_files(draw: st.DrawFn) -> str:
    """A docker compose file of the vLLM service, in the forms compose accepts."""
    command = draw(st.sampled_from([
        "command: --model Qwen/Qwen3-8B --port 8000", 'command: ["--model", "Qwen/Qwen3-8B", "--gpu-memory-utilization", "0.8"]',
        "command: vllm serve /models/x --max-model-len 8192", "command: >\n      --model x\n      --port 9", "command:\n      - --model\n      - m",
        "", "command: [unclosed", "command: '--model ${MODEL}'",
    ]))
    extras = draw(st.lists(st.sampled_from([
        "ipc: host", "shm_size: 16g", "restart: unless-stopped", "container_name: vllm", "runtime: nvidia", "init: true",
        "ports:\n      - \"8000:8000\"", "environment:\n      - HF_TOKEN=${HF_TOKEN}\n      - VLLM_X=1", "environment:\n      HF_HOME: /root/.cache/hf",
        "volumes:\n      - ~/.cache/huggingface:/root/.cache/huggingface\n      - type: bind\n        source: /a\n        target: /b",
        "deploy:\n      resources:\n        reservations:\n          devices:\n            - driver: nvidia\n              count: all\n              capabilities: [gpu]",
        "ulimits:\n      memlock: -1\n      stack:\n        soft: 67108864\n        hard: 67108864", "healthcheck:\n      test: [\"CMD\", \"curl\"]",
        "env_file: .env", "network_mode: host", "user: \"1000\"",
    ]), max_size=6, unique=True))
    image = draw(st.sampled_from(["image: vllm/vllm-openai:latest", "image: ${IMAGE}", "", "image: nvcr.io/nvidia/vllm:26.05-py3  # pinned"]))
    service = "\n    ".join(p for p in [image, command, *extras] if p)
    others = draw(st.sampled_from(["", "  web:\n    image: nginx\n", "  db:\n"]))
    return draw(st.sampled_from(["", "version: '3.8'\n", "---\n"])) + f"services:\n  {draw(st.sampled_from(['vllm', 'llm', 'x']))}:\n    {service}\n{others}"


def import_script(raw: bytes) -> tuple[int, str, str]:
    """`gb10d import-script FILE` run in this process, with its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "start.sh"
        script.write_bytes(raw)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(["import-script", str(script)])
    return status, out.getvalue(), err.getvalue()


def _assert_validates_or_warns(raw: bytes, damaged: bool = False) -> None:
    status, out, err = import_script(raw)
    assert status in (0, EXIT_CONFIG), (status, err)
    assert "Traceback" not in out + err
    if status == EXIT_CONFIG:
        event("exit 78")
        assert not out and err and all(line.startswith("gb10d: ") for line in err.splitlines()), err
        return
    data = tomllib.loads(out)  # what import-script writes is TOML, whatever it read
    # Damage may cut a here-document's opener, and its lines become commands indeed.
    assert damaged or data.get("vllm", {}).get("model") != _DECOY, "a here-document's line was read as the script's command"
    warnings = [line for line in out.splitlines() if line.startswith("# warning: ")]
    try:
        parse_config(data)
    except ConfigError as exc:
        event("invalid config, with warnings")
        said = " ".join(warnings)
        for problem in exc.problems:
            # The warning names the key, or the text it could not read into the value (an unset $VAR, a $(...)).
            leaf = problem.key.rpartition(".")[2].strip('"')
            unread = re.findall(r"\$\{?\w+|\$\(|`|~", problem.message)
            assert leaf.replace("_", "-") in said.replace("_", "-") or any(u in said for u in unread), \
                f"{problem}: no warning names {leaf!r} or what was not understood in its value:\n{out}"
        return
    event("valid config")


@given(script=scripts())
@budget(ci=100, long=4000)
def test_import_script_of_a_start_script_gives_a_valid_config_or_warns(script: str) -> None:
    _assert_validates_or_warns(script.encode())


@given(text=compose_files())
@budget(ci=50, long=3000)
def test_import_script_of_a_compose_file_gives_a_valid_config_or_warns(text: str) -> None:
    _assert_validates_or_warns(text.encode())


@given(raw=scripts().map(str.encode).flatmap(mutated_bytes))
@budget(ci=60, long=2000)
def test_import_script_of_a_damaged_script_gives_a_valid_config_or_warns_or_exit_78(raw: bytes) -> None:
    _assert_validates_or_warns(raw, damaged=True)

