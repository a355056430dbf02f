"""The gb10d.toml configuration: its schema, loading, drop-ins, and errors that point at a line.

The schema is a pydantic v2 model in strict mode: TOML already has types, so
`port = "8000"` or `warmup = 1` is a mistake worth reporting, not a value to
coerce. Loading never raises anything but `ConfigError`, whose problems each
name the file, the line (when the key is found in the text), the dotted key
and the fix, so the CLI can print them and exit 78 without a traceback.

The main file may be overridden by drop-ins, `<config without .toml>.d/*.toml`
(`/etc/gb10d.d/` for `/etc/gb10d.toml`), merged in name order. Every
effective value remembers the file it came from, for `--explain` and for
error messages that name the drop-in that set a bad value.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from .errors import ConfigError, ConfigProblem
from .image import parse_reference
from .tasks import ProbeRoute

DEFAULT_CONFIG_PATH = Path("/etc/gb10d.toml")
CONFIG_ENV = "GB10D_CONFIG"
DEFAULT_SOURCE = "default"

LOAD_STRATEGIES = ("eager", "lazy", "prefetch", "torchao")
# The three ways to say what runs vLLM; exactly one is set.
PROGRAM_KEYS = ("executable", "venv", "image")
LoadStrategy = Literal["eager", "lazy", "prefetch", "torchao"]


def _default_ladder() -> list[LoadStrategy]:
    """eager avoids the mmap stall seen on GB10, so it is the first and only rung by default."""
    return ["eager"]



class _Table(BaseModel):
    """A gb10d table: unknown keys are errors, values are checked strictly enough to catch typos."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)


def _absolute(value: Path | None) -> Path | None:
    """Relative paths would depend on the working directory, which is / under systemd."""
    if value is not None and not value.is_absolute():
        raise ValueError(f"must be an absolute path (got {str(value)!r}); gb10d runs from / under systemd")
    return value


class VllmSection(_Table):
    """`[vllm]`: what to run and with which flags."""

    # Path fields take TOML strings; strict mode alone would demand Path objects.
    executable: Path | None = Field(default=None, strict=False)
    venv: Path | None = Field(default=None, strict=False)
    # A container image whose `vllm` runs under docker or podman ([container] says how).
    image: str | None = None
    model: str
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)
    served_model_name: str | list[str] | None = None
    gpu_memory_utilization: float = 0.9
    args: dict[str, Any] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    env_file: Path | None = Field(default=None, strict=False)

    absolute_paths = field_validator("executable", "venv", "env_file")(_absolute)

    @field_validator("image")
    @classmethod
    def _image_reference(cls, value: str | None) -> str | None:
        if value is not None:
            parse_reference(value)
        return value

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError('must name a Hugging Face repository or a local directory, e.g. "Qwen/Qwen3.6-27B-FP8"')
        return value

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, value: str) -> str:
        if not value.strip() or any(c.isspace() for c in value):
            raise ValueError(f'must be an address such as "0.0.0.0" or "127.0.0.1" (got {value!r})')
        return value

    @field_validator("served_model_name")
    @classmethod
    def _names_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        names = [value] if isinstance(value, str) else (value or [])
        if isinstance(value, list) and not value:
            raise ValueError("must list at least one name, or be left out to serve under the model name")
        if any(not n.strip() for n in names):
            raise ValueError("names must not be empty")
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _utilization_range(cls, value: float) -> float:
        if math.isnan(value) or not (0 < value <= 1):
            raise ValueError(f"must be > 0 and <= 1 (got {value})")
        return value

    @field_validator("args")
    @classmethod
    def _args_shape(cls, value: dict[str, Any]) -> dict[str, Any]:
        problems: list[tuple[str, str]] = []
        seen: dict[str, str] = {}
        for key, item in value.items():
            flag = normalize_flag(key)
            if flag in seen:
                problems.append((key, f"set twice (as {seen[flag]!r} and {key!r}); keep one"))
            seen[flag] = key
            if flag in _FIRST_CLASS_FLAGS:
                problems.append((key, f"is set with vllm.{_FIRST_CLASS_FLAGS[flag]}, not in vllm.args"))
            elif not _FLAG_NAME.fullmatch(flag):
                problems.append((key, "is not a vllm serve flag name (letters, digits, '-' or '_')"))
            elif isinstance(item, list) and any(isinstance(v, (dict, list)) for v in item):
                problems.append((key, "a list may hold only plain values (strings, numbers, true/false)"))
        _raise_keyed(problems)
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_integers(cls, value: Any) -> Any:
        # `CUDA_VISIBLE_DEVICES = 0` is what people write; the environment only holds strings.
        if isinstance(value, dict):
            return {k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v for k, v in value.items()}
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        problems = [
            (name, "is not an environment variable name (letters, digits and '_', not starting with a digit)")
            for name in value
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name)
        ]
        problems += [(name, "must not contain NUL bytes") for name, text in value.items() if "\x00" in text]
        _raise_keyed(problems)
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_unmanaged(cls, value: list[str]) -> list[str]:
        problems: list[tuple[str, str]] = []
        for index, word in enumerate(value):
            if not word.startswith("--"):
                continue
            flag = normalize_flag(word.partition("=")[0])
            owner = _MANAGED_FLAGS.get(flag)
            if owner:
                problems.append((str(index), f"{word.partition('=')[0]!r} must be set with {owner}, not in extra_args"))
        _raise_keyed(problems)
        return value

    @model_validator(mode="after")
    def _one_program(self) -> VllmSection:
        chosen = [key for key in PROGRAM_KEYS if getattr(self, key) is not None]
        if not chosen:
            raise ValueError(
                "set one of vllm.executable (path of the vllm program), vllm.venv (a virtualenv with vLLM) "
                'or vllm.image (a container image with vLLM, e.g. "nvcr.io/nvidia/vllm:26.05-py3")'
            )
        if len(chosen) > 1:
            raise ValueError(f"set only one of {' and '.join(f'vllm.{k}' for k in chosen)}, not {'both' if len(chosen) == 2 else 'all three'}")
        in_args = {normalize_flag(k) for k in self.args}
        twice = [w for w in self.extra_args if w.startswith("--") and normalize_flag(w.partition("=")[0]) in in_args]
        if twice:
            raise ValueError(f"{twice[0].partition('=')[0]!r} is in both vllm.args and vllm.extra_args; keep one")
        return self

    @property
    def program(self) -> Path:
        """The `vllm` executable this config runs; in a container image, the `vllm` on the image's PATH."""
        if self.executable is not None:
            return self.executable
        if self.image is not None:
            return Path("vllm")
        assert self.venv is not None
        return self.venv / "bin" / "vllm"

    @property
    def served_names(self) -> list[str]:
        """The names clients use; vLLM falls back to the model argument when none is set."""
        if self.served_model_name is None:
            return [self.model]
        if isinstance(self.served_model_name, str):
            return [self.served_model_name]
        return list(self.served_model_name)

    def arg(self, flag: str) -> Any:
        """The value of a `vllm.args` flag, whichever spelling the user chose, or None."""
        for key, value in self.args.items():
            if normalize_flag(key) == flag:
                return value
        return None

    @property
    def api_key(self) -> str | None:
        """The API key vLLM will demand on /v1 paths, from args, extra_args or VLLM_API_KEY."""
        value = self.arg("api-key")
        if isinstance(value, str) and value:
            return value
        for index, word in enumerate(self.extra_args):
            name, eq, rest = word.partition("=")
            if word.startswith("--") and normalize_flag(name) == "api-key":
                if eq:
                    return rest or None
                return self.extra_args[index + 1] if index + 1 < len(self.extra_args) else None
        return self.env.get("VLLM_API_KEY") or None


