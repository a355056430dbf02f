"""The gb10d.toml schema: one pydantic v2 model per table, and `Config`, a whole file after drop-ins are merged.

The schema is a pydantic v2 model in strict mode: TOML already has types, so
`port = "8000"` or `warmup = 1` is a mistake worth reporting, not a value to
coerce. A validator's message is the fix an operator reads; configload.py
turns it into a problem that names the file, the line and the key.
"""

from __future__ import annotations

import math
import re
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import Field, field_validator, model_validator

from .configtable import Table, absolute, raise_keyed
from .flags import CLUSTER_VLLM_FLAGS, CONTAINER_OWNED_OPTIONS, FIRST_CLASS_FLAGS, FLAG_NAME, MANAGED_FLAGS, RAY_OWNED_FLAGS, normalize_flag
from .frontconfig import FrontSection
from .image import parse_reference
from .tasks import ProbeRoute

LOAD_STRATEGIES = ("eager", "lazy", "prefetch", "torchao")
# The three ways to say what runs vLLM; exactly one is set.
PROGRAM_KEYS = ("executable", "venv", "image")
LoadStrategy = Literal["eager", "lazy", "prefetch", "torchao"]


def _default_ladder() -> list[LoadStrategy]:
    """eager avoids the mmap stall seen on GB10, so it is the first and only rung by default."""
    return ["eager"]


class VllmSection(Table):
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

    absolute_paths = field_validator("executable", "venv", "env_file")(absolute)

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
            if flag in FIRST_CLASS_FLAGS:
                problems.append((key, f"is set with vllm.{FIRST_CLASS_FLAGS[flag]}, not in vllm.args"))
            elif not FLAG_NAME.fullmatch(flag):
                problems.append((key, "is not a vllm serve flag name (letters, digits, '-' or '_')"))
            elif isinstance(item, list) and any(isinstance(v, (dict, list)) for v in item):
                problems.append((key, "a list may hold only plain values (strings, numbers, true/false)"))
        raise_keyed(problems)
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
        raise_keyed(problems)
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_unmanaged(cls, value: list[str]) -> list[str]:
        problems: list[tuple[str, str]] = []
        for index, word in enumerate(value):
            if not word.startswith("--"):
                continue
            flag = normalize_flag(word.partition("=")[0])
            owner = MANAGED_FLAGS.get(flag)
            if owner:
                problems.append((str(index), f"{word.partition('=')[0]!r} must be set with {owner}, not in extra_args"))
        raise_keyed(problems)
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


class StartupSection(Table):
    """`[startup]`: how long a start may take and what counts as stalled."""

    stall_timeout_s: float = Field(default=300.0, gt=0)
    ready_timeout_s: float = Field(default=3600.0, gt=0)
    warmup: bool = True
    load_strategy_ladder: list[LoadStrategy] = Field(default_factory=_default_ladder)
    allow_max_model_len_reduction: bool = False
    health_poll_interval_s: float = Field(default=2.0, gt=0)


class MemorySection(Table):
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


class RestartSection(Table):
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


class LivenessSection(Table):
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


class Webhook(Table):
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


class AlertsSection(Table):
    """`[alerts]`: webhooks gb10d posts to on a give-up, a stall, a driver event, memory not returned and a recovery."""

    webhooks: list[Webhook] = Field(default_factory=list)
    timeout_s: float = Field(default=10.0, gt=0)
    retries: int = Field(default=3, ge=0, le=10)
    retry_initial_s: float = Field(default=2.0, ge=0)


class OnDemandSection(Table):
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


class MetricsSection(Table):
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


class DaemonSection(Table):
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

_CONTAINER_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}")
_SHM_SIZE = re.compile(r"[1-9][0-9]*[bkmgBKMG]?")


class ContainerSection(Table):
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

    absolute_paths = field_validator("socket", "cache_dir")(absolute)

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
        raise_keyed(problems)
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
        raise_keyed(problems)
        return value


class ClusterSection(Table):
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

    absolute_ray = field_validator("ray")(absolute)

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
        owned = [w for w in value if w.partition("=")[0] in RAY_OWNED_FLAGS]
        if owned:
            raise ValueError(f"{owned[0].partition('=')[0]} is set by gb10d from cluster.role, cluster.head_address and cluster.port; remove it from cluster.ray_args")
        return value


class Config(Table):
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

    def tables(self) -> Iterator[tuple[str, Table]]:
        """(name, table) in schema order, skipping a table that does not apply ([cluster] left out, [container] without an image)."""
        for name in type(self).model_fields:
            table = getattr(self, name)
            if table is not None and (name != "container" or self.vllm.image is not None):
                yield name, table

    @model_validator(mode="after")
    def _container_needs_an_image(self) -> Config:
        """[container] says how to run an image; without one it would be silently ignored."""
        if self.vllm.image is None and "container" in self.model_fields_set:
            raise_keyed([(("container",), 'applies only to vLLM from a container image: set vllm.image, or remove the [container] table')])
        if self.vllm.image is not None and self.cluster is not None:
            raise_keyed([(("vllm", "image"), "vLLM from a container image is not supported on a two-machine pair ([cluster]); "
                           "use vllm.venv or vllm.executable on both machines, or remove [cluster] to serve from this machine alone")])
        return self

    @model_validator(mode="after")
    def _sleep_behind_the_front(self) -> Config:
        """vLLM's sleep endpoints are development endpoints that anyone who reaches the port may call."""
        if self.on_demand is None:
            return self
        if self.on_demand.park == "sleep" and self.vllm.host not in ("127.0.0.1", "::1", "localhost"):
            raise_keyed([(("vllm", "host"), f'is {self.vllm.host!r}, but on_demand.park = "sleep" turns on vLLM\'s development endpoints '
                           '(VLLM_SERVER_DEV_MODE=1), which anyone reaching the port could call: set host = "127.0.0.1" and let clients in through gb10d front')])
        if self.cluster is not None:
            raise_keyed([(("on_demand",), "is not supported on a two-machine pair ([cluster]): remove [on_demand], or serve from this machine alone")])
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
        raise_keyed(problems)
        return self
