"""A real stand-in process: startup lines in order on the right streams, the process tree, signals."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gb10d.sim import make_venv
from sim_support import (
    ACCESS,
    DEADLINE_S,
    GRAPH_BAR,
    RECORD,
    SHARD_BAR,
    STARTUP_ORDER,
    UVICORN,
    UVICORN_STARTUP,
    StartSim,
    http,
    kind_of,
    messages,
    physical_lines,
    port_refuses,
)

RECORDED_FLAGS = ["/srv/models/tiny-llama", "--served-model-name", "tiny", "--max-model-len", "2048", "--gpu-memory-utilization", "0.30"]


def _assert_in_order(found: list[str]) -> None:
    position = 0
    for name, pattern in STARTUP_ORDER:
        while position < len(found) and not pattern.match(found[position]):
            position += 1
        assert position < len(found), f"phase {name!r} missing or out of order"
        position += 1


@pytest.mark.parametrize("era", ["0.30", "0.31"])
def test_healthy_start_prints_every_phase_in_order_on_the_right_streams(sim: StartSim, era: str) -> None:
    s = sim(*RECORDED_FLAGS, env={"GB10D_SIM_ERA": era, "VLLM_DISABLE_LOG_LOGO": "1"})
    s.wait_ready()
    stdout, stderr = bytes(s.stdout), bytes(s.stderr)
    _assert_in_order(messages(stdout))
    assert messages(stdout)[0] == f"vLLM server version {'0.23.0' if era == '0.30' else '0.31.0'}, serving model /srv/models/tiny-llama"
    for line in physical_lines(stdout):
        assert kind_of(line) in ("record", "access"), f"not a vLLM record or access line on stdout: {line!r}"
    err_kinds = [kind_of(line) for line in physical_lines(stderr)]
    assert None not in err_kinds, physical_lines(stderr)
    assert err_kinds.count("shard_bar") == 8  # 0/6 .. 6/6 drawn each, 100% twice
    assert err_kinds.count("graph_bar") == 2
    uvicorn = [UVICORN.match(line).group("msg") for line in physical_lines(stderr) if UVICORN.match(line)]  # type: ignore[union-attr]
    assert [m.split(" [")[0] for m in uvicorn] == UVICORN_STARTUP


def test_era_0_30_tags_every_line_and_0_31_only_the_records(sim: StartSim) -> None:
    old = sim("m", env={"GB10D_SIM_ERA": "0.30"})
    new = sim("m", env={"GB10D_SIM_ERA": "0.31"})
    old.wait_ready()
    new.wait_ready()
    for line in physical_lines(bytes(old.stdout)) + physical_lines(bytes(old.stderr)):
        assert line.startswith(("(APIServer pid=", "(EngineCore pid=")), line
    for line in physical_lines(bytes(new.stderr)):
        assert not line.startswith("("), line
    new_records = [RECORD.match(line) for line in physical_lines(bytes(new.stdout)) if not ACCESS.match(line)]
    assert all(m and m.group("tag") for m in new_records)
    assert "(MainProcess pid=" in physical_lines(bytes(new.stdout))[0]


def test_logo_banner_is_the_recorded_multi_line_record(sim: StartSim) -> None:
    s = sim("/srv/models/tiny-llama")
    s.wait_text("non-default args")
    lines = physical_lines(bytes(s.stdout))[:6]
    assert [RECORD.match(line).group("msg") for line in lines] == [  # type: ignore[union-attr]
        "",
        "       \u2588     \u2588     \u2588\u2584   \u2584\u2588",
        " \u2584\u2584 \u2584\u2588 \u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588  version 0.23.0",
        "  \u2588\u2584\u2588\u2580 \u2588     \u2588     \u2588     \u2588  model   /srv/models/tiny-llama",
        "   \u2580\u2580  \u2580\u2580\u2580\u2580\u2580 \u2580\u2580\u2580\u2580\u2580 \u2580     \u2580",
        "",
    ]
    assert all(line.endswith("\r") for line in lines[:5]) and not lines[5].endswith("\r")


def test_healthy_start_at_speed_0_01_is_ready_in_under_3_seconds(sim: StartSim) -> None:
    started = time.monotonic()
    s = sim("m")
    s.wait_ready()
    assert time.monotonic() - started < 3.0


def test_port_refuses_connections_until_startup_is_complete(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "slow_shards=100"})
    s.wait_text("Loading safetensors checkpoint shards", "stderr")
    assert port_refuses(s.port)
    with pytest.raises(OSError):
        # bound already: a second bind of the same port fails
        import socket

        with socket.socket() as other:
            other.bind(("0.0.0.0", s.port))


def test_prefix_and_logging_switches_are_honoured(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_ERA": "0.31", "VLLM_LOGGING_PREFIX": "[gpu0] ", "VLLM_DISABLE_LOG_LOGO": "1"})
    s.wait_ready()
    assert all(line.startswith("[gpu0] (") for line in physical_lines(bytes(s.stdout)) if not ACCESS.match(line))
    quiet = sim("m", env={"VLLM_CONFIGURE_LOGGING": "0"})
    quiet.wait_ready()
    assert all(ACCESS.match(line) for line in physical_lines(bytes(quiet.stdout)))  # uvicorn logs on its own
    assert b"pid=" not in bytes(quiet.stderr)


def test_engine_core_is_a_separate_child_in_the_same_process_group(sim: StartSim) -> None:
    s = sim("m")
    s.wait_ready()
    engine = s.engine_pid()
    assert engine != s.process.pid
    assert os.getpgid(engine) == s.process.pid
    assert Path(f"/proc/{engine}/comm").read_text().strip() == "VLLM::EngineCor"
    stat = Path(f"/proc/{engine}/stat").read_text()
    assert int(stat[stat.rindex(")") + 2 :].split()[1]) == s.process.pid  # parent is the API server


def test_sigkill_of_the_api_server_leaves_the_engine_core_running(sim: StartSim) -> None:
    s = sim("m")
    s.wait_ready()
    engine = s.engine_pid()
    os.kill(s.process.pid, signal.SIGKILL)
    assert s.wait_exit() == -signal.SIGKILL
    assert port_refuses(s.port)  # the port goes with the API server
    assert s.group_pids() == [engine]
    os.killpg(s.process.pid, signal.SIGKILL)


def test_sigterm_while_serving_prints_the_shutdown_lines_and_exits_0(sim: StartSim) -> None:
    s = sim("m")
    s.wait_ready()
    s.process.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0
    s.drain()
    found = messages(bytes(s.stdout))
    assert "[shutdown] API server: shutdown triggered" in found
    assert "[shutdown] EngineCore: trigger received signal=SIGTERM" in found
    assert found[-1] == "[shutdown] API server: shutting down FastAPI HTTP server"
    assert physical_lines(bytes(s.stderr))[-3:] == [
        f"(APIServer pid={s.process.pid}) INFO:     Shutting down",
        f"(APIServer pid={s.process.pid}) INFO:     Waiting for application shutdown.",
        f"(APIServer pid={s.process.pid}) INFO:     Application shutdown complete.",
    ]
    assert s.group_pids() == []


def test_sigterm_while_connections_keep_arriving_still_stops_the_server(sim: StartSim) -> None:
    # Every connection starts a handler thread, and a thread being created
    # readily takes a process-directed signal; the stop must still happen.
    s = sim("m")
    s.wait_ready()
    stop = threading.Event()

    def connect_repeatedly() -> None:
        while not stop.is_set():
            try:
                socket.create_connection(("127.0.0.1", s.port), timeout=1).close()
            except OSError:
                return

    clients = [threading.Thread(target=connect_repeatedly, daemon=True) for _ in range(2)]
    for client in clients:
        client.start()
    try:
        s.process.send_signal(signal.SIGTERM)
        assert s.wait_exit() == 0
    finally:
        stop.set()
    s.drain()
    assert messages(bytes(s.stdout))[-1] == "[shutdown] API server: shutting down FastAPI HTTP server"


def test_sigterm_during_startup_exits_as_keyboard_interrupt_and_stops_the_engine(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "slow_shards=100"})
    s.wait_text("Loading safetensors checkpoint shards", "stderr")
    s.process.send_signal(signal.SIGTERM)
    assert s.wait_exit() == -signal.SIGINT
    s.drain()
    assert physical_lines(bytes(s.stderr))[-1].endswith("KeyboardInterrupt: terminated")
    assert s.group_pids() == []


def test_unknown_flag_is_an_argparse_usage_error_with_status_2(sim: StartSim) -> None:
    s = sim("m", "--no-such-flag", "1")
    assert s.wait_exit() == 2
    s.drain()
    assert bytes(s.stdout) == b""
    assert bytes(s.stderr).decode().splitlines() == [
        "usage: vllm serve [model_tag] [options]",
        "vllm serve: error: unrecognized arguments: --no-such-flag 1",
    ]


def test_bad_knob_is_one_line_without_traceback(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "explode"})
    assert s.wait_exit() == 2
    s.drain()
    assert bytes(s.stderr).decode().count("\n") == 1
    assert b"Traceback" not in bytes(s.stderr)


def test_make_venv_gives_a_vllm_program_that_runs_the_stand_in(tmp_path: Path) -> None:
    vllm = make_venv(tmp_path / "venv")
    assert vllm == tmp_path / "venv" / "bin" / "vllm"
    assert os.access(vllm, os.X_OK)
    assert sys.executable in vllm.read_text()
    result = subprocess.run([str(vllm), "serve", "m", "--bogus"], capture_output=True, timeout=DEADLINE_S, env={"PATH": os.environ.get("PATH", "")})
    assert result.returncode == 2
    assert b"unrecognized arguments: --bogus" in result.stderr


def test_make_venv_command_prints_the_program_path(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "gb10d.sim", "make-venv", str(tmp_path / "v")], capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0
    assert result.stdout.strip() == str(tmp_path / "v" / "bin" / "vllm")


def test_shard_bar_and_graph_bars_match_the_tqdm_formats(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SHARDS": "3"})
    s.wait_ready()
    bars = [SHARD_BAR.match(line) for line in physical_lines(bytes(s.stderr)) if SHARD_BAR.match(line)]
    assert [(b.group(2), b.group(3)) for b in bars] == [("0", "3"), ("1", "3"), ("2", "3"), ("3", "3"), ("3", "3")]  # type: ignore[union-attr]
    assert bars[0].group(5) == "?" and bars[0].group(6) == "?"  # type: ignore[union-attr]
    graphs = [line for line in physical_lines(bytes(s.stderr)) if GRAPH_BAR.match(line)]
    assert [g.split("\r")[1].split(":")[0] for g in graphs] == ["Capturing CUDA graphs (PIECEWISE)", "Capturing CUDA graphs (FULL)"]
    assert all(g.endswith("51/51" + g.rsplit("51/51", 1)[1]) for g in graphs)


def test_eager_load_strategy_marks_the_bar(sim: StartSim) -> None:
    s = sim("m", "--safetensors-load-strategy", "eager", "--enforce-eager")
    s.wait_ready()
    stderr = bytes(s.stderr).decode()
    assert "Loading safetensors checkpoint shards (eager):" in stderr
    assert "Capturing CUDA graphs" not in stderr
    assert not any(m.startswith("torch.compile took") for m in messages(bytes(s.stdout)))


def test_newer_versions_print_the_one_line_kv_form_and_gib_memory(sim: StartSim) -> None:
    s = sim("m", "--max-model-len", "32k", env={"GB10D_SIM_VERSION": "0.29.0"})
    s.wait_ready()
    found = messages(bytes(s.stdout))
    assert any(re.fullmatch(r"GPU KV cache size: [\d,]+ tokens, Maximum concurrency for 32,000 tokens per request: [\d.]+x", m) for m in found)
    assert not any(m.startswith("Maximum concurrency") for m in found)
    assert any(re.fullmatch(r"Model loading took [\d.]+ GiB memory and [\d.]+ seconds", m) for m in found)
    assert http(s.port, "/version").json() == {"version": "0.29.0"}


def test_only_0_34_knows_the_extensible_kv_cache_and_there_a_short_start_passes_the_start(sim: StartSim) -> None:
    older = sim("m", "--no-enable-extensible-kv-cache", env={"GB10D_SIM_VERSION": "0.33.0"})
    assert older.wait_exit() == 2
    older.drain()
    assert "unrecognized arguments: --no-enable-extensible-kv-cache" in bytes(older.stderr).decode()
    # 5 GiB free would fail vLLM's check at 0.92 up to 0.33; 0.34 skips it and the KV cache finds nothing left.
    short = sim("m", "--device-memory-utilization", "0.92", env={"GB10D_SIM_VERSION": "0.34.0", "GB10D_SIM_FREE_GIB": "5"})
    assert short.wait_exit() == 1
    short.drain()
    found = messages(bytes(short.stdout))
    assert not any("Free memory on device" in m for m in found)
    assert any("ValueError: No available memory for the cache blocks. The KV cache gets what is left after the model and its "
               "activations within `gpu_memory_utilization`=0.92;" in m for m in found), found[-3:]


def test_a_local_model_folder_gives_its_shards_architecture_and_real_reads(sim: StartSim, tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    for index in range(3):
        (model / f"model-0000{index + 1}-of-00003.safetensors").write_bytes(b"\0" * 200_000)
    s = sim(str(model))
    s.wait_ready()
    found = messages(bytes(s.stdout))
    assert "Resolved architecture: LlamaForCausalLM" in found
    assert any(m.startswith("Filesystem type for checkpoints: EXT4. Checkpoint size: 0.00 GiB.") for m in found)
    assert "| 3/3 [" in bytes(s.stderr).decode()


def test_version_flag_prints_the_simulated_version() -> None:
    result = subprocess.run([sys.executable, "-m", "gb10d.sim", "--version"], capture_output=True, text=True, timeout=DEADLINE_S, env={**os.environ, "GB10D_SIM_VERSION": "0.33.0"})
    assert (result.returncode, result.stdout) == (0, "0.33.0\n")


def test_uvicorn_log_level_warning_hides_the_uvicorn_lines(sim: StartSim) -> None:
    s = sim("m", "--uvicorn-log-level", "warning")
    s.wait_text("Starting vLLM server on")
    deadline = time.monotonic() + DEADLINE_S
    while port_refuses(s.port):  # until the port answers, at most DEADLINE_S
        assert time.monotonic() < deadline, "the port never started listening"
    assert http(s.port, "/health").status == 200
    assert b"INFO:     " not in bytes(s.stderr) + bytes(s.stdout)
