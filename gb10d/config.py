"""The gb10d.toml configuration: its schema, loading, and errors that point at a line.

The schema is a pydantic v2 model. Loading never raises anything but
`ConfigError`, whose problems each name the file, the line (when the key is
found in the text), the dotted key and the fix, so the CLI can print them and
exit 78 without a traceback.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError, ConfigProblem

DEFAULT_CONFIG_PATH = Path("/etc/gb10d.toml")
DEFAULT_DROPIN_DIR = Path("/etc/gb10d.d")
CONFIG_ENV = "GB10D_CONFIG"

LOAD_STRATEGIES = ("eager", "lazy", "prefetch", "torchao")


class _Table(BaseModel):
    """A gb10d table: unknown keys are errors, values are checked strictly enough to catch typos."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class VllmSection(_Table):
    """`[vllm]`: what to run and with which flags."""

    executable: Path | None = None
    venv: Path | None = None
    model: str
    host: str = "0.0.0.0"
    port: int = Field(default=8000, ge=1, le=65535)
    served_model_name: str | list[str] | None = None
    gpu_memory_utilization: float = 0.9
    args: dict[str, Any] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    env_file: Path | None = None

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError('must name a Hugging Face repository or a local directory, e.g. "Qwen/Qwen3.6-27B-FP8"')
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
        if not (0 < value <= 1) or math.isnan(value):
            raise ValueError(f"must be > 0 and <= 1 (got {value})")
        return value

    @field_validator("args")
    @classmethod
    def _args_shape(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            flag = normalize_flag(key)
            if flag in _FIRST_CLASS_FLAGS:
                raise ValueError(f"{key!r} is set with vllm.{_FIRST_CLASS_FLAGS[flag]}, not in vllm.args")
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]*(\.[a-z0-9_-]+)*", flag):
                raise ValueError(f"{key!r} is not a vllm serve flag name (letters, digits, '-' or '_')")
            if isinstance(item, list) and any(isinstance(v, (dict, list)) for v in item):
                raise ValueError(f"{key!r}: a list may hold only plain values")
        return value

    @model_validator(mode="after")
    def _one_program(self) -> VllmSection:
        if self.executable is None and self.venv is None:
            raise ValueError("set either vllm.executable (path of the vllm program) or vllm.venv (a virtualenv with vLLM)")
        if self.executable is not None and self.venv is not None:
            raise ValueError("set only one of vllm.executable and vllm.venv, not both")
        return self

    @property
    def program(self) -> Path:
        """The `vllm` executable this config runs."""
        if self.executable is not None:
            return self.executable
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
        """The API key vLLM will demand on /v1 paths, from args or VLLM_API_KEY."""
        value = self.arg("api-key")
        if isinstance(value, str) and value:
            return value
        return self.env.get("VLLM_API_KEY") or None


class StartupSection(_Table):
    """`[startup]`: how long a start may take and what counts as stalled."""

    stall_timeout_s: float = Field(default=300.0, gt=0)
    ready_timeout_s: float = Field(default=3600.0, gt=0)
    warmup: bool = True
    load_strategy_ladder: list[Literal["eager", "lazy", "prefetch", "torchao"]] = Field(
        default_factory=lambda: ["eager"]
    )
    allow_max_model_len_reduction: bool = False
    health_poll_interval_s: float = Field(default=2.0, gt=0)


class MemorySection(_Table):
    """`[memory]`: the unified-memory arithmetic of GB10."""

    meminfo_path: Path = Path("/proc/meminfo")
    headroom_gib: float = Field(default=1.0, ge=0)
    min_gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    preflight: bool = True
    evict_page_cache: bool = True
    recovery_timeout_s: float = Field(default=60.0, ge=0)
    recovery_tolerance_gib: float = Field(default=4.0, ge=0)


class RestartSection(_Table):
    """`[restart]`: the bounded retry budget for failures gb10d cannot correct."""

    max_attempts: int = Field(default=5, ge=1, le=100)
    backoff_initial_s: float = Field(default=5.0, ge=0)
    backoff_max_s: float = Field(default=300.0, ge=0)

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
    progress_timeout_s: float = Field(default=120.0, gt=0)
    idle_probe_interval_s: float = Field(default=60.0, gt=0)
    probe_timeout_s: float = Field(default=60.0, gt=0)


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


