"""The stand-in against the real vLLM 0.23.0 recording: same line kinds, same phases, same events."""

from __future__ import annotations

import os
import signal

import pytest

from gb10d.vllm.logparse import EventScanner, LineFramer
from sim_support import FIXTURES, RECORD, STARTUP_ORDER, STATS, THIRD_PARTY, Sim, StartSim, http, kind_of, messages, physical_lines

RECORDED_FLAGS = ["/srv/models/tiny-llama", "--served-model-name", "tiny", "--max-model-len", "2048", "--gpu-memory-utilization", "0.30"]


def _recorded(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def _kinds(data: bytes) -> set[str]:
    found = set()
    for line in physical_lines(data):
        kind = kind_of(line)
        if kind is None:
            assert THIRD_PARTY.match(line), f"line of no known kind: {line!r}"
            continue
        found.add(kind)
    return found


def _event_kinds(data: bytes) -> list[str]:
    """gb10d's parser over one stream: event class names, repeats collapsed."""
    framer, scanner = LineFramer(), EventScanner()
    names = [type(e).__name__ for line in framer.feed(data) + framer.flush() for e in scanner.feed(line.text)]
    names += [type(e).__name__ for e in scanner.flush()]
    return [n for i, n in enumerate(names) if i == 0 or names[i - 1] != n]


def _in_order(found: list[str]) -> list[str]:
    """The names of STARTUP_ORDER phases found in order."""
    seen, position = [], 0
    for name, pattern in STARTUP_ORDER:
        for index in range(position, len(found)):
            if pattern.match(found[index]):
                seen.append(name)
                position = index + 1
                break
    return seen


@pytest.mark.parametrize("name", ["healthy.stdout", "healthy.stderr", "enginedeath.stdout", "enginedeath.stderr"])
def test_every_recorded_line_has_a_known_kind(name: str) -> None:
    assert _kinds(_recorded(name))


def test_startup_phase_regexes_fit_the_recording() -> None:
    assert _in_order(messages(_recorded("healthy.stdout"))) == [name for name, _ in STARTUP_ORDER]


def test_recorded_stats_line_fits_the_stats_regex() -> None:
    stats = [m for m in messages(_recorded("healthy.stdout")) if m.startswith("Engine 000:")]
    assert stats and all(STATS.match(m) for m in stats)


def _healthy_run(sim: StartSim) -> Sim:
    """What the recording did: start, one completion, a 404, a stats line, SIGTERM."""
    s = sim(*RECORDED_FLAGS, port=None)
    s.wait_ready()
    http(s.port, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5})
    http(s.port, "/v1/completions", {"model": "Qwen3.6-27B-FP8", "prompt": "Hello", "max_tokens": 5})
    s.wait_output(lambda out, err: any(STATS.match(m) for m in messages(out)))
    s.process.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    s.drain()
    return s


def test_sim_lines_are_of_the_same_kinds_as_the_recording(sim: StartSim) -> None:
    s = _healthy_run(sim)
    assert _kinds(bytes(s.stdout)) == _kinds(_recorded("healthy.stdout"))
    assert _kinds(bytes(s.stderr)) == _kinds(_recorded("healthy.stderr"))
    assert _in_order(messages(bytes(s.stdout))) == [name for name, _ in STARTUP_ORDER]


def test_sim_shutdown_lines_are_the_recorded_ones_per_process(sim: StartSim) -> None:
    def shutdown(data: bytes, process: str) -> list[str]:
        lines = [RECORD.match(line) for line in physical_lines(data)]
        return [m.group("msg") for m in lines if m and "[shutdown]" in m.group("msg") and m.group("tag").startswith(f"({process} ")]

    s = _healthy_run(sim)
    for process in ("APIServer", "EngineCore"):
        assert shutdown(bytes(s.stdout), process) == shutdown(_recorded("healthy.stdout"), process)


def test_replaying_the_recording_and_the_sim_through_logparse_gives_the_same_events(sim: StartSim) -> None:
    s = _healthy_run(sim)
    assert _event_kinds(bytes(s.stdout)) == _event_kinds(_recorded("healthy.stdout"))
    assert _event_kinds(bytes(s.stderr)) == _event_kinds(_recorded("healthy.stderr"))


def test_engine_death_gives_the_recorded_lines_and_events(sim: StartSim) -> None:
    s = sim("/srv/models/tiny-llama", "--served-model-name", "tiny", "--max-model-len", "2048", "--gpu-memory-utilization", "0.30", "--enforce-eager")
    s.wait_ready()
    os.kill(s.engine_pid(), signal.SIGKILL)
    assert s.wait_exit() == 0
    s.drain()

    def after_death(data: bytes) -> list[str]:
        found = messages(data)
        start = found.index("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")
        return found[start:]

    assert after_death(bytes(s.stdout)) == after_death(_recorded("enginedeath.stdout"))
    assert _event_kinds(bytes(s.stdout)) == _event_kinds(_recorded("enginedeath.stdout"))
    assert _event_kinds(bytes(s.stderr)) == _event_kinds(_recorded("enginedeath.stderr"))
    recorded_tail = [line.split(") ", 1)[1] for line in physical_lines(_recorded("enginedeath.stderr")) if line.startswith("(APIServer")]
    assert [line.split(") ", 1)[1] for line in physical_lines(bytes(s.stderr)) if line.startswith("(APIServer")] == [
        t.replace("4066", str(s.process.pid)) for t in recorded_tail
    ]


def test_both_eras_give_gb10ds_parser_the_same_events(sim: StartSim) -> None:
    runs = [sim(*RECORDED_FLAGS, env={"GB10D_SIM_ERA": era}) for era in ("0.30", "0.31")]
    for s in runs:
        s.wait_ready()
    old, new = runs
    assert _event_kinds(bytes(old.stdout)) == _event_kinds(bytes(new.stdout))
    assert _event_kinds(bytes(old.stderr)) == _event_kinds(bytes(new.stderr))
