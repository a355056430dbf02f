"""What went wrong with an attempt, and what the next attempt should be.

`classify` turns the failure events seen during an attempt (plus how it
ended) into a `Failed` outcome with one `Cause`; `next_attempt` turns it,
the settings used and the history into `Retry` (with corrected settings and
a delay) or `GiveUp` (with an exit status); `after_failure` also keeps the
count of attempts and back-offs, and `failure_line` and `event_kind` say
how the journal tells of it. All pure: the supervisor feeds them facts and
carries out the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..base.backoff import doubled
from ..base.command import Tunables
from ..base.config import Config
from ..base.errors import EXIT_CONFIG, EXIT_GAVE_UP, EXIT_MEMORY_NOT_RETURNED
from ..base.units import GIB
from ..vllm import failures
from ..vllm.events import (
    BadArgument,
    CudaOutOfMemory,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    KvCacheInsufficient,
    ModelNotFound,
    NoKvCacheMemory,
    ProgramNotRun,
)
from ..vllm.failures import FailureKind
from ..vllm.known import issue_for
from . import advice
from .host import HostFacts
from .memory import ALONE, Neighbours, fitting_utilization, floor2
from .outcome import Cause, Failed

# The variable that points Triton at another ptxas, and the allocator setting reported to keep the driver's memory in check.
TRITON_PTXAS_PATH = "TRITON_PTXAS_PATH"
ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
AUTOTUNE_FLAG = "enable-flashinfer-autotune"
# vLLM 0.34's switch back to a KV cache sized from the utilization budget, checked at the start.
NO_EXTENSIBLE_KV = "--no-enable-extensible-kv-cache"
# How much lower the utilization goes after the driver ran out of memory or CUDA did.
OOM_MARGIN = 0.05

def starts_new_count(outcome: Failed, config: Config) -> bool:
    """Whether this failure begins a new count of `restart.max_attempts`.

    Only after vLLM served for `restart.reset_after_s` or longer: an engine
    that dies soon after every ready would otherwise be restarted forever
    (the loop a systemd `Restart=` makes). A hang never begins a new count,
    so a model that keeps hanging is given up on.
    """
    return outcome.was_ready and outcome.cause is not Cause.ENGINE_HUNG and outcome.served_s >= config.restart.reset_after_s


def classify(seen: Sequence[Failure], exit_status: int | None, was_ready: bool) -> Failed:
    """The cause of an attempt that vLLM ended itself (exited), from what it printed."""
    # The registry's order: a more specific failure wins over the generic wrapper printed after it.
    for kind in failures.kinds():
        found = next((f for f in reversed(seen) if kind.event is not None and isinstance(f, kind.event)), None)
        if found is not None:
            return Failed(cause=kind, failure=found, exit_status=exit_status, was_ready=was_ready)
    if was_ready and exit_status == 0:
        # vLLM exits 0 after its engine dies (REFERENCE: engine death at run time).
        return Failed(cause=Cause.ENGINE_DEAD, exit_status=exit_status, was_ready=was_ready, detail="vLLM exited with status 0 while serving")
    last = next((f for f in reversed(seen) if isinstance(f, ExceptionRaised)), None)
    detail = f"{last.exc_type}: {last.message}" if last else ""
    return Failed(cause=Cause.CRASH, failure=last, exit_status=exit_status, was_ready=was_ready, detail=detail)


@dataclass(frozen=True)
class Retry:
    """Start again after `delay_s` with `tunables`; `message` is the journal line's action part."""

    tunables: Tunables
    delay_s: float
    message: str


@dataclass(frozen=True)
class GiveUp:
    """Stop trying; exit with `exit_status` after logging `message`."""

    message: str
    exit_status: int


@dataclass(frozen=True)
class History:
    """Attempts made since the last failure that began a new count (`starts_new_count`)."""

    attempts: int = 0
    backoffs: int = 0


def backoff_delay(config: Config, backoffs: int) -> float:
    """Exponential back-off: initial, doubled per consecutive uncorrectable failure, capped."""
    r = config.restart
    return doubled(r.backoff_initial_s, backoffs, r.backoff_max_s)


def _lower_utilization(current: float, target: float, config: Config, why: str, machine: str | None = None) -> Retry | GiveUp:
    """Retry with `target` (never the same value again), unless below the configured minimum.

    `machine`: where memory ran short, when it is the other machine of a pair.
    """
    new = min(floor2(target), floor2(current - 0.01))
    minimum = config.memory.min_gpu_memory_utilization
    if new < minimum:
        return GiveUp(advice.utilization_below_minimum(why, new, minimum, machine), EXIT_GAVE_UP)
    return Retry(tunables=Tunables(new, None, None), delay_s=0.0, message=f"restarting with gpu_memory_utilization {new:g}")


