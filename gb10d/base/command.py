"""The `vllm serve` command line and environment, built purely from the config.

`Tunables` are the settings gb10d may change between attempts (utilization,
load strategy, max model length); everything else comes from gb10d.toml as
written. Nothing here touches the system except `read_env_file`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence
from urllib.parse import urlsplit

from .config import Config, ContainerSection, VllmSection
from .configfile import DEFAULT_CONFIG_PATH
from .errors import ConfigError, ConfigProblem
from .flags import normalize_flag
from .hfcache import hub_cache

# Variables that belong to gb10d's own contract with systemd; vLLM must never see them.
_SYSTEMD_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")

# What REFERENCE.md advises for a supervised child: unbuffered, uncoloured, one-line banner.
CHILD_DEFAULTS = {"PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "VLLM_DISABLE_LOG_LOGO": "1"}

# In a container, the mounted cache directory is /root/.cache, where the image's programs look by
# default; the variables send Triton, Inductor and CUDA there too, in the layout the unit gives a venv.
CONTAINER_CACHE = "/root/.cache"
CONTAINER_CACHE_ENV = {
    "HF_HOME": f"{CONTAINER_CACHE}/huggingface",
    "VLLM_CACHE_ROOT": f"{CONTAINER_CACHE}/vllm",
    "TRITON_CACHE_DIR": f"{CONTAINER_CACHE}/triton",
    "TORCHINDUCTOR_CACHE_DIR": f"{CONTAINER_CACHE}/torchinductor",
    "CUDA_CACHE_PATH": f"{CONTAINER_CACHE}/nv",
    "XDG_CACHE_HOME": CONTAINER_CACHE,
}
# The label that tells gb10d's own container from any other: the config it was started from.
CONTAINER_LABEL = "gb10d.config"
# podman's API socket as podman.socket creates it, for a gb10d that does not run as root.
PODMAN_SOCKET = Path("/run/podman/podman.sock")

_SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
_SECRET_FLAGS = {"api-key", "hf-token"}
REDACTED = "***"


@dataclass(frozen=True)
class Tunables:
    """The settings an attempt may differ in from the config as written.

    `env` holds variables gb10d adds for a known failure (TRITON_PTXAS_PATH
    for Triton's ptxas, a PyTorch allocator setting after the driver ran out
    of memory); the config's own [vllm.env] and env_file win over them.
    `without` names flags gb10d leaves out for one (`enable-flashinfer-autotune`);
    `flags` are words it adds for one (`--no-enable-extensible-kv-cache`).
    `why` says what the last correction answered (a failure, the preflight, a learned entry's reason): it
    travels with the settings it explains, into the learned-settings file once they serve, and is not a setting.
    """

    gpu_memory_utilization: float
    load_strategy: str | None = None
    max_model_len: int | str | None = None
    env: tuple[tuple[str, str], ...] = ()
    without: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    why: str = field(default="", compare=False)

    @classmethod
    def from_config(cls, vllm: VllmSection) -> Tunables:
        """The values the config asks for, before any correction."""
        strategy = vllm.arg("safetensors-load-strategy")
        max_len = vllm.arg("max-model-len")
        return cls(
            gpu_memory_utilization=vllm.gpu_memory_utilization,
            load_strategy=str(strategy) if strategy is not None else None,
            max_model_len=max_len if isinstance(max_len, (int, str)) and not isinstance(max_len, bool) else None,
        )

    def with_(self, **changes: Any) -> Tunables:
        """A copy with some fields changed."""
        return replace(self, **changes)

    def with_env(self, name: str, value: str) -> Tunables:
        """A copy that also sets the variable `name` for vLLM."""
        return replace(self, env=(*((k, v) for k, v in self.env if k != name), (name, value)))

    def with_flag(self, word: str) -> Tunables:
        """A copy that also passes `word` (a whole flag such as `--no-enable-extensible-kv-cache`) to vLLM."""
        return self if word in self.flags else replace(self, flags=(*self.flags, word))

    def without_flag(self, flag: str) -> Tunables:
        """A copy that leaves the flag `flag` (either spelling) out of vLLM's command line."""
        name = normalize_flag(flag)
        return self if name in self.without else replace(self, without=(*self.without, name))


def flag_values(flag: str, value: Any) -> list[str]:
    """The argv words for one `[vllm.args]` entry, following vLLM's own conventions.

    true -> `--flag`, false -> `--no-flag`, table -> compact JSON, list ->
    the flag once followed by each value (argparse nargs="+"), otherwise
    `--flag value`.
    """
    name = normalize_flag(flag)
    if isinstance(value, bool):
        return [f"--{name}"] if value else [f"--no-{name}"]
    if isinstance(value, dict):
        return [f"--{name}", json.dumps(value, separators=(",", ":"))]
    if isinstance(value, list):
        return [f"--{name}", *(_scalar(v) for v in value)]
    return [f"--{name}", _scalar(value)]


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return repr(value)
    return str(value)


def env_api_key(vllm: VllmSection) -> str | None:
    """The `[vllm.args] api_key` that reaches vLLM as VLLM_API_KEY instead of on its command line, which every
    user of the machine can read (`ps`, /proc). vLLM reads one key there: several stay flags."""
    value = vllm.arg("api-key")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value if isinstance(value, str) and value else None


# What vLLM needs after its drain to stop its engine and its HTTP server, within gb10d's stop_timeout_s.
DRAIN_MARGIN_S = 5.0


def drain_flags(vllm: VllmSection, stop_timeout_s: float | None) -> list[str]:
    """`--shutdown-timeout`: on SIGTERM vLLM finishes the requests it has for that long instead of aborting them
    (its default, 0), leaving `DRAIN_MARGIN_S` of gb10d's `stop_timeout_s` to stop. None when the config sets it,
    or when the stop is too short to drain."""
    if stop_timeout_s is None or vllm.arg("shutdown-timeout") is not None or "shutdown-timeout" in _extra_flag_names(vllm):
        return []
    seconds = math.floor(stop_timeout_s - DRAIN_MARGIN_S)
    return ["--shutdown-timeout", str(seconds)] if seconds >= 1 else []


def _extra_flag_names(vllm: VllmSection) -> set[str]:
    return {name for name in (_flag_name(word) for word in vllm.extra_args) if name is not None}


def build_argv(
    vllm: VllmSection, tunables: Tunables | None = None, cluster_flags: Sequence[str] = (), stop_timeout_s: float | None = None
) -> list[str]:
    """The exact argv gb10d executes for one attempt; `cluster_flags` come from gb10d.core.cluster on a Ray head;
    `stop_timeout_s` (daemon.stop_timeout_s) sets how long vLLM drains its requests when stopped."""
    tunables = tunables or Tunables.from_config(vllm)
    argv = [str(vllm.program), "serve", vllm.model]
    if vllm.served_model_name is not None:
        argv += ["--served-model-name", *vllm.served_names]
    overridden = {"safetensors-load-strategy", "max-model-len", *tunables.without}
    if env_api_key(vllm) is not None:
        overridden.add("api-key")
    for key, value in vllm.args.items():
        if normalize_flag(key) in overridden:
            continue
        argv += flag_values(key, value)
    if tunables.max_model_len is not None:
        argv += ["--max-model-len", str(tunables.max_model_len)]
    argv += ["--gpu-memory-utilization", f"{tunables.gpu_memory_utilization:g}"]
    if tunables.load_strategy is not None:
        argv += ["--safetensors-load-strategy", tunables.load_strategy]
    argv += ["--host", vllm.host, "--port", str(vllm.port)]
    argv += drain_flags(vllm, stop_timeout_s)
    argv += tunables.flags
    argv += cluster_flags
    argv += [word for word in vllm.extra_args if _flag_name(word) not in tunables.without]
    return argv


def _flag_name(word: str) -> str | None:
    """The flag a word of extra_args sets (`--enable-x`, `--enable-x=1`, `--no-enable-x` -> `enable-x`), or None."""
    if not word.startswith("--"):
        return None
    name = normalize_flag(word.split("=", 1)[0])
    return name[3:] if name.startswith("no-") else name


def read_env_file(path: Path) -> dict[str, str]:
    """Parse a systemd-style EnvironmentFile (KEY=value, optional quotes, # comments)."""
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([ConfigProblem(shown, "vllm.env_file", f"cannot read: {exc.strerror or exc}; it must be readable by the user running gb10d")]) from None
    result: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", ";")):
            continue
        stripped = stripped.removeprefix("export ").strip()
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError([ConfigProblem(shown, "", f"not a KEY=value line: {line.strip()[:40]!r}", line=number)])
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        result[name] = value
    return result


def env_additions(vllm: VllmSection) -> dict[str, str]:
    """What gb10d sets on top of its own environment: defaults, VIRTUAL_ENV, env_file, [vllm.env], then
    `[vllm.args] api_key` as VLLM_API_KEY.

    PATH is left out: it is gb10d's own PATH with the venv's bin in front
    (see `build_env`), so it has no fixed value to show. In a container this
    is the whole environment gb10d gives vLLM, with the cache variables in
    place of VIRTUAL_ENV: the image brings its own PATH and the rest.
    """
    env = dict(CHILD_DEFAULTS)
    if vllm.venv is not None:
        env["VIRTUAL_ENV"] = str(vllm.venv)
    if vllm.image is not None:
        env.update(CONTAINER_CACHE_ENV)
    if vllm.env_file is not None:
        env.update(read_env_file(vllm.env_file))
    env.update(vllm.env)
    key = env_api_key(vllm)
    if key is not None:
        env["VLLM_API_KEY"] = key  # as on the command line, the flag's key wins over the variable
    return env


def inherited_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a child inherits of gb10d's environment (`base`, else gb10d's own): all of it but systemd's variables."""
    return {k: v for k, v in (os.environ if base is None else base).items() if k not in _SYSTEMD_ONLY}