class StartupSection(_Table):
    """`[startup]`: how long a start may take and what counts as stalled."""

    stall_timeout_s: float = Field(default=300.0, gt=0)
    ready_timeout_s: float = Field(default=3600.0, gt=0)
    warmup: bool = True
    load_strategy_ladder: list[LoadStrategy] = Field(default_factory=_default_ladder)
    allow_max_model_len_reduction: bool = False
    health_poll_interval_s: float = Field(default=2.0, gt=0)


class MemorySection(_Table):
    """`[memory]`: the unified-memory arithmetic of GB10."""

    meminfo_path: Path = Field(default=Path("/proc/meminfo"), strict=False)
    # Where the kernel's free blocks by size are read, for the fragmentation of long uptimes.
    buddyinfo_path: Path = Field(default=Path("/proc/buddyinfo"), strict=False)
    headroom_gib: float = Field(default=1.0, ge=0)
    min_gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    preflight: bool = True
    evict_page_cache: bool = True
    recovery_timeout_s: float = Field(default=60.0, ge=0)
    recovery_tolerance_gib: float = Field(default=4.0, ge=0)
    # The directory the gb10d instances of this machine share their memory budget in (budget.py, ledger.py);
    # "" runs without it. The package creates the default (tmpfiles.d).
    ledger_dir: str = "/run/gb10d-ledger"
    # A start whose share does not fit beside the starts of other instances waits for them, or fails at once.
    when_full: Literal["wait", "fail"] = "wait"
    # The NVIDIA driver's out-of-memory line stops vLLM only with evidence (driveroom.py): this many lines within
    # driver_oom_window_s are a burst that counts as evidence, and a line counts for that long.
    driver_oom_burst: int = Field(default=50, ge=1)
    driver_oom_window_s: float = Field(default=60.0, gt=0)

    @field_validator("ledger_dir")
    @classmethod
    def _ledger_dir_absolute(cls, value: str) -> str:
        if value and not value.startswith("/"):
            raise ValueError(f'must be an absolute directory such as "/run/gb10d-ledger", or "" to run without one (got {value!r})')
        return value

    @property
    def ledger_path(self) -> Path | None:
        """The ledger directory, or None when the budget is not shared."""
        return Path(self.ledger_dir) if self.ledger_dir else None


class RestartSection(_Table):
    """`[restart]`: the bounded retry budget for failures gb10d cannot correct."""

    max_attempts: int = Field(default=5, ge=1, le=100)
    backoff_initial_s: float = Field(default=5.0, ge=0)
    backoff_max_s: float = Field(default=300.0, ge=0)
    # After serving this long, a failure starts a new count of max_attempts;
    # a failure sooner counts with the start that preceded it.
    reset_after_s: float = Field(default=600.0, ge=0)

    @model_validator(mode="after")
    def _backoff_order(self) -> RestartSection:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_initial_s ({self.backoff_initial_s})"
            )
        return self


class LivenessSection(_Table):
    """`[liveness]`: how a hung engine is told from a busy one after ready."""

    enabled: bool = True
    health_interval_s: float = Field(default=10.0, gt=0)
    # A 27B model on GB10 decodes ~20 tokens/s per stream, but a long prompt's
    # prefill moves no generation counter for tens of seconds: 120 s covers it
    # with room. Raise it for prompts near a 256k max_model_len.
    progress_timeout_s: float = Field(default=120.0, gt=0)
    # One 1-token completion a minute costs nothing and bounds how long an idle
    # hung engine goes unnoticed (interval + timeout, about 2 minutes).
    idle_probe_interval_s: float = Field(default=60.0, gt=0)
    # Generous: the probe normally takes well under a second, but it shares the
    # engine with whatever arrives after it (and tokens flowing excuse it anyway).
    probe_timeout_s: float = Field(default=60.0, gt=0)
    # The route of the warm-up and of the idle probe: "auto" follows vLLM's `Supported tasks` line (a completion
    # for a model that generates, an embedding for an embedding model); "none" sends no request at all.
    probe_route: ProbeRoute = "auto"