def next_attempt(
    outcome: Failed, used: Tunables, history: History, config: Config, host: HostFacts | None = None, neighbours: Neighbours = ALONE
) -> Retry | GiveUp:
    """The next attempt's settings and delay after `outcome`, or the reason to stop.

    `history.attempts` counts attempts made so far (including the one that
    just failed); the budget is `restart.max_attempts`. `host` says what
    this machine offers for GB10's own failures (a CUDA toolkit's ptxas).
    `neighbours`: the other gb10d instances of this machine; a lowered
    utilization never takes what their starts reserved.
    """
    if outcome.cause.gives_up:
        return GiveUp(_config_advice(outcome, config), EXIT_CONFIG)
    fix = _fix(outcome, used, config, host)
    if isinstance(fix, GiveUp):
        return fix
    retry = fix if fix is not None else _retry(outcome, used, history, config, neighbours)
    issue = issue_for(outcome.failure) if outcome.failure is not None else None
    if issue is not None and issue.retry_helps and outcome.failure is not None and isinstance(retry, Retry):
        # A retry may get past it, but the operator should know the lasting fix.
        retry = Retry(retry.tunables, retry.delay_s, f"{advice.platform(outcome.failure)}; {retry.message}")
    if history.attempts >= config.restart.max_attempts:
        return GiveUp(advice.gave_up(history.attempts, describe(outcome)), EXIT_GAVE_UP)
    return retry


def _fix(outcome: Failed, used: Tunables, config: Config, host: HostFacts | None) -> Retry | GiveUp | None:
    """The one change a GB10 failure or a KV cache too small calls for, or why it cannot be made; None for other causes.

    Its give-up is final whatever the count of attempts: the same start
    again would fail the same way.
    """
    if outcome.cause is Cause.PTXAS:
        return _ptxas(used, config, host)
    if outcome.cause is Cause.DRIVER_OOM:
        return _driver_oom(used, config)
    if outcome.cause in (Cause.KV_CACHE, Cause.NO_KV_MEMORY):
        return _kv_cache(outcome, used, config)
    return None


def _retry(outcome: Failed, used: Tunables, history: History, config: Config, neighbours: Neighbours) -> Retry | GiveUp:
    """The retry for the other causes: a lower utilization where memory ran short (or why it cannot go lower),
    the next load strategy after a stall, else the same settings, paced by the back-off where they failed to start."""
    if outcome.cause is Cause.FREE_MEMORY:
        return _free_memory(outcome, used, config, neighbours)
    if outcome.cause is Cause.CUDA_OOM:
        retry = _lower_utilization(
            used.gpu_memory_utilization, used.gpu_memory_utilization - OOM_MARGIN, config, "CUDA ran out of memory"
        )
        if isinstance(retry, Retry):
            retry = Retry(used.with_(gpu_memory_utilization=retry.tunables.gpu_memory_utilization), 0.0, retry.message)
        return retry
    if outcome.cause is Cause.PULL_STALLED:
        # The network or the registry may recover; the pull starts over, paced by the back-off.
        return Retry(used, backoff_delay(config, history.backoffs), "pulling again")
    if outcome.cause is Cause.STALL:
        return _next_load_strategy(used, history, config)
    if starts_new_count(outcome, config) or outcome.cause is Cause.ENGINE_HUNG:
        # It served a good while (or hung, which keeps counting): a fresh start is the fix,
        # and a full start is slow enough to pace itself.
        return Retry(used, 0.0, "restarting with the same settings")
    if outcome.was_ready:
        return Retry(
            used,
            backoff_delay(config, history.backoffs),
            f"it served only {outcome.served_s:.0f} s (less than restart.reset_after_s "
            f"{config.restart.reset_after_s:g}), so this counts as a failed start; restarting with the same settings",
        )
    return Retry(used, backoff_delay(config, history.backoffs), "restarting with the same settings")


def _free_memory(outcome: Failed, used: Tunables, config: Config, neighbours: Neighbours) -> Retry | GiveUp:
    """Too little free memory at the start: the utilization that fits what is free, less what neighbours reserved."""
    failure = outcome.failure
    assert isinstance(failure, FreeMemoryShort)
    # Another machine's memory (a pair's worker) is not this machine's ledger's.
    around = ALONE if failure.node else neighbours
    target = fitting_utilization(failure.free_gib - around.reserved / GIB, failure.total_gib, config.memory.headroom_gib)
    retry = _lower_utilization(
        used.gpu_memory_utilization,
        target,
        config,
        describe(outcome) + around.less() + around.beside(),
        failure.node,
    )
    if isinstance(retry, Retry):
        new = retry.tunables.gpu_memory_utilization
        spared = f", leaving{around.less().removeprefix(' less')} alone" if around.reserved else ""
        retry = Retry(used.with_(gpu_memory_utilization=new), 0.0, f"restarting with {new:g}{spared}")
    return retry


