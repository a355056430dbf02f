"""Parking by sleep, the pure part: vLLM's calls as it reads them, the checks around a wake, the front's asks,
the config that turns it on."""

from __future__ import annotations

from pathlib import Path

import pytest

from config_support import write_config
from gb10d.base.configload import load_config
from gb10d.base.errors import ConfigError
from gb10d.base.units import GIB
from gb10d.core.reload import ConfigSnapshot, diff_configs
from gb10d.core.statefile import DaemonState, StateRecord
from gb10d.front.core import Readiness, readiness_of, should_park, should_wake
from gb10d.vllm.sleepmode import PARK, WAKE, check_failure, control_path, sleep_freed, vllm_env, vllm_flags, wake_refusal


def test_park_is_level_2_in_the_query_and_the_wake_reloads_the_weights_between_its_two_tags() -> None:
    # vLLM reads level, mode and tags from the query: a body would be ignored and the sleep be level 1 (abort).
    assert [str(call) for call in PARK] == ["POST /sleep?level=2&mode=wait"]
    assert [str(call) for call in WAKE] == ["POST /wake_up?tags=weights", "POST /collective_rpc", "POST /wake_up?tags=kv_cache"]
    assert WAKE[1].body == {"method": "reload_weights"}
    assert all(call.body is None for call in (*PARK, WAKE[0], WAKE[2]))


@pytest.mark.parametrize(("available_gib", "refused"), [(60.0, False), (57.0, False), (56.9, True), (10.0, True)])
def test_a_wake_needs_what_the_sleep_gave_back_plus_the_margin(available_gib: float, refused: bool) -> None:
    why = wake_refusal(int(available_gib * GIB), 55 * GIB, 2 * GIB)
    assert (why is not None) == refused
    if why:
        assert "55.00 GiB the sleep gave back plus the 2.00 GiB margin" in why and "on_demand.wake_margin_gib" in why


@pytest.mark.parametrize(("available_gib", "starting_gib", "refused"), [(110.0, 50.0, False), (106.0, 50.0, True), (60.0, 0.0, False)])
def test_a_wake_leaves_alone_what_the_starts_of_other_instances_reserved(available_gib: float, starting_gib: float, refused: bool) -> None:
    # Another instance's start was admitted beside the sleeping one and has not taken its share yet: a wake that
    # took it would leave that start short (found by `python -m bench soak`: both on-demand models up, the pinned
    # one's restart refused for memory ever after).
    why = wake_refusal(int(available_gib * GIB), 55 * GIB, 2 * GIB, int(starting_gib * GIB), "gb10d@alpha")
    assert (why is not None) == refused
    if why:
        assert why == ("MemAvailable is 106.00 GiB, and the starts of gb10d@alpha reserve 50.00 GiB of it, which leaves less than "
                       "the 55.00 GiB the sleep gave back plus the 2.00 GiB margin (on_demand.wake_margin_gib)")


@pytest.mark.parametrize(("text", "reference", "problem"), [
    (" Paris. The capital", " Paris. The capital", None),
    (" Paris.", None, None),
    ("", " Paris.", "empty text"),
    ("   ", None, "empty text"),
    (None, " Paris.", "no answer"),
    (" !!!!", " Paris.", "as before the first sleep"),
])
def test_the_check_generation_must_answer_text_and_the_same_as_before_the_first_sleep(text: str | None, reference: str | None, problem: str | None) -> None:
    found = check_failure(text, reference)
    assert (found is None) == (problem is None)
    if problem:
        assert found is not None and problem in found


def test_vllms_sleep_line_gives_what_was_freed_and_what_stays() -> None:
    line = "(EngineCore pid=7) INFO 07-01 10:00:00 [gpu_worker.py:221] Sleep mode freed 41.09 GiB memory, 1.66 GiB memory is still in use."
    assert sleep_freed(line) == (int(41.09 * GIB), int(1.66 * GIB))
    assert sleep_freed("It took 4.628540 seconds to fall asleep.") is None


def test_the_control_socket_sits_beside_the_state_file() -> None:
    assert control_path(Path("/run/gb10d/chat.json")) == Path("/run/gb10d/chat.sock")


SLEEPS = {"park": "sleep", "idle_timeout_s": 30}


def config(tmp_path: Path, host: str, on_demand: dict[str, object] | None = SLEEPS) -> Path:
    """A gb10d.toml of vLLM on host, parked on demand as on_demand says (None: always on)."""
    parked = {} if on_demand is None else {"on_demand": on_demand}
    return write_config(tmp_path / "gb10d.toml", parked, vllm={"executable": "/usr/bin/true", "model": "m", "host": host, "port": 8101})