class Webhook(_Table):
    """One `[[alerts.webhooks]]`: where gb10d posts its alerts, and in which body."""

    url: str
    format: Literal["json", "ntfy", "slack"] = "json"
    # Values may say ${NAME}: taken from gb10d's environment or vllm.env_file when sent, so no token sits in gb10d.toml.
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError('must be an http:// or https:// URL such as "https://ntfy.sh/my-gb10"')
        return value


class AlertsSection(_Table):
    """`[alerts]`: webhooks gb10d posts to on a give-up, a stall, a driver event, memory not returned and a recovery."""

    webhooks: list[Webhook] = Field(default_factory=list)
    timeout_s: float = Field(default=10.0, gt=0)
    retries: int = Field(default=3, ge=0, le=10)
    retry_initial_s: float = Field(default=2.0, ge=0)


class OnDemandSection(_Table):
    """`[on_demand]`: the front starts this instance's vLLM for the first request, parks it when idle, and may park it
    to make room for another model.

    `park = "stop"` (the default) stops vLLM and gives its memory back; gb10d stays active for systemd, parked, and
    starts vLLM for the next request through the normal start. `park = "sleep"` keeps vLLM running and puts it to
    sleep at vLLM's level 2 (weights and KV cache given back, about 1.7 GiB kept); a wake takes seconds instead of a
    whole start. Its endpoints are vLLM's development ones, so vLLM must listen on loopback only, behind `gb10d front`."""

    park: Literal["stop", "sleep"] = "stop"
    # The front parks the instance after this long without a request (and none in flight).
    idle_timeout_s: float = Field(default=600.0, gt=0)
    # A wake from sleep needs the memory the sleep gave back plus this much free, else gb10d stops vLLM and starts it cold.
    wake_margin_gib: float = Field(default=2.0, ge=0)


class MetricsSection(_Table):
    """`[metrics]`: the Prometheus listener; an empty `listen` disables it."""

    listen: str = "127.0.0.1:9400"
    proxy_vllm: bool = True

    @field_validator("listen")
    @classmethod
    def _listen_form(cls, value: str) -> str:
        if value == "":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not (0 < int(port) < 65536) or not host:
            raise ValueError(f'must be "HOST:PORT" such as "127.0.0.1:9400", or "" to disable (got {value!r})')
        return value

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to bind, or None when disabled."""
        if not self.listen:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)


API_KEY_FORM = (
    "each key must be at least 16 characters without spaces (e.g. from `openssl rand -hex 24`), optionally followed by "
    'the models it may use: "KEY qwen llama"'
)


def api_key_problem(entry: str) -> bool:
    """Whether an api_keys entry is malformed (its key too short); the message, API_KEY_FORM, never repeats the key."""
    words = entry.split()
    return not words or len(words[0]) < 16


class FrontSection(_Table):
    """`[front]`: the one public endpoint (`gb10d front`) before every gb10d instance of the machine.

    Read from the front's own config (/etc/gb10d.toml); in an instance's config it is accepted and ignored, so one
    file may carry both."""

    listen: str = "0.0.0.0:8000"
    # The instance configs, one *.toml per `gb10d@NAME`; their [vllm] host and port are the internal addresses.
    instances_dir: Path = Field(default=Path("/etc/gb10d"), strict=False)
    # How long a request waits for its model's instance to start or recover before it gets 503 with Retry-After.
    hold_timeout_s: float = Field(default=900.0, gt=0)
    # Requests held per model at once; one more gets 503 at once.
    queue_limit: int = Field(default=256, ge=1)
    # A request body over this gets 413: vLLM's image and audio inputs fit far below it.
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # Prometheus metrics per model (requests, held, hold time, rejected); "" disables them.
    metrics_listen: str = "127.0.0.1:9500"
    # Each model's state and held requests, rewritten as they change, for `gb10d status --all`.
    state_file: Path = Field(default=Path("/run/gb10d-front/state.json"), strict=False)
    # Keys a client must send (`Authorization: Bearer KEY` or `x-api-key: KEY`); none: every client is let in.
    # "KEY qwen llama": a key that may use only those models.
    api_keys: list[str] = Field(default_factory=list)
    # More keys, one entry a line in the same form (# comments), kept out of the config: root:gb10d, mode 0640.
    api_keys_file: Path | None = Field(default=None, strict=False)

    absolute_dir = field_validator("instances_dir", "api_keys_file", "state_file")(_absolute)

    @field_validator("api_keys")
    @classmethod
    def _keys_long_enough(cls, value: list[str]) -> list[str]:
        if any(api_key_problem(entry) for entry in value):
            raise ValueError(API_KEY_FORM)
        return value

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _listen_form(cls, value: str, info: ValidationInfo) -> str:
        if value == "" and info.field_name == "metrics_listen":
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not (0 < int(port) < 65536) or not host:
            example = '"0.0.0.0:8000" or "127.0.0.1:8000"' if info.field_name == "listen" else '"127.0.0.1:9500", or "" to disable'
            raise ValueError(f"must be \"HOST:PORT\" such as {example} (got {value!r})")
        return value

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) to bind."""
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the metrics listener, or None when disabled."""
        if not self.metrics_listen:
            return None
        host, _, port = self.metrics_listen.rpartition(":")
        return host.strip("[]"), int(port)


class DaemonSection(_Table):
    """`[daemon]`: gb10d's own behaviour and files."""

    stop_timeout_s: float = Field(default=30.0, ge=0)
    state_file: Path = Field(default=Path("/run/gb10d/state.json"), strict=False)
    learned_file: Path = Field(default=Path("/var/lib/gb10d/state.toml"), strict=False)
    apply_on_change: bool = False
    watch_config: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Where the NVIDIA driver's kernel messages (out of memory, Xid errors) are read: journald's kernel stream,
    # /dev/kmsg, nowhere, or a file to follow.
    kernel_log: str = "journal"

    @field_validator("kernel_log")
    @classmethod
    def _kernel_log_source(cls, value: str) -> str:
        if value in ("journal", "kmsg", "none") or value.startswith("/"):
            return value
        raise ValueError(f'must be "journal", "kmsg", "none" or the absolute path of a file to follow (got {value!r})')


