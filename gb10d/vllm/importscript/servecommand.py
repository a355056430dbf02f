"""The command that runs vLLM (`vllm serve`, or `python -m vllm.entrypoints...`), placed as gb10d.toml keeps it.

Which command of a script runs vLLM, what it runs from (a venv or an executable), its model, its flags as
first-class [vllm] keys or [vllm.args], and the environment it inherits. Apart from the shell that reads the
script, because the same command line also comes after the image of a `docker run` and from a compose service.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from typing import Any

from ...base.flags import normalize_flag
from .importtoml import Findings
from .shellexpansion import Shell
from .shellsyntax import Command

_NEGATIVE_NUMBER = re.compile(r"-\d+(\.\d+)?")
# Prefixes of variables vLLM, PyTorch, CUDA or Hugging Face read; exported ones go to [vllm.env].
_RELEVANT_ENV = (
    "VLLM_", "CUDA_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "TRITON_", "NCCL_",
    "NVIDIA_", "OMP_", "MKL_", "TOKENIZERS_", "SAFETENSORS_", "UCX_", "GLOO_", "TP_SOCKET_", "RAY_",
    "MASTER_", "FLASHINFER_", "LD_LIBRARY_PATH", "XDG_CACHE_HOME", "TMPDIR", "PYTHON",
)
# Commands with no effect on vLLM once gb10d runs it (it owns output, restarts and the process).
HARMLESS = {
    "echo", "printf", "set", "shopt", "sleep", "mkdir", "touch", "date", "tail", "cat", "tee", "true", ":",
    "umask", "disown", "wait", "exit", "deactivate", "nvidia-smi", "sync", "trap", "rm", "ls", "pwd", *("[", "[[", "test"),
}
STOPPERS = {"pkill", "kill", "killall"}
# Wrappers before the program that gb10d makes unnecessary: systemd keeps it running and owns the process.
_WRAPPERS = {"nohup", "exec", "setsid", "time", "env"}
_SHORT_FLAGS = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size", "-dp": "data-parallel-size", "-q": "quantization"}
_OLD_ENTRY = "vllm.entrypoints.openai.api_server"
_CLI_ENTRY = "vllm.entrypoints.cli.main"
_SYSTEM_PREFIXES = ("/usr", "/usr/local", "/")


def is_vllm(word: str) -> bool:
    """The word names vllm's own program, by any path (a venv's bin/vllm, a container's vllm)."""
    return posixpath.basename(word) == "vllm"


def is_python(word: str) -> bool:
    """The word names a Python, by any path and version, that may run vLLM as a module."""
    return re.fullmatch(r"python(\d+(\.\d+)?)?", posixpath.basename(word)) is not None


def vllm_start(fields: list[str]) -> int | None:
    """The index of the vllm (or python -m vllm...) word when this command runs vLLM, else None."""
    start = next((k for k, f in enumerate(fields) if is_vllm(f) or is_python(f)), None)
    runs_vllm = start is not None and (
        fields[start + 1 : start + 2] == ["-m"] or (is_vllm(fields[start]) and (start == 0 or fields[start + 1 : start + 2] == ["serve"]))
    )
    # `pkill -f vllm` or `echo vllm serve` mention vllm without running it.
    return start if runs_vllm and posixpath.basename(fields[0]) not in HARMLESS | STOPPERS else None


def relevant(name: str) -> bool:
    """A variable vLLM or a library under it reads, so the script's value matters to vLLM."""
    return name.startswith(_RELEVANT_ENV)


def wrappers(prefix: list[str], line: int, result: Findings) -> None:
    """Words before the program: nohup/exec/env are not needed under systemd, others are not reproduced."""
    if not prefix:
        return
    known = [w for w in prefix if w in _WRAPPERS]
    unknown = [w for w in prefix if w not in _WRAPPERS]
    if known:
        result.notes.append(
            f"line {line}: {' '.join(known)} not needed: systemd keeps gb10d running and gb10d owns the vLLM process"
        )
    if unknown:
        result.warnings.append(
            f"line {line}: {shlex.join(unknown)!r} before vllm is not reproduced; gb10d runs vLLM directly "
            "(CPU pinning or priorities belong in a systemd drop-in: systemctl edit gb10d)"
        )


