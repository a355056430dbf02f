"""docker compose files: the one vLLM service read as the `docker run` it amounts to (dockerrun).

gb10d does not run compose (its restart policy would restart the container behind gb10d's back); the answer is
the equivalent config. Only the subset of YAML that compose files use is read, so no YAML library is needed.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from ...base.errors import ConfigError, ConfigProblem
from .dockerrun import container_command
from .importtoml import Findings, Imported, import_script_result
from .shellexpansion import Shell
from .shellsyntax import Command

_COMPOSE_RUN_OPTIONS = {
    "container_name": "--name", "ipc": "--ipc", "shm_size": "--shm-size", "network_mode": "--network", "restart": "--restart",
    "runtime": "--runtime", "user": "--user", "pull_policy": "--pull",
}
_COMPOSE_LISTS = {"environment": "-e", "volumes": "-v", "ports": "-p", "env_file": "--env-file", "devices": "--device"}


def looks_like_compose(text: str) -> bool:
    """A docker compose file: YAML with a top-level `services:` mapping."""
    return re.search(r"^services:\s*(#.*)?$", text, re.MULTILINE) is not None


def _yaml_scalar(text: str) -> Any:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [_yaml_scalar(item) for item in text[1:-1].split(",") if item.strip()]
    if text.startswith("{") and text.endswith("}"):
        return {k.strip(): _yaml_scalar(v) for k, _, v in (item.partition(":") for item in text[1:-1].split(",")) if k.strip()}
    return text


def _yaml_lines(text: str) -> list[tuple[int, str]]:
    """(indent, content) of the lines that carry something, comments removed."""
    lines = []
    for raw in text.splitlines():
        content = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if content.strip() and content.strip() != "---":
            lines.append((len(content) - len(content.lstrip()), content.strip()))
    return lines


def _yaml_block(lines: list[tuple[int, str]], start: int, indent: int) -> tuple[Any, int]:
    """The mapping or list whose lines start at `start` with this indentation (the subset compose files use)."""
    if start < len(lines) and lines[start][1].startswith("- "):
        items: list[Any] = []
        index = start
        while index < len(lines) and lines[index][0] == indent and lines[index][1].startswith("- "):
            body = lines[index][1][2:]
            if re.match(r"^[\w.-]+:(\s|$)", body):
                # `- driver: nvidia` opens a mapping whose further keys sit under the first one.
                nested = [(indent + 2, body)] + [(i, c) for i, c in lines[index + 1 :]]
                value, used = _yaml_block(nested, 0, indent + 2)
                items.append(value)
                index += used
            else:
                items.append(_yaml_scalar(body))
                index += 1
        return items, index - start
    mapping: dict[str, Any] = {}
    index = start
    while index < len(lines) and lines[index][0] == indent:
        key, _, rest = lines[index][1].partition(":")
        index += 1
        rest = rest.strip()
        if rest in ("|", ">", "|-", ">-"):
            block = []
            while index < len(lines) and lines[index][0] > indent:
                block.append(lines[index][1])
                index += 1
            mapping[key.strip()] = " ".join(block)
        elif rest:
            mapping[key.strip()] = _yaml_scalar(rest)
        elif index < len(lines) and lines[index][0] > indent:
            mapping[key.strip()], used = _yaml_block(lines, index, lines[index][0])
            index += used
        else:
            mapping[key.strip()] = None
    return mapping, index - start


def _compose_run(service: dict[str, Any], warnings: list[str]) -> list[str]:
    """The `docker run` words equivalent to one compose service, as far as gb10d has settings for them."""
    words = ["docker", "run"]
    for key, value in service.items():
        if key in _COMPOSE_RUN_OPTIONS:
            words += [_COMPOSE_RUN_OPTIONS[key], str(value)]
        elif key in _COMPOSE_LISTS:
            entries = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else value if isinstance(value, list) else [value]
            for entry in entries:
                if isinstance(entry, dict):
                    warnings.append(f"{key}: the long form {entry} is not read; write it as a short HOST:CONTAINER[:OPTIONS] entry")
                else:
                    words += [_COMPOSE_LISTS[key], str(entry)]
        elif key == "init" and str(value) == "true":
            words.append("--init")
        elif key == "ulimits" and isinstance(value, dict):
            for name, limit in value.items():
                bound = f"{limit.get('soft')}:{limit.get('hard')}" if isinstance(limit, dict) else str(limit)
                words += ["--ulimit", f"{name}={bound}"]
        elif key == "deploy" and "nvidia" in str(value) and "gpu" in str(value):
            words += ["--gpus", "all"]
        elif key not in ("image", "command"):
            warnings.append(f"{key}: not read; gb10d has no setting for it")
    image = str(service.get("image", ""))
    command = service.get("command")
    words.append(image)
    if isinstance(command, list):
        words += [str(w) for w in command]
    elif command:
        words += shlex.split(str(command))
    return words


def import_compose(text: str, shown: str) -> Imported:
    """A compose file is not imported as such; the answer is the config equivalent to its vLLM service."""
    services, _ = _yaml_block(_yaml_lines(text), 0, 0)
    found = services.get("services") if isinstance(services, dict) else None
    if not isinstance(found, dict) or not found:
        raise ConfigError([ConfigProblem(shown, "", "a docker compose file without services; nothing to import")])
    name, service = next(((n, s) for n, s in found.items() if "vllm" in str(s)), next(iter(found.items())))
    if not isinstance(service, dict) or not service.get("image"):
        raise ConfigError([ConfigProblem(shown, "", f"the compose service {name!r} names no image; gb10d runs vLLM from an image, a venv or an executable")])
    warnings = [
        f"docker compose files are not supported: gb10d runs, restarts and stops the container itself (a compose restart "
        f"policy would restart it behind gb10d's back). Stop the compose project (docker compose down), then use this "
        f"config, the equivalent of its service {name!r}"
    ]
    words = _compose_run(service, warnings)
    if len(found) > 1:
        warnings.append(f"only the service {name!r} was read; gb10d runs one vLLM per config ({', '.join(n for n in found if n != name)} left out)")
    if "${" in text:
        warnings.append("compose fills ${...} from its .env file or environment; the text was kept as written, replace it (secrets in vllm.env_file)")
    result = Findings()
    container_command(Shell(), words, Command(0, words), result)
    imported = import_script_result(result)
    where = f"service {name}: "
    return Imported(imported.data, [n.replace("line 0: ", where) for n in imported.notes],
                    warnings + [w.replace("line 0: ", where) for w in imported.warnings])