# `docker run` / `podman run` options gb10d sets itself from [container], [vllm] and [daemon]; another
# value in run_args would contradict what gb10d believes (the name it removes, the port it probes).
CONTAINER_OWNED_OPTIONS = {
    "--name": "gb10d names the container after its config (container.name)",
    "--rm": "gb10d removes the container itself, after reading how it ended",
    "-d": "gb10d stays attached to read vLLM's output", "--detach": "gb10d stays attached to read vLLM's output",
    "-i": "vLLM reads no input", "--interactive": "vLLM reads no input",
    "-t": "a terminal would mix vLLM's two streams", "--tty": "a terminal would mix vLLM's two streams",
    "-a": "gb10d attaches stdout and stderr", "--attach": "gb10d attaches stdout and stderr",
    "--network": "the container uses the host's network, so vllm.port is the host's port",
    "--net": "the container uses the host's network, so vllm.port is the host's port",
    "-p": "the container uses the host's network: vllm.port is already the host's port",
    "--publish": "the container uses the host's network: vllm.port is already the host's port",
    "-P": "the container uses the host's network: vllm.port is already the host's port",
    "--publish-all": "the container uses the host's network: vllm.port is already the host's port",
    "--ipc": "set container.shm_size instead of the default --ipc=host",
    "--shm-size": "set container.shm_size",
    "--init": "set container.init",
    "--gpus": "set container.gpu",
    "--pull": "set container.pull",
    "--stop-timeout": "set daemon.stop_timeout_s",
    "--log-driver": "vLLM's output goes to the journal through gb10d",
}
_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")
_SHM_SIZE = re.compile(r"[1-9][0-9]*[bkmgBKMG]?")


class ContainerSection(_Table):
    """`[container]`: how vLLM runs when `vllm.image` is set (docker or podman, GPU, mounts, pulling)."""

    # "auto": docker if its daemon answers, else podman.
    engine: Literal["auto", "docker", "podman"] = "auto"
    # The engine's API socket; empty: docker's own default (or $DOCKER_HOST), podman without a
    # service as root and /run/podman/podman.sock (podman.socket) for any other user.
    socket: Path | None = Field(default=None, strict=False)
    # "auto": docker --gpus all (NVIDIA Container Toolkit), podman --device nvidia.com/gpu=all (CDI).
    gpu: Literal["auto", "toolkit", "cdi", "none"] = "auto"
    # Mounted at /root/.cache, where the image keeps Hugging Face downloads and vLLM's, Triton's
    # and Inductor's compile caches, so they survive every new container.
    cache_dir: Path = Field(default=Path("/var/cache/gb10d"), strict=False)
    mounts: list[str] = Field(default_factory=list)
    # Empty: --ipc=host, as vLLM advises (its processes share memory through /dev/shm).
    shm_size: str | None = None
    init: bool = True
    run_args: list[str] = Field(default_factory=list)
    pull: Literal["never", "missing", "always"] = "missing"
    # Empty: "gb10d" for /etc/gb10d.toml, "gb10d-NAME" for NAME.toml.
    name: str | None = None

    absolute_paths = field_validator("socket", "cache_dir")(_absolute)

    @field_validator("mounts")
    @classmethod
    def _mount_form(cls, value: list[str]) -> list[str]:
        problems: list[tuple[str | tuple[str, ...], str]] = []
        for index, mount in enumerate(value):
            parts = mount.split(":")
            if len(parts) not in (2, 3) or not all(parts[:2]):
                problems.append((str(index), f'must be "HOST:CONTAINER" or "HOST:CONTAINER:OPTIONS", e.g. "/srv/models:/models:ro" (got {mount!r})'))
            elif not (parts[0].startswith("/") and parts[1].startswith("/")):
                problems.append((str(index), f"both paths must be absolute (got {mount!r}); gb10d runs from / under systemd"))
        _raise_keyed(problems)
        return value

    @field_validator("shm_size")
    @classmethod
    def _shm_size_form(cls, value: str | None) -> str | None:
        if value is not None and not _SHM_SIZE.fullmatch(value):
            raise ValueError(f'must be a size such as "16g" or "512m" (got {value!r}); leave it out for --ipc=host')
        return value

    @field_validator("name")
    @classmethod
    def _name_form(cls, value: str | None) -> str | None:
        if value is not None and not _CONTAINER_NAME.fullmatch(value):
            raise ValueError(f"must be a container name: letters, digits, '_', '.' and '-', starting with a letter or digit (got {value!r})")
        return value

    @field_validator("run_args")
    @classmethod
    def _run_args_unmanaged(cls, value: list[str]) -> list[str]:
        problems: list[tuple[str | tuple[str, ...], str]] = []
        for index, word in enumerate(value):
            option = word.partition("=")[0]
            if option in CONTAINER_OWNED_OPTIONS:
                problems.append((str(index), f"{option} is gb10d's to decide: {CONTAINER_OWNED_OPTIONS[option]}; remove it from container.run_args"))
            elif option in ("--device", "--label", "-l") and "=" in word and ("nvidia.com/gpu" in word or "gb10d." in word):
                problems.append((str(index), f"{word} is set by gb10d from container.gpu and the config's path; remove it"))
        _raise_keyed(problems)
        return value


