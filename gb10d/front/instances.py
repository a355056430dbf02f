"""Which gb10d instances the front stands before: every *.toml of `front.instances_dir`, plus the main config when
it runs a model itself. Each one's [vllm] host and port is its internal address, its [daemon] state_file tells
whether it serves. Also the API keys the front lets in, from the config and front.api_keys_file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..base.config import Config, MemorySection
from ..base.configload import LoadedConfig, load_config_explained, tables_of
from ..base.errors import ConfigError, ConfigProblem
from ..base.frontconfig import API_KEY_FORM, FrontSection, api_key_problem
from ..vllm.sleepmode import control_path
from .core import Instance
from .routes import ApiKey

# An instance bound to every address is reached on the loopback one.
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


@dataclass(frozen=True)
class Known:
    instance: Instance
    state_file: Path
    # on_demand.idle_timeout_s of an on-demand instance (parked by stop or sleep), else None: a pinned one; its control socket.
    idle_timeout_s: float | None = None
    control: Path | None = None
    # What its start reserves in the memory ledger (its utilization with the machine's MemTotal and its headroom), and
    # where the machine's memory and ledger are read.
    utilization: float = 0.0
    memory: MemorySection = field(default_factory=MemorySection)
    # How long its requests are held: front.hold_timeout_s, else what its start may take (startup.ready_timeout_s).
    hold_timeout_s: float = 900.0
    # The key its vLLM demands (vllm.api_key), which the front adds: clients use the front's keys, never this one.
    api_key: str | None = None


def _known(name: str, config: Config, front: FrontSection) -> Known:
    vllm = config.vllm
    host = _LOOPBACK.get(vllm.host, vllm.host)
    parks = config.on_demand.idle_timeout_s if config.on_demand else None
    control = control_path(config.daemon.state_file) if parks is not None else None
    return Known(
        Instance(name, tuple(vllm.served_names), host, vllm.port), config.daemon.state_file, parks, control,
        vllm.gpu_memory_utilization, config.memory, front.hold_timeout_s or config.startup.ready_timeout_s, vllm.api_key,
    )


def discover(front: FrontSection, main: Path) -> list[Known]:
    """The instances, in name order; a ConfigError for broken instance configs (all of them), a model served twice, or
    an instance on the front's own port (the front owns the public address: the instance moves to an internal one)."""
    named = [("gb10d", main)] if main.exists() and "vllm" in tables_of(main) else []
    if front.instances_dir.is_dir():
        named += [(path.stem, path) for path in sorted(front.instances_dir.glob("*.toml"))]
    found: list[tuple[LoadedConfig, Known]] = []
    problems: list[ConfigProblem] = []
    for name, path in named:
        try:
            loaded = load_config_explained(path)
        except ConfigError as exc:
            problems += exc.problems  # every broken instance config is told at once, each with its own file and line
            continue
        found.append((loaded, _known(name, loaded.config, front)))
    owner: dict[str, str] = {}
    _, front_port = front.address
    for loaded, known in found:
        if known.instance.port == front_port:
            problems.append(loaded.problem("vllm.port", f"is {front_port}, the front's own port (front.listen): give this instance an internal port such as {8100 + len(owner)}"))
        # Without served_model_name the model's own name is served.
        named_by = "vllm.served_model_name" if loaded.config.vllm.served_model_name is not None else "vllm.model"
        for model in known.instance.models:
            if model in owner:
                problems.append(loaded.problem(named_by, f"serves {model!r}, which instance {owner[model]} serves too: each model name must be unique"))
            owner.setdefault(model, known.instance.name)
    if problems:
        raise ConfigError(problems)
    if not found:
        raise ConfigError([ConfigProblem(str(front.instances_dir), "front.instances_dir", f"holds no instance config (*.toml), and {main} runs no model: the front has nothing to serve")])
    return [known for _, known in found]


def api_keys(front: FrontSection) -> list[ApiKey]:
    """front.api_keys and the entries of front.api_keys_file; a ConfigError names the file and line of a bad entry,
    never the key itself."""
    entries = list(front.api_keys)
    path = front.api_keys_file
    if path is not None:
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError([ConfigProblem(str(path), "front.api_keys_file", f"cannot be read ({why}): the front runs as gb10d, so make it root:gb10d, mode 0640")]) from None
        problems = []
        for number, line in enumerate(lines, 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if api_key_problem(entry):
                problems.append(ConfigProblem(str(path), "", API_KEY_FORM, line=number))
            entries.append(entry)
        if problems:
            raise ConfigError(problems)
    return [ApiKey.parse(entry) for entry in entries]