def build_env(vllm: VllmSection, base: Mapping[str, str] | None = None, added: Sequence[tuple[str, str]] = ()) -> dict[str, str]:
    """vLLM's environment: gb10d's own minus systemd's variables, plus `env_additions`, plus `added`
    (a `Tunables.env`) where the config sets no value of its own.

    With a venv, its bin directory goes first on PATH, as `activate` would
    do, so tools vLLM runs (ninja, the Triton compiler) come from the venv.
    """
    env = inherited_env(base)
    if vllm.venv is not None:
        env["PATH"] = f"{vllm.venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
    configured = env_additions(vllm)
    env.update(configured)
    env.update((name, value) for name, value in added if name not in configured)
    return env


EngineKind = Literal["docker", "podman"]


@dataclass(frozen=True)
class Engine:
    """A container engine and the client command that reaches it (`docker`, `podman --remote --url ...`)."""

    kind: EngineKind
    client: tuple[str, ...]


def engine_client(kind: EngineKind, socket: Path | None, as_root: bool) -> Engine:
    """The client command for `kind`: its own default socket, the configured one, or podman's service for non-root.

    podman without a socket runs containers of the user that calls it; a
    gb10d that is not root would get rootless containers with their own
    image store, so it talks to the rootful service (podman.socket) instead.
    """
    if kind == "docker":
        return Engine(kind, ("docker", "-H", f"unix://{socket}") if socket is not None else ("docker",))
    if socket is None and as_root:
        return Engine(kind, ("podman",))
    return Engine(kind, ("podman", "--remote", "--url", f"unix://{socket or PODMAN_SOCKET}"))


