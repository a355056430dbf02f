"""journal: level-prefixed stdout for vLLM's lines, native journald entries for gb10d's decisions.

A real AF_UNIX datagram socket bound in tmp_path stands in for journald; the
datagrams are decoded here independently of gb10d's encoder.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gb10d.machine.journal import MAX_FIELD_BYTES, MESSAGE_IDS, Journal, field_name

REPO = Path(__file__).resolve().parents[2]
CATALOG = REPO / "packaging" / "gb10d.catalog"


def decode_native(datagram: bytes) -> dict[str, str]:
    """journald's parser in miniature: `KEY=value\\n` or `KEY\\n<u64 le length><bytes>\\n`."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(datagram):
        newline = datagram.index(b"\n", pos)
        line = datagram[pos:newline]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            pos = newline + 1
        else:
            key = line
            (length,) = struct.unpack("<Q", datagram[newline + 1 : newline + 9])
            value = datagram[newline + 9 : newline + 9 + length]
            assert datagram[newline + 9 + length : newline + 10 + length] == b"\n"
            pos = newline + 10 + length
        assert re.fullmatch(rb"[A-Z][A-Z0-9_]*", key), key
        fields[key.decode()] = value.decode()
    return fields


@pytest.fixture
def journald(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A bound datagram socket where journald's would be, with a generous receive timeout."""
    path = str(tmp_path / "journal.socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(30)
    yield path, server
    server.close()


def receive(server: socket.socket) -> dict[str, str]:
    return decode_native(server.recv(1 << 20))


def nothing_more(server: socket.socket) -> bool:
    server.setblocking(False)
    try:
        server.recv(1 << 20)
    except BlockingIOError:
        return True
    finally:
        server.settimeout(30)
    return False


# --- vLLM lines on stdout -----------------------------------------------------


@pytest.mark.parametrize(
    ("priority", "line"),
    [
        (3, "(EngineCore pid=7) ERROR 12-02 14:09:02 [core.py:1] EngineCore failed to start."),
        (4, "(APIServer pid=7) WARNING 12-02 14:09:02 [api_server.py:1] Default sampling parameters"),
        (6, "INFO:     Application startup complete."),
        (7, "DEBUG 12-02 14:09:02 [utils.py:1] Waiting for 1 local, 0 remote core engine proc(s) to start."),
    ],
)
def test_vllm_line_gets_its_syslog_level_prefix(priority: int, line: str) -> None:
    out = io.StringIO()
    journal = Journal(out=out, socket_path=None)
    journal.vllm_line(line, priority)
    journal.flush()
    assert out.getvalue() == f"<{priority}>{line}\n"


def test_vllm_lines_reach_a_real_pipe_in_order_after_flush() -> None:
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as writer, os.fdopen(read_fd) as reader:
        journal = Journal(out=writer, socket_path=None)
        journal.vllm_line("INFO 12-02 14:09:02 [a.py:1] first", 6)
        journal.vllm_line("Traceback (most recent call last):", 3)
        journal.flush()
        assert reader.readline() == "<6>INFO 12-02 14:09:02 [a.py:1] first\n"
        assert reader.readline() == "<3>Traceback (most recent call last):\n"


def test_a_full_batch_is_written_without_waiting_for_flush() -> None:
    out = io.StringIO()
    journal = Journal(out=out, socket_path=None)
    for n in range(10_000):
        journal.vllm_line(f"line {n}", 6)
    written = out.getvalue().splitlines()
    assert written, "a long burst must not sit in memory until the next flush()"
    assert written == [f"<6>line {n}" for n in range(len(written))]


def test_forwarding_keeps_up_with_a_fast_printer() -> None:
    # The goal is 100,000 lines/s; the bound is loose for a loaded shared machine.
    lines = 100_000
    with open(os.devnull, "w") as sink:
        journal = Journal(out=sink, socket_path=None)
        text = "(APIServer pid=2700) INFO 12-02 14:09:02 [loggers.py:271] Engine 000: Avg prompt throughput: 0.2 tokens/s"
        started = time.perf_counter()
        for _ in range(lines):
            journal.vllm_line(text, 6)
        journal.flush()
        elapsed = time.perf_counter() - started
    assert elapsed < 10, f"{lines} lines took {elapsed:.1f} s"


# --- gb10d's own events -------------------------------------------------------


def test_event_is_sent_natively_with_structured_fields_and_not_on_stdout(
    journald: tuple[str, socket.socket],
) -> None:
    path, server = journald
    out = io.StringIO()
    journal = Journal(out=out, socket_path=path)
    journal.event(
        "free_memory_retry",
        "free memory 61.3 GiB of 119.7 GiB is below 0.9; restarting with gpu_memory_utilization 0.49",
        priority=4,
        attempt=2,
        gpu_memory_utilization=0.49,
        mem_available_bytes=65_821_179_904,
        load_strategy=None,
    )
    fields = receive(server)
    assert fields == {
        "MESSAGE": "free memory 61.3 GiB of 119.7 GiB is below 0.9; restarting with gpu_memory_utilization 0.49",
        "PRIORITY": "4",
        "MESSAGE_ID": MESSAGE_IDS["free_memory_retry"],
        "SYSLOG_IDENTIFIER": "gb10d",
        "GB10D_EVENT": "free_memory_retry",
        "GB10D_ATTEMPT": "2",
        "GB10D_GPU_MEMORY_UTILIZATION": "0.49",
        "GB10D_MEM_AVAILABLE_BYTES": "65821179904",
    }
    assert out.getvalue() == ""


def test_field_values_with_newlines_use_the_binary_length_form(journald: tuple[str, socket.socket]) -> None:
    path, server = journald
    journal = Journal(out=io.StringIO(), socket_path=path)
    traceback = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom"
    journal.event("crashed", "vLLM exited with status 1 in loading_weights", priority=3, traceback=traceback)
    datagram = server.recv(1 << 20)
    assert b"GB10D_TRACEBACK\n" + struct.pack("<Q", len(traceback)) in datagram
    assert decode_native(datagram)["GB10D_TRACEBACK"] == traceback


def test_list_and_bool_fields_are_written_readably(journald: tuple[str, socket.socket]) -> None:
    path, server = journald
    journal = Journal(out=io.StringIO(), socket_path=path)
    journal.event("starting", "starting vLLM", command=["vllm", "serve", "m"], warmup=True)
    fields = receive(server)
    assert fields["GB10D_COMMAND"] == "vllm serve m"
    assert fields["GB10D_WARMUP"] == "true"


def test_oversize_message_is_truncated_and_still_delivered(journald: tuple[str, socket.socket]) -> None:
    path, server = journald
    out = io.StringIO()
    journal = Journal(out=out, socket_path=path)
    journal.event("crashed", "x" * (4 * MAX_FIELD_BYTES), priority=3)
    message = receive(server)["MESSAGE"]
    assert len(message.encode()) <= MAX_FIELD_BYTES
    assert message.startswith("xxxx") and message.endswith("[truncated by gb10d]")
    assert out.getvalue() == ""


def test_pending_vllm_lines_are_written_before_an_event_is_sent(journald: tuple[str, socket.socket]) -> None:
    path, server = journald
    out = io.StringIO()
    journal = Journal(out=out, socket_path=path)
    journal.vllm_line("(EngineCore pid=9) ValueError: Free memory on device cuda:0 ...", 3)
    journal.event("free_memory_retry", "retrying", priority=4)
    receive(server)
    assert out.getvalue() == "<3>(EngineCore pid=9) ValueError: Free memory on device cuda:0 ...\n"


@pytest.mark.slow
def test_event_without_journal_socket_goes_to_stdout_marked_as_gb10d(tmp_path: Path) -> None:
    out = io.StringIO()
    journal = Journal(out=out, socket_path=str(tmp_path / "absent.socket"))
    journal.vllm_line("INFO:     Application startup complete.", 6)
    journal.event("ready", "vLLM serves tiny on http://127.0.0.1:8000 after 70 s", attempt=1)
    assert out.getvalue().splitlines() == [
        "<6>INFO:     Application startup complete.",
        "<6>gb10d: vLLM serves tiny on http://127.0.0.1:8000 after 70 s",
    ]


def test_multiline_event_on_stdout_keeps_the_prefix_on_every_line() -> None:
    out = io.StringIO()
    journal = Journal(out=out, socket_path=None)
    journal.event("config_error", "config invalid:\n[vllm].port = 0 (must be >= 1)", priority=3)
    assert out.getvalue() == "<3>gb10d: config invalid:\n<3>gb10d: [vllm].port = 0 (must be >= 1)\n"


def test_event_falls_back_to_stdout_when_journald_has_gone(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.socket")
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gone.bind(path)
    out = io.StringIO()
    journal = Journal(out=out, socket_path=path)
    journal.event("starting", "starting vLLM, attempt 1")
    gone.close()  # the socket file stays, nobody reads it: ECONNREFUSED
    journal.event("crashed", "vLLM exited with status 1", priority=3)
    assert out.getvalue() == "<3>gb10d: vLLM exited with status 1\n"


def test_journal_comes_back_after_journald_restarts(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.socket")
    first = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    first.bind(path)
    out = io.StringIO()
    journal = Journal(out=out, socket_path=path)
    journal.event("starting", "one")
    first.close()
    os.unlink(path)
    journal.event("phase", "two")
    second = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    second.bind(path)
    second.settimeout(30)
    try:
        journal.event("phase", "three")
        assert receive(second)["MESSAGE"] == "three"
    finally:
        second.close()
    assert out.getvalue() == "<6>gb10d: two\n"


def test_unknown_kind_is_logged_without_message_id(journald: tuple[str, socket.socket]) -> None:
    path, server = journald
    journal = Journal(out=io.StringIO(), socket_path=path)
    journal.event("something_new", "a decision without an id yet")
    fields = receive(server)
    assert "MESSAGE_ID" not in fields
    assert fields["GB10D_EVENT"] == "something_new"
    assert nothing_more(server)


def test_out_of_range_priority_is_clamped_to_syslog_levels() -> None:
    out = io.StringIO()
    journal = Journal(out=out, socket_path=None)
    journal.event("watchdog", "high", priority=12)
    journal.event("watchdog", "low", priority=-1)
    assert out.getvalue() == "<7>gb10d: high\n<0>gb10d: low\n"


@pytest.mark.parametrize(
    ("key", "name"),
    [
        ("attempt", "GB10D_ATTEMPT"),
        ("gpu_memory_utilization", "GB10D_GPU_MEMORY_UTILIZATION"),
        ("mem_available_bytes", "GB10D_MEM_AVAILABLE_BYTES"),
        ("load-strategy", "GB10D_LOAD_STRATEGY"),
        ("_private", "GB10D_PRIVATE"),
    ],
)
def test_keywords_become_valid_journal_field_names(key: str, name: str) -> None:
    assert field_name(key) == name


# --- message ids and the catalog ------------------------------------------------


def catalog_entries() -> dict[str, tuple[dict[str, str], str]]:
    """id -> (headers, body) as journalctl's catalog parser reads them."""
    entries: dict[str, tuple[dict[str, str], str]] = {}
    blocks = re.split(r"^-- ", CATALOG.read_text(encoding="utf-8"), flags=re.M)
    for block in blocks[1:]:
        head, _, rest = block.partition("\n")
        header_text, _, body = rest.partition("\n\n")
        headers = dict(line.split(": ", 1) for line in header_text.splitlines())
        assert head not in entries, f"duplicate catalog entry {head}"
        entries[head.strip()] = (headers, body.strip())
    return entries


def test_every_message_id_is_32_hex_digits_and_unique() -> None:
    for kind, message_id in MESSAGE_IDS.items():
        assert re.fullmatch(r"[0-9a-f]{32}", message_id), kind
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)


def test_catalog_has_exactly_one_entry_per_message_id() -> None:
    assert set(catalog_entries()) == set(MESSAGE_IDS.values())


@pytest.mark.slow
def test_catalog_entries_have_subject_origin_support_and_a_body() -> None:
    for message_id, (headers, body) in catalog_entries().items():
        assert set(headers) == {"Subject", "Defined-By", "Support"}, message_id
        assert headers["Defined-By"] == "gb10d"
        assert headers["Support"] == "man:gb10d(8)"
        assert headers["Subject"].strip()
        assert len(body) > 40, message_id
        for field in re.findall(r"@([^@\s]+)@", headers["Subject"] + body):
            assert re.fullmatch(r"GB10D_[A-Z0-9_]+", field), (message_id, field)


def test_every_event_kind_used_in_gb10d_has_a_message_id() -> None:
    used: set[str] = set()
    for source in (REPO / "gb10d").glob("*.py"):
        used.update(re.findall(r"\.event\(\s*\"([a-z_]+)\"", source.read_text(encoding="utf-8")))
    assert used <= set(MESSAGE_IDS), sorted(used - set(MESSAGE_IDS))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("journalctl") is None, reason="journalctl not installed")
def test_journalctl_indexes_the_catalog(tmp_path: Path) -> None:
    catalog_dir = tmp_path / "usr" / "lib" / "systemd" / "catalog"
    catalog_dir.mkdir(parents=True)
    shutil.copy(CATALOG, catalog_dir / "gb10d.catalog")
    subprocess.run(["journalctl", f"--root={tmp_path}", "--update-catalog"], check=True, timeout=60)
    listed = subprocess.run(
        ["journalctl", f"--root={tmp_path}", "--list-catalog"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    assert {line.split()[0] for line in listed.splitlines() if line.strip()} == set(MESSAGE_IDS.values())


# --- the whole forwarding path on real vLLM output ------------------------------

RECORDED = REPO / "tests" / "fixtures" / "real-vllm-0.23.0"


def forward_recording(name: str) -> list[str]:
    """Push a recorded vLLM stream through framing, bar collapsing, classification and the journal into a pipe."""
    from gb10d.vllm.logparse import BarCollapser, Classifier, LineFramer

    read_fd, write_fd = os.pipe()
    collected: list[str] = []
    with os.fdopen(read_fd) as reader:
        thread = threading.Thread(target=lambda: collected.extend(reader))
        thread.start()
        with os.fdopen(write_fd, "w") as writer:
            journal = Journal(out=writer, socket_path=None)
            collapser, classifier = BarCollapser(), Classifier()
            framer = LineFramer()
            data = (RECORDED / name).read_bytes()
            # Chunks of a pipe's read size, as the supervisor receives them.
            for start in range(0, len(data), 4096):
                for line in framer.feed(data[start : start + 4096]):
                    if collapser.forward(line.text):
                        journal.vllm_line(line.text, classifier.classify(line.text).priority)
                journal.flush()
            for line in framer.flush():
                if collapser.forward(line.text):
                    journal.vllm_line(line.text, classifier.classify(line.text).priority)
            journal.close()
        thread.join(60)
    return [line.rstrip("\n") for line in collected]


def priority_of(line: str) -> int:
    match = re.match(r"<([0-7])>", line)
    assert match, f"journal line without a level prefix: {line!r}"
    return int(match.group(1))


@pytest.mark.parametrize("name", ["healthy.stdout", "healthy.stderr", "enginedeath.stdout", "enginedeath.stderr"])
def test_every_recorded_vllm_line_reaches_the_journal_with_a_level(name: str) -> None:
    lines = forward_recording(name)
    assert lines
    for line in lines:
        priority_of(line)
        assert "\r" not in line


def test_warning_filter_of_a_healthy_start_shows_only_vllm_warnings() -> None:
    lines = forward_recording("healthy.stdout")
    problems = [line for line in lines if priority_of(line) <= 4]
    assert problems, "the recording has WARNING lines"
    assert all(" WARNING " in line for line in problems), problems


def test_engine_death_traceback_is_logged_as_errors() -> None:
    lines = forward_recording("enginedeath.stdout")
    dead = [line for line in lines if "EngineDeadError: EngineCore encountered an issue" in line]
    assert dead and all(priority_of(line) == 3 for line in dead)
    assert all(priority_of(line) == 3 for line in lines if " ERROR " in line)


def test_progress_bars_reach_the_journal_once_per_step() -> None:
    lines = [line for line in forward_recording("healthy.stderr") if "Completed |" in line or "Capturing CUDA graphs" in line]
    steps = [re.sub(r"\[.*$", "", line) for line in lines]
    assert len(steps) == len(set(steps)), "a bar redraw of the same step was forwarded twice"


def test_connected_to_journal_only_when_journal_stream_names_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from gb10d.machine.journal import connected_to_journal

    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert connected_to_journal(stream)
        monkeypatch.setenv("JOURNAL_STREAM", "0:1")
        assert not connected_to_journal(stream)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not connected_to_journal(stream)
    os.close(read_fd)
