"""`gb10d status --all` shows the front's queue per model, from the state file the front rewrites as it changes."""

from __future__ import annotations

import io
import json
import os
import textwrap
from pathlib import Path

from gb10d.base.config import MemorySection
from gb10d.cmdline.status import show_all
from gb10d.front.snapshot import FrontSnapshot, ModelQueue, from_json, read, render, write

NOW = 1_800_000_000.0
SNAPSHOT = FrontSnapshot(4242, "0.0.0.0:8000", (
    ModelQueue("qwen", "qwen", "serving", 0),
    ModelQueue("llama", "llama", "starting: loading_weights 12/66", 37, NOW - 41),
    ModelQueue("llama-fast", "llama", "starting: loading_weights 12/66", 37, NOW - 41),
))


def test_each_model_shows_its_instance_state_and_how_many_requests_wait_and_since_when() -> None:
    assert render(SNAPSHOT, True, NOW, Path("/run/gb10d-front/state.json")) == textwrap.dedent(
        """\
        Front on 0.0.0.0:8000 (pid 4242), requests held per model:
        MODEL       INSTANCE  STATE                            HELD  HELD FOR
        qwen        qwen      serving                          0
        llama       llama     starting: loading_weights 12/66  37    41s
        llama-fast  llama     starting: loading_weights 12/66  37    41s
        """
    )


def test_a_front_that_is_gone_is_said_to_be_not_running() -> None:
    said = render(SNAPSHOT, False, NOW, Path("/run/gb10d-front/state.json"))
    assert said == "Front: not running (its last state, /run/gb10d-front/state.json, names pid 4242)\n"


def test_a_file_that_is_not_a_snapshot_is_not_shown(tmp_path: Path) -> None:
    assert from_json({"pid": 1}) is None and from_json([]) is None
    (tmp_path / "state.json").write_text("{half")
    assert read(tmp_path / "state.json") is None and read(tmp_path / "missing.json") is None


def test_status_all_appends_the_fronts_queues_as_text_and_json(tmp_path: Path) -> None:
    state = tmp_path / "front" / "state.json"
    write(state, FrontSnapshot(os.getpid(), "127.0.0.1:8000", SNAPSHOT.models))
    assert read(state) == FrontSnapshot(os.getpid(), "127.0.0.1:8000", SNAPSHOT.models)
    assert state.stat().st_mode & 0o777 == 0o640
    memory = MemorySection(ledger_dir=str(tmp_path / "ledger"))
    (tmp_path / "ledger").mkdir()
    text, as_json = io.StringIO(), io.StringIO()
    assert show_all(memory, tmp_path / "run" / "state.json", out=text, front=state) == 3
    assert show_all(memory, tmp_path / "run" / "state.json", json_output=True, out=as_json, front=state) == 3
    assert text.getvalue().splitlines()[1] == f"Front on 127.0.0.1:8000 (pid {os.getpid()}), requests held per model:"
    front = json.loads(as_json.getvalue())["front"]
    assert front["running"] is True and [m["held"] for m in front["models"]] == [0, 37, 37]
