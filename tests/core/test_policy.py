"""The decision core: classifying a failed attempt and choosing the next one."""

from __future__ import annotations

from functools import partial

import pytest

from config_support import make_config
from gb10d.base.command import Tunables
from gb10d.base.errors import EXIT_CONFIG, EXIT_GAVE_UP
from gb10d.base.units import GIB
from gb10d.core.memory import Neighbours
from gb10d.core.outcome import Cause, Failed
from gb10d.core.policy import (
    GiveUp,
    History,
    Retry,
    after_failure,
    backoff_delay,
    classify,
    describe,
    event_kind,
    failure_line,
    next_attempt,
    starts_new_count,
    uncounted,
)
from gb10d.vllm.events import (
    BadArgument,
    CudaOutOfMemory,
    EngineDied,
    EngineStartFailed,
    ExceptionRaised,
    FreeMemoryShort,
    KvCacheInsufficient,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    RayWorkerLost,
)

config = partial(make_config, {"vllm": {"gpu_memory_utilization": 0.92}})


FREE = FreeMemoryShort(free_gib=103.45, total_gib=123.73, requested_utilization=0.92, requested_gib=113.83)


@pytest.mark.parametrize(
    ("failures", "status", "was_ready", "cause"),
    [
        ([FREE, EngineStartFailed(), ExceptionRaised("RuntimeError", "Engine core initialization failed.")], 1, False, Cause.FREE_MEMORY),
        ([CudaOutOfMemory(1.71), EngineStartFailed()], 1, False, Cause.CUDA_OOM),
        ([KvCacheInsufficient(131072, 16.0, 8.0, 65536)], 1, False, Cause.KV_CACHE),
        ([NoKvCacheMemory()], 1, False, Cause.NO_KV_MEMORY),
        ([PortInUse(8000)], 1, False, Cause.PORT_IN_USE),
        ([ModelNotFound("Qwen/Nope")], 1, False, Cause.MODEL_NOT_FOUND),
        ([BadArgument("invalid tool call parser: nope")], 1, False, Cause.BAD_ARGUMENT),
        ([], 0, True, Cause.ENGINE_DEAD),
        ([EngineDied("EngineDeadError"), RayWorkerLost("ray.exceptions.ActorDiedError: The actor died")], 1, True, Cause.WORKER_LOST),
        ([ExceptionRaised("ZeroDivisionError", "division by zero")], 1, False, Cause.CRASH),
        ([], -9, False, Cause.CRASH),
    ],
)
def test_classify_names_the_most_specific_cause(failures: list, status: int, was_ready: bool, cause: Cause) -> None:
    assert classify(failures, status, was_ready).cause is cause


def test_free_memory_retry_computes_the_fitting_utilization_from_the_error() -> None:
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=FREE), Tunables(0.92), History(1), config())
    assert isinstance(decision, Retry)
    assert decision.tunables.gpu_memory_utilization == 0.82  # floor((103.45 - 1.0) / 123.73, 2)
    assert decision.delay_s == 0


def test_free_memory_retry_never_repeats_the_same_value() -> None:
    # The error's numbers would allow the value just tried: lower it anyway.
    generous = FreeMemoryShort(free_gib=120.0, total_gib=121.69, requested_utilization=0.8, requested_gib=97.35)
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=generous), Tunables(0.8), History(1), config())
    assert isinstance(decision, Retry)
    assert decision.tunables.gpu_memory_utilization == 0.79


def test_free_memory_below_the_minimum_gives_up_with_advice() -> None:
    short = FreeMemoryShort(free_gib=20.0, total_gib=121.69, requested_utilization=0.9, requested_gib=109.52)
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=short), Tunables(0.9), History(1), config())
    assert isinstance(decision, GiveUp)
    assert decision.exit_status == EXIT_GAVE_UP
    assert "memory.min_gpu_memory_utilization 0.3" in decision.message
    assert "Free memory on this machine" in decision.message


def test_free_memory_retry_leaves_what_other_instances_starts_reserved_alone() -> None:
    # vLLM saw 103.45 GiB free, but another instance's start reserved 49.68 GiB of it that it has not taken yet.
    around = Neighbours(int(49.68 * GIB), "gb10d@a", "gb10d@a (49.68 GiB, starting: loading_weights)")
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=FREE), Tunables(0.92), History(1), config(), neighbours=around)
    assert isinstance(decision, Retry)
    assert decision.tunables.gpu_memory_utilization == 0.42  # floor((103.45 - 49.68 - 1.0) / 123.73, 2)
    assert decision.message == "restarting with 0.42, leaving 49.68 GiB reserved by the starts of gb10d@a alone"


