"""The hot path from vLLM's pipe: every line reaches the journal, and a bar's steps within one read reach the loop as two."""

from __future__ import annotations

import io

from gb10d.daemon.attempt import OutputStream, skip_between_steps
from gb10d.machine.journal import Journal
from gb10d.vllm.events import Event, GraphsProgressed, ShardsProgressed, StatsLogged
from gb10d.vllm.logparse import BarCollapser

CORE = "(EngineCore pid=2835) "


def _stream() -> tuple[OutputStream, io.StringIO, list[Event]]:
    out = io.StringIO()
    posted: list[Event] = []
    return OutputStream(Journal(out, socket_path=None), BarCollapser(), posted.append), out, posted


def _graph_line(steps: range) -> bytes:
    redraws = "".join(f"\rCapturing CUDA graphs (PIECEWISE): {100 * n // 50:3d}%|{'#' * (n // 5):<10}| {n}/50 [00:00<00:01, 44.32it/s]"
                      for n in steps)
    return (CORE + redraws + "\n").encode()


def _shard_lines(done: range, total: int = 4) -> bytes:
    return "".join(f"{CORE}Loading safetensors checkpoint shards: {100 * n // total:3d}% Completed | {n}/{total} [00:0{n}<00:00, 1.0s/it]\n"
                   for n in done).encode()


def test_a_graph_bar_redrawn_within_one_read_reaches_the_loop_as_its_first_and_last_step() -> None:
    stream, out, posted = _stream()
    stream.feed(_graph_line(range(0, 51, 5)))
    assert posted == [GraphsProgressed(0, 50), GraphsProgressed(50, 50)]
    # The journal still gets the bar's first state, each new decile and the final one.
    assert out.getvalue().count("Capturing CUDA graphs") == 11


def test_a_new_shard_pass_in_the_same_read_is_still_seen() -> None:
    stream, _, posted = _stream()
    stream.feed(_shard_lines(range(0, 5)) + _shard_lines(range(0, 5)))
    assert posted == [ShardsProgressed(0, 4), ShardsProgressed(4, 4), ShardsProgressed(0, 4), ShardsProgressed(4, 4)]


def test_steps_of_a_bar_in_separate_reads_all_reach_the_loop() -> None:
    stream, _, posted = _stream()
    for n in range(0, 5):
        stream.feed(_shard_lines(range(n, n + 1)))
    assert posted == [ShardsProgressed(n, 4) for n in range(0, 5)]


def test_events_between_steps_keep_their_place_and_split_the_run() -> None:
    stats = StatsLogged(1.0, 2.0, 1, 0, None, None, "000")
    events: list[Event] = [ShardsProgressed(0, 4), ShardsProgressed(1, 4), stats, ShardsProgressed(2, 4), ShardsProgressed(3, 4)]
    assert skip_between_steps(events) == events
    finished = GraphsProgressed(finished=True, gib=0.5)
    steps: list[Event] = [GraphsProgressed(1, 9), GraphsProgressed(2, 9), GraphsProgressed(3, 9), finished]
    assert skip_between_steps(steps) == [GraphsProgressed(1, 9), GraphsProgressed(3, 9), finished]