class ClusterSection(_Table):
    """`[cluster]`: this machine's part in a pair of GB10s that serve one model through Ray.

    Absent for a single machine. Both machines name the same `head_address`
    (the head's address on the ConnectX-7 link); the head also says how many
    machines, each with its one GPU, the model needs.
    """

    role: Literal["head", "worker"]
    head_address: IPv4Address = Field(strict=False)
    port: int = Field(default=6379, ge=1, le=65535)
    nodes: int = Field(default=2, ge=2, le=64)
    interface: str | None = None
    ray: Path | None = Field(default=None, strict=False)
    ray_args: list[str] = Field(default_factory=list)

    absolute_ray = field_validator("ray")(_absolute)

    @field_validator("head_address", mode="before")
    @classmethod
    def _head_address_form(cls, value: Any) -> Any:
        try:
            return IPv4Address(value) if isinstance(value, str) else value
        except ValueError:
            raise ValueError(f'must be the head\'s IPv4 address on the link between the machines, e.g. "10.0.0.1" (got {value!r})') from None

    @field_validator("interface")
    @classmethod
    def _interface_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[^\s/]{1,15}", value):
            raise ValueError(f"must be a network interface name such as \"enp1s0f0np0\" (got {value!r}); remove it to let gb10d pick the one on the head's subnet")
        return value

    @field_validator("ray_args")
    @classmethod
    def _ray_args_unmanaged(cls, value: list[str]) -> list[str]:
        owned = [w for w in value if w.partition("=")[0] in _RAY_OWNED_FLAGS]
        if owned:
            raise ValueError(f"{owned[0].partition('=')[0]} is set by gb10d from cluster.role, cluster.head_address and cluster.port; remove it from cluster.ray_args")
        return value


# `ray start` flags gb10d derives from [cluster]; a second value in ray_args would contradict them.
_RAY_OWNED_FLAGS = {"--head", "--address", "--port", "--node-ip-address", "--block"}
# vLLM flags the head sets from [cluster]: the tensor-parallel size is the number of machines, the backend Ray.
CLUSTER_VLLM_FLAGS = ("tensor-parallel-size", "distributed-executor-backend")


