"""The HTTP side of one attempt: the readiness checks before READY=1 and the liveness watch after it.

Each is a coroutine the attempt runs as a task; each reports what it
concluded through `post(kind, detail, label)` and decides nothing about
the attempt itself: the lifecycle core does. The judgements they make on
the way are pure and live elsewhere (`lifecycle.served_name_problem`, the
`liveness` core); this module only sends requests and keeps time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable

from ..base.backoff import pauses
from ..base.config import Config, LivenessSection
from ..base.tasks import Probe
from ..core.facts import ProbeKind, ProbeResult
from ..core.lifecycle import served_name_problem, waits_for_listen
from ..core.liveness import (
    AskIfAsleep,
    Asleep,
    Dead,
    Hung,
    LivenessState,
    MetricsSample,
    death,
    next_deadline,
    next_probe_due,
    observe_health,
    observe_metrics,
    observe_probe,
    observe_sleep_check,
    parse_metrics,
    probe_may_go,
    probe_sent,
    sleep_check_sent,
    sleep_check_timeout,
    sleep_check_wanted,
    start,
    verdict,
)
from .probe import Prober

Post = Callable[..., None]


async def check_ready(prober: Prober, config: Config, post: Post, probe: Probe) -> None:
    """/health 200, the served names in /v1/models, and (if configured) the model's tiny request (`probe`).

    Gives up silently when the port does not open within LISTEN_GRACE_S: the
    health poller and the stall timer take it from there.
    """
    v = config.vllm
    started = time.monotonic()
    delays = pauses(0.005, 0.5)
    while not (await prober.health()).ok:
        if not waits_for_listen(time.monotonic() - started):
            return
        await asyncio.sleep(next(delays))  # uvicorn listens moments after logging startup complete
    models = await prober.models()
    problem = served_name_problem(v.served_names, models)
    if problem is not None:
        post(ProbeKind.WRONG_NAME, problem)
        return
    detail = f"/health 200, /v1/models lists {', '.join(models.models)}"
    if config.startup.warmup and probe.route is not None:
        post(ProbeKind.WARMING)
        result = await prober.send(probe, v.served_names[0], timeout_s=config.liveness.probe_timeout_s)
        if not result.ok:
            # 404: vLLM opens only the routes of the model's tasks (an embedding model has no completions).
            hint = "; the model does not serve that route: set liveness.probe_route to one it serves" if result.status == 404 else ""
            post(ProbeKind.NOT_READY, f"the warm-up {probe.noun} ({probe.route}) failed ({result.status or result.reason}){hint}")
            return
        detail += f", warm-up {probe.noun} took {result.seconds:.2f} s"
    elif config.startup.warmup:
        detail += ", no warm-up request (liveness.probe_route: none for this model)"
    post(ProbeKind.READY, detail)


async def poll_until_healthy(prober: Prober, interval_s: float, waiting: Callable[[], bool], post: Post) -> None:
    """Fallback for a missed `Application startup complete.` (e.g. --uvicorn-log-level warning), or for
    readiness checks that gave up waiting for the port: poll /health while `waiting()` says so."""
    while True:
        await asyncio.sleep(interval_s)
        if waiting() and (await prober.health(timeout_s=5.0)).ok:
            post(ProbeKind.HEALTHY)


async def watch_liveness(
    prober: Prober,
    limits: LivenessSection,
    post: Post,
    *,
    model: str,
    probe: Probe,
    sleep_checks: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Watch a serving vLLM until the evidence says hung, dead or asleep; post that verdict once, then return.

    Samples (/health, then /metrics), the idle probe (`probe`; none when
    its route is None) and, with `sleep_checks` (vLLM's development
    endpoints are on), GET /is_sleeping before each idle probe and before a
    hang is called, are tasks of their own, so a request that hangs (which is
    the very symptom looked for) never stops the others or the clock.
    Cancelling it cancels them.
    """
    state = start(clock(), probe.words, sleep_checks)
    sampling: asyncio.Task[tuple[ProbeResult, MetricsSample | None]] | None = None
    probing: asyncio.Task[ProbeResult] | None = None
    checking: asyncio.Task[tuple[ProbeResult, bool | None]] | None = None
    next_sample = state.started_at + limits.health_interval_s

    def check_sleep(state: LivenessState, now: float) -> LivenessState:
        nonlocal checking
        checking = asyncio.create_task(prober.is_sleeping(timeout_s=sleep_check_timeout(limits)))
        return sleep_check_sent(state, now)

    async def sample() -> tuple[ProbeResult, MetricsSample | None]:
        health = await prober.health(timeout_s=limits.probe_timeout_s)
        if death(health, "/health"):
            return health, None
        text = await prober.metrics_text(timeout_s=limits.probe_timeout_s)
        return health, parse_metrics(text) if text is not None else None

    try:
        while True:
            now = clock()
            deadline = next_deadline(state, limits)
            due = next_probe_due(state, now, limits) if probe.route else None
            # Deadlines and a due probe bring the next sample forward: verdicts are taken, and the
            # probe is sent, on fresh figures only.
            sample_at = min(t for t in (next_sample, deadline, due) if t is not None)
            if sampling is None and now >= sample_at:
                sampling = asyncio.create_task(sample())
            await _first_of([t for t in (sampling, probing, checking) if t is not None], None if sampling else sample_at - now)
            now = clock()
            if sampling is not None and sampling.done():
                health, metrics = sampling.result()
                state = observe_metrics(observe_health(state, health, now), metrics, now)
                sampling, next_sample = None, now + limits.health_interval_s
                due = next_probe_due(state, now, limits) if probe.route else None
                if probing is None and due is not None and now >= due:
                    if probe_may_go(state, due):
                        state = probe_sent(state, now)
                        probing = asyncio.create_task(prober.send(probe, model, timeout_s=limits.probe_timeout_s))
                    elif sleep_check_wanted(state, due):
                        state = check_sleep(state, now)
            elif probing is not None and probing.done():
                state, probing = observe_probe(state, probing.result(), now), None
            elif checking is not None and checking.done():
                result, sleeping = checking.result()
                state, checking = observe_sleep_check(state, sleeping, result, now), None
            else:
                continue
            found = verdict(state, now, limits)
            if isinstance(found, AskIfAsleep) and checking is None:
                state = check_sleep(state, now)
            elif isinstance(found, Hung):
                post(ProbeKind.HUNG, found.evidence, found.cause)
                return
            elif isinstance(found, Dead):
                post(ProbeKind.DEAD, found.reason, found.cause)
                return
            elif isinstance(found, Asleep):
                post(ProbeKind.ASLEEP, found.evidence, found.cause)
                return
    finally:
        leftovers = [task for task in (sampling, probing, checking) if task is not None and not task.done()]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)


async def _first_of(tasks: Iterable[asyncio.Task[Any]], timeout_s: float | None) -> None:
    """Wait until one of `tasks` finishes or `timeout_s` passes (a timer when there is no task)."""
    if tasks := list(tasks):
        await asyncio.wait(tasks, timeout=None if timeout_s is None else max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED)
    elif timeout_s is not None:
        await asyncio.sleep(max(0.0, timeout_s))
