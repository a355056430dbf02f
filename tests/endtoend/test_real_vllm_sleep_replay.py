"""Replay of two real vLLM 0.26.0 instances swapping by level-2 sleep through `gb10d front` (one H200).

tests/fixtures/real-vllm-0.26.0-sleep holds what `tests/gpu/run-real-vllm.sh sleep` recorded (paths normalised,
docs/REAL_VLLM.md): both gb10d journals with every line vLLM printed, their sd_notify messages, the front's
output and the driver's timeline. Read again by the parser, the lines must give what the live gb10d said: every
sleep's figures, no failure in any sleep, wake or reload line, the wakes that answered empty text caught by the
check generation and followed by a cold start, and every held request released.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gb10d.base.units import GIB
from gb10d.vllm.events import Failure
from gb10d.vllm.logparse import Classifier, EventScanner
from gb10d.vllm.sleepmode import sleep_freed

FIXTURES = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.26.0-sleep"
INSTANCES = ("small", "large")


def entries(name: str) -> list[str]:
    """A recorded journal's messages, without the time stamps and priorities."""
    return [re.sub(r"^\s*[\d.]+ (<\d>)?", "", line) for line in (FIXTURES / name).read_text().splitlines()]


def vllm_lines(instance: str) -> list[str]:
    return [entry for entry in entries(f"journal-{instance}.txt") if not entry.startswith("gb10d: ")]


def said(instance: str, pattern: str) -> list[str]:
    return [entry for entry in entries(f"journal-{instance}.txt") if entry.startswith("gb10d: ") and re.search(pattern, entry)]


@pytest.mark.parametrize("instance", INSTANCES)
def test_no_line_of_a_real_sleep_wake_or_reload_reads_as_a_failure(instance: str) -> None:
    classifier, scanner = Classifier(), EventScanner()
    lines = vllm_lines(instance)
    assert any("Reloading and processing weights took" in line for line in lines), "the recording holds a reload"
    for line in lines:
        classifier.classify(line)
        failures = [event for event in scanner.feed(line) if isinstance(event, Failure)]
        assert failures == [], f"{line!r} read as {failures}"


@pytest.mark.parametrize("instance", INSTANCES)
def test_every_sleep_is_told_with_the_figures_vllm_printed(instance: str) -> None:
    freed = [sleep_freed(line) for line in vllm_lines(instance) if "Sleep mode freed" in line]
    told = said(instance, r"^gb10d: vLLM sleeps \(level 2\)")
    assert freed and len(told) == len(freed)
    for figures, line in zip(freed, told):
        assert figures is not None
        assert f"{figures[0] / GIB:.2f} GiB given back, {figures[1] / GIB:.2f} GiB still in use" in line, line


def test_the_larger_models_wakes_were_checked_and_its_skipped_reload_was_caught_and_started_cold() -> None:
    assert len(said("large", r"^gb10d: woke vLLM in [\d.]+ s \(weights, reload_weights, kv_cache\) and checked it")) == 2
    caught = said("large", r"the wake looked fine but the check generation answered with empty text")
    assert len(caught) == 1 and "stopping vLLM and starting it cold" in caught[0]
    lines = entries("journal-large.txt")
    after = lines[lines.index(caught[0]):]
    assert any(line.startswith("gb10d: started vLLM as pid") for line in after)
    assert any(line.startswith("gb10d: vLLM is ready after") for line in after)


def test_the_tiny_models_real_wakes_answered_empty_text_and_gb10d_started_it_cold_each_time() -> None:
    # No fault was forced on `small`: its reload ran, yet its check generation came back empty, twice.
    caught = said("small", r"the wake looked fine but the check generation answered with empty text")
    assert len(caught) == 2 and not said("small", r"^gb10d: woke vLLM in")
    assert len(said("small", r"^gb10d: vLLM is ready after")) == 3  # the first start and the two cold ones


def test_the_front_held_every_request_until_its_model_served_and_rejected_none() -> None:
    front = (FIXTURES / "front.txt").read_text()
    assert len(re.findall(r"released the requests held for (small|large) after [\d.]+ s: it serves", front)) == 5
    assert "rejected" not in front
