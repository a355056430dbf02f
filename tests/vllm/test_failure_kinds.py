"""The failure kinds' table (gb10d.vllm.failures): each kind complete, the catalog as the table says, and a kind
taught through the table alone flowing from vLLM's line to the journal, the metrics and `gb10d diagnose`."""

from __future__ import annotations

import io
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gb10d.base.command import Tunables
from gb10d.base.config import Config
from gb10d.core.diagnose import VERDICT_HELP, diagnose
from gb10d.core.policy import History, Retry, classify, event_kind, failure_line, next_attempt
from gb10d.daemon.metrics import Metrics, restart_causes
from gb10d.machine.journal import MESSAGE_IDS, Journal
from gb10d.vllm import failures
from gb10d.vllm.events import Failure
from gb10d.vllm.failures import Cause, FailureKind, JournalEvent, Pattern, Verdict
from gb10d.vllm.logparse import parse_line

CATALOG = Path(__file__).resolve().parents[2] / "packaging" / "gb10d.catalog"


def catalog_blocks() -> dict[str, str]:
    """MESSAGE_ID -> its entry, as the file writes it."""
    blocks = re.split(r"^(?=-- )", CATALOG.read_text(encoding="utf-8"), flags=re.M)
    return {block[3:35]: block.rstrip("\n") + "\n" for block in blocks if block.startswith("-- ")}


# --- each kind complete ------------------------------------------------------------------------------------------


def test_the_causes_are_the_failure_kinds_each_named_once() -> None:
    values = [kind.value for kind in failures.KINDS]
    assert len(values) == len(set(values))
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", value) for value in values)
    assert all(getattr(Cause, name) is kind for name, kind in vars(Cause).items() if isinstance(kind, FailureKind))
    events = [kind.event for kind in failures.KINDS if kind.event is not None]
    assert len(events) == len(set(events)), "an event shows one kind"


@pytest.mark.parametrize("kind", failures.KINDS, ids=lambda kind: kind.value)
def test_each_failure_kind_has_its_journal_event_catalog_entry_and_restart_label(kind: FailureKind) -> None:
    told = kind.journal
    assert re.fullmatch(r"[0-9a-f]{32}", told.message_id)
    assert MESSAGE_IDS[told.kind] == told.message_id
    assert catalog_blocks().get(told.message_id) == told.catalog_entry(), (
        f"packaging/gb10d.catalog's entry for {told.kind} differs from gb10d.vllm.failures; it reads:\n{told.catalog_entry()}"
    )
    assert (kind.value in restart_causes()) is not kind.gives_up


@pytest.mark.parametrize("kind", [kind for kind in failures.KINDS if kind.event is not None], ids=lambda kind: kind.value)
def test_each_parsed_failure_kind_has_a_verdict_and_advice(kind: FailureKind) -> None:
    from gb10d.core.diagnose.verdicts import _BUILDERS  # the verdict builders: where the advice of a kind without its own is built

    assert kind.verdict is not None and VERDICT_HELP[kind.verdict.name] == kind.verdict.help
    assert kind.event is not None
    built = any(issubclass(kind.event, cls) for cls, _ in _BUILDERS)
    known = any(issue.event is kind.event for issue in failures.ISSUES)
    assert kind.advice or built or known or kind.verdict is failures.VERDICT_CRASH, f"{kind.value} has no advice"


def test_one_journal_event_is_one_object_so_its_text_is_declared_once() -> None:
    told = {kind.journal.kind: kind.journal for kind in failures.KINDS}
    assert all(kind.journal is told[kind.journal.kind] for kind in failures.KINDS)
    assert len({event.message_id for event in told.values()}) == len(told)


def test_every_verdict_of_a_failure_is_documented_once() -> None:
    names = [verdict.name for verdict in failures.VERDICTS]
    assert len(names) == len(set(names))
    assert {kind.verdict for kind in failures.KINDS if kind.verdict is not None} <= set(failures.VERDICTS)


# --- a kind taught through the table alone ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuOverheated(Failure):
    """The GPU passed its thermal limit (the kind these tests teach gb10d)."""

    celsius: int


def _overheated(msg: str) -> Failure | None:
    m = re.search(r"GPU thermal limit reached at (\d+) C", msg)
    return GpuOverheated(int(m.group(1))) if m else None


