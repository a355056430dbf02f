"""Every GB10D_SIM_SCENARIO and the memory model, observed from outside as gb10d observes vLLM."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest

from gb10d.daemon.lab import write_meminfo
from harness import wait_until
from sim_support import BLANK_TAGGED, RECORD, SHARD_BAR, TRACEBACK, Sim, StartSim, messages, physical_lines

FREE_MEMORY = re.compile(
    r"Free memory on device (\S+) \(([\d.]+)/([\d.]+) GiB\) on startup is less than desired GPU memory utilization \(([\d.]+), ([\d.]+) GiB\)"
)
ENGINE_FAILED = "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def _failure_record(stdout: bytes) -> list[str]:
    """The physical lines of the `EngineCore failed to start.` record."""
    lines = physical_lines(stdout)
    start = next(i for i, line in enumerate(lines) if line.endswith("EngineCore failed to start.\r"))
    end = next(i for i in range(start, len(lines)) if not lines[i].endswith("\r"))
    return lines[start : end + 1]


def _assert_engine_start_failed(s: Sim, last_engine_line: str) -> None:
    """vLLM's chain of §3.1: the ERROR record, `Process EngineCore:` on stderr, the API's RuntimeError, exit 1."""
    assert s.wait_exit() == 1
    s.drain()
    record = _failure_record(bytes(s.stdout))
    heads = {RECORD.match(line).group(0)[: -len(RECORD.match(line).group("msg")) - len(RECORD.match(line).group("cr"))] for line in record}  # type: ignore[union-attr]
    assert len(heads) == 1 and "ERROR" in heads.pop()  # every line carries the same full prefix
    assert RECORD.match(record[-1]).group("msg") == last_engine_line  # type: ignore[union-attr]
    stderr = physical_lines(bytes(s.stderr))
    engine_tag = record[0].split(") ")[0] + ") "
    dump = stderr.index(engine_tag + "Process EngineCore:")
    assert stderr[dump + 1] == engine_tag + "Traceback (most recent call last):"
    assert stderr[stderr.index(engine_tag + last_engine_line)] == engine_tag + last_engine_line
    assert stderr[-1] == f"(APIServer pid={s.process.pid}) {ENGINE_FAILED}"
    assert all(TRACEBACK.match(line) for line in stderr[dump:])
    assert s.group_pids() == []


def test_free_memory_below_utilization_fails_exactly_as_vllm(sim: StartSim, tmp_path: Path) -> None:
    meminfo = write_meminfo(tmp_path / "meminfo", 121.69, 80.0, cached_gib=12.0)
    s = sim("m", "--gpu-memory-utilization", "0.9", env={"GB10D_SIM_MEMINFO": str(meminfo)})
    expected = (
        "ValueError: Free memory on device cuda:0 (80.0/121.69 GiB) on startup is less than desired GPU memory utilization "
        "(0.9, 109.52 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )
    _assert_engine_start_failed(s, expected)
    assert FREE_MEMORY.search(expected)


def test_a_lower_utilization_that_fits_starts(sim: StartSim, tmp_path: Path) -> None:
    meminfo = write_meminfo(tmp_path / "meminfo", 121.69, 80.0, cached_gib=12.0)
    s = sim("m", "--gpu-memory-utilization", "0.65", env={"GB10D_SIM_MEMINFO": str(meminfo)})
    s.wait_ready()
    # 0.65 of 121.69 GiB is 79.1 GiB, below the 80.0 GiB free: vLLM's check passes and says nothing.
    assert s.process.poll() is None
    assert b"Free memory on device" not in bytes(s.stdout) + bytes(s.stderr)


def test_free_and_total_gib_knobs_feed_the_same_check(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_TOTAL_GIB": "100", "GB10D_SIM_FREE_GIB": "50"})
    _assert_engine_start_failed(
        s,
        "ValueError: Free memory on device cuda:0 (50.0/100.0 GiB) on startup is less than desired GPU memory utilization "
        "(0.92, 92.0 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
    )


def _bar_states(stderr: bytes) -> list[tuple[int, int]]:
    return [(int(m.group(2)), int(m.group(3))) for m in map(SHARD_BAR.match, physical_lines(stderr)) if m]


def _io_chars(pid: int) -> int:
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()[0]


def test_stall_at_k_stops_the_bar_and_all_output_and_io(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "stall_at=2"})
    s.wait_output(lambda out, err: (2, 6) in _bar_states(err))
    engine = s.engine_pid()
    # The bar's bytes can reach us before the kernel counts them in /proc/PID/io (it does once write()
    # returns): count from when the loader sleeps, which after the 2/6 draw is only the stall itself.
    wait_until(lambda: _state(engine) == "S", what="the stalled loader to sleep")
    before = (bytes(s.stdout), bytes(s.stderr), _io_chars(engine))
    # An observation window of ten healthy shard times (0.12 s each at this speed).
    time.sleep(1.2)
    assert (bytes(s.stdout), bytes(s.stderr), _io_chars(engine)) == before
    assert _bar_states(bytes(s.stderr))[-1] == (2, 6)
    assert s.process.poll() is None


def test_slow_shards_progress_and_read_real_bytes(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "slow_shards=50"})
    s.wait_output(lambda out, err: (1, 6) in _bar_states(err))
    engine = s.engine_pid()
    before = _io_chars(engine)
    s.wait_output(lambda out, err: (2, 6) in _bar_states(err))
    assert _io_chars(engine) > before
    s.wait_ready()
    assert _bar_states(bytes(s.stderr)) == [(n, 6) for n in range(7)] + [(6, 6)]


def test_eager_load_strategy_is_not_hit_by_the_stall(sim: StartSim) -> None:
    s = sim("m", "--safetensors-load-strategy", "eager", env={"GB10D_SIM_SCENARIO": "stall_at=2"})
    s.wait_ready()
    assert (6, 6) in _bar_states(bytes(s.stderr))


@pytest.mark.parametrize("phase", ["load", "profile", "graphs"])
def test_cuda_oom_fails_the_engine_start(sim: StartSim, phase: str) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": f"cuda_oom_during={phase}"})
    assert s.wait_exit() == 1
    s.drain()
    last = RECORD.match(_failure_record(bytes(s.stdout))[-1]).group("msg")  # type: ignore[union-attr]
    assert last.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate ")
    _assert_engine_start_failed(s, last)
    found = messages(bytes(s.stdout))
    assert any(m.startswith("Failed to load model - not enough GPU memory.") for m in found) == (phase == "load")
    assert any(m.startswith("Loading weights took") for m in found) == (phase != "load")
    assert any(m.startswith("Graph capturing finished") for m in found) is False


def test_kv_insufficient_fails_with_vllms_text(sim: StartSim) -> None:
    s = sim("m", "--max-model-len", "131072", env={"GB10D_SIM_SCENARIO": "kv_insufficient"})
    assert s.wait_exit() == 1
    s.drain()
    last = RECORD.match(_failure_record(bytes(s.stdout))[-1]).group("msg")  # type: ignore[union-attr]
    assert re.fullmatch(
        r"ValueError: To serve at least one request with the model's max seq len \(131072\), \(8\.00 GiB KV cache is needed, "
        r"which is larger than the available KV cache memory \(4\.80 GiB\)\. Based on the available memory, the estimated "
        r"maximum model length is 78640\. Try increasing `gpu_memory_utilization` \(which also controls CPU memory on the CPU "
        r"backend\) or decreasing `max_model_len` when initializing the engine\. See https://docs\.vllm\.ai/en/latest/"
        r"configuration/conserving_memory/ for more details\.",
        last,
    )
    _assert_engine_start_failed(s, last)


def test_a_utilization_below_the_weights_leaves_no_kv_blocks(sim: StartSim) -> None:
    s = sim("m", "--gpu-memory-utilization", "0.2")
    _assert_engine_start_failed(
        s,
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
        "engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
    )


def test_model_not_found_fails_in_the_api_server_before_any_engine(sim: StartSim) -> None:
    s = sim("Qwen/No-Such-Model", env={"GB10D_SIM_SCENARIO": "model_not_found"})
    assert s.wait_exit() == 1
    s.drain()
    stderr = bytes(s.stderr).decode()
    assert "OSError: Qwen/No-Such-Model is not a local folder and is not a valid model identifier listed on 'https://huggingface.co/models'" in stderr
    assert "ValueError: Invalid repository ID or local directory specified: 'Qwen/No-Such-Model'." in stderr
    assert b"EngineCore" not in bytes(s.stdout) + bytes(s.stderr)
    assert all(TRACEBACK.match(line) or BLANK_TAGGED.match(line) for line in physical_lines(bytes(s.stderr)))


def test_bad_tool_parser_fails_before_the_port_is_bound(sim: StartSim) -> None:
    s = sim("m", "--enable-auto-tool-choice", "--tool-call-parser", "qwen9", env={})
    assert s.wait_exit() == 1
    s.drain()
    last = physical_lines(bytes(s.stderr))[-1]
    assert re.search(r"KeyError: 'invalid tool call parser: qwen9 \(chose from \{ [\w,-]+ \}\)'$", last)
    forced = sim("m", "--reasoning-parser", "qwen3", env={"GB10D_SIM_SCENARIO": "bad_parser"})
    assert forced.wait_exit() == 1
    forced.drain()
    assert "KeyError: 'invalid reasoning parser: qwen3 (chose from {" in physical_lines(bytes(forced.stderr))[-1]


def test_port_in_use_is_vllms_oserror_before_any_engine(sim: StartSim) -> None:
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        s = sim("m", port=holder.getsockname()[1])
        assert s.wait_exit() == 1
        s.drain()
    assert physical_lines(bytes(s.stderr))[-1] == f"(APIServer pid={s.process.pid}) OSError: [Errno 98] Address already in use"
    assert b"EngineCore" not in bytes(s.stdout)


def test_served_model_name_without_a_model_is_vllms_value_error(sim: StartSim) -> None:
    s = sim("--served-model-name", "tiny")
    assert s.wait_exit() == 1
    s.drain()
    assert physical_lines(bytes(s.stderr))[-1] == (
        "ValueError: `model` should be provided as the first positional argument when using `vllm serve`. "
        "i.e. `vllm serve <model> --<arg> <value>`."
    )


def test_leak_gib_leaves_memory_trapped_in_the_meminfo_file_after_a_failed_start(sim: StartSim, tmp_path: Path) -> None:
    meminfo = write_meminfo(tmp_path / "meminfo", 121.69, 100.0, cached_gib=12.0)
    before = {k: v for k, v in (line.split(":") for line in meminfo.read_text().splitlines())}
    s = sim("m", env={"GB10D_SIM_MEMINFO": str(meminfo), "GB10D_SIM_SCENARIO": "cuda_oom_during=profile,leak_gib=40"})
    assert s.wait_exit() == 1
    after = {k: v for k, v in (line.split(":") for line in meminfo.read_text().splitlines())}

    def kb(text: str) -> int:
        return int(text.split()[0])

    assert kb(before["MemAvailable"]) - kb(after["MemAvailable"]) == 40 * 1024 * 1024
    assert kb(before["MemFree"]) - kb(after["MemFree"]) == 40 * 1024 * 1024
    assert after["MemTotal"] == before["MemTotal"]


def test_a_missing_meminfo_file_is_one_line_not_a_traceback_of_the_stand_in(sim: StartSim, tmp_path: Path) -> None:
    s = sim("m", env={"GB10D_SIM_MEMINFO": str(tmp_path / "absent")})
    assert s.wait_exit() == 1
    s.drain()
    stderr = bytes(s.stderr).decode()
    assert f"gb10d.sim: GB10D_SIM_MEMINFO: cannot read {tmp_path / 'absent'}: No such file or directory\n" in stderr
    assert "gb10d/sim" not in stderr
    assert physical_lines(bytes(s.stderr))[-1].endswith(ENGINE_FAILED)
