"""vLLM from a container image: `docker run [options] IMAGE [vllm serve] MODEL flags`, podman alike.

Each option of the engine becomes a [container] key, an environment variable, a note that gb10d does it itself,
or run_args; the command after the image is read as any vLLM command (servecommand). Apart because
these are the engine's words, not the shell's or vLLM's.
"""

from __future__ import annotations

import posixpath

from ...base.command import CHILD_DEFAULTS, CONTAINER_CACHE_ENV
from .importtoml import Findings
from .servecommand import is_python, is_vllm, vllm_command
from .shellexpansion import Shell
from .shellsyntax import Command

# The container engines whose `run` line is read as vLLM from an image.
ENGINES = ("docker", "podman")
# `docker run` options that take a value (as `-e X=1` or `--env=X=1`); any other option is a switch.
_VALUED_OPTIONS = {
    "-a", "--attach", "-c", "--cpu-shares", "-e", "--env", "--env-file", "-h", "--hostname", "-l", "--label", "--label-file",
    "-m", "--memory", "-p", "--publish", "-u", "--user", "-v", "--volume", "-w", "--workdir", "--add-host", "--cap-add",
    "--cap-drop", "--cgroupns", "--cidfile", "--cpus", "--cpuset-cpus", "--device", "--dns", "--entrypoint", "--gpus",
    "--group-add", "--ipc", "--log-driver", "--log-opt", "--memory-swap", "--mount", "--name", "--network", "--net",
    "--pid", "--platform", "--pull", "--restart", "--runtime", "--security-opt", "--shm-size", "--stop-signal",
    "--stop-timeout", "--tmpfs", "--ulimit", "--userns", "--uts", "--health-cmd", "--pids-limit",
}
_SHORT_SWITCHES = set("itdP")
# What a gb10d-made line carries for gb10d's own bookkeeping; reading it back changes nothing.
_OWN_LABEL = "gb10d.config="


def _engine_options(words: list[str]) -> tuple[list[tuple[str, str | None]], list[str]]:
    """(option, value) pairs up to the image, and the words from the image on; `-it` is `-i`, `-t`."""
    options: list[tuple[str, str | None]] = []
    index = 0
    while index < len(words) and words[index].startswith("-") and words[index] != "-":
        word = words[index]
        index += 1
        name, eq, value = word.partition("=")
        if not name.startswith("--") and len(name) > 2 and set(name[1:]) <= _SHORT_SWITCHES:
            options += [(f"-{c}", None) for c in name[1:]]
        elif not name.startswith("--") and len(name) > 2 and name[:2] in _VALUED_OPTIONS:
            options.append((name[:2], word[2:]))  # -p8000:8000
        elif name in _VALUED_OPTIONS and not eq:
            options.append((name, words[index] if index < len(words) else ""))
            index += 1
        else:
            options.append((name, value if eq else None))
    return options, words[index:]


def container_command(shell: Shell, fields: list[str], command: Command, result: Findings) -> None:
    """`docker run ... IMAGE [vllm serve] MODEL flags`: [vllm] image and [container], then the vllm command as usual."""
    line = command.line
    engine = posixpath.basename(fields[0])
    options, rest = _engine_options(fields[2:])
    if not rest:
        result.warnings.append(f"line {line}: {engine} run names no image; set vllm.image")
        return
    image, rest = rest[0], rest[1:]
    result.vllm["image"] = image
    if engine == "podman":
        result.container["engine"] = "podman"
    published: list[str] = []
    for option, value in options:
        _engine_option(shell, engine, option, value or "", line, result, published)
    if rest[:2] == ["vllm", "serve"] or (rest[:1] and (is_vllm(rest[0]) or is_python(rest[0]))):
        vllm_command(Shell(), rest, [], command, result)
    else:
        result.notes.append(f"line {line}: no command after the image: its entrypoint is taken to run `vllm serve` with the words that follow")
        vllm_command(Shell(), ["vllm", "serve", *rest], [], command, result)
    port = str(result.vllm.get("port", 8000))
    for mapping in published:
        host, _, inside = mapping.rpartition(":")
        host = host.rpartition(":")[2]  # 127.0.0.1:8000:8000
        if inside.split("/")[0] == port and host.isdigit() and host != port:
            result.vllm["port"] = int(host)
            result.notes.append(f"line {line}: -p {mapping}: the container uses the host's network under gb10d, so vLLM listens on {host} itself")
        else:
            result.notes.append(f"line {line}: -p {mapping} not needed: the container uses the host's network, so vllm.port is the host's port")