class DaemonSection(_Table):
    """`[daemon]`: gb10d's own behaviour and files."""

    stop_timeout_s: float = Field(default=30.0, ge=0)
    state_file: Path = Path("/run/gb10d/state.json")
    learned_file: Path = Path("/var/lib/gb10d/state.toml")
    apply_on_change: bool = False
    watch_config: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class Config(_Table):
    """A whole gb10d.toml, after drop-ins are merged."""

    vllm: VllmSection
    startup: StartupSection = Field(default_factory=StartupSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    restart: RestartSection = Field(default_factory=RestartSection)
    liveness: LivenessSection = Field(default_factory=LivenessSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    daemon: DaemonSection = Field(default_factory=DaemonSection)


# Flags owned by a first-class [vllm] key; setting them in args would be ambiguous.
_FIRST_CLASS_FLAGS = {
    "host": "host",
    "port": "port",
    "served-model-name": "served_model_name",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "model": "model",
}


def normalize_flag(key: str) -> str:
    """`max_model_len`, `max-model-len` and `--max-model-len` all name the flag `max-model-len`."""
    return key.lstrip("-").replace("_", "-").lower()


def default_config_path() -> Path:
    """`$GB10D_CONFIG` when set, else /etc/gb10d.toml."""
    return Path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def read_toml(path: Path) -> tuple[dict[str, Any], str]:
    """Read and parse one TOML file, or raise ConfigError naming the file and the position."""
    shown = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError([ConfigProblem(shown, "", "file not found; create it (see /usr/share/doc/gb10d/examples) or pass --config PATH")]) from None
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


def locate_key(text: str, dotted: str) -> int | None:
    """The 1-based line where `dotted` (e.g. "vllm.port") is set in `text`, if it can be found.

    Handles `[table]` headers, dotted keys (`vllm.port = 1`) and quoted keys,
    which covers how people write gb10d.toml; returns the table's header line
    when the key itself is missing (a required key), or None.
    """
    parts = dotted.split(".")
    table: list[str] = []
    header_lines: dict[tuple[str, ...], int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.match(r"^\[\[?\s*([^\]]+?)\s*\]\]?", stripped)
        if header:
            table = [_unquote(p) for p in _split_dotted(header.group(1))]
            header_lines.setdefault(tuple(table), number)
            continue
        assignment = re.match(r'^((?:"[^"]*"|\'[^\']*\'|[A-Za-z0-9_.\- ])+?)\s*=', stripped)
        if not assignment:
            continue
        key = table + [_unquote(p) for p in _split_dotted(assignment.group(1))]
        if key[: len(parts)] == parts and len(key) >= len(parts):
            return number
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
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
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


def _describe(error: dict[str, Any]) -> str:
    """An operator-facing sentence for one pydantic error."""
    kind: str = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    got = f" (got {value!r})" if not isinstance(value, dict) else ""
    if kind == "missing":
        return "is required"
    if kind == "extra_forbidden":
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


def _problems_from(exc: ValidationError, shown: str, text: str) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    seen: set[tuple[str, str]] = set()
    for error in exc.errors(include_url=False):
        loc = tuple(p for p in error["loc"] if not (isinstance(p, str) and p in _UNION_TAGS))
        key = ".".join(str(p) for p in loc)
        message = _describe(error)
        if error["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), _known_keys(loc), n=1)
            message += f"; did you mean {'.'.join(str(p) for p in loc[:-1] + (close[0],))}?" if close else "; remove it"
        if (key, message) in seen:
            continue
        seen.add((key, message))
        problems.append(ConfigProblem(shown, key, message, line=locate_key(text, key) if key else None))
    return problems


# pydantic names union members in error locations; they mean nothing to an operator.
_UNION_TAGS = {"str", "list[str]", "function-after[_names_not_empty(), union[str,list[str],none]]"}


def parse_config(data: dict[str, Any], shown: str = "<config>", text: str = "") -> Config:
    """Validate already-parsed TOML data, raising ConfigError with located problems."""
    if not data:
        raise ConfigError([ConfigProblem(shown, "", "is empty; it needs at least a [vllm] table with model and executable or venv")])
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_problems_from(exc, shown, text)) from None


def load_config(path: Path | None = None) -> Config:
    """Read, parse and validate the config file; the only error raised is ConfigError."""
    path = path or default_config_path()
    data, text = read_toml(path)
    return parse_config(data, str(path), text)
