"""Fuzzing the log parser and diagnose: the real logs of tests/corpus, mutated (lines cut, dropped, repeated or
interleaved with another log, binary junk, invalid UTF-8, stray `\\r` and ANSI), read both ways gb10d reads vLLM:
the daemon's pipe (framed from chunks of any size, classified, scanned) and `gb10d diagnose` (a paste). No
exception; the framing does not depend on the read sizes; every verdict is one `--help` lists, and every
utilization diagnose advises lies in [memory.min_gpu_memory_utilization, 1]."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from fuzz_support import JUNK, budget, mutated_bytes
from gb10d.base.config import MemorySection
from gb10d.core.diagnose import VERDICTS, diagnose
from gb10d.vllm.events import Event
from gb10d.vllm.logparse import BarCollapser, Classifier, EventScanner, Line, LineFramer

CORPUS = sorted((Path(__file__).parent.parent / "corpus").glob("*.log"))
_MIN_UTILIZATION = MemorySection().min_gpu_memory_utilization
# Every utilization an advice names: "gpu_memory_utilization 0.85", "gpu_memory_utilization = 0.85", "at 0.85 vLLM gets".
_NUMBER = re.compile(rb"\d+(?:\.\d+)?")
_ADVISED = re.compile(r"gpu_memory_utilization(?: =)? (\d+(?:\.\d+)?)\b|\bat (\d+(?:\.\d+)?) vLLM gets")


@st.composite
def logs(draw: st.DrawFn) -> bytes:
    """A corpus log, its lines sometimes cut, dropped, repeated, or interleaved with another log's, then bytes mutated."""
    lines = draw(st.sampled_from(CORPUS)).read_bytes().split(b"\n")
    if draw(st.integers(0, 2)) == 0:
        other = draw(st.sampled_from(CORPUS)).read_bytes().split(b"\n")
        merged: list[bytes] = []
        while lines or other:
            source = lines if (draw(st.booleans()) and lines) or not other else other
            merged.append(source.pop(0))
        lines = merged
    for _ in range(draw(st.integers(0, 3))):
        if not lines:
            break
        at = draw(st.integers(0, len(lines) - 1))
        how = draw(st.sampled_from(["cut", "drop", "repeat", "junk", "join"]))
        if how == "cut":
            lines[at] = lines[at][: draw(st.integers(0, len(lines[at])))]
        elif how == "drop":
            del lines[at : at + draw(st.integers(1, 20))]
        elif how == "repeat":
            lines[at:at] = [lines[at]] * draw(st.integers(1, 30))
        elif how == "junk":
            lines[at] = lines[at] + draw(JUNK) + draw(st.binary(max_size=32))
        elif at + 1 < len(lines):
            lines[at : at + 2] = [lines[at] + lines[at + 1]]  # a lost newline
    raw = b"\n".join(lines)
    numbers = list(_NUMBER.finditer(raw))
    for _ in range(draw(st.integers(0, 4))):
        if not numbers:
            break
        # The numbers are what the advice is computed from: memory sizes, utilizations, lengths, ports.
        found = draw(st.sampled_from(numbers))
        value = draw(st.sampled_from([b"0", b"0.0", b"1", b"1.0", b"0.99", b"0.3", b"0.29", b"0.05", b"1.5", b"-1", b"nan", b"inf",
                                      b"1e308", b"99999999999999999999", b"0.0001"]))
        raw = raw[: found.start()] + value + raw[found.end() :]
        numbers = list(_NUMBER.finditer(raw))
    return draw(mutated_bytes(raw, max_mutations=2))


def _daemon_read(raw: bytes, cuts: list[int]) -> tuple[list[Line], list[Event]]:
    """What the daemon's output stream makes of `raw` read in chunks ending at `cuts`: the lines, and the events."""
    framer, classifier, collapser, scanner = LineFramer(), Classifier(), BarCollapser(), EventScanner()
    lines: list[Line] = []
    events: list[Event] = []
    start = 0
    for end in [*sorted(set(cuts)), len(raw)]:
        lines += framer.feed(raw[start:end])
        start = max(start, end)
    lines += framer.flush()
    for line in lines:
        record = classifier.classify(line.text)
        collapser.forward(line.text)
        events += scanner.feed_message(record.message)
    return lines, events + scanner.flush()


