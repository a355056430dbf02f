"""The stand-in's knobs, read from GB10D_SIM_* and vLLM's own environment variables.

Everything is parsed once into frozen values so that a typo in a test's
environment fails at once with one line, never with a traceback, and so the
API server and the EngineCore agree on what they simulate.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .output import LEVELS, LogStyle

GIB = 2**30
DEFAULT_TOTAL_GIB = 121.69
DEFAULT_FREE_GIB = 115.0
DEFAULT_SHARDS = 6
RECORDED_VERSION = "0.23.0"
OOM_PHASES = ("load", "profile", "graphs")


class SettingsError(ValueError):
    """A GB10D_SIM_* variable has a value the stand-in cannot use."""


@dataclass(frozen=True)
class Scenario:
    """What goes wrong (or not) in this run, from GB10D_SIM_SCENARIO."""

    stall_at: int | None = None
    slow_shards_s: float | None = None
    cuda_oom_during: str | None = None
    kv_insufficient: bool = False
    engine_dies_after_s: float | None = None
    hang_after_s: float | None = None
    model_not_found: bool = False
    bad_parser: bool = False
    leak_gib: float = 0.0  # memory a failed engine leaves trapped (GB10's crashed-CUDA-process trap)
    page_cache_gib: float = 0.0  # page cache the load leaves (the checkpoint's pages): MemFree falls, MemAvailable does not
    # GB10's own failures (REFERENCE §12):
    ptxas: bool = False  # Triton's bundled ptxas does not know sm_121a: compile or warm-up fails unless TRITON_PTXAS_PATH helps
    no_kernel_image: bool = False  # a build without kernels for this GPU: the first kernel after loading fails
    hidden_init_failure: bool = False  # vLLM 0.23: the EngineCore dies without a word, the API server says `{}`
    ipc_removed: bool = False  # the EngineCore's semaphore was removed before it could open it (logind's RemoveIPC)
    bad_wake: bool = False  # a wake from level-2 sleep whose reload_weights leaves the weights garbage (vllm#49237: 200s, empty text)


def parse_scenario(text: str) -> Scenario:
    """Parse `healthy`, `stall_at=K`, `slow_shards=S`, ... separated by commas."""
    values: dict[str, object] = {}
    flags = {"kv_insufficient", "model_not_found", "bad_parser", "ptxas", "no_kernel_image", "hidden_init_failure", "ipc_removed", "bad_wake"}
    numbers = {"slow_shards": "slow_shards_s", "engine_dies_after": "engine_dies_after_s", "hang_after": "hang_after_s", "leak_gib": "leak_gib",
               "page_cache_gib": "page_cache_gib"}
    for item in (part.strip() for part in text.split(",")):
        if not item or item == "healthy":
            continue
        name, sep, raw = item.partition("=")
        if name in flags and not sep:
            values[name] = True
        elif name == "stall_at" and sep:
            values["stall_at"] = _number("GB10D_SIM_SCENARIO stall_at", raw, integer=True)
        elif name in numbers and sep:
            values[numbers[name]] = _number(f"GB10D_SIM_SCENARIO {name}", raw)
        elif name == "cuda_oom_during" and raw in OOM_PHASES:
            values["cuda_oom_during"] = raw
        else:
            known = ("healthy, stall_at=K, slow_shards=S, cuda_oom_during=load|profile|graphs, kv_insufficient, engine_dies_after=S, "
                     "hang_after=S, model_not_found, bad_parser, leak_gib=G, page_cache_gib=G, ptxas, no_kernel_image, hidden_init_failure, ipc_removed, bad_wake")
            raise SettingsError(f"GB10D_SIM_SCENARIO: unknown item {item!r} (known: {known})")
    return Scenario(**values)  # type: ignore[arg-type]


def _number(name: str, raw: str, integer: bool = False) -> float:
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be {'an integer' if integer else 'a number'} >= 0, got {raw!r}") from None
    if value < 0 or math.isnan(value):
        raise SettingsError(f"{name} must be >= 0, got {raw!r}")
    return value


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string such as `0.23.0` or `0.31.1rc1`."""
    parts = version.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        raise SettingsError(f"GB10D_SIM_VERSION must look like 0.23.0, got {version!r}") from None


@dataclass(frozen=True)
class Memory:
    """What cudaMemGetInfo would report on GB10, in bytes."""

    total_bytes: int
    free_bytes: int
    available_bytes: int


