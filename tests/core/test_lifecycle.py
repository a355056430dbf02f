"""One attempt's life as a pure step function: what each fact leads to, in milliseconds.

Every rule the supervisor follows during a start is here as a table of
facts in, actions out: what extends systemd's start timeout, when a start
has stalled or timed out, how readiness and liveness verdicts end an
attempt, and which of two racing reports (vLLM's exit, a failed probe)
names the cause.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import pytest

from config_support import make_config
from gb10d.base.command import Tunables
from gb10d.base.config import Config, OnDemandSection
from gb10d.base.image import PullProgress
from gb10d.base.levels import PRIORITY_ERR, PRIORITY_WARNING
from gb10d.core.facts import AttemptFact, Exited, ExitSeen, Parsed, Probed, ProbeKind, ProbeResult, Pulled, Tick
from gb10d.core.lifecycle import (
    EXIT_GRACE_S,
    IO_PROGRESS_MIN_BYTES,
    LISTEN_GRACE_S,
    Action,
    AttemptState,
    BecomeReady,
    Extend,
    Finish,
    LivenessFailed,
    Observe,
    ProcessExited,
    Say,
    ShowPhase,
    StartReadiness,
    WakeUnasked,
    begin,
    begin_pull,
    deadline,
    served_name_problem,
    start_time_asked,
    step,
    waits_for_listen,
)
from gb10d.core.outcome import Cause, Failed
from gb10d.vllm.events import (
    CompileProgressed,
    EngineDied,
    FreeMemoryShort,
    RayWorkerLost,
    ShardsProgressed,
    StartupCompleted,
    StatsLogged,
)

T0 = 1000.0
STALL_S = 300.0
READY_TIMEOUT_S = 3600.0


config = partial(make_config, {
    "vllm": {"gpu_memory_utilization": 0.8},
    "startup": {"stall_timeout_s": STALL_S, "ready_timeout_s": READY_TIMEOUT_S},
    "restart": {"max_attempts": 5},
})


CONFIG = config()



@pytest.mark.parametrize(("stall_s", "wait_s", "asked"), [(300.0, 0.0, 360.0), (300.0, 8.0, 368.0), (5.0, 0.0, 65.0), (5.0, 120.0, 185.0)])
def test_the_start_time_asked_covers_the_wait_and_a_whole_stall_timeout_with_a_margin(stall_s: float, wait_s: float, asked: float) -> None:
    assert start_time_asked(config(startup={"stall_timeout_s": stall_s}), wait_s) == asked


@dataclass
class Run:
    """An attempt driven fact by fact; `actions` holds what the last fact led to."""

    state: AttemptState
    actions: list[Action]

    def __call__(self, fact: AttemptFact, at: float) -> list[Action]:
        self.state, self.actions = step(self.state, fact, at, CONFIG)
        return self.actions


def started(number: int = 1) -> Run:
    return Run(*begin(number, Tunables(0.8), T0, CONFIG))


def ready_run() -> Run:
    run = started()
    run(Parsed(1, StartupCompleted()), T0 + 60)
    run(Probed(1, ProbeKind.READY, "/health 200, /v1/models lists tiny"), T0 + 61)
    assert run.state.ready
    return run


def finished(actions: list[Action]) -> Failed | None:
    return next((a.outcome for a in actions if isinstance(a, Finish)), None)


def says(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.kind, a.message) for a in actions if isinstance(a, Say)]


# --- the start ----------------------------------------------------------------


def test_a_new_attempt_extends_the_start_timeout_beyond_the_stall_timer_and_shows_spawning() -> None:
    state, actions = begin(2, Tunables(0.75), T0, CONFIG)
    assert actions == [Extend(STALL_S + 60), ShowPhase("starting vllm, attempt 2/5, gpu_memory_utilization=0.75")]
    assert state.spawned_at == T0 and not state.ready


def test_progress_extends_the_start_timeout_at_most_once_a_second() -> None:
    run = started()
    assert Extend(STALL_S + 60) in run(Parsed(1, ShardsProgressed(1, 6)), T0 + 5)
    assert not any(isinstance(a, Extend) for a in run(Parsed(1, ShardsProgressed(2, 6)), T0 + 5.5))
    assert Extend(STALL_S + 60) in run(Parsed(1, ShardsProgressed(3, 6)), T0 + 6.6)


def test_stats_lines_feed_the_metrics_and_are_not_progress() -> None:
    run = started()
    stats = StatsLogged(10.0, 20.0, 1, 0)
    assert run(Parsed(1, stats), T0 + 5) == [Observe(stats)]


def test_a_new_phase_or_shard_shows_in_status() -> None:
    run = started()
    assert ShowPhase("loading weights 1/6 (16%), attempt 1/5, gpu_memory_utilization=0.8") in run(Parsed(1, ShardsProgressed(1, 6)), T0 + 5)
    assert ShowPhase("compiling (torch.compile), attempt 1/5, gpu_memory_utilization=0.8") in run(Parsed(1, CompileProgressed()), T0 + 10)


def test_startup_complete_starts_the_readiness_checks_and_ready_is_announced_with_its_latency() -> None:
    run = started()
    assert StartReadiness() in run(Parsed(1, StartupCompleted()), T0 + 60)
    actions = run(Probed(1, ProbeKind.READY, "/health 200, /v1/models lists tiny"), T0 + 60.25)
    assert actions == [
        BecomeReady(
            "vLLM is ready after 60.2 s: /health 200, /v1/models lists tiny; READY=1 250 ms after 'Application startup complete.'",
            60.25,
        )
    ]
    assert run.state.ready and run.state.startup.phase.value == "ready"


def test_a_healthy_port_without_the_startup_line_starts_the_readiness_checks() -> None:
    assert started()(Probed(1, ProbeKind.HEALTHY), T0 + 30) == [StartReadiness()]


def test_the_warm_up_shows_as_its_own_phase() -> None:
    assert started()(Probed(1, ProbeKind.WARMING), T0 + 30) == [ShowPhase("warming up, attempt 1/5, gpu_memory_utilization=0.8")]


@pytest.mark.parametrize(
    ("kind", "event", "cause"),
    [(ProbeKind.WRONG_NAME, "served_name_mismatch", Cause.SERVED_NAME), (ProbeKind.NOT_READY, "crashed", Cause.CRASH)],
)
def test_a_failed_readiness_check_ends_the_attempt_with_its_cause(kind: ProbeKind, event: str, cause: Cause) -> None:
    actions = started()(Probed(1, kind, "vLLM serves other but the config expects tiny"), T0 + 30)
    assert says(actions) == [(event, "vLLM serves other but the config expects tiny")]
    assert finished(actions) == Failed(cause=cause, detail="vLLM serves other but the config expects tiny")


# --- deadlines ----------------------------------------------------------------------


def test_the_first_deadline_is_the_first_io_sample_then_every_two_seconds() -> None:
    run = started()
    assert deadline(run.state, CONFIG) == T0
    run(Tick(io_bytes=10), T0)
    assert deadline(run.state, CONFIG) == T0 + 2


def test_no_progress_for_the_stall_timeout_is_a_stall_named_by_its_shard() -> None:
    run = started()
    run(Parsed(1, ShardsProgressed(3, 6)), T0 + 10)
    run(Tick(io_bytes=500), T0 + 11)
    assert finished(run(Tick(io_bytes=500), T0 + 10 + STALL_S - 1)) is None
    actions = run(Tick(io_bytes=500), T0 + 10 + STALL_S)
    assert says(actions) == [
        ("stall_detected", "no loading progress for 300 s (startup.stall_timeout_s 300) at shard 3/6, and vLLM's processes did no I/O; stopping the process group")
    ]
    assert finished(actions) == Failed(cause=Cause.STALL, detail="stalled at shard 3/6")


def test_reading_without_printing_is_progress_that_defers_the_stall() -> None:
    run = started()
    run(Tick(io_bytes=0), T0)  # the first sample is only a baseline
    actions = run(Tick(io_bytes=IO_PROGRESS_MIN_BYTES), T0 + STALL_S - 10)
    assert Extend(STALL_S + 60) in actions
    assert finished(run(Tick(io_bytes=IO_PROGRESS_MIN_BYTES + 1), T0 + STALL_S + 5)) is None
    assert finished(run(Tick(io_bytes=IO_PROGRESS_MIN_BYTES + 1), T0 + 2 * STALL_S - 10)) == Failed(cause=Cause.STALL, detail="stalled in phase spawning")


def test_less_io_than_a_mebibyte_is_no_sign_of_life() -> None:
    run = started()
    run(Tick(io_bytes=0), T0)
    assert run(Tick(io_bytes=IO_PROGRESS_MIN_BYTES - 1), T0 + 10) == []
    assert run.state.startup.last_progress_at == T0


def test_a_start_that_keeps_progressing_still_times_out_after_ready_timeout() -> None:
    run = started()
    for n in range(1, 60):
        run(Parsed(1, ShardsProgressed(n % 6, 6)), T0 + n * 60)
    actions = run(Tick(io_bytes=None), T0 + READY_TIMEOUT_S)
    assert says(actions)[0][0] == "stall_detected"
    assert "did not become ready within startup.ready_timeout_s 3600 s" in says(actions)[0][1]
    assert finished(actions) == Failed(cause=Cause.START_TIMEOUT, detail="not ready after 3600 s")


def test_once_ready_no_deadline_is_left() -> None:
    assert deadline(ready_run().state, CONFIG) is None


# --- how an attempt ends ---------------------------------------------------------------


def test_an_exit_is_classified_from_what_vllm_printed() -> None:
    run = started()
    free = FreeMemoryShort(103.45, 121.69, 0.92, 111.95)
    run(Parsed(1, free), T0 + 20)
    assert run(Exited(1, 1), T0 + 21) == [
        ProcessExited(),
        Finish(Failed(cause=Cause.FREE_MEMORY, failure=free, exit_status=1, detail="vLLM exited with status 1")),
    ]


def test_a_killed_vllm_is_reported_by_its_signal() -> None:
    actions = ready_run()(Exited(1, -9), T0 + 100)
    assert finished(actions) == Failed(
        cause=Cause.CRASH, exit_status=-9, was_ready=True, detail="vLLM was killed by SIGKILL (out of memory? see journalctl -k)"
    )


def test_a_probe_failure_after_the_exit_defers_to_the_exit() -> None:
    # SIGKILL of the API server: the port closes with the process, so /health fails at once,
    # while the exit report waits for the pipes an orphaned EngineCore keeps open.
    run = ready_run()
    assert run(ExitSeen(1, -9), T0 + 100) == [ProcessExited()]
    assert run(Probed(1, ProbeKind.DEAD, "/health failed (connection refused)", "health"), T0 + 100.1) == []
    assert run(Tick(io_bytes=None), T0 + 101.5) == []
    assert finished(run(Exited(1, -9), T0 + 102)).cause is Cause.CRASH  # type: ignore[union-attr]


def test_a_probe_failure_just_before_the_exit_is_seen_still_defers_to_it() -> None:
    run = ready_run()
    assert run(Probed(1, ProbeKind.DEAD, "/health failed (connection refused)", "health"), T0 + 100) == []
    assert deadline(run.state, CONFIG) == T0 + 100 + EXIT_GRACE_S
    run(ExitSeen(1, -9), T0 + 100.01)
    assert run(Tick(io_bytes=None), T0 + 100 + EXIT_GRACE_S) == []
    assert finished(run(Exited(1, -9), T0 + 102)).detail.startswith("vLLM was killed by SIGKILL")  # type: ignore[union-attr]


def test_a_dead_engine_with_no_exit_within_the_grace_is_reported_as_dead() -> None:
    run = ready_run()
    run(Probed(1, ProbeKind.DEAD, "/health answered 503 Service Unavailable", "health"), T0 + 100)
    assert run(Tick(io_bytes=None), T0 + 100 + EXIT_GRACE_S / 2) == []
    actions = run(Tick(io_bytes=None), T0 + 100 + EXIT_GRACE_S)
    assert says(actions) == [("engine_dead", "vLLM's engine is dead: /health answered 503 Service Unavailable; stopping its process group")]
    assert LivenessFailed("health") in actions
    assert finished(actions) == Failed(cause=Cause.ENGINE_DEAD, was_ready=True, detail="/health answered 503 Service Unavailable")


def test_a_hung_engine_ends_the_attempt_at_once() -> None:
    actions = ready_run()(Probed(1, ProbeKind.HUNG, "no generated token for 120 s", "hung"), T0 + 300)
    assert [type(a) for a in actions] == [Say, LivenessFailed, Finish]
    assert actions[0] == Say("engine_hung", "vLLM's engine is hung: no generated token for 120 s; stopping its process group", PRIORITY_ERR, (("attempt", 1),))
    assert finished(actions) == Failed(cause=Cause.ENGINE_HUNG, was_ready=True, detail="no generated token for 120 s")


ASLEEP = Probed(1, ProbeKind.ASLEEP, "vllm:engine_sleep_state says awake 0", "asleep")
FOUND = (
    "vLLM is asleep, and gb10d did not ask it to sleep (someone called /sleep on its port 8000 directly, not through gb10d "
    "or its front): vllm:engine_sleep_state says awake 0; asleep, it holds every request unanswered"
)


def parks_by(park: str | None) -> Config:
    return CONFIG.model_copy(update={"on_demand": OnDemandSection(park=park) if park else None})


@pytest.mark.parametrize(
    ("park", "when", "expected"),
    [
        # gb10d parks it by sleep, so it knows how to wake it and check the wake: it wakes it.
        ("sleep", "serving", [Say("slept_unasked", f"{FOUND}: waking it (weights, reload_weights, kv_cache) and checking that it answers",
                                  PRIORITY_WARNING, (("attempt", 1),)), LivenessFailed("asleep"), WakeUnasked()]),
        # Any other instance has no checked wake: it is stopped and started again.
        (None, "serving", [Say("slept_unasked", f"{FOUND}: stopping its process group and starting it again (gb10d wakes only a vLLM it "
                                                "parks by sleep)", PRIORITY_ERR, (("attempt", 1),)), LivenessFailed("asleep"),
                           Finish(Failed(cause=Cause.ENGINE_HUNG, was_ready=True, detail="asleep, not asked to by gb10d: vllm:engine_sleep_state says awake 0"))]),
        ("stop", "serving", [Say("slept_unasked", f"{FOUND}: stopping its process group and starting it again (gb10d wakes only a vLLM it "
                                                  "parks by sleep)", PRIORITY_ERR, (("attempt", 1),)), LivenessFailed("asleep"),
                             Finish(Failed(cause=Cause.ENGINE_HUNG, was_ready=True, detail="asleep, not asked to by gb10d: vllm:engine_sleep_state says awake 0"))]),
        ("sleep", "starting", []),  # not serving yet: nothing to say about a sleep
        ("sleep", "exited", []),  # the exit is what matters
        ("sleep", "dead", []),  # a dead verdict waits for its exit
    ],
)
def test_a_vllm_asleep_that_gb10d_did_not_put_to_sleep_is_woken_where_gb10d_parks_by_sleep_else_restarted(
    park: str | None, when: str, expected: list[Action]
) -> None:
    config = parks_by(park)
    state, _ = begin(1, Tunables(0.8), T0, config)
    if when != "starting":
        state, _ = step(state, Probed(1, ProbeKind.READY, "/health 200"), T0 + 60, config)
    if when == "exited":
        state, _ = step(state, ExitSeen(1, 0), T0 + 99, config)
    if when == "dead":
        state, _ = step(state, Probed(1, ProbeKind.DEAD, "/health answered 503", "health"), T0 + 99, config)
    assert step(state, ASLEEP, T0 + 100, config)[1] == expected


def test_an_exit_being_read_is_not_taken_for_a_stall() -> None:
    run = started()
    run(Parsed(1, ShardsProgressed(3, 6)), T0 + 10)
    run(ExitSeen(1, 1), T0 + 10 + STALL_S - 0.5)
    assert run(Tick(io_bytes=None), T0 + 10 + STALL_S + 1) == []
    assert deadline(run.state, CONFIG) is None


@pytest.mark.parametrize(("event", "cause"), [(EngineDied("EngineDeadError"), Cause.ENGINE_DEAD), (RayWorkerLost("ActorDiedError"), Cause.WORKER_LOST)])
def test_an_engine_death_printed_while_serving_ends_the_attempt(event: EngineDied, cause: Cause) -> None:
    assert finished(ready_run()(Parsed(1, event), T0 + 500)) == Failed(cause=cause, failure=event, was_ready=True, detail=event.message)


def test_liveness_verdicts_before_ready_are_ignored() -> None:
    run = started()
    assert run(Probed(1, ProbeKind.DEAD, "refused", "health"), T0 + 5) == []
    assert run(Probed(1, ProbeKind.HUNG, "stuck", "hung"), T0 + 6) == []


def test_readiness_verdicts_after_the_exit_say_nothing_more() -> None:
    run = started()
    run(ExitSeen(1, 1), T0 + 30)
    assert run(Probed(1, ProbeKind.NOT_READY, "the warm-up completion failed (connection refused)"), T0 + 30.1) == []


# --- the served-name verdict -------------------------------------------------------


def test_every_served_name_listed_is_ready() -> None:
    assert served_name_problem(["qwen", "default"], ProbeResult(200, "OK", 0.01, ("qwen", "default", "lora"))) is None


def test_a_missing_name_would_give_clients_404() -> None:
    assert served_name_problem(["qwen"], ProbeResult(200, "OK", 0.01, ("Qwen/Qwen3.6-27B-FP8",))) == (
        "vLLM serves Qwen/Qwen3.6-27B-FP8 but the config expects qwen: clients asking for qwen would get 404"
    )


def test_models_that_do_not_answer_say_what_came_back() -> None:
    assert served_name_problem(["qwen"], ProbeResult(401, "Unauthorized", 0.01)) == (
        "vLLM serves nothing (HTTP 401) but the config expects qwen: clients asking for qwen would get 404"
    )


# --- the pull of a container image -------------------------------------------------------


def pulling(layers_done: int, downloaded: int, total: int = 9_800_000_000) -> Pulled:
    progress = PullProgress("nvcr.io/nvidia/vllm:26.05-py3", layers_done, 12, downloaded, downloaded // 2, total)
    return Pulled(1, progress)


def pull_started() -> Run:
    return Run(begin_pull(1, Tunables(0.8), T0), [])


def test_a_pull_says_nothing_until_the_engine_reports_one() -> None:
    # An image that is there already (or a venv) needs no pull: no STATUS= flashes by, no extension is asked for.
    run = pull_started()
    assert run.state.startup.phase.value == "pulling" and deadline(run.state, CONFIG) == T0 + STALL_S


def test_each_step_of_a_pull_is_progress_shown_in_status_and_extends_the_start_timeout() -> None:
    run = pull_started()
    actions = run(pulling(3, 4_100_000_000), T0 + 30)
    assert actions == [
        Extend(STALL_S + 60),
        ShowPhase("pulling nvcr.io/nvidia/vllm:26.05-py3: 4.10 of 9.80 GB downloaded, 2.05 GB unpacked (3 of 12 layers), attempt 1/5"),
    ]
    assert deadline(run.state, CONFIG) == T0 + 30 + STALL_S
    assert not any(isinstance(a, Extend) for a in run(pulling(3, 4_200_000_000), T0 + 30.5)), "throttled to once a second"


def test_a_pull_that_moves_nothing_for_the_stall_timeout_is_cancelled_as_stalled() -> None:
    run = pull_started()
    run(pulling(3, 4_100_000_000), T0 + 30)
    assert run(Tick(None), T0 + 30 + STALL_S - 1) == []
    actions = run(Tick(None), T0 + 30 + STALL_S)
    where = "pulling nvcr.io/nvidia/vllm:26.05-py3: 4.10 of 9.80 GB downloaded, 2.05 GB unpacked (3 of 12 layers)"
    assert says(actions) == [("stall_detected", f"the image's pull made no progress for 300 s (startup.stall_timeout_s 300): {where}; cancelling it")]
    assert finished(actions) == Failed(cause=Cause.PULL_STALLED, detail=f"stalled while {where}")


def test_a_long_pull_that_keeps_moving_is_never_a_start_timeout() -> None:
    # startup.ready_timeout_s counts from vLLM's start; a 40 GB image over a slow link may take longer to pull.
    run = pull_started()
    for minute in range(1, 90):
        assert finished(run(pulling(minute // 10, minute * 100_000_000), T0 + minute * 60)) is None
        assert finished(run(Tick(None), T0 + minute * 60 + 1)) is None


def test_the_readiness_check_waits_half_a_minute_for_the_port_after_startup_complete() -> None:
    assert LISTEN_GRACE_S == 30.0
    assert waits_for_listen(0.0) and waits_for_listen(30.0)
    assert not waits_for_listen(30.1)
