"""The verdict for a failure that ended a start: its facts, its summary, and advice taken from gb10d's own decision.

One builder per failure class (`_BUILDERS`), the GB10 platform's failures
from the known-issues table, and a crash for the rest. Where gb10d's
supervisor handles the cause, the advice is what its `policy.next_attempt`
would do on a first attempt (`_what_gb10d_does`), so `gb10d diagnose` never
advises what gb10d would not do. Apart from the starts (which failure ended
one) and the reading of the paste: this is only what a failure means.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ...base.command import Tunables
from ...base.config import Config
from ...base.errors import EXIT_CONFIG
from ...vllm import failures
from ...vllm.events import (
    BadArgument,
    CudaOutOfMemory,
    DriverOutOfMemory,
    EngineDied,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    GpuXid,
    InternalPortInUse,
    IpcRemoved,
    KvCacheInsufficient,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    PtxasArchUnsupported,
)
from ...vllm.failures import FailureKind
from ...vllm.kernel import describe as kernel_describe
from ...vllm.kernel import xid_meaning
from ...vllm.known import by_name, issue_for
from .. import advice
from ..outcome import Cause, Failed
from ..policy import GiveUp, History, Retry, next_attempt
from .diagnosis import Diagnosis, as_logged, sentence
from .starts import STOP_EXCEPTIONS, Attempt

DEFAULT_PORT = 8000  # vLLM's, when the log does not say
# A model's parameter count and quantization as its name gives them (`Qwen3.6-27B-FP8`, `Llama-3.1-8B-Instruct-AWQ`).
_NAME_PARAMS = re.compile(r"(?:^|[-_])(\d+(?:\.\d+)?)[Bb](?=$|[-_.])")
_NAME_BYTES = ((re.compile(r"(?i)fp4|mxfp4|awq|gptq|int4|w4a"), 0.5), (re.compile(r"(?i)fp8|int8|w8a"), 1.0))
# Free memory below this share of the total means something holds it, not the desktop and the OS.
_MUCH_HELD = 0.25
_LOWER_BY_MARGIN = "Lower vllm.gpu_memory_utilization by 0.05."


@dataclass(frozen=True)
class _Scene:
    """What a verdict builder reads besides its failure: the start, the facts found so far, the weights' size if logged."""

    attempt: Attempt
    facts: dict[str, Any]
    weights_gib: float | None


def failure_verdict(event: Failure, attempt: Attempt, facts: dict[str, Any], weights_gib: float | None = None) -> Diagnosis:
    """The verdict for the failure that ended `attempt`: a GB10 platform failure's, else its kind's own advice,
    else its class's builder, else a crash."""
    issue = issue_for(event)
    if issue is not None:
        return _platform_verdict(issue.name, event, facts)
    kind = failures.for_event(event)
    if kind is not None and kind.verdict is not None and kind.advice:
        # A kind that brings its own advice needs no builder: its verdict, its meaning and its fix as declared.
        return Diagnosis(kind.verdict.name, facts, sentence(kind.advice), sentence(kind.meaning) if kind.meaning else "")
    build = next((builder for kind, builder in _BUILDERS if isinstance(event, kind)), _crash)
    return build(event, _Scene(attempt, facts, weights_gib))


def killed_verdict(attempt: Attempt, facts: dict[str, Any]) -> Diagnosis:
    """vLLM killed from outside (SIGKILL), on GB10 almost always for want of host memory."""
    util = attempt.utilization()
    lower = _LOWER_BY_MARGIN
    if util is not None:
        # gb10d answers running out of memory by lowering the utilization 0.05, never below its minimum.
        lower = _lowered(_what_gb10d_does(Cause.CUDA_OOM, CudaOutOfMemory(None), util, None, None), lower)
    return Diagnosis(
        failures.VERDICT_CRASH.name, facts,
        "vLLM was killed from outside, most likely by the kernel's OOM killer (on GB10 the GPU's memory is the "
        f"system's). {lower} A lower vllm.args.max_model_len and stopping other large processes help too.",
        "vLLM was killed (SIGKILL), most likely out of host memory.",
    )


