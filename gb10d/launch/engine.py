"""The container engine's client, docker or podman: one command with a deadline, the engine chosen and probed, its errors explained.

Apart from the container of one attempt because check-config, `gb10d
cleanup` and the image's pull speak to the engine too, with no container
running. An engine that cannot be reached is an EngineUnavailable whose
exit status says whether it may come back by itself (75) or the operator
must act (78); `unreachable_advice` says what to do, from the client's words.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..base.command import PODMAN_SOCKET, Engine, EngineKind, engine_client
from ..base.config import ContainerSection
from ..base.configload import LoadedConfig
from ..base.errors import EXIT_CONFIG, EXIT_GAVE_UP, ConfigProblem, SpawnError
from ..base.image import not_present

# An engine that does not answer a simple request within this long is as good as unreachable.
ENGINE_TIMEOUT_S = 30.0


class EngineUnavailable(SpawnError):
    """The container engine cannot be reached, or refused to run the container."""

    def __init__(self, message: str, exit_status: int = EXIT_CONFIG) -> None:
        # 78 when the operator must change something (a permission, a package, the GPU toolkit);
        # 75 when the engine may come back by itself (its daemon not started yet, or hung).
        self.exit_status = exit_status
        super().__init__(message)


# --- what the engine's words mean -------------------------------------------------------------------


def unreachable_advice(engine: Engine, text: str, user: str) -> str | None:
    """What to do when the engine's client says it cannot reach the engine; None when the text says something else.

    Only failures on the engine's own socket count: a registry that refuses
    a connection is a pull failure, not an engine that is down.
    """
    socket = re.search(r"dial unix (/\S+?):|unix://(/\S+?)[.:]?(?:\s|$)", text)
    if socket is None and "Cannot connect to the Docker daemon" not in text and "Cannot connect to Podman" not in text:
        return None
    path = (socket.group(1) or socket.group(2)) if socket else ("/var/run/docker.sock" if engine.kind == "docker" else str(PODMAN_SOCKET))
    if "permission denied" in text:
        if engine.kind == "docker":
            return (
                f"the user {user} may not use docker's socket {path}; add it to the docker group "
                f"(sudo usermod -aG docker {user}, then restart gb10d). Membership of the docker group is as good as root on this machine"
            )
        return (
            f"the user {user} may not use podman's socket {path}; let its group in (sudo systemctl edit podman.socket: "
            f"[Socket] SocketGroup={user}, then sudo systemctl restart podman.socket). Access to the socket is as good as root on this machine"
        )
    if engine.kind == "docker":
        return f"docker's daemon is not running (nothing answers on {path}); start it: sudo systemctl enable --now docker"
    return f"podman's API service is not running (nothing answers on {path}); start it: sudo systemctl enable --now podman.socket"


def unreachable_status(text: str) -> int:
    """The exit status for an engine that cannot be reached: 75 when its daemon is not running (it may yet start), else 78."""
    if "permission denied" in text:
        return EXIT_CONFIG
    return EXIT_GAVE_UP


# --- running the engine's client -----------------------------------------------------------------------


@dataclass(frozen=True)
class EngineResult:
    """What one engine command printed, and its exit status."""

    status: int
    stdout: str
    stderr: str


def running_user() -> str:
    """The name of the user gb10d runs as, for advice such as `usermod -aG docker gb10d`."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def unreachable_error(engine: Engine, result: EngineResult, what: str) -> EngineUnavailable:
    """The error for an engine command `what` that failed: the client's last word, with advice and status when the engine is out of reach."""
    text = result.stderr.strip() or result.stdout.strip()
    advice = unreachable_advice(engine, text, running_user())
    last = text.splitlines()[-1] if text else f"exit status {result.status}"
    status = unreachable_status(text) if advice is not None else EXIT_CONFIG
    return EngineUnavailable(f"{engine.kind} {what} failed: {last}" + (f"; {advice}" if advice else ""), status)


async def engine_call(engine: Engine, *args: str, env: Mapping[str, str] | None = None, timeout_s: float | None = ENGINE_TIMEOUT_S) -> EngineResult:
    """Run one engine command (`docker container inspect ...`) with a deadline (None: `wait` for as long as it takes); EngineUnavailable if it cannot run or hangs."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *engine.client, *args,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(env) if env is not None else None, start_new_session=True,
        )
    except FileNotFoundError:
        raise EngineUnavailable(not_installed(engine)) from None
    except OSError as exc:
        raise EngineUnavailable(f"cannot run {engine.client[0]}: {exc.strerror or exc}") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        kill_group(proc.pid)
        await proc.wait()
        raise EngineUnavailable(
            f"{engine.kind} {' '.join(args[:2])} did not answer within {timeout_s:g} s; is the {engine.kind} daemon hung? ({engine.kind} info)", EXIT_GAVE_UP
        ) from None
    except asyncio.CancelledError:
        kill_group(proc.pid)
        raise
    return EngineResult(proc.returncode or 0, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def kill_group(pid: int) -> None:
    """SIGKILL a client started in a session of its own, with whatever it started (a hung or cancelled command)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def not_installed(engine: Engine) -> str:
    """What to do when the engine's client program is not on this machine."""
    package = "docker.io (or Docker's docker-ce)" if engine.kind == "docker" else "podman"
    other = "podman" if engine.kind == "docker" else "docker"
    return f"{engine.client[0]} is not installed: sudo apt install {package}, or set container.engine = \"{other}\""