def test_free_memory_that_only_fits_in_another_instances_reservation_gives_up_naming_it() -> None:
    around = Neighbours(int(90 * GIB), "gb10d@a", "gb10d@a (90.00 GiB, starting: compiling)")
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=FREE), Tunables(0.92), History(1), config(), neighbours=around)
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_GAVE_UP
    assert decision.message.startswith(
        "free memory 103.45 of 123.73 GiB is below gpu_memory_utilization 0.92 (113.83 GiB) less 90.00 GiB reserved by the "
        "starts of gb10d@a; other gb10d instances here: gb10d@a (90.00 GiB, starting: compiling); the next gpu_memory_utilization would be 0.1"
    )


def test_free_memory_short_on_the_other_machine_of_a_pair_gives_up_naming_it() -> None:
    short = FreeMemoryShort(free_gib=20.0, total_gib=121.69, requested_utilization=0.9, requested_gib=109.52, node="10.0.0.2")
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=short), Tunables(0.9), History(1), config())
    assert isinstance(decision, GiveUp)
    assert decision.message.startswith("free memory 20 of 121.69 GiB on the machine 10.0.0.2 is below gpu_memory_utilization 0.9")
    assert "Free memory on the machine 10.0.0.2 (stop what uses it" in decision.message


def test_stall_moves_down_the_load_strategy_ladder() -> None:
    cfg = config(startup={"load_strategy_ladder": ["eager", "prefetch"]})
    first = next_attempt(Failed(cause=Cause.STALL), Tunables(0.8), History(1), cfg)
    assert isinstance(first, Retry) and first.tunables.load_strategy == "eager"
    second = next_attempt(Failed(cause=Cause.STALL), first.tunables, History(2), cfg)
    assert isinstance(second, Retry) and second.tunables.load_strategy == "prefetch"
    third = next_attempt(Failed(cause=Cause.STALL), second.tunables, History(3), cfg)
    assert isinstance(third, Retry) and third.tunables.load_strategy == "prefetch" and third.delay_s > 0


@pytest.mark.parametrize("cause", [Cause.PORT_IN_USE, Cause.MODEL_NOT_FOUND, Cause.MODEL_GATED, Cause.BAD_ARGUMENT])
def test_config_causes_give_up_at_once_with_exit_78(cause: Cause) -> None:
    decision = next_attempt(Failed(cause=cause, failure=BadArgument("x") if cause is Cause.BAD_ARGUMENT else None), Tunables(0.8), History(1), config())
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_CONFIG


def test_port_in_use_advice_names_the_port_and_the_key() -> None:
    decision = next_attempt(Failed(cause=Cause.PORT_IN_USE, failure=PortInUse(8000)), Tunables(0.8), History(1), config())
    assert isinstance(decision, GiveUp)
    assert "port 8000 is already in use" in decision.message and "vllm.port" in decision.message


def test_kv_cache_too_small_uses_vllms_estimate_only_when_allowed() -> None:
    kv = KvCacheInsufficient(max_model_len=131072, needed_gib=16.0, available_gib=5.0, estimated_max_model_len=40960)
    refused = next_attempt(Failed(cause=Cause.KV_CACHE, failure=kv), Tunables(0.8, None, 131072), History(1), config())
    assert isinstance(refused, GiveUp) and "vllm.args.max_model_len = 40960" in refused.message
    allowed = next_attempt(
        Failed(cause=Cause.KV_CACHE, failure=kv), Tunables(0.8, None, 131072), History(1), config(startup={"allow_max_model_len_reduction": True})
    )
    assert isinstance(allowed, Retry) and allowed.tunables.max_model_len == 40960


@pytest.mark.parametrize("failure", [NoKvCacheMemory(extensible=True), KvCacheInsufficient(131072, 16.0, 5.0, 40960, extensible=True)])
def test_a_too_small_extensible_kv_cache_is_retried_with_the_budget_sizing(failure: NoKvCacheMemory | KvCacheInsufficient) -> None:
    cause = Cause.NO_KV_MEMORY if isinstance(failure, NoKvCacheMemory) else Cause.KV_CACHE
    decision = next_attempt(Failed(cause=cause, failure=failure), Tunables(0.8), History(1), config(startup={"allow_max_model_len_reduction": True}))
    assert isinstance(decision, Retry)
    assert decision.tunables == Tunables(0.8, flags=("--no-enable-extensible-kv-cache",))
    assert "restarting with --no-enable-extensible-kv-cache" in decision.message and "page cache" in decision.message


