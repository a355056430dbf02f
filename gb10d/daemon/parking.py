"""Parking a serving vLLM by its level-2 sleep and waking it, when the front asks (on_demand.park = "sleep").

The supervisor hands each ParkAsked or WakeAsked fact here with the attempt in progress; every decision is
gb10d.vllm.sleepmode's. A wake that cannot be trusted (its memory is gone, a call fails, the check generation is
empty or differs from the one made before the first sleep) ends the attempt with WakeFailed: the supervisor
stops vLLM and starts it cold, and the journal says why.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from ..base.levels import PRIORITY_INFO, PRIORITY_WARNING
from ..base.units import GIB, gib
from ..core import budget
from ..core.budget import Reservation
from ..core.facts import ParkAsked, SleptUnasked, WakeAsked
from ..core.memory import MemInfo
from ..core.outcome import WakeFailed
from ..core.statefile import DaemonState
from ..vllm.sleepmode import CHECK_PROMPT, CHECK_TOKENS, PARK, WAKE, awake_line, check_failure, parked_status, wake_refusal
from .attempt import Attempt
from .reporter import Reporter

# How long one sleep or wake call may take: seconds measured, a minute allowed (a large model's reload from disk).
CALL_TIMEOUT_S = 120.0
# How long vLLM's `Sleep mode freed ...` line may trail the sleep call's answer in the pipe.
LINE_GRACE_S = 2.0


class Parking:
    """Whether vLLM sleeps, what the sleep gave back, and the reference generation made before the first sleep."""

    def __init__(self, reporter: Reporter, meminfo: Callable[[], MemInfo | None]) -> None:
        self.reporter = reporter
        self.meminfo = meminfo
        self.asleep = False
        self.freed = 0
        self.reference: str | None = None
        self._attempt: Attempt | None = None

    async def handle(self, fact: ParkAsked | WakeAsked | SleptUnasked, attempt: Attempt) -> WakeFailed | None:
        """Park or wake as asked; a park of a sleeping or a wake of an awake vLLM changes nothing. A vLLM that
        someone else put to sleep (SleptUnasked) is woken at once, as a parked one is."""
        if attempt is not self._attempt:  # a new vLLM: awake, and its reference is made anew
            self._attempt, self.asleep, self.reference = attempt, False, None
        if isinstance(fact, SleptUnasked):
            # What the sleep gave back, as vLLM's own line said it (a level-1 sleep gives back only the KV cache).
            self.asleep, self.freed = True, attempt.slept[0] if attempt.slept is not None else 0
            self.reporter.sleep_state(DaemonState.ASLEEP, "asleep: put to sleep by someone else, not gb10d; waking it")
            return await self._wake(attempt)
        if not attempt.ready:
            self.reporter.say("park_ignored", f"asked to {'park' if isinstance(fact, ParkAsked) else 'wake'} vLLM while it is not serving yet; nothing done", PRIORITY_INFO)
            return None
        if isinstance(fact, ParkAsked) and not self.asleep:
            await self._park(attempt)
        elif isinstance(fact, WakeAsked) and self.asleep:
            return await self._wake(attempt)
        return None

    async def _park(self, attempt: Attempt) -> None:
        model = attempt.config.vllm.served_names[0]
        if self.reference is None:
            self.reference = await attempt.prober.generate(model, CHECK_PROMPT, CHECK_TOKENS, CALL_TIMEOUT_S)
        self.reporter.sleep_state(DaemonState.PARKING, "parking: putting vLLM to sleep (level 2)")
        attempt.pause_liveness()
        before, started = self.meminfo(), time.monotonic()
        attempt.slept = None
        attempt.slept_seen.clear()
        for call in PARK:
            result = await attempt.prober.call(call, CALL_TIMEOUT_S)
            if not result.ok:
                self.reporter.say("park_failed", f"vLLM refused to sleep ({call}: {result.status or result.reason}); it keeps serving", PRIORITY_WARNING)
                attempt.resume_liveness()
                self.reporter.sleep_state(DaemonState.SERVING, self.reporter.situation.serving_text(self.reporter.config.vllm))
                return
        seconds = time.monotonic() - started
        try:
            await asyncio.wait_for(attempt.slept_seen.wait(), LINE_GRACE_S)
        except asyncio.TimeoutError:
            pass
        after = self.meminfo()
        measured = after.available - before.available if before is not None and after is not None else None
        freed, still = attempt.slept if attempt.slept is not None else (measured or 0, None)
        self.asleep, self.freed = True, max(freed, measured or 0)
        self.reporter.say(
            "parked", f"vLLM sleeps (level 2) after {seconds:.2f} s: {gib(self.freed)} given back"
            + (f", {gib(still)} still in use" if still is not None else ""), PRIORITY_INFO, freed_bytes=self.freed, still_bytes=still,
        )
        self.reporter.sleep_state(DaemonState.ASLEEP, parked_status(still, seconds))

    async def _wake(self, attempt: Attempt) -> WakeFailed | None:
        config = attempt.config
        assert config.on_demand is not None
        mem = self.meminfo()
        margin = int(config.on_demand.wake_margin_gib * GIB)

        def refusal_of(others: list[Reservation]) -> str | None:
            starts = budget.pending(others)
            return wake_refusal(mem.available, self.freed, margin, sum(o.bytes for o in starts), ", ".join(o.name for o in starts)) if mem else None

        booking = self.reporter.ledger.booking
        refusal = booking.wake(refusal_of) if booking is not None else refusal_of([])
        if refusal is not None:
            return self._failed("no_memory", f"not waking vLLM: {refusal}")
        self.reporter.sleep_state(DaemonState.WAKING, "waking: weights, reload_weights, kv_cache, then a check generation")
        started = time.monotonic()
        for call in WAKE:
            result = await attempt.prober.call(call, CALL_TIMEOUT_S)
            if not result.ok:
                return self._failed("call_failed", f"the wake's {call} answered {result.status or result.reason}")
        text = await attempt.prober.generate(config.vllm.served_names[0], CHECK_PROMPT, CHECK_TOKENS, CALL_TIMEOUT_S)
        problem = check_failure(text, self.reference)
        if problem is not None:
            return self._failed("check_failed", f"the wake looked fine but {problem}")
        seconds = time.monotonic() - started
        self.asleep, attempt.slept = False, None  # the next sleep's line is its own
        self.reporter.woke("ok", seconds)
        self.reporter.say("woke", awake_line(seconds), PRIORITY_INFO, wake_seconds=round(seconds, 3))
        attempt.resume_liveness()
        self.reporter.sleep_state(DaemonState.SERVING, self.reporter.situation.serving_text(self.reporter.config.vllm))
        return None

    def _failed(self, result: str, why: str) -> WakeFailed:
        self.asleep, self._attempt = False, None
        self.reporter.woke(result)
        self.reporter.say("wake_failed", f"{why}; stopping vLLM and starting it cold (a swap by sleep is only as good as its wake)", PRIORITY_WARNING, result=result)
        return WakeFailed(why)