def probe(engine: Engine, env: Mapping[str, str] | None = None) -> EngineUnavailable | None:
    """Whether the engine answers (synchronous); None when it does, else what to do about it."""
    args = ["version", "--format", "{{.Server.Version}}"] if engine.kind == "docker" else ["info", "--format", "{{.Version.Version}}"]
    try:
        done = subprocess.run([*engine.client, *args], capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return EngineUnavailable(not_installed(engine))
    except subprocess.TimeoutExpired:
        return EngineUnavailable(f"{engine.kind} did not answer within {ENGINE_TIMEOUT_S:g} s; is its daemon hung? ({engine.kind} info)", EXIT_GAVE_UP)
    if done.returncode == 0:
        return None
    return unreachable_error(engine, EngineResult(done.returncode, done.stdout, done.stderr), "info" if engine.kind == "podman" else "version")


def _missing_socket(container: ContainerSection) -> EngineUnavailable | None:
    """A configured socket that is not there: the config's mistake (78), not an engine that may yet come up."""
    socket = container.socket
    if socket is None:
        return None
    try:
        os.stat(socket)
        return None
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError:
        return None  # not ours to look at (a 0700 /run/podman): the engine's client says what it finds
    return EngineUnavailable(
        f"there is no socket {socket}: no engine can answer there; set container.socket to the engine's API socket "
        f"(docker: /var/run/docker.sock, podman: {PODMAN_SOCKET}), or remove it to use the engine's default"
    )


def choose_engine(container: ContainerSection, env: Mapping[str, str] | None = None) -> tuple[Engine, EngineUnavailable | None]:
    """The engine to use and, when it cannot be reached, what to do about it.

    `auto` takes docker when its daemon answers, else podman when it
    answers; when neither does, docker with both engines' problems.
    """
    as_root = os.geteuid() == 0
    missing = _missing_socket(container)
    if missing is not None:
        return engine_client("docker" if container.engine == "auto" else container.engine, container.socket, as_root), missing
    if container.engine != "auto":
        engine = engine_client(container.engine, container.socket, as_root)
        return engine, probe(engine, env)
    problems: list[EngineUnavailable] = []
    kinds: tuple[EngineKind, ...] = ("docker", "podman")
    for kind in kinds:
        engine = engine_client(kind, container.socket, as_root)
        problem = probe(engine, env)
        if problem is None:
            return engine, None
        problems.append(problem)
    # Only when both may still come up is it worth systemd's starting gb10d again later.
    status = EXIT_GAVE_UP if all(p.exit_status == EXIT_GAVE_UP for p in problems) else EXIT_CONFIG
    text = "neither docker nor podman can be reached: " + "; ".join(str(p) for p in problems)
    return engine_client("docker", container.socket, as_root), EngineUnavailable(text, status)


def engine_problems(loaded: LoadedConfig) -> tuple[Engine, list[ConfigProblem]]:
    """check-config's container checks: the engine answers, a `never`-pulled image is there, a CDI GPU is described."""
    config = loaded.config
    assert config.vllm.image is not None
    engine, problem = choose_engine(config.container)
    # The line to fix: the socket when one is set and the client is installed, else the engine, else the image.
    on_socket = config.container.socket is not None and shutil.which(engine.client[0]) is not None
    keys = [key for key in ("container.socket" if on_socket else "", "container.engine") if key and loaded.location_of(key)]
    where = keys[0] if keys else "vllm.image"
    if problem is not None:
        return engine, [loaded.problem(where, str(problem))]
    problems: list[ConfigProblem] = []
    if config.container.pull == "never":
        found = subprocess.run([*engine.client, "image", "inspect", config.vllm.image], capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if found.returncode != 0:
            problems.append(loaded.problem("container.pull", str(not_present(engine.kind, config.vllm.image))))
    uses_cdi = config.container.gpu == "cdi" or (config.container.gpu == "auto" and engine.kind == "podman")
    if uses_cdi and not any(Path(d, "nvidia.yaml").exists() or Path(d, "nvidia.json").exists() for d in ("/etc/cdi", "/var/run/cdi")):
        problems.append(loaded.problem(
            "container.gpu",
            f"{engine.kind} gives the GPU through CDI, but there is no /etc/cdi/nvidia.yaml or /var/run/cdi/nvidia.yaml: "
            "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml (again after every driver update), "
            'or set container.gpu = "none" to run without the GPU',
        ))
    return engine, problems