class Config(_Table):
    """A whole gb10d.toml, after drop-ins are merged."""

    vllm: VllmSection
    startup: StartupSection = Field(default_factory=StartupSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    restart: RestartSection = Field(default_factory=RestartSection)
    liveness: LivenessSection = Field(default_factory=LivenessSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    alerts: AlertsSection = Field(default_factory=AlertsSection)
    daemon: DaemonSection = Field(default_factory=DaemonSection)
    container: ContainerSection = Field(default_factory=ContainerSection)
    cluster: ClusterSection | None = None
    front: FrontSection | None = None
    on_demand: OnDemandSection | None = None

    def tables(self) -> Iterator[tuple[str, _Table]]:
        """(name, table) in schema order, skipping a table that does not apply ([cluster] left out, [container] without an image)."""
        for name in type(self).model_fields:
            table = getattr(self, name)
            if table is not None and (name != "container" or self.vllm.image is not None):
                yield name, table

    @model_validator(mode="after")
    def _container_needs_an_image(self) -> Config:
        """[container] says how to run an image; without one it would be silently ignored."""
        if self.vllm.image is None and "container" in self.model_fields_set:
            _raise_keyed([(("container",), 'applies only to vLLM from a container image: set vllm.image, or remove the [container] table')])
        if self.vllm.image is not None and self.cluster is not None:
            _raise_keyed([(("vllm", "image"), "vLLM from a container image is not supported on a two-machine pair ([cluster]); "
                           "use vllm.venv or vllm.executable on both machines, or remove [cluster] to serve from this machine alone")])
        return self

    @model_validator(mode="after")
    def _sleep_behind_the_front(self) -> Config:
        """vLLM's sleep endpoints are development endpoints that anyone who reaches the port may call."""
        if self.on_demand is None:
            return self
        if self.on_demand.park == "sleep" and self.vllm.host not in ("127.0.0.1", "::1", "localhost"):
            _raise_keyed([(("vllm", "host"), f'is {self.vllm.host!r}, but on_demand.park = "sleep" turns on vLLM\'s development endpoints '
                           '(VLLM_SERVER_DEV_MODE=1), which anyone reaching the port could call: set host = "127.0.0.1" and let clients in through gb10d front')])
        if self.cluster is not None:
            _raise_keyed([(("on_demand",), "is not supported on a two-machine pair ([cluster]): remove [on_demand], or serve from this machine alone")])
        return self

    @model_validator(mode="after")
    def _cluster_owns_parallelism(self) -> Config:
        """On the head, gb10d derives the parallel layout from [cluster]; the same flags in [vllm] would contradict it."""
        if self.cluster is None or self.cluster.role != "head":
            return self
        problems: list[tuple[str | tuple[str, ...], str]] = []
        for key in self.vllm.args:
            if normalize_flag(key) in CLUSTER_VLLM_FLAGS:
                problems.append((("vllm", "args", key), f"is set by gb10d on the cluster head (--tensor-parallel-size {self.cluster.nodes} "
                                 "from cluster.nodes, --distributed-executor-backend ray); remove it"))
        for word in self.vllm.extra_args:
            if word.startswith("--") and normalize_flag(word.partition("=")[0]) in CLUSTER_VLLM_FLAGS:
                problems.append((("vllm", "extra_args"), f"{word.partition('=')[0]} is set by gb10d on the cluster head from cluster.nodes; remove it"))
        _raise_keyed(problems)
        return self


# Flags owned by a first-class [vllm] key; setting them in args would be ambiguous.
_FIRST_CLASS_FLAGS = {
    "host": "host",
    "port": "port",
    "served-model-name": "served_model_name",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "model": "model",
}

# Flags gb10d must know the value of (to probe, to tune), so a raw extra_args
# word would silently override what gb10d believes.
_MANAGED_FLAGS = {
    **{flag: f"vllm.{key}" for flag, key in _FIRST_CLASS_FLAGS.items()},
    "max-model-len": "vllm.args.max-model-len",
    "safetensors-load-strategy": "vllm.args.safetensors-load-strategy",
}

_FLAG_NAME = re.compile(r"[a-z0-9][a-z0-9-]*(\.[A-Za-z0-9_-]+)*")


def _raise_keyed(problems: Sequence[tuple[str | tuple[str, ...], str]]) -> None:
    """Report problems of several keys of one table at once, each located at its own key."""
    if problems:
        raise PydanticCustomError("keyed", "{summary}", {"summary": "; ".join(m for _, m in problems), "problems": problems})


def normalize_flag(key: str) -> str:
    """`max_model_len`, `max-model-len` and `--max-model-len` all name the flag `max-model-len`.

    Only the part before the first dot is normalised, as vLLM does: in
    `speculative-config.num_speculative_tokens` the part after the dot is a
    JSON field name and keeps its underscores.
    """
    name, dot, rest = key.lstrip("-").partition(".")
    return name.replace("_", "-").lower() + dot + rest


def default_config_path() -> Path:
    """`$GB10D_CONFIG` when set, else /etc/gb10d.toml."""
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def dropin_dir_for(path: Path) -> Path:
    """The drop-in directory of a config file: `/etc/gb10d.toml` -> `/etc/gb10d.d`, `x/foo.toml` -> `x/foo.d`."""
    if path.suffix == ".toml":
        return path.with_suffix(".d")
    return path.with_name(path.name + ".d")


def read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """Read and parse one TOML file, or raise ConfigError naming the file and the position."""
    shown = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([ConfigProblem(shown, "", f"file not found; create it, or point --config or ${CONFIG_ENV} at the right file")]) from None
    except IsADirectoryError:
        raise ConfigError([ConfigProblem(shown, "", "is a directory, not a TOML file; pass the file itself with --config")]) from None
    except PermissionError:
        raise ConfigError([ConfigProblem(shown, "", f"permission denied; make it readable by the user running gb10d (uid {os.getuid()})")]) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem(shown, "", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError([ConfigProblem(shown, "", f"not UTF-8 text (invalid byte at offset {exc.start}); is this really a TOML file?", line=line)]) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise ConfigError([ConfigProblem(shown, "", "contains NUL bytes; is this really a TOML file?", line=line)])
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([_syntax_problem(shown, text, exc)]) from None
    return data, text


def _syntax_problem(shown: str, text: str, exc: tomllib.TOMLDecodeError) -> ConfigProblem:
    """Turn tomllib's "msg (at line L, column C)" into a located problem."""
    message = str(exc)
    match = re.search(r"\(at line (\d+), column (\d+)\)$", message)
    if match:
        return ConfigProblem(
            shown, "", f"TOML syntax error: {message[: match.start()].strip()}", int(match.group(1)), int(match.group(2))
        )
    match = re.search(r"\(at end of document\)$", message)
    if match:
        return ConfigProblem(shown, "", f"TOML syntax error: {message[: match.start()].strip()} at end of file", text.count("\n") + 1)
    return ConfigProblem(shown, "", f"TOML syntax error: {message}")


def locate_key(text: str, dotted: str | tuple[str, ...]) -> int | None:
    """The 1-based line where a key (e.g. "vllm.port") is set in `text`, if it can be found.

    Handles `[table]` headers, dotted keys (`vllm.port = 1`), quoted keys and
    inline tables, which covers how people write gb10d.toml; returns the
    table's header line when the key itself is missing (a required key), or
    None. Pass a tuple when a key part itself contains a dot.
    """
    parts = tuple(dotted.split(".")) if isinstance(dotted, str) else dotted
    table: list[str] = []
    header_lines: dict[tuple[str, ...], int] = {}
    inline: int | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.match(r"^\[\[?\s*([^\]]+?)\s*\]\]?", stripped)
        if header:
            table = [_unquote(p) for p in _split_dotted(header.group(1))]
            header_lines.setdefault(tuple(table), number)
            if tuple(table) == parts:
                return number
            continue
        assignment = re.match(r'^((?:"[^"]*"|\'[^\']*\'|[A-Za-z0-9_.\- ])+?)\s*=', stripped)
        if not assignment:
            continue
        key = tuple(table + [_unquote(p) for p in _split_dotted(assignment.group(1))])
        if key[: len(parts)] == parts:
            return number
        if inline is None and parts[: len(key)] == key:
            inline = number  # the key lives inside an inline table or array set on this line
    if inline is not None:
        return inline
    for length in range(len(parts) - 1, 0, -1):
        if tuple(parts[:length]) in header_lines:
            return header_lines[tuple(parts[:length])]
    return None


def _split_dotted(key: str) -> list[str]:
    return [p.strip() for p in re.findall(r'"[^"]*"|\'[^\']*\'|[^.]+', key)]


def _unquote(part: str) -> str:
    if len(part) >= 2 and part[0] == part[-1] and part[0] in "\"'":
        return part[1:-1]
    return part


def _known_keys(loc: tuple[str | int, ...]) -> list[str]:
    """The valid keys of the table that `loc` points into, for did-you-mean."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field_info = model.model_fields.get(str(part))
        # An optional table (`cluster: ClusterSection | None`) is its model for did-you-mean.
        kinds = get_args(field_info.annotation) or (field_info.annotation,) if field_info is not None else ()
        tables = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if not tables:
            return []
        model = tables[0]
    return list(model.model_fields)


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "bool": "true or false",
    "string": "a string",
    "str": "a string",
    "list": "a list",
    "dict": "a table",
    "model": "a table",
    "path": "a path string",
}


def _describe(error: ErrorDetails) -> str:
    """An operator-facing sentence for one pydantic error."""
    kind: str = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    got = f" (got {_shown(value)})" if not isinstance(value, dict) else ""
    if kind == "missing":
        if tuple(error["loc"]) == ("vllm",):
            return "the [vllm] table is missing; it needs at least model and one of venv, executable or image"
        return "is required"
    if kind == "extra_forbidden":
        if len(error["loc"]) == 1 and isinstance(value, dict):
            return f"unknown table [{error['loc'][0]}]; gb10d's tables are {', '.join(f'[{t}]' for t in Config.model_fields)}"
        return "unknown key"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"])).removeprefix("Value error, ")
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    for op, word in (("greater_than_equal", ">="), ("greater_than", ">"), ("less_than_equal", "<="), ("less_than", "<")):
        if kind == op:
            bound = next(iter(ctx.values()), "?")
            return f"must be {word} {bound}{got}"
    for prefix, words in _TYPE_WORDS.items():
        if kind.startswith(prefix):
            return f"must be {words}{got}"
    return f"{error['msg']}{got}"


def _shown(value: Any) -> str:
    """A value as the user wrote it in TOML, so `true` is not shown as Python's `True`."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _is_union_tag(part: str | int) -> bool:
    """pydantic names union members and validators in error locations; they mean nothing to an operator."""
    return isinstance(part, str) and (part in ("str", "list[str]") or part.startswith("function-"))


@dataclass(frozen=True)
class LoadedConfig:
    """A merged config with where each value came from.

    `locations` maps dotted keys (`vllm.port`, `vllm.args.max-model-len`) of
    the values set in some file to (file, line); keys missing from it are
    defaults. `files` lists the files read, main file first, so a watcher
    knows what to watch.
    """

    config: Config
    files: tuple[Path, ...]
    locations: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)  # defaults of its own an instance got, and why

    def location_of(self, dotted: str) -> tuple[str, int | None] | None:
        """(file, line) that set this key or a table holding it; None for a default."""
        probe = dotted
        while probe:
            if probe in self.locations:
                return self.locations[probe]
            probe = probe.rpartition(".")[0]
        return None

    def source_of(self, dotted: str) -> str:
        """`FILE:LINE` of the file that set this key, else "default"."""
        where = self.location_of(dotted)
        if where is None:
            return self.derived.get(dotted, DEFAULT_SOURCE)
        file, line = where
        return f"{file}:{line}" if line else file

    def problem(self, dotted: str, message: str) -> ConfigProblem:
        """A problem with an effective value, located in the file that set it."""
        file, line = self.location_of(dotted) or (str(self.files[0]), None)
        return ConfigProblem(file, dotted, message, line=line)

    def explain(self) -> list[tuple[str, Any, str]]:
        """(dotted key, effective value, source) for every setting, in schema order."""
        rows: list[tuple[str, Any, str]] = []
        for section_name, section in self.config.tables():
            for key in type(section).model_fields:
                value = getattr(section, key)
                dotted = f"{section_name}.{key}"
                if isinstance(value, dict) and value:
                    rows += [(f"{dotted}.{k}", v, self.source_of(f"{dotted}.{k}")) for k, v in value.items()]
                else:
                    rows.append((dotted, value, self.source_of(dotted)))
        return rows


@dataclass
class _Layers:
    """The merge of the main file and its drop-ins, remembering who set what."""

    data: dict[str, Any] = field(default_factory=dict)
    origin: dict[tuple[str, ...], int] = field(default_factory=dict)  # key path -> index into files
    files: list[Path] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def add(self, path: Path, data: dict[str, Any], text: str) -> None:
        self.files.append(path)
        self.texts.append(text)
        self._merge(self.data, data, ())

    def _forget(self, prefix: tuple[str, ...]) -> None:
        for key in [k for k in self.origin if k[: len(prefix)] == prefix]:
            del self.origin[key]

    def _merge(self, base: dict[str, Any], overlay: dict[str, Any], path: tuple[str, ...]) -> None:
        index = len(self.files) - 1
        for key, value in overlay.items():
            here = path + (key,)
            if path == ("vllm", "args"):
                # A drop-in's max-model-len overrides the main file's max_model_len.
                # Two spellings within one file stay, so validation can report them.
                earlier = [k for k in base if normalize_flag(k) == normalize_flag(key) and self.origin.get(path + (k,)) != index]
                for old in earlier:
                    del base[old]
                    self._forget(path + (old,))
            if path == ("vllm",) and key in PROGRAM_KEYS:
                # Choosing the program in a drop-in replaces the other ways of choosing it.
                for other in PROGRAM_KEYS:
                    if other != key and other not in overlay and other in base:
                        del base[other]
                        self._forget(path + (other,))
            is_arg_value = path == ("vllm", "args")
            if isinstance(value, dict) and not is_arg_value:
                if not isinstance(base.get(key), dict):
                    base[key] = {}
                    self._forget(here)
                self._merge(base[key], value, here)
                if not value:
                    self.origin.setdefault(here, index)
            else:
                self._forget(here)
                base[key] = value
                self.origin[here] = index

    def where(self, loc: tuple[str, ...]) -> tuple[int, tuple[str, ...]]:
        """Which file to blame for a problem at `loc`, and the key as spelled there."""
        setters = [(i, k) for k, i in self.origin.items() if loc[: len(k)] == k]
        if setters:
            index, key = max(setters, key=lambda c: (c[0], len(c[1])))
            return index, key
        # A table-level problem (a missing key, two keys that clash): blame the first file writing into it.
        inside = [i for k, i in self.origin.items() if k[: len(loc)] == loc]
        return (min(inside) if inside else 0), loc

    def location(self, key: tuple[str, ...]) -> tuple[str, int | None]:
        index = self.origin[key]
        return str(self.files[index]), locate_key(self.texts[index], key)

    def problem(self, loc: tuple[str, ...], message: str) -> ConfigProblem:
        index, key = self.where(loc)
        line = locate_key(self.texts[index], key) if loc else None
        return ConfigProblem(str(self.files[index]), ".".join(loc), message, line=line)


def _dropins(directory: Path) -> list[Path]:
    """The drop-in files in name order; a missing directory simply means none."""
    try:
        entries = sorted(p for p in directory.iterdir() if p.suffix == ".toml" and not p.name.startswith("."))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError([ConfigProblem(str(directory), "", "is not a directory; drop-ins go in a directory of *.toml files")]) from None
    except OSError as exc:
        raise ConfigError([ConfigProblem(str(directory), "", f"cannot list drop-ins: {exc.strerror or exc}")]) from None
    return entries


def _problems_from(exc: ValidationError, layers: _Layers) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    seen: set[tuple[str, str]] = set()
    for error in exc.errors(include_url=False):
        loc = tuple(str(p) for p in error["loc"] if not _is_union_tag(p))
        keyed = (error.get("ctx") or {}).get("problems")
        items = [(loc + (k if isinstance(k, tuple) else (k,)), m) for k, m in keyed] if keyed else [(loc, _describe(error))]
        for where, message in items:
            if error["type"] == "extra_forbidden":
                close = difflib.get_close_matches(where[-1], _known_keys(where), n=1)
                if close:
                    message += f"; did you mean {'.'.join(where[:-1] + (close[0],))}?"
                elif len(where) > 1:
                    message += "; remove it"
            if (".".join(where), message) in seen:
                continue
            seen.add((".".join(where), message))
            problems.append(layers.problem(where, message))
    return _join_alternatives(problems)


def _join_alternatives(problems: list[ConfigProblem]) -> list[ConfigProblem]:
    """A union type fails once per member; say "must be a string or a list (got 5)" once instead."""
    joined: list[ConfigProblem] = []
    for problem in problems:
        last = joined[-1] if joined else None
        this = re.fullmatch(r"must be (.+) (\(got .*\))", problem.message)
        before = re.fullmatch(r"must be (.+) (\(got .*\))", last.message) if last else None
        if last and this and before and last.key == problem.key and this.group(2) == before.group(2):
            joined[-1] = replace(last, message=f"must be {before.group(1)} or {this.group(1)} {this.group(2)}")
        else:
            joined.append(problem)
    return joined


def parse_config(data: dict[str, Any], shown: str = "<config>", text: str = "") -> Config:
    """Validate already-parsed TOML data, raising ConfigError with located problems."""
    layers = _Layers()
    layers.add(Path(shown), data, text)
    return _validate(layers)


def _validate(layers: _Layers) -> Config:
    if not layers.data:
        raise ConfigError([ConfigProblem(str(layers.files[0]), "", "is empty; it needs at least a [vllm] table with model and one of venv, executable or image")])
    try:
        return Config.model_validate(layers.data)
    except ValidationError as exc:
        raise ConfigError(_problems_from(exc, layers)) from None


def load_config_explained(path: Path | None = None, dropin_dir: Path | None = None) -> LoadedConfig:
    """Read the main file and its drop-ins, merge and validate them, remembering each value's file.

    Drop-ins are merged over the main file in name order: tables merge key
    by key, arrays and other values are replaced, `[vllm.args]` keys match
    whatever their `-`/`_` spelling. Every file is read before any is
    validated, so syntax errors in several files are reported together.
    """
    path = path or default_config_path()
    dropin_dir = dropin_dir or dropin_dir_for(path)
    layers = _Layers()
    problems: list[ConfigProblem] = []
    for file in [path, *_dropins(dropin_dir)]:
        try:
            data, text = read_toml(file)
        except ConfigError as exc:
            problems += exc.problems
            continue
        layers.add(file, data, text)
    if problems:
        raise ConfigError(problems)
    derived: dict[str, str] = {}
    if layers.data:
        from .instance import fill_defaults  # the instance's own state files and metrics port; imports this module

        derived = fill_defaults(layers.data, path)
    config = _validate(layers)
    locations = {".".join(key): layers.location(key) for key in layers.origin}
    return LoadedConfig(config=config, files=tuple(layers.files), locations=locations, derived=derived)


def load_config(path: Path | None = None, dropin_dir: Path | None = None) -> Config:
    """Read, merge and validate the config file and its drop-ins; the only error raised is ConfigError."""
    return load_config_explained(path, dropin_dir).config


class _FrontFile(_Table):
    """The front's view of its config: `[front]` alone; the rest belongs to the gb10d instance the file may also run."""

    model_config = ConfigDict(extra="ignore", frozen=True, validate_default=True, strict=True)
    front: FrontSection = Field(default_factory=FrontSection)


def load_front(path: Path) -> FrontSection:
    """`[front]` of `path` (defaults when the file or the table is absent), problems located like load_config's."""
    if not path.exists():
        return FrontSection()
    data, text = read_toml(path)
    layers = _Layers()
    layers.add(path, data, text)
    try:
        return _FrontFile.model_validate(data).front
    except ValidationError as exc:
        raise ConfigError(_problems_from(exc, layers)) from None