@pytest.mark.parametrize("chosen", [{"args": {"enable_extensible_kv_cache": True}}, {"extra_args": ["--enable-extensible-kv-cache"]}])
def test_an_extensible_kv_cache_the_operator_asked_for_is_kept(chosen: dict[str, object]) -> None:
    cfg = config(vllm={"executable": "/usr/bin/vllm", "model": "m", "gpu_memory_utilization": 0.8, **chosen})
    decision = next_attempt(Failed(cause=Cause.NO_KV_MEMORY, failure=NoKvCacheMemory(extensible=True)), Tunables(0.8), History(1), cfg)
    assert isinstance(decision, GiveUp) and "no memory is left for the KV cache" in decision.message


def test_cuda_oom_lowers_utilization_by_five_points() -> None:
    decision = next_attempt(Failed(cause=Cause.CUDA_OOM, failure=CudaOutOfMemory(1.71)), Tunables(0.8), History(1), config())
    assert isinstance(decision, Retry) and decision.tunables.gpu_memory_utilization == 0.75


def test_unknown_crashes_back_off_exponentially_up_to_the_cap() -> None:
    cfg = config(restart={"backoff_initial_s": 5, "backoff_max_s": 30, "max_attempts": 10})
    delays = [next_attempt(Failed(cause=Cause.CRASH), Tunables(0.8), History(n, n - 1), cfg) for n in range(1, 6)]
    assert [d.delay_s for d in delays if isinstance(d, Retry)] == [5, 10, 20, 30, 30]
    assert backoff_delay(cfg, 0) == 5


def test_budget_is_exhausted_after_max_attempts() -> None:
    decision = next_attempt(Failed(cause=Cause.CRASH, detail="exit 1"), Tunables(0.8), History(5, 4), config())
    assert isinstance(decision, GiveUp)
    assert decision.exit_status == EXIT_GAVE_UP
    assert "giving up after 5 failed starts" in decision.message


def test_a_failure_on_the_other_machine_of_a_pair_names_that_machine() -> None:
    remote = FreeMemoryShort(40.0, 121.69, 0.8, 97.35, "cuda:0", node="10.213.0.2")
    assert describe(Failed(cause=Cause.FREE_MEMORY, failure=remote)) == (
        "free memory 40 of 121.69 GiB on the machine 10.213.0.2 is below gpu_memory_utilization 0.8 (97.35 GiB)"
    )
    assert describe(Failed(cause=Cause.CUDA_OOM, failure=CudaOutOfMemory(1.71, node="10.213.0.2"))) == "CUDA out of memory on the machine 10.213.0.2 allocating 1.71 GiB"


def test_a_lost_ray_worker_that_served_restarts_with_the_same_settings_and_counts() -> None:
    outcome = Failed(cause=Cause.WORKER_LOST, failure=RayWorkerLost("ray.exceptions.ActorDiedError: The actor died"), was_ready=True, detail="ActorDiedError", served_s=900)
    decision = next_attempt(outcome, Tunables(0.92, None, None), History(1, 0), config())
    assert isinstance(decision, Retry) and decision.delay_s == 0 and decision.message == "restarting with the same settings"
    assert isinstance(next_attempt(outcome, Tunables(0.92, None, None), History(3, 0), config(restart={"max_attempts": 3})), GiveUp)


def test_a_failure_after_serving_reset_after_s_or_longer_starts_a_new_count() -> None:
    cfg = config(restart={"reset_after_s": 600})
    assert starts_new_count(Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=600), cfg)
    assert not starts_new_count(Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=599), cfg)
    assert not starts_new_count(Failed(cause=Cause.CRASH), cfg)


def test_a_failure_after_serving_a_good_while_restarts_at_once() -> None:
    outcome = Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=3600)
    decision = next_attempt(outcome, Tunables(0.8), History(1, 0), config())
    assert isinstance(decision, Retry) and decision.delay_s == 0 and decision.message == "restarting with the same settings"


def test_a_failure_soon_after_ready_backs_off_and_says_why_it_counts() -> None:
    cfg = config(restart={"backoff_initial_s": 5, "reset_after_s": 600})
    decision = next_attempt(Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=42.4), Tunables(0.8), History(2, 1), cfg)
    assert isinstance(decision, Retry) and decision.delay_s == 10
    assert decision.message == (
        "it served only 42 s (less than restart.reset_after_s 600), so this counts as a failed start; "
        "restarting with the same settings"
    )


def test_an_engine_that_dies_soon_after_every_ready_is_given_up_on() -> None:
    outcome = Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=30)
    decision = next_attempt(outcome, Tunables(0.8), History(5, 3), config())
    assert isinstance(decision, GiveUp) and decision.exit_status == EXIT_GAVE_UP
    assert "giving up after 5 failed starts" in decision.message