OVERHEATED = FailureKind(
    "gpu_overheated",
    JournalEvent(
        "gpu_overheated",
        "4f6c1e0d9a8b47e2b3c5d7e9f1a2b3c4",
        "The GPU passed its thermal limit",
        "vLLM stopped because the GPU reached its thermal limit. gb10d starts it\nagain after a back-off.",
    ),
    GpuOverheated,
    Verdict("gpu_overheated", "the GPU passed its thermal limit"),
    advice="let the machine cool down and check that nothing blocks its air intake",
    meaning="the GPU passed its thermal limit",
    pattern=Pattern(("thermal limit",), _overheated),
)
LINE = "(EngineCore pid=4300) ERROR 12-02 14:03:00 [gpu_worker.py:88] GPU thermal limit reached at 97 C, stopping"


@pytest.fixture
def overheated() -> Iterator[FailureKind]:
    with failures.teaching(OVERHEATED) as kind:
        yield kind


def test_a_taught_kind_is_parsed_decided_and_given_a_restart_label(overheated: FailureKind) -> None:
    events = parse_line(LINE)
    assert events == [GpuOverheated(97)]
    outcome = classify([e for e in events if isinstance(e, Failure)], exit_status=1, was_ready=False)
    assert outcome.cause is overheated and outcome.failure == GpuOverheated(97)
    config = Config.model_validate({"vllm": {"executable": "/usr/bin/vllm", "model": "m"}})
    decision = next_attempt(outcome, Tunables(0.9), History(1), config)
    assert isinstance(decision, Retry) and decision.message == "restarting with the same settings"
    text = generate_latest(Metrics().registry).decode()
    assert 'gb10d_restarts_total{cause="gpu_overheated"} 0.0' in text
    assert 'gb10d_start_attempts_total{reason="gpu_overheated"} 0.0' in text


def test_a_taught_kinds_journal_line_carries_its_message_id(overheated: FailureKind, tmp_path: Path) -> None:
    path = str(tmp_path / "journal.socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(30)
        outcome = classify(parse_line(LINE), exit_status=1, was_ready=False)  # type: ignore[arg-type]
        config = Config.model_validate({"vllm": {"executable": "/usr/bin/vllm", "model": "m"}})
        decision = next_attempt(outcome, Tunables(0.9), History(1), config)
        journal = Journal(out=io.StringIO(), socket_path=path)
        journal.event(event_kind(outcome.cause), failure_line(outcome, decision, History(1), config), 4, cause=outcome.cause.value)
        datagram = server.recv(1 << 20).decode()
    assert "MESSAGE_ID=4f6c1e0d9a8b47e2b3c5d7e9f1a2b3c4\n" in datagram
    assert "GB10D_EVENT=gpu_overheated\n" in datagram and "GB10D_CAUSE=gpu_overheated\n" in datagram
    assert "MESSAGE=the GPU passed its thermal limit; restarting with the same settings in 5 s (attempt 2/5)\n" in datagram


def test_diagnose_gives_a_taught_kinds_verdict_and_advice(overheated: FailureKind) -> None:
    log = "\n".join((
        "(APIServer pid=4242) INFO 12-02 14:00:00 [api_utils.py:330] vLLM server version 0.31.0, serving model m",
        "(EngineCore pid=4300) INFO 12-02 14:00:20 [gpu_model_runner.py:2901] Starting to load model m...",
        "(EngineCore pid=4300) INFO 12-02 14:02:20 [gpu_model_runner.py:2950] Model loading took 29.1 GiB and 120.0 seconds",
        LINE,
        "(EngineCore pid=4300) ERROR 12-02 14:03:00 [core.py:700] EngineCore failed to start.",
    )) + "\n"
    found = diagnose(log)
    assert found.verdict == "gpu_overheated"
    assert found.advice == "Let the machine cool down and check that nothing blocks its air intake."
    assert found.summary == "The GPU passed its thermal limit."


def test_a_taught_kind_is_forgotten_after_the_block() -> None:
    with failures.teaching(OVERHEATED):
        assert failures.for_event(GpuOverheated(90)) is OVERHEATED
    assert failures.for_event(GpuOverheated(90)) is None
    assert parse_line(LINE) == []
    assert OVERHEATED not in failures.kinds()


def test_the_platform_kinds_take_their_name_from_the_known_issues_table() -> None:
    platform = [kind for kind in failures.KINDS if kind.verdict is not None and kind.verdict.name in failures.VERDICT_PLATFORM]
    assert len(platform) == 6
    for kind in platform:
        assert any(issue.event is kind.event and issue.name == kind.value == kind.verdict.name for issue in failures.ISSUES)