def _next_load_strategy(used: Tunables, history: History, config: Config) -> Retry:
    """A load that stalled: the next strategy of `startup.load_strategy_ladder`, else the same settings after a back-off."""
    ladder = config.startup.load_strategy_ladder
    following = ladder[ladder.index(used.load_strategy) + 1 :] if used.load_strategy in ladder else ladder
    if following:
        return Retry(
            used.with_(load_strategy=following[0]),
            0.0,
            f"restarting with --safetensors-load-strategy {following[0]}",
        )
    return Retry(used, backoff_delay(config, history.backoffs), "retrying with the same settings")


def _kv_cache(outcome: Failed, used: Tunables, config: Config) -> Retry | GiveUp:
    """The KV cache is too small for one request, or got nothing: 0.34's extensible cache is sized from the budget
    instead (once); else vLLM's estimate of max_model_len, where allowed; else the operator must choose."""
    if _extensible_kv_too_small(outcome, config):
        return Retry(used.with_flag(NO_EXTENSIBLE_KV), 0.0, advice.extensible_kv_too_small(NO_EXTENSIBLE_KV))
    failure = outcome.failure
    if not isinstance(failure, KvCacheInsufficient):
        return GiveUp(advice.no_kv_memory(), EXIT_CONFIG)
    estimate = failure.estimated_max_model_len
    if config.startup.allow_max_model_len_reduction and estimate:
        return Retry(used.with_(max_model_len=estimate), 0.0, f"restarting with max_model_len {estimate} (vLLM's estimate)")
    return GiveUp(advice.kv_cache_too_small(failure.max_model_len, failure.needed_gib, failure.available_gib, estimate), EXIT_CONFIG)


def _extensible_kv_too_small(outcome: Failed, config: Config) -> bool:
    """vLLM 0.34's extensible KV cache came out too small, and the operator did not ask for it by name.

    It is sized from what is free once the model ran, and on GB10 the page
    cache the load just filled counts as used there; the budget sizing of
    0.33 and before is not, and vLLM checks it at the start, where gb10d
    knows how to fit it.
    """
    failure = outcome.failure
    chosen = config.vllm.arg("enable-extensible-kv-cache") is not None or any(
        word.split("=", 1)[0].replace("_", "-") in ("--enable-extensible-kv-cache", NO_EXTENSIBLE_KV) for word in config.vllm.extra_args
    )
    return isinstance(failure, (KvCacheInsufficient, NoKvCacheMemory)) and failure.extensible and not chosen


def _ptxas(used: Tunables, config: Config, host: HostFacts | None) -> Retry | GiveUp:
    """Triton's bundled ptxas is older than sm_121a: point it at the CUDA toolkit's, once, if there is one."""
    given = dict(used.env).get(TRITON_PTXAS_PATH) or config.vllm.env.get(TRITON_PTXAS_PATH)
    if config.vllm.image is not None and not given:
        # The host's CUDA toolkit is not in the container: its ptxas path would mean nothing there.
        return GiveUp(advice.ptxas_in_image(config.vllm.image), EXIT_CONFIG)
    if given:
        return GiveUp(
            f"Triton still fails to compile for sm_121a with TRITON_PTXAS_PATH={given}; point it at the ptxas of a CUDA "
            "12.9 or later toolkit (vllm.env.TRITON_PTXAS_PATH), or install the CUDA 13 toolkit; not retrying",
            EXIT_CONFIG,
        )
    if host is None or host.ptxas is None:
        return GiveUp(
            "no CUDA toolkit ptxas that knows sm_121a was found (looked at $CUDA_HOME/bin/ptxas, /usr/local/cuda/bin/ptxas "
            "and vLLM's PATH); install the CUDA 13 toolkit (sudo apt install cuda-toolkit-13-0 puts it in /usr/local/cuda) "
            "or set vllm.env.TRITON_PTXAS_PATH to the ptxas of a CUDA 12.9 or later toolkit; not retrying",
            EXIT_CONFIG,
        )
    return Retry(
        used.with_env(TRITON_PTXAS_PATH, host.ptxas), 0.0, f"restarting with {TRITON_PTXAS_PATH}={host.ptxas}, the CUDA toolkit's ptxas"
    )