def test_a_hang_never_starts_a_new_count_however_long_it_served() -> None:
    hang = Failed(cause=Cause.ENGINE_HUNG, was_ready=True, served_s=86400)
    assert not starts_new_count(hang, config())
    decision = next_attempt(hang, Tunables(0.8), History(2, 0), config())
    assert isinstance(decision, Retry) and decision.delay_s == 0


def test_reset_after_s_zero_makes_every_ready_start_a_new_count() -> None:
    assert starts_new_count(Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=0.0), config(restart={"reset_after_s": 0}))


# --- the count of attempts, and how the journal tells of a failure -----------------


def test_a_failed_start_keeps_counting_and_a_delayed_retry_counts_a_back_off() -> None:
    history, decision = after_failure(Failed(cause=Cause.CRASH), Tunables(0.8), History(2, 1), config())
    assert isinstance(decision, Retry) and decision.delay_s == 10
    assert history == History(2, 2)


def test_a_failure_after_a_long_serve_begins_a_new_count() -> None:
    history, decision = after_failure(Failed(cause=Cause.ENGINE_DEAD, was_ready=True, served_s=3600), Tunables(0.8), History(4, 3), config())
    assert history == History(1, 0)
    assert isinstance(decision, Retry) and decision.delay_s == 0


def test_a_corrected_retry_does_not_back_off() -> None:
    history, decision = after_failure(Failed(cause=Cause.FREE_MEMORY, failure=FREE), Tunables(0.92), History(1, 0), config())
    assert isinstance(decision, Retry) and decision.delay_s == 0
    assert history == History(1, 0)


def test_a_retry_carries_the_failure_as_the_reason_for_its_settings() -> None:
    outcome = Failed(cause=Cause.FREE_MEMORY, failure=FREE)
    _, decision = after_failure(outcome, Tunables(0.92), History(1, 0), config())
    assert isinstance(decision, Retry)
    assert decision.tunables.why == describe(outcome) and decision.tunables.why.startswith("free memory ")


def test_a_lost_machine_gives_back_its_attempt() -> None:
    assert uncounted(History(3, 1)) == History(2, 1)


@pytest.mark.parametrize(
    ("cause", "kind"),
    [
        (Cause.FREE_MEMORY, "free_memory_retry"),
        (Cause.STALL, "load_strategy_changed"),
        (Cause.CUDA_OOM, "cuda_oom"),
        (Cause.KV_CACHE, "kv_cache_insufficient"),
        (Cause.NO_KV_MEMORY, "kv_cache_insufficient"),
        (Cause.ENGINE_DEAD, "engine_dead"),
        (Cause.WORKER_LOST, "engine_dead"),
        (Cause.ENGINE_HUNG, "engine_hung"),
        (Cause.PORT_IN_USE, "config_error"),
        (Cause.SERVED_NAME, "config_error"),
        (Cause.CRASH, "crashed"),
        (Cause.START_TIMEOUT, "crashed"),
    ],
)
def test_each_cause_has_its_journal_event(cause: Cause, kind: str) -> None:
    assert event_kind(cause) == kind


def test_a_retry_line_names_the_cause_the_action_and_the_next_attempt() -> None:
    outcome = Failed(cause=Cause.FREE_MEMORY, failure=FREE)
    history, decision = after_failure(outcome, Tunables(0.92), History(1, 0), config())
    assert failure_line(outcome, decision, history, config()) == (
        "free memory 103.45 of 123.73 GiB is below gpu_memory_utilization 0.92 (113.83 GiB); restarting with 0.82 (attempt 2/5)"
    )


def test_a_waiting_retry_says_how_long() -> None:
    outcome = Failed(cause=Cause.CRASH, detail="vLLM exited with status 1")
    history, decision = after_failure(outcome, Tunables(0.8), History(1, 0), config())
    assert failure_line(outcome, decision, history, config()) == "crash: vLLM exited with status 1; restarting with the same settings in 5 s (attempt 2/5)"


def test_a_give_up_line_names_the_cause_and_a_config_cause_only_the_fix() -> None:
    crash = Failed(cause=Cause.CRASH, detail="vLLM exited with status 1")
    history, decision = after_failure(crash, Tunables(0.8), History(5, 4), config())
    assert failure_line(crash, decision, history, config()).startswith("crash: vLLM exited with status 1: giving up after 5 failed starts")
    port = Failed(cause=Cause.PORT_IN_USE, failure=PortInUse(8000))
    history, decision = after_failure(port, Tunables(0.8), History(1, 0), config())
    assert isinstance(decision, GiveUp)
    assert failure_line(port, decision, history, config()) == decision.message