@given(raw=logs(), data=st.data())
@budget(ci=80, long=2000)
def test_the_daemon_reads_any_output_the_same_whatever_the_read_sizes(raw: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=12))
    whole_lines, whole_events = _daemon_read(raw, [])
    lines, events = _daemon_read(raw, cuts)
    # A redraw may be emitted once its next `\r` arrives, so chunks may tell a bar's states apart differently: the text is the same.
    assert [line.text for line in lines if not line.redraw] == [line.text for line in whole_lines if not line.redraw]
    assert [type(e) for e in events if not type(e).__name__.endswith("Progressed")] == \
        [type(e) for e in whole_events if not type(e).__name__.endswith("Progressed")]


def _assert_sound(raw: bytes) -> None:
    result = diagnose(raw.decode("utf-8", "replace"))
    event(result.verdict)
    assert result.verdict in VERDICTS
    json.dumps(result.to_json())  # --json must be able to print it
    assert result.render().endswith("\n")
    suggested = result.facts.get("suggested_utilization")
    if suggested is not None:
        assert _MIN_UTILIZATION <= suggested <= 1, result
    for match in _ADVISED.finditer(result.advice):
        value = float(match.group(1) or match.group(2))
        if "would be" not in result.advice[max(0, match.start() - 30) : match.start()]:
            assert _MIN_UTILIZATION <= value <= 1, f"advised utilization {value}: {result.advice}"


@given(raw=logs())
@budget(ci=80, long=2000)
def test_diagnose_of_a_damaged_log_gives_a_known_verdict_and_advises_utilizations_in_range(raw: bytes) -> None:
    _assert_sound(raw)


@given(raw=st.binary(max_size=2048) | st.text(max_size=500).map(str.encode))
@budget(ci=100, long=5000)
def test_diagnose_of_bytes_that_are_no_log_gives_a_known_verdict(raw: bytes) -> None:
    _assert_sound(raw)


# --- time: linear, a 10 MB line in under a second ------------------------------------------------------------

_HUGE = 10 * 1024 * 1024
# Shapes of a runaway line: plain text, a failure word repeated (every failure pattern tries it), a bar, glued records.
_RUNAWAY = {
    "text": b"a",
    "failure words": b"Error memory ",
    "bar": b"Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01, 1.00s/it]",
    "glued records": b"(EngineCore_DP0 pid=1) INFO 01-02 03:04:05 [core.py:1] x ",
    "tags and brackets": b"[1;36m(Worker pid=1)[0;0m ",
    "binary": bytes(range(256)).replace(b"\n", b"").replace(b"\r", b""),
}


@pytest.mark.parametrize("shape", sorted(_RUNAWAY))
def test_a_10_mb_line_is_read_in_under_a_second_by_the_daemon_and_by_diagnose(shape: str) -> None:
    line = (_RUNAWAY[shape] * (_HUGE // len(_RUNAWAY[shape]) + 1))[:_HUGE]
    head = (Path(__file__).parent.parent / "corpus" / "kv_insufficient__0.31__plain.log").read_bytes()
    raw = head + line + b"\n" + head
    # CPU time: the bound is about this work, not about the other tests and suites sharing the cores.
    started = time.process_time()
    _daemon_read(raw, list(range(0, _HUGE, 65536)))
    daemon_s = time.process_time() - started
    started = time.process_time()
    verdict = diagnose(raw.decode("utf-8", "replace")).verdict
    diagnose_s = time.process_time() - started
    assert verdict == "kv_cache_insufficient"
    assert daemon_s < 1.0 and diagnose_s < 1.0, f"{shape}: the daemon took {daemon_s:.2f} s, diagnose {diagnose_s:.2f} s"