def _driver_oom(used: Tunables, config: Config) -> Retry | GiveUp:
    """The driver ran out of memory: never the same settings again; lower, with the reported workaround, once."""
    name, value = ALLOC_CONF
    if dict(used.env).get(name) == value or config.vllm.env.get(name) == value:
        return GiveUp(
            f"the NVIDIA driver ran out of memory again with gpu_memory_utilization {used.gpu_memory_utilization:g} and "
            f"{name}={value}; not retrying: lower vllm.gpu_memory_utilization, look at what else uses memory "
            "(journalctl -k shows the driver's messages), and reboot if the machine misbehaves",
            EXIT_MEMORY_NOT_RETURNED,
        )
    lowered = _lower_utilization(
        used.gpu_memory_utilization, used.gpu_memory_utilization - OOM_MARGIN, config, "the NVIDIA driver ran out of memory"
    )
    if isinstance(lowered, GiveUp):
        return GiveUp(lowered.message, EXIT_MEMORY_NOT_RETURNED)
    new = lowered.tunables.gpu_memory_utilization
    return Retry(
        used.with_(gpu_memory_utilization=new).with_env(name, value).without_flag(AUTOTUNE_FLAG),
        0.0,
        f"restarting with gpu_memory_utilization {new:g}, {name}={value} and without --{AUTOTUNE_FLAG}",
    )


def describe(outcome: Failed) -> str:
    """A few words for the cause, used in give-up messages and STATUS=."""
    failure = outcome.failure
    where = f" on the machine {failure.node}" if failure is not None and failure.node else ""
    issue = issue_for(failure) if failure is not None else None
    if issue is not None and outcome.cause.value == issue.name:
        return issue.meaning
    if outcome.cause.meaning:
        return outcome.cause.meaning
    if isinstance(failure, FreeMemoryShort):
        return (
            f"free memory {failure.free_gib:g} of {failure.total_gib:g} GiB{where} is below gpu_memory_utilization "
            f"{failure.requested_utilization:g} ({failure.requested_gib:g} GiB)"
        )
    if isinstance(failure, CudaOutOfMemory) and failure.tried_gib is not None:
        return f"CUDA out of memory{where} allocating {failure.tried_gib:g} GiB"
    if outcome.detail:
        return f"{outcome.cause.value}: {outcome.detail}"
    return outcome.cause.value.replace("_", " ")


def _config_advice(outcome: Failed, config: Config) -> str:
    """The operator's fix for a failure no retry can mend."""
    failure = outcome.failure
    v = config.vllm
    issue = issue_for(failure) if failure is not None else None
    if issue is not None and failure is not None:
        return f"{issue.meaning}; {advice.platform(failure)}"
    if isinstance(failure, ProgramNotRun):
        return advice.image_without_vllm(v.image or str(v.program), failure.program, failure.reason, config.container.engine)
    if outcome.cause is Cause.PORT_IN_USE:
        return advice.port_in_use(v.port)
    if outcome.cause is Cause.MODEL_GATED:
        return advice.model_gated(v.model)
    if outcome.cause is Cause.MODEL_NOT_FOUND:
        return advice.model_not_found(v.model, isinstance(failure, ModelNotFound) and failure.unreachable)
    if outcome.cause is Cause.SERVED_NAME:
        return advice.served_name(outcome.detail)
    if isinstance(failure, BadArgument):
        return advice.bad_argument(failure.message, failure.flag, failure.value)
    return advice.bad_argument(outcome.detail)


def event_kind(cause: FailureKind) -> str:
    """The journal event that tells of a failure with this cause."""
    return cause.journal.kind


def after_failure(
    outcome: Failed, used: Tunables, history: History, config: Config, host: HostFacts | None = None, neighbours: Neighbours = ALONE
) -> tuple[History, Retry | GiveUp]:
    """The count after `outcome` and what to do next: a failure after a long enough serve begins a new
    count, and a retry that waits counts one more back-off (so the next wait doubles)."""
    if starts_new_count(outcome, config):
        history = History(1, 0)
    decision = next_attempt(outcome, used, history, config, host, neighbours)
    if isinstance(decision, Retry):
        # The failure is why the next settings are what they are: kept if that start serves with them corrected.
        decision = replace(decision, tunables=decision.tunables.with_(why=describe(outcome)))
        if decision.delay_s > 0:
            history = History(history.attempts, history.backoffs + 1)
    return history, decision


def uncounted(history: History) -> History:
    """The count after an attempt that was not vLLM's failure (a machine of the pair left)."""
    return History(history.attempts - 1, history.backoffs)


def failure_line(outcome: Failed, decision: Retry | GiveUp, history: History, config: Config) -> str:
    """The journal's and STATUS='s one line for a failure: the cause, the numbers and the action."""
    cause = describe(outcome)
    if isinstance(decision, Retry):
        wait = f" in {decision.delay_s:g} s" if decision.delay_s else ""
        return f"{cause}; {decision.message}{wait} (attempt {history.attempts + 1}/{config.restart.max_attempts})"
    return decision.message if outcome.cause.gives_up else f"{cause}: {decision.message}"