def container_name(container: ContainerSection, config_path: Path) -> str:
    """`container.name`, else "gb10d" for /etc/gb10d.toml and "gb10d-NAME" for any NAME.toml."""
    if container.name is not None:
        return container.name
    if config_path == DEFAULT_CONFIG_PATH:
        return "gb10d"
    stem = re.sub(r"[^a-zA-Z0-9_.-]", "-", config_path.stem).strip("-.") or "config"
    return f"gb10d-{stem}"


def gpu_options(engine: EngineKind, gpu: str) -> list[str]:
    """docker's NVIDIA Container Toolkit flag or the CDI device (podman's way, and docker's with CDI enabled)."""
    if gpu == "none":
        return []
    if gpu == "toolkit" or (gpu == "auto" and engine == "docker"):
        return ["--gpus", "all"]
    return ["--device", "nvidia.com/gpu=all"]


def container_argv(config: Config, config_path: Path, engine: Engine, vllm_argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The exact `docker run` / `podman run` that runs `vllm_argv` in the configured image.

    Attached (no -d), so the client's stdout, stderr and exit status are the
    container's; named and labelled after the config, so gb10d finds its own
    container again; without --rm, so gb10d can read how it ended before it
    removes it. The image is pulled beforehand (with progress), so the run
    itself never pulls. Secret variables are passed by name only: their
    values reach the client through its environment, never its argv, which
    any user can read in /proc.
    """
    c = config.container
    vllm = config.vllm
    assert vllm.image is not None
    argv = [*engine.client, "run", "--name", container_name(c, config_path), "--label", f"{CONTAINER_LABEL}={config_path}"]
    argv += ["--pull", "never", "--network", "host"]
    argv += ["--shm-size", c.shm_size] if c.shm_size else ["--ipc", "host"]
    argv += ["--init"] if c.init else []
    argv += gpu_options(engine.kind, c.gpu)
    argv += ["--stop-timeout", str(math.ceil(config.daemon.stop_timeout_s)), "--log-driver", "none"]
    for mount in container_mounts(config):
        argv += ["-v", mount]
    for name, value in env.items():
        argv += ["-e", name if is_secret_name(name) else f"{name}={value}"]
    argv += c.run_args
    argv += [vllm.image, *vllm_argv]
    return argv


def container_mounts(config: Config) -> list[str]:
    """The container's `-v` mounts, `HOST:INSIDE[:OPTIONS]`: the cache directory, a local model, container.mounts."""
    c, model = config.container, config.vllm.model
    mounts = [f"{c.cache_dir}:{CONTAINER_CACHE}"]
    if model.startswith("/") and not any(_under(model, m.split(":")[1]) for m in c.mounts):
        # A local model directory is seen at the same path inside, so the config means the same in both places;
        # a model in a directory mounted by container.mounts is a path inside the container already.
        mounts.append(f"{model}:{model}:ro")
    return mounts + list(c.mounts)


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def host_path(config: Config, inside: str) -> Path | None:
    """Where a path inside the container lies on this host, through the deepest mount that holds it; None when none does."""
    holding = [(h, i) for h, i, *_ in (m.split(":") for m in container_mounts(config)) if _under(inside, i)]
    if not holding:
        return None
    host, directory = max(holding, key=lambda mount: len(mount[1]))
    rest = inside[len(directory.rstrip("/")):].lstrip("/")
    return Path(host) / rest if rest else Path(host)


# The variables that decide where huggingface_hub keeps its cache.
HF_CACHE_VARIABLES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def model_on_host(config: Config, env: Mapping[str, str]) -> tuple[str, dict[str, str]] | None:
    """The model and the Hugging Face cache variables as this host finds its files (`machine.memory.safetensors_files` takes them).

    For a venv that is the model and vLLM's environment as they are. For a
    container it is the host side of the mounts: a local model's directory,
    or the hub cache the image resolves (under /root/.cache unless the config
    moves it), mapped to where it lies here; None when no mount shows it. The
    Hugging Face variables are taken from `env`, vLLM's environment with the
    config's additions, which set HF_HOME for a container.
    """
    model = config.vllm.model
    if config.vllm.image is None:
        return model, dict(env)
    if model.startswith("/"):
        local = host_path(config, model)
        return (str(local), {}) if local is not None else None
    inside = {name: env[name] for name in HF_CACHE_VARIABLES if name in env}
    hub = host_path(config, hub_cache(inside, "/root"))
    return (model, {"HF_HUB_CACHE": str(hub)}) if hub is not None else None


def redact_argv(argv: list[str]) -> list[str]:
    """argv with secret flag values replaced by ***."""
    shown: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            shown.append(REDACTED)
            hide_next = False
            continue
        name, eq, _ = word.partition("=")
        if word.startswith("--") and normalize_flag(name) in _SECRET_FLAGS:
            if eq:
                shown.append(f"{name}={REDACTED}")
            else:
                shown.append(word)
                hide_next = True
            continue
        shown.append(word)
    return shown


def is_secret_name(name: str) -> bool:
    """Environment names whose values must never be printed."""
    return bool(_SECRET_NAME.search(name))


def redact_setting(dotted: str, value: Any) -> Any:
    """A config value safe to print: secret env names, secret flags and their extra_args forms masked."""
    table, _, name = dotted.rpartition(".")
    if (table == "vllm.env" and is_secret_name(name)) or (table == "vllm.args" and normalize_flag(name) in _SECRET_FLAGS):
        return REDACTED
    if dotted == "vllm.extra_args":
        return redact_argv(value)
    if dotted == "alerts.webhooks":
        # Tokens live in webhook paths, queries and headers: only where each one goes, and how, is shown.
        return [{"url": url_shown(hook.url), "format": hook.format, **({"headers": dict.fromkeys(hook.headers, REDACTED)} if hook.headers else {})}
                for hook in value]
    if dotted == "front.api_keys":
        return [REDACTED for _ in value]
    return value


def url_shown(url: str) -> str:
    """A URL as the journal or --explain may show it: scheme and host only (tokens live in paths, queries and users)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}/…"


def shell_line(argv: list[str], env: Mapping[str, str] | None = None, path_prefix: Path | None = None) -> str:
    """One pasteable shell line; `env` entries are prefixed as VAR=value, secrets shown as ***.

    `path_prefix` adds `PATH=<prefix>:"$PATH"`, the way gb10d extends PATH
    for a venv, so the pasted line behaves like gb10d's child.
    """
    words = [f'PATH={shlex.quote(str(path_prefix))}:"$PATH"'] if path_prefix is not None else []
    words += [f"{k}={shlex.quote(REDACTED if is_secret_name(k) else v)}" for k, v in (env or {}).items()]
    words += [shlex.quote(w) for w in redact_argv(argv)]
    return " ".join(words)