def _kv_cache(event: KvCacheInsufficient, scene: _Scene) -> Diagnosis:
    facts, attempt = scene.facts, scene.attempt
    facts["max_model_len"] = event.max_model_len
    if event.needed_gib is not None and event.available_gib is not None:
        facts.update(needed_gib=event.needed_gib, available_gib=event.available_gib)
    if event.estimated_max_model_len is not None:
        facts["estimated_max_model_len"] = event.estimated_max_model_len
    decision = _what_gb10d_does(Cause.KV_CACHE, event, attempt.utilization(), attempt.model, attempt.port)
    return Diagnosis(
        failures.VERDICT_KV_CACHE.name, facts, sentence(decision.message),
        f"The KV cache cannot hold one request of max_model_len {event.max_model_len}"
        + (f": it needs {as_logged(event.needed_gib)} GiB, {as_logged(event.available_gib)} GiB are available."
           if event.needed_gib is not None and event.available_gib is not None else "."),
    )


def _no_kv_memory(event: NoKvCacheMemory, scene: _Scene) -> Diagnosis:
    attempt = scene.attempt
    decision = _what_gb10d_does(Cause.NO_KV_MEMORY, event, attempt.utilization(), attempt.model, attempt.port)
    return Diagnosis(
        failures.VERDICT_KV_CACHE.name, scene.facts, sentence(decision.message),
        "No memory was left for the KV cache blocks after loading the weights.",
    )


def _cuda_oom(event: CudaOutOfMemory, scene: _Scene) -> Diagnosis:
    facts, attempt = scene.facts, scene.attempt
    if event.tried_gib is not None:
        facts["tried_to_allocate"] = event.tried_gib
    lower = _LOWER_BY_MARGIN
    current_util = attempt.utilization()
    if current_util is not None:
        lower = _lowered(_what_gb10d_does(Cause.CUDA_OOM, event, current_util, attempt.model, attempt.port), lower)
    where = " while loading the weights" if event.during_load else ""
    tried = f" allocating {as_logged(event.tried_gib)} GiB" if event.tried_gib is not None else ""
    return Diagnosis(
        failures.VERDICT_CUDA_OOM.name, facts,
        f"{lower} A lower vllm.args.max_model_len helps too; on GB10 also check what else uses the shared memory.",
        f"CUDA ran out of memory{where}{tried}.",
    )


def _internal_port(event: InternalPortInUse, scene: _Scene) -> Diagnosis:
    facts = scene.facts
    facts.update(socket="internal")
    if event.port is not None:
        facts["port"] = event.port
    if event.address:
        facts["address"] = event.address
    return Diagnosis(
        failures.VERDICT_PORT_IN_USE.name, facts, sentence(advice.internal_port_in_use(event.port, event.address)),
        f"vLLM could not bind an internal socket ({event.address or event.port or 'address not shown'}); "
        "this is not the API port.",
    )


def _port(event: PortInUse, scene: _Scene) -> Diagnosis:
    port = event.port or scene.attempt.port or DEFAULT_PORT
    scene.facts["port"] = port
    decision = _what_gb10d_does(Cause.PORT_IN_USE, event, None, scene.attempt.model, port)
    return Diagnosis(failures.VERDICT_PORT_IN_USE.name, scene.facts, sentence(decision.message),
                     f"vLLM could not bind port {port}: another process has it.")


def _model_named(event: ModelNotFound | ModelGated, scene: _Scene) -> str | None:
    """The model the failure names, else the one the start's arguments name; a fact when known."""
    model = event.model or scene.attempt.model
    if model:
        scene.facts["model"] = model
    return model