def test_on_demand_sleep_adds_the_flag_and_the_dev_mode_and_nothing_without_it(tmp_path: Path) -> None:
    parked = load_config(config(tmp_path, "127.0.0.1"))
    assert vllm_flags(parked) == ("--enable-sleep-mode",) and vllm_env(parked) == {"VLLM_SERVER_DEV_MODE": "1"}
    plain = load_config(config(tmp_path, "0.0.0.0", on_demand=None))
    assert vllm_flags(plain) == () and vllm_env(plain) == {}


def test_turning_on_demand_on_by_a_reload_restarts_vllm_and_a_new_idle_timeout_does_not(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = ConfigSnapshot.take(load_config(config(tmp_path / "a", "127.0.0.1", on_demand=None)))
    parked = ConfigSnapshot.take(load_config(config(tmp_path / "b", "127.0.0.1")))
    assert diff_configs(plain, parked).needs_vllm_restart, "--enable-sleep-mode is on vLLM's command line"
    later = ConfigSnapshot.take(load_config(config(tmp_path / "a", "127.0.0.1", on_demand={"park": "sleep", "idle_timeout_s": 90})))
    assert not diff_configs(parked, later).needs_vllm_restart


def test_sleep_on_a_public_address_is_a_config_error_naming_the_host(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(config(tmp_path, "0.0.0.0"))
    text = str(caught.value)
    assert "vllm.host" in text and "VLLM_SERVER_DEV_MODE" in text and 'host = "127.0.0.1"' in text


def test_park_stop_is_the_default_runs_vllm_without_sleep_mode_and_may_listen_anywhere(tmp_path: Path) -> None:
    stopped = load_config(config(tmp_path, "0.0.0.0", on_demand={"idle_timeout_s": 30}))
    assert stopped.on_demand is not None and stopped.on_demand.park == "stop"
    assert vllm_flags(stopped) == () and vllm_env(stopped) == {}, "no development endpoints: nothing to keep off the network"


def record(state: DaemonState) -> StateRecord:
    return StateRecord(pid=1, started_at=0.0, updated_at=0.0, state=state)


@pytest.mark.parametrize(("state", "asleep"), [(DaemonState.ASLEEP, True), (DaemonState.PARKING, False), (DaemonState.WAKING, False)])
def test_the_front_holds_for_a_sleeping_instance_and_knows_which_one_to_wake(state: DaemonState, asleep: bool) -> None:
    ready = readiness_of(record(state), alive=True)
    assert (ready.serving, ready.coming, ready.parked, ready.detail) == (False, True, asleep, state.value)


ASLEEP = Readiness(serving=False, coming=True, detail="asleep", parked=True)
SERVING = Readiness(serving=True, coming=True, detail="serving")


@pytest.mark.parametrize(("ready", "held", "in_flight", "asked", "wake"), [
    (ASLEEP, 1, 0, False, True),
    (ASLEEP, 0, 1, False, True),  # sent just before it fell asleep: vLLM holds it until a wake
    (ASLEEP, 0, 0, False, False),
    (ASLEEP, 3, 0, True, False),  # asked once per sleep
    (SERVING, 1, 0, False, False),
])
def test_the_front_wakes_a_sleeping_instance_only_for_a_waiting_request(ready: Readiness, held: int, in_flight: int, asked: bool, wake: bool) -> None:
    assert should_wake(ready, held, in_flight, asked) is wake


@pytest.mark.parametrize(("ready", "held", "in_flight", "idle_s", "timeout", "asked", "park"), [
    (SERVING, 0, 0, 31.0, 30.0, False, True),
    (SERVING, 0, 0, 29.0, 30.0, False, False),
    (SERVING, 0, 1, 99.0, 30.0, False, False),  # a stream in flight is not idle
    (SERVING, 1, 0, 99.0, 30.0, False, False),
    (SERVING, 0, 0, 99.0, None, False, False),  # not on demand: never parked
    (SERVING, 0, 0, 99.0, 30.0, True, False),
    (ASLEEP, 0, 0, 99.0, 30.0, False, False),
])
def test_the_front_parks_only_an_idle_serving_on_demand_instance(
    ready: Readiness, held: int, in_flight: int, idle_s: float, timeout: float | None, asked: bool, park: bool,
) -> None:
    assert should_park(ready, held, in_flight, idle_s, timeout, asked) is park


def test_the_sleep_state_metric_names_one_state_at_a_time_and_none_without_vllm() -> None:
    from prometheus_client import generate_latest

    from gb10d.daemon.metrics import Metrics

    metrics = Metrics()
    metrics.set_sleep_state("asleep")
    metrics.wake("check_failed")
    text = generate_latest(metrics.registry).decode()
    assert 'gb10d_sleep_state{state="asleep"} 1.0' in text and 'gb10d_sleep_state{state="serving"} 0.0' in text
    assert 'gb10d_wakes_total{result="check_failed"} 1.0' in text
    metrics.set_sleep_state("")
    assert 'gb10d_sleep_state{state="asleep"} 0.0' in generate_latest(metrics.registry).decode()