def parse_meminfo(text: str) -> dict[str, int]:
    """`/proc/meminfo` fields in bytes."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            fields[name.strip()] = int(words[0]) * (1024 if len(words) > 1 and words[1] == "kB" else 1)
    return fields


@dataclass(frozen=True)
class SimSettings:
    """All knobs of one run."""

    era: str
    version: str
    scenario: Scenario
    speed: float
    shards: int | None
    meminfo: Path | None
    hold_memory: bool  # the EngineCore holds its memory in `meminfo` (GB10D_SIM_MEMINFO_HOLD)
    total_gib: float
    free_gib: float
    style: LogStyle
    logo: bool
    stats_interval_s: float
    api_key_env: str | None
    keep_alive_on_engine_death: bool
    # GB10D_SIM_LOAD_GATE: the weights' load waits for this file before its first shard (a test holds a start there).
    load_gate: Path | None = None
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def minor(self) -> int:
        """vLLM's minor version, which selects the line formats."""
        return version_tuple(self.version)[1]

    def delay(self, sim_seconds: float) -> float:
        """Wall-clock seconds for a simulated duration."""
        return sim_seconds * self.speed

    def sleep(self, sim_seconds: float) -> None:
        """Let a simulated duration pass."""
        if self.speed > 0 and sim_seconds > 0:
            time.sleep(sim_seconds * self.speed)

    def memory(self) -> Memory:
        """Total and free memory as the EngineCore sees them now (re-read every call)."""
        if self.meminfo is not None:
            try:
                fields = parse_meminfo(self.meminfo.read_text(encoding="ascii", errors="replace"))
            except OSError as exc:
                raise SettingsError(f"GB10D_SIM_MEMINFO: cannot read {self.meminfo}: {exc.strerror}") from None
            if "MemTotal" not in fields or "MemFree" not in fields:
                raise SettingsError(f"GB10D_SIM_MEMINFO: {self.meminfo} has no MemTotal or MemFree line")
            free = fields["MemFree"]
            return Memory(fields["MemTotal"], free, fields.get("MemAvailable", free))
        free = int(self.free_gib * GIB)
        return Memory(int(self.total_gib * GIB), free, free)


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off")


def use_color(env: Mapping[str, str], minor: int, fd_is_tty: bool) -> bool:
    """REFERENCE §1: NO_COLOR / VLLM_LOGGING_COLOR=0 win, then =1 or FORCE_COLOR (0.31+), then a TTY."""
    if env.get("NO_COLOR", "0") != "0" or env.get("VLLM_LOGGING_COLOR") == "0":
        return False
    if env.get("VLLM_LOGGING_COLOR") == "1":
        return True
    if minor >= 31 and env.get("FORCE_COLOR", "0") != "0":
        return True
    return fd_is_tty


def from_environ(env: Mapping[str, str] | None = None) -> SimSettings:
    """Read every knob; raises SettingsError with a one-line explanation."""
    env = dict(os.environ if env is None else env)
    era = env.get("GB10D_SIM_ERA", "").strip()
    version = env.get("GB10D_SIM_VERSION", "").strip()
    if era not in ("", "0.30", "0.31"):
        raise SettingsError(f"GB10D_SIM_ERA must be 0.30 (stream-wrapper tags) or 0.31 (tags in the format), got {era!r}")
    if not version:
        version = "0.31.0" if era == "0.31" else RECORDED_VERSION
    minor = version_tuple(version)[1]
    if not era:
        era = "0.31" if minor >= 31 else "0.30"
    speed = _number("GB10D_SIM_SPEED", env.get("GB10D_SIM_SPEED", "1") or "1")
    shards_raw = env.get("GB10D_SIM_SHARDS", "")
    shards = int(_number("GB10D_SIM_SHARDS", shards_raw, integer=True)) if shards_raw else None
    if shards == 0:
        raise SettingsError("GB10D_SIM_SHARDS must be at least 1")
    meminfo = Path(env["GB10D_SIM_MEMINFO"]) if env.get("GB10D_SIM_MEMINFO") else None
    total = _number("GB10D_SIM_TOTAL_GIB", env.get("GB10D_SIM_TOTAL_GIB") or str(DEFAULT_TOTAL_GIB))
    free = _number("GB10D_SIM_FREE_GIB", env.get("GB10D_SIM_FREE_GIB") or str(DEFAULT_FREE_GIB))
    level = env.get("VLLM_LOGGING_LEVEL", "INFO").upper()
    if level not in LEVELS:
        level = "INFO"
    try:
        interval = float(env.get("VLLM_LOG_STATS_INTERVAL", "10") or "10")
    except ValueError:
        interval = 10.0
    style = LogStyle(
        wrapper_tag=era == "0.30",
        prefix=env.get("VLLM_LOGGING_PREFIX", ""),
        configured=_flag(env, "VLLM_CONFIGURE_LOGGING", True),
        threshold=LEVELS[level],
        color=use_color(env, minor, os.isatty(1)),
    )
    scenario = parse_scenario(env.get("GB10D_SIM_SCENARIO", "healthy"))
    if scenario.hidden_init_failure and minor >= 24:
        raise SettingsError(
            f"GB10D_SIM_SCENARIO hidden_init_failure is vLLM 0.23's behaviour (0.24 prints the root cause); "
            f"GB10D_SIM_VERSION is {version}"
        )
    return SimSettings(
        era=era,
        version=version,
        scenario=scenario,
        speed=speed,
        shards=shards,
        meminfo=meminfo,
        hold_memory=_flag(env, "GB10D_SIM_MEMINFO_HOLD", True),
        total_gib=total,
        free_gib=free,
        style=style,
        logo=not _flag(env, "VLLM_DISABLE_LOG_LOGO", False),
        stats_interval_s=interval if interval > 0 else 10.0,
        api_key_env=env.get("VLLM_API_KEY") or None,
        keep_alive_on_engine_death=_flag(env, "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", False),
        load_gate=Path(env["GB10D_SIM_LOAD_GATE"]) if env.get("GB10D_SIM_LOAD_GATE") else None,
        env=env,
    )