def _model_gated(event: ModelGated, scene: _Scene) -> Diagnosis:
    model = _model_named(event, scene)
    decision = _what_gb10d_does(Cause.MODEL_GATED, event, None, model, scene.attempt.port)
    return Diagnosis(
        failures.VERDICT_MODEL_NOT_FOUND.name, scene.facts, sentence(decision.message),
        f"Hugging Face refused access to the gated repository {model or ''}".rstrip() + ".",
    )


def _model_not_found(event: ModelNotFound, scene: _Scene) -> Diagnosis:
    model = _model_named(event, scene)
    if event.unreachable:
        scene.facts["hub_unreachable"] = True
    decision = _what_gb10d_does(Cause.MODEL_NOT_FOUND, event, None, model, scene.attempt.port)
    return Diagnosis(failures.VERDICT_MODEL_NOT_FOUND.name, scene.facts, sentence(decision.message), f"vLLM cannot find the model {model!r}.")


def _bad_argument(event: BadArgument, scene: _Scene) -> Diagnosis:
    facts = scene.facts
    if event.flag:
        facts["flag"] = event.flag
    if event.value is not None:
        facts["value"] = event.value
    decision = _what_gb10d_does(Cause.BAD_ARGUMENT, event, None, scene.attempt.model, scene.attempt.port)
    return Diagnosis(failures.VERDICT_BAD_ARGUMENT.name, facts, sentence(decision.message), f"vLLM exited at once: {event.message}.")


def _engine_died(event: EngineDied, scene: _Scene) -> Diagnosis:
    return Diagnosis(
        failures.VERDICT_ENGINE_DEAD.name, scene.facts,
        "The engine process died; the lines before its death name the cause. gb10d restarts it; if it keeps "
        "dying under load, lower vllm.gpu_memory_utilization or vllm.args.max_model_len.",
        "vLLM's engine core died" + (" after startup." if scene.attempt.substantive else "."),
    )


def _crash(event: Failure, scene: _Scene) -> Diagnosis:
    """Any other failure: the exception that names it, this one or the start's last that was not a stop."""
    exc = event if isinstance(event, ExceptionRaised) else next(
        (e for _, e in reversed(scene.attempt.events) if isinstance(e, ExceptionRaised) and e.exc_type.split(".")[-1] not in STOP_EXCEPTIONS),
        None)
    cause = f"{exc.exc_type}: {exc.message}" if exc else "the engine core failed to start"
    return Diagnosis(
        failures.VERDICT_CRASH.name, scene.facts,
        "The error says what broke; if it names a flag or a value, change that in vllm.args of gb10d.toml "
        "(gb10d print-command shows the full command), then restart gb10d.",
        f"vLLM crashed: {cause}.",
    )


def _free_memory(event: FreeMemoryShort, scene: _Scene) -> Diagnosis:
    """Too little free memory: what holds it first when much is held, then the value that fits and whether it holds the model."""
    facts, model = scene.facts, scene.attempt.model
    facts.update(free_gib=event.free_gib, total_gib=event.total_gib, requested_utilization=event.requested_utilization,
                 requested_gib=event.requested_gib)
    decision = _what_gb10d_does(Cause.FREE_MEMORY, event, event.requested_utilization, model, scene.attempt.port)
    held = event.total_gib - event.free_gib
    parts = [advice.what_holds_memory(held, event.total_gib)] if held > _MUCH_HELD * event.total_gib else []
    parts.append(_lowered(decision, ""))
    if isinstance(decision, Retry):
        fits = decision.tunables.gpu_memory_utilization
        facts["suggested_utilization"] = fits
        weights_gib, weights_from = scene.weights_gib, "as vLLM loaded them before"
        if weights_gib is None and model:
            weights_gib, weights_from = _weights_from_name(model), f"estimated from the name {model}"
        if weights_gib is not None:
            facts["weights_gib"] = round(weights_gib, 2)
            warning = advice.share_too_small(fits, fits * event.total_gib, weights_gib, weights_from, scene.attempt.max_model_len)
            parts += [warning] if warning else []
    return Diagnosis(
        failures.VERDICT_FREE_MEMORY.name, facts, " ".join(sentence(p) for p in parts if p),
        f"vLLM refused to start: free memory {as_logged(event.free_gib)} of {as_logged(event.total_gib)} GiB is below "
        f"gpu_memory_utilization {event.requested_utilization:g} ({as_logged(event.requested_gib)} GiB).",
    )