def _program(fields: list[str], line: int, result: Findings) -> list[str]:
    """Set venv or executable from the program word; return the words after `serve` (or the entry point)."""
    word = fields[0]
    if is_vllm(word):
        rest = fields[1:]
        if rest[:1] != ["serve"]:
            result.warnings.append(f"line {line}: vllm {' '.join(rest[:1])!r} is not 'vllm serve'; read as if it were")
        else:
            rest = rest[1:]
        if "/" in word:
            path = result.absolute(word, line, "vllm")
            if result.venv is not None and path == posixpath.join(result.venv, "bin", "vllm"):
                return rest
            result.vllm["executable"] = path
            result.venv = None
        elif result.venv is None and "image" not in result.vllm:
            result.warnings.append(
                "the script runs 'vllm' from PATH; set vllm.executable to its full path (see: command -v vllm) or vllm.venv"
            )
        return rest
    module = fields[2] if len(fields) > 2 else ""
    rest = fields[3:]
    old = module == _OLD_ENTRY
    if module == _CLI_ENTRY and rest[:1] == ["serve"]:
        rest = rest[1:]
    elif not old:
        result.warnings.append(f"line {line}: python -m {module} is not a vLLM server entry point; read as if it were")
    if old:
        result.notes.append(
            f"line {line}: python -m {_OLD_ENTRY} is vLLM's old entry point; gb10d runs 'vllm serve', which takes the same flags"
        )
    if "/" in word:
        bindir = posixpath.dirname(result.absolute(word, line, "python"))
        root = posixpath.dirname(bindir)
        if posixpath.basename(bindir) == "bin" and root not in _SYSTEM_PREFIXES:
            result.venv = root
        elif result.venv is None:
            result.vllm["executable"] = "/usr/local/bin/vllm"
            result.warnings.append(
                f"line {line}: vLLM runs from the system Python {word}; executable was guessed as /usr/local/bin/vllm, check it"
            )
    elif result.venv is None:
        result.warnings.append("the script runs 'python' from PATH; set vllm.venv to the virtualenv that has vLLM")
    return rest


def vllm_command(shell: Shell, fields: list[str], assignments: list[tuple[str, str]], command: Command, result: Findings) -> None:
    """The vllm serve command itself: program, model, flags, environment, and what wraps it."""
    line = command.line
    result.found += 1
    if result.found > 1:
        result.warnings.append(f"line {line}: another vLLM command; gb10d runs one vLLM per config, so only the first was imported")
        return
    rest = _program(fields, line, result)
    positional, flags = _split_flags(rest, line, result)
    if positional:
        result.vllm["model"] = positional[0]
        if positional[0].startswith(("./", "../", "~")):
            result.vllm["model"] = result.absolute(positional[0], line, "model")
        if len(positional) > 1:
            result.warnings.append(f"line {line}: extra words {shlex.join(positional[1:])!r} after the model; kept in extra_args")
            result.extra_args += positional[1:]
    for flag, values, spelled in flags:
        _flag(flag, values, spelled, line, result)
    if "model" not in result.vllm:
        result.warnings.append(f"line {line}: no model was given; set vllm.model")
    _environment(shell, assignments, line, result)
    if command.redirects:
        outputs = [r.split(None, 1)[1] for r in command.redirects if r.split(None, 1)[0] in (">", ">>", "1>", "1>>", "&>", "&>>") and " " in r]
        target = " ".join(shell.expand(outputs[0]).fields) if outputs else ""
        result.notes.append(
            f"line {line}: {' '.join(command.redirects)} not needed: vLLM's output goes to the journal now "
            f"(journalctl -u gb10d){f', no longer to {target}' if target else ''}"
        )
    if command.background:
        result.notes.append(
            f"line {line}: & not needed: systemd runs gb10d in the background, and systemctl start gb10d returns once vLLM serves"
        )
    if command.piped_from:
        result.warnings.append(f"line {line}: vllm reads from a pipe here; gb10d gives it no input")


def _split_flags(words: list[str], line: int, result: Findings) -> tuple[list[str], list[tuple[str, list[str], str]]]:
    """Positional words and (flag, values, as written) in order; a flag takes every value up to the next flag."""
    positional: list[str] = []
    flags: list[tuple[str, list[str], str]] = []
    index = 0
    while index < len(words):
        word = words[index]
        index += 1
        if word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.fullmatch(word):
            name, eq, value = word.partition("=")
            if not name.startswith("--"):
                if name not in _SHORT_FLAGS:
                    result.warnings.append(f"line {line}: short option {word!r} is not known; kept in extra_args")
                    result.extra_args.append(word)
                    continue
                name = "--" + _SHORT_FLAGS[name]
            values = [value] if eq else []
            while not eq and index < len(words) and (not words[index].startswith("-") or _NEGATIVE_NUMBER.fullmatch(words[index])):
                values.append(words[index])
                index += 1
            flags.append((normalize_flag(name), values, word))
        else:
            positional.append(word)
    return positional, flags