def _engine_option(shell: Shell, engine: str, option: str, value: str, line: int, result: Findings, published: list[str]) -> None:
    """One `docker run` option: a [container] key, an environment variable, a note that gb10d does it, or run_args."""
    c = result.container
    gb10d_does = {
        "--name": "gb10d names the container after its config (container.name)",
        "--rm": "gb10d removes the container itself once it has read how it ended",
        "-i": "vLLM reads no input", "--interactive": "vLLM reads no input", "-t": "gb10d reads vLLM's output through pipes",
        "--tty": "gb10d reads vLLM's output through pipes", "-d": "systemd keeps gb10d running and gb10d stays attached",
        "--detach": "systemd keeps gb10d running and gb10d stays attached", "--restart": "gb10d restarts vLLM with corrected settings, and systemd restarts gb10d",
        "--init": "gb10d adds --init (container.init)", "--log-driver": "gb10d sends vLLM's output to the journal",
        "--stop-timeout": "gb10d stops the container after [daemon] stop_timeout_s", "--network": "gb10d uses the host's network",
        "--net": "gb10d uses the host's network",
    }
    if option in gb10d_does:
        result.notes.append(f"line {line}: {option} not needed: {gb10d_does[option]}")
    elif option in ("-e", "--env"):
        name, eq, text = value.partition("=")
        if name in CHILD_DEFAULTS or name in CONTAINER_CACHE_ENV:
            return  # gb10d sets these itself
        if not eq:
            text = shell.variables.get(name, f"${name}")
            if name not in shell.variables:
                result.warnings.append(f"line {line}: -e {name} passes the script's {name}, which it does not set; put {name}=... in vllm.env_file")
        result.env[name] = text
    elif option == "--env-file":
        result.vllm["env_file"] = result.absolute(value, line, "--env-file")
    elif option in ("-v", "--volume"):
        _mount(value, line, result)
    elif option in ("-p", "--publish"):
        published.append(value)
    elif option == "--gpus" or (option == "--runtime" and value == "nvidia"):
        if value.strip("\"'") not in ("all", "nvidia"):
            result.warnings.append(f"line {line}: {option} {value}: gb10d gives the container all GPUs (a GB10 has one); set container.gpu to change how")
    elif option == "--device" and value.startswith("nvidia.com/gpu"):
        if engine == "docker":
            c["gpu"] = "cdi"
    elif option == "--ipc":
        if value != "host":
            result.warnings.append(f"line {line}: --ipc {value}: gb10d uses --ipc=host, or a private /dev/shm of container.shm_size")
    elif option == "--shm-size":
        c["shm_size"] = value
    elif option == "--pull":
        if value in ("missing", "always"):
            c["pull"] = value
        else:
            result.notes.append(f"line {line}: --pull {value}: gb10d pulls before it runs, as container.pull says (\"missing\" by default)")
    elif option in ("-l", "--label") and value.startswith(_OWN_LABEL):
        return
    else:
        if option not in ("--ulimit", "--user", "-u", "--cap-add", "--security-opt", "--device", "--tmpfs", "--privileged", "--runtime"):
            result.warnings.append(f"line {line}: {option} is not a setting gb10d knows; kept in container.run_args, check it")
        c.setdefault("run_args", []).extend([option] if value == "" and option not in _VALUED_OPTIONS else [f"{option}={value}"])


def _mount(value: str, line: int, result: Findings) -> None:
    """`-v HOST:CONTAINER[:OPTIONS]`: a mount, except over gb10d's own cache directory or the local model's."""
    host, _, inside = value.partition(":")
    inside_path = inside.partition(":")[0]
    if inside_path == "/root/.cache" or inside_path.startswith("/root/.cache/"):
        if host in ("/var/cache/gb10d", ""):
            return
        if not host.startswith("/"):
            result.warnings.append(
                f"line {line}: -v {value}: the script's cache is not mounted; gb10d keeps the Hugging Face and compile caches in "
                f"/var/cache/gb10d (mounted at /root/.cache): move the downloaded models there, or mount the cache by its absolute path in container.mounts"
            )
            return
    if inside_path == result.vllm.get("model") and inside_path == host:
        return  # gb10d mounts a local model directory itself
    if not host.startswith("/"):
        result.warnings.append(f"line {line}: -v {value}: {host!r} is not an absolute path (a named volume, ~ or a relative path); write the host's absolute path in container.mounts")
    result.container.setdefault("mounts", []).append(value)