# The verdict builder of each failure class gb10d tells apart, tried in order; any other failure is a crash.
_BUILDERS: tuple[tuple[type[Failure], Callable[[Any, _Scene], Diagnosis]], ...] = (
    (FreeMemoryShort, _free_memory),
    (KvCacheInsufficient, _kv_cache),
    (NoKvCacheMemory, _no_kv_memory),
    (CudaOutOfMemory, _cuda_oom),
    (InternalPortInUse, _internal_port),
    (PortInUse, _port),
    (ModelGated, _model_gated),
    (ModelNotFound, _model_not_found),
    (BadArgument, _bad_argument),
    (EngineDied, _engine_died),
)


def _weights_from_name(model: str) -> float | None:
    """The weights' GiB from the parameters and quantization a model's name states; None when it states no size."""
    name = model.rstrip("/").rsplit("/", 1)[-1]
    found = _NAME_PARAMS.search(name)
    if found is None:
        return None
    per_param = next((size for pattern, size in _NAME_BYTES if pattern.search(name)), 2.0)
    return float(found.group(1)) * 1e9 * per_param / 2**30


def _platform_verdict(name: str, event: Failure, facts: dict[str, Any]) -> Diagnosis:
    """A GB10 platform failure of the known-issues table: its meaning, its facts, its fix."""
    issue = by_name(name)
    if isinstance(event, PtxasArchUnsupported):
        facts["arch"] = event.arch
    if isinstance(event, GpuXid):
        meaning = xid_meaning(event.xid)
        facts.update(xid=event.xid, xid_name=meaning.name, reboot_needed=meaning.reboot)
        if event.pci:
            facts["pci"] = event.pci
    facts["retry_helps"] = issue.retry_helps and not (isinstance(event, GpuXid) and xid_meaning(event.xid).reboot)
    summary = kernel_describe(event) if isinstance(event, (GpuXid, DriverOutOfMemory)) else issue.meaning
    if isinstance(event, IpcRemoved) and not event.confirmed:
        summary = f"a vLLM process waited a minute or more for shared memory: a process hangs, or {summary}"
    return Diagnosis(name, facts, sentence(advice.platform(event)), sentence(summary))


def _lowered(decision: Retry | GiveUp, otherwise: str) -> str:
    """Advice from gb10d's decision on a memory failure: the value it restarts with, or why it gives up."""
    if isinstance(decision, Retry):
        return sentence(advice.utilization_that_fits(decision.tunables.gpu_memory_utilization))
    return sentence(decision.message) if decision.exit_status != EXIT_CONFIG else otherwise


def _what_gb10d_does(cause: FailureKind, failure: Failure | None, utilization: float | None, model: str | None,
                     port: int | None) -> Retry | GiveUp:
    """What gb10d's supervisor decides after this failure on a first attempt: its defaults, plus what the log says.

    The one place diagnose's numbers and words come from for the causes the
    supervisor handles, so the advice is never what gb10d would not do.
    """
    vllm: dict[str, object] = {"executable": "/usr/bin/vllm", "model": model or "MODEL"}
    if port:
        vllm["port"] = port
    if utilization is not None and 0 < utilization <= 1:
        vllm["gpu_memory_utilization"] = utilization
    config = Config.model_validate({"vllm": vllm})
    used = Tunables(config.vllm.gpu_memory_utilization)
    return next_attempt(Failed(cause=cause, failure=failure), used, History(1), config)