def _flag(flag: str, values: list[str], spelled: str, line: int, result: Findings) -> None:
    """Place one flag where gb10d.toml keeps it: a first-class [vllm] key or [vllm.args]."""
    first_class = {"host": "host", "port": "port", "served-model-name": "served_model_name",
                   "gpu-memory-utilization": "gpu_memory_utilization", "model": "model"}
    key = first_class.get(flag)
    if key in result.vllm or flag in result.args or (flag.startswith("no-") and flag[3:] in result.args):
        result.warnings.append(f"line {line}: --{flag} is given twice; the last value is used, as vLLM does")
    if key == "served_model_name" and values:
        result.vllm[key] = values[0] if len(values) == 1 else values
    elif key is not None:
        if len(values) != 1:
            result.warnings.append(f"line {line}: --{flag} needs one value (got {shlex.join(values) or 'none'}); set vllm.{key} yourself")
            return
        converted: Any = values[0]
        try:
            converted = {"port": int, "gpu_memory_utilization": float}.get(key, str)(values[0])
        except ValueError:
            result.warnings.append(f"line {line}: --{flag} {values[0]!r} is not a number; set vllm.{key} yourself")
            return
        result.vllm[key] = converted
    elif not re.fullmatch(r"[a-z0-9][a-z0-9-]*(\.[A-Za-z0-9_-]+)*", flag):
        result.warnings.append(f"line {line}: {spelled!r} is not a flag name gb10d can write as a key; kept in extra_args")
        result.extra_args += [spelled, *values] if "=" not in spelled else [spelled]
    elif not values:
        if flag.startswith("no-"):
            result.args[flag[3:]] = False
        else:
            result.args[flag] = True
    else:
        result.args[flag] = _value(values[0]) if len(values) == 1 else [_value(v) for v in values]
    if flag in ("api-key", "hf-token"):
        result.warnings.append(
            f"line {line}: --{flag} is a secret and gb10d.toml is usually world-readable; better put "
            f"{'VLLM_API_KEY' if flag == 'api-key' else 'HF_TOKEN'}=... in a file only root and gb10d can read "
            f"(chmod 0640), set vllm.env_file to it, and remove {flag} from [vllm.args]"
        )


def _value(text: str) -> Any:
    """A flag value in the TOML type that prints back the same: 131072 -> int, 0.5 -> float, JSON -> table."""
    if re.fullmatch(r"-?\d+", text) and str(int(text)) == text:
        return int(text)
    if re.fullmatch(r"-?\d+\.\d+", text) and repr(float(text)) == text:
        return float(text)
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            return text
        if isinstance(parsed, dict) and not _has_null(parsed):
            return parsed
    return text


def _has_null(value: Any) -> bool:
    """TOML has no null, so JSON holding one must stay a string."""
    if isinstance(value, dict):
        return any(_has_null(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_null(v) for v in value)
    return value is None


def _environment(shell: Shell, assignments: list[tuple[str, str]], line: int, result: Findings) -> None:
    """What vLLM would inherit from the script: exports and assignments before the command."""
    inherited = {name: shell.variables.get(name, "") for name in sorted(shell.exported)}
    for name, value in [*inherited.items(), *assignments]:
        if name == "PATH":
            result.notes.append(f"line {line}: PATH is not copied; gb10d puts the venv's bin first on its own PATH")
            continue
        if name == "VIRTUAL_ENV":
            result.venv = result.venv or value
            continue
        if name in dict(assignments) or relevant(name) or name not in shell.referenced:
            if not relevant(name) and name not in dict(assignments):
                result.warnings.append(f"line {line}: exported {name} is passed to vLLM; remove it from [vllm.env] if vLLM does not need it")
            result.env[name] = value
        else:
            result.notes.append(f"exported {name} is used only by the script itself; not passed to vLLM")
    for name in result.env:
        if re.search(r"TOKEN|KEY|SECRET|PASSWORD", name, re.IGNORECASE):
            result.warnings.append(
                f"{name} is a secret and gb10d.toml is usually world-readable; better move it to a file only root and "
                f"gb10d can read (chmod 0640, lines like {name}=...), set vllm.env_file to it, and remove it from [vllm.env]"
            )
