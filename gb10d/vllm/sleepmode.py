"""Parking by vLLM's sleep mode: the calls, the checks around a wake, and what they tell. No I/O here.

Measured on vLLM 0.26 (REFERENCE §18): only level 2 parks on GB10. Level 1 copies the weights to host memory,
which on GB10 is the same memory, and keeps that copy after the wake. Level 2 gives all back but what the CUDA
context keeps, and its wake must go weights, `reload_weights`, kv_cache: weights woken without the reload answer
200 with empty text. vLLM reads `level`, `mode` and `tags` from the query string, never from a body.

A wake on GB10 has killed the engine (vllm-project/vllm#50011) and has failed with /health still green (#49237).
So a wake happens only when the memory the sleep gave back is free again with a margin, and every wake is checked
by a real generation compared with one made before the first sleep. On any doubt gb10d stops vLLM and starts it
cold, and says why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..base.config import Config
from ..base.units import GIB, gib

# The environment and flag that turn sleep mode and its endpoints on.
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
SLEEP_FLAG = "--enable-sleep-mode"

# The generation that checks a wake: deterministic (temperature 0), long enough that garbage cannot pass.
CHECK_PROMPT = "The capital of France is"
CHECK_TOKENS = 16


@dataclass(frozen=True)
class Call:
    """One HTTP call to vLLM's development endpoints."""

    method: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    body: dict[str, object] | None = field(default=None, hash=False)

    def __str__(self) -> str:
        query = "&".join(f"{k}={v}" for k, v in self.params)
        return f"{self.method} {self.path}{'?' + query if query else ''}"


# mode=wait: a request that arrived just before the park finishes instead of being aborted.
PARK = (Call("POST", "/sleep", (("level", "2"), ("mode", "wait"))),)
WAKE = (
    Call("POST", "/wake_up", (("tags", "weights"),)),
    Call("POST", "/collective_rpc", body={"method": "reload_weights"}),
    Call("POST", "/wake_up", (("tags", "kv_cache"),)),
)
# Whether vLLM sleeps, asked by the liveness watch: a sleep nobody asked gb10d for holds every request.
IS_SLEEPING = Call("GET", "/is_sleeping")


def control_path(state_file: Path) -> Path:
    """The control socket beside the instance's state file (state.json -> state.sock): the front finds it from the
    instance's config alone."""
    return state_file.with_name(state_file.stem + ".sock")


def sleeps(config: Config) -> bool:
    """The instance parks by sleep."""
    return config.on_demand is not None and config.on_demand.park == "sleep"


def stops(config: Config) -> bool:
    """The instance parks by stopping vLLM (on_demand.park = "stop"): gb10d waits parked, vLLM starts on demand."""
    return config.on_demand is not None and config.on_demand.park == "stop"


# STATUS= and the state file of an instance parked by stop.
PARKED_STATUS = "parked: starts on the first request"


def vllm_flags(config: Config) -> tuple[str, ...]:
    return (SLEEP_FLAG,) if sleeps(config) else ()


def vllm_env(config: Config) -> dict[str, str]:
    return dict(DEV_MODE_ENV) if sleeps(config) else {}


def wake_refusal(available: int, freed: int, margin: int, starting: int = 0, starters: str = "") -> str | None:
    """Why a wake must not be tried (its memory is not free again with the margin), or None.

    `starting`: what the starts of other instances in progress (`starters`) reserved in the memory ledger and
    may not have taken yet: a wake that counted it as free would leave one of them, or itself, short."""
    needed = freed + margin
    if available - starting >= needed:
        return None
    if starting:
        return (f"MemAvailable is {gib(available)}, and the starts of {starters} reserve {gib(starting)} of it, which leaves "
                f"less than the {gib(freed)} the sleep gave back plus the {gib(margin)} margin (on_demand.wake_margin_gib)")
    return (f"MemAvailable is {gib(available)}, less than the {gib(freed)} the sleep gave back plus the "
            f"{gib(margin)} margin (on_demand.wake_margin_gib): another process took it meanwhile")


def check_failure(text: str | None, reference: str | None) -> str | None:
    """Why the generation after a wake shows a bad engine, or None when it answers as before the first sleep."""
    if text is None:
        return "the check generation got no answer"
    if not text.strip():
        return "the check generation answered with empty text (weights not loaded)"
    if reference is not None and text != reference:
        return f"the check generation answered {text[:60]!r}, not {reference[:60]!r} as before the first sleep"
    return None


_FREED = re.compile(r"Sleep mode freed (?P<freed>[\d.]+) GiB memory, (?P<still>[\d.]+) GiB memory is still in use\.")


def sleep_freed(message: str) -> tuple[int, int] | None:
    """(freed, still in use) in bytes from vLLM's `Sleep mode freed X GiB memory, Y GiB memory is still in use.`"""
    if "Sleep mode freed" not in message:
        return None
    match = _FREED.search(message)
    return (int(float(match["freed"]) * GIB), int(float(match["still"]) * GIB)) if match else None


def parked_status(still: int | None, seconds: float) -> str:
    kept = f", {gib(still)} still in use" if still is not None else ""
    return f"asleep: parked by vLLM's level-2 sleep in {seconds:.1f} s{kept}; wakes on the next request"


def awake_line(seconds: float) -> str:
    return f"woke vLLM in {seconds:.2f} s (weights, reload_weights, kv_cache) and checked it with a {CHECK_TOKENS}-token generation"
