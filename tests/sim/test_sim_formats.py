"""The stand-in's bytes, character for character: records, tags, bars, failure texts."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

import pytest

from gb10d.sim import texts
from gb10d.sim.args import human_int, non_default_args, parse_serve_args
from gb10d.sim.output import Bar, Console, LogStyle, format_default_meter, format_record, format_shard_meter, format_uvicorn
from gb10d.sim.server import ApiServer
from gb10d.sim.settings import GIB, SettingsError, from_environ, parse_meminfo, parse_scenario

WHEN = 1796220484.0  # a fixed instant; the month-day and time depend on the local zone


def _stamp() -> str:
    import time

    return time.strftime("%m-%d %H:%M:%S", time.localtime(WHEN))


def test_record_in_the_wrapper_era_has_no_tag_in_the_format() -> None:
    style = LogStyle(wrapper_tag=True)
    line = format_record(style, "APIServer", 42, "INFO", WHEN, "entrypoints/openai/api_server.py:583", "Starting vLLM server on http://0.0.0.0:8000")
    assert line == f"INFO {_stamp()} [api_server.py:583] Starting vLLM server on http://0.0.0.0:8000\n"


def test_record_in_the_0_31_era_carries_the_tag_after_the_prefix() -> None:
    style = LogStyle(wrapper_tag=False, prefix="[vllm] ")
    line = format_record(style, "EngineCore", 7, "WARNING", WHEN, "v1/worker/gpu_worker.py:480", "x")
    assert line == f"[vllm] (EngineCore pid=7) WARNING {_stamp()} [gpu_worker.py:480] x\n"


def test_multi_line_record_repeats_the_full_prefix_after_each_carriage_return() -> None:
    style = LogStyle(wrapper_tag=False)
    line = format_record(style, "APIServer", 1, "ERROR", WHEN, "v1/engine/async_llm.py:704", "failed.\nTraceback (most recent call last):\nValueError: x")
    head = f"(APIServer pid=1) ERROR {_stamp()} [async_llm.py:704] "
    assert line == f"{head}failed.\r\n{head}Traceback (most recent call last):\r\n{head}ValueError: x\n"


def test_debug_level_shows_the_relative_source_path() -> None:
    style = LogStyle(wrapper_tag=True, threshold=10)
    line = format_record(style, "APIServer", 1, "DEBUG", WHEN, "v1/metrics/loggers.py:271", "m")
    assert "[v1/metrics/loggers.py:271] m" in line


def test_uvicorn_level_is_padded_to_nine_then_a_space() -> None:
    assert format_uvicorn("INFO", "Started server process [5]") == "INFO:     Started server process [5]\n"
    assert format_uvicorn("WARNING", "x") == "WARNING:  x\n"


def _captured_console(tmp_path: Path, style: LogStyle, name: str = "EngineCore", pid: int = 9) -> tuple[Console, Callable[[], tuple[bytes, bytes]]]:
    """A Console whose fds 1 and 2 are files, read back after writing."""
    out, err = tmp_path / "out", tmp_path / "err"
    saved = os.dup(1), os.dup(2)
    fd_out, fd_err = os.open(out, os.O_WRONLY | os.O_CREAT), os.open(err, os.O_WRONLY | os.O_CREAT)
    os.dup2(fd_out, 1)
    os.dup2(fd_err, 2)

    def restore() -> tuple[bytes, bytes]:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (fd_out, fd_err, *saved):
            os.close(fd)
        return out.read_bytes(), err.read_bytes()

    return Console(style, name, pid), restore


def test_wrapper_tag_starts_every_physical_line_including_bar_padding(tmp_path: Path) -> None:
    console, restore = _captured_console(tmp_path, LogStyle(wrapper_tag=True))
    console.write(2, "\rlong state line\n")
    console.write(2, "\rshort\n" + " " * 10)
    console.write(2, "\rnext\n")
    console.write(2, "\n")
    _, err = restore()
    tag = b"(EngineCore pid=9) "
    assert err == tag + b"\rlong state line\n" + tag + b"\rshort\n" + tag + b" " * 10 + b"\rnext\n" + tag + b"\n"


def test_no_tag_anywhere_without_vllm_logging_configuration(tmp_path: Path) -> None:
    console, restore = _captured_console(tmp_path, LogStyle(wrapper_tag=True, configured=False))
    console.log("INFO", "x.py:1", "hidden")
    console.log("WARNING", "x.py:1", "shown bare")
    console.write(2, "\rbar\n")
    out, err = restore()
    assert out == b""
    assert err == b"shown bare\n\rbar\n"


def test_shard_meter_fields_follow_tqdm() -> None:
    desc = "Loading safetensors checkpoint shards"
    assert format_shard_meter(desc, 0, 4, 0, None) == f"{desc}:   0% Completed | 0/4 [00:00<?, ?it/s]\n"
    assert format_shard_meter(desc, 1, 4, 12.3, 1 / 12.04) == f"{desc}:  25% Completed | 1/4 [00:12<00:36, 12.04s/it]\n"
    assert format_shard_meter(desc, 6, 6, 0.0105, None) == f"{desc}: 100% Completed | 6/6 [00:00<00:00, 571.43it/s]\n"
    assert format_shard_meter(desc, 2, 4, 3700, 3.21) == f"{desc}:  50% Completed | 2/4 [1:01:40<00:00,  3.21it/s]\n"


def test_default_meter_draws_the_ten_column_unicode_bar_of_the_recording() -> None:
    assert format_default_meter("Capturing CUDA graphs (PIECEWISE)", 5, 51, 0.1, 44.32) == (
        "Capturing CUDA graphs (PIECEWISE):  10%|\u2589         | 5/51 [00:00<00:01, 44.32it/s]"
    )
    assert format_default_meter("Capturing CUDA graphs (FULL)", 51, 51, 0.4, 120.98) == (
        "Capturing CUDA graphs (FULL): 100%|" + "\u2588" * 10 + "| 51/51 [00:00<00:00, 120.98it/s]"
    )


def test_a_fast_shard_bar_shows_zero_then_the_final_state_once_then_an_empty_line(tmp_path: Path) -> None:
    console, restore = _captured_console(tmp_path, LogStyle(wrapper_tag=False))
    bar = Bar(console, "Loading safetensors checkpoint shards", 6, shard_format=True)
    for _ in range(6):
        bar.advance()  # far faster than tqdm's 0.1 s mininterval: nothing redrawn
    bar.close()
    _, err = restore()
    lines = err.decode().split("\n")
    assert lines[0] == "\rLoading safetensors checkpoint shards:   0% Completed | 0/6 [00:00<?, ?it/s]"
    assert lines[1].startswith("\rLoading safetensors checkpoint shards: 100% Completed | 6/6 [00:00<00:00, ")
    assert lines[2:] == ["", ""]


def test_free_memory_error_uses_vllms_rounding_and_float_repr() -> None:
    total = int(121.69 * GIB)
    free = int(80.0 * GIB)
    requested = math.ceil(total * 0.9)
    assert texts.free_memory_error(free, total, 0.9, requested) == (
        "Free memory on device cuda:0 (80.0/121.69 GiB) on startup is less than desired GPU memory utilization "
        "(0.9, 109.52 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
    )


def test_kv_insufficient_error_text() -> None:
    assert texts.kv_insufficient_error(262144, 16.0, 9.6, 157280) == (
        "To serve at least one request with the model's max seq len (262144), (16.00 GiB KV cache is needed, which is "
        "larger than the available KV cache memory (9.60 GiB). Based on the available memory, the estimated maximum model "
        "length is 157280. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
        "decreasing `max_model_len` when initializing the engine. See "
        "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def test_not_found_body_is_vllms_exact_json_and_lists_aliases_from_0_32() -> None:
    assert texts.not_found_body("Qwen3.6-27B-FP8", ["tiny"], 23) == (
        '{"error":{"message":"The model `Qwen3.6-27B-FP8` does not exist.","type":"NotFoundError","param":"model","code":404}}'
    )
    assert "does not exist. Valid aliases: a, b." in texts.not_found_body("x", ["a", "b"], 32)


def test_engine_start_failure_ends_with_the_recorded_empty_set() -> None:
    assert texts.engine_init_failed() == "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"


def test_spec_decoding_line_has_vllms_fixed_order() -> None:
    now: dict[str, float] = {"accepted": 30, "draft_tokens": 60, "pos0": 17, "pos1": 9, "pos2": 4}
    before: dict[str, float] = {"accepted": 0, "draft_tokens": 0}
    line = ApiServer._spec_line(now, before, 20, 3, 10.0)
    assert line == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, Drafted throughput: 6.00 tokens/s, "
        "Accepted: 30 tokens, Drafted: 60 tokens, Per-position acceptance rate: 0.850, 0.450, 0.200, Avg Draft acceptance rate: 50.0%"
    )


def test_max_model_len_accepts_vllms_human_readable_forms() -> None:
    assert [human_int(t) for t in ("32768", "32k", "32K", "25.6k", "-1", "auto")] == [32768, 32000, 32768, 25600, -1, -1]


def test_non_default_args_come_in_vllms_order() -> None:
    args = parse_serve_args(["/srv/models/tiny-llama", "--served-model-name", "tiny", "--port", "8000", "--max-model-len", "2048", "--gpu-memory-utilization", "0.30"], 23)
    assert repr(non_default_args(args, 23)) == (
        "{'model_tag': '/srv/models/tiny-llama', 'model': '/srv/models/tiny-llama', 'max_model_len': 2048, "
        "'served_model_name': ['tiny'], 'gpu_memory_utilization': 0.3}"
    )


def test_dotted_and_underscored_flags_are_accepted_like_vllm() -> None:
    args = parse_serve_args(["m", "--speculative-config.method", "mtp", "--speculative_config.num_speculative_tokens", "3", "--max_model_len=4k"], 23)
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert args.max_model_len == 4000


def test_scenarios_parse_and_combine() -> None:
    scenario = parse_scenario("slow_shards=2.5, hang_after=3,kv_insufficient")
    assert (scenario.slow_shards_s, scenario.hang_after_s, scenario.kv_insufficient) == (2.5, 3.0, True)
    assert parse_scenario("healthy") == parse_scenario("")


@pytest.mark.parametrize("text", ["stall_at=x", "cuda_oom_during=compile", "explode", "slow_shards=-1"])
def test_bad_scenarios_are_one_line_errors(text: str) -> None:
    with pytest.raises(SettingsError):
        parse_scenario(text)


def test_era_selects_tag_placement_and_default_version() -> None:
    assert (from_environ({}).era, from_environ({}).version) == ("0.30", "0.23.0")
    newer = from_environ({"GB10D_SIM_ERA": "0.31"})
    assert (newer.style.wrapper_tag, newer.version) == (False, "0.31.0")
    assert from_environ({"GB10D_SIM_VERSION": "0.33.1"}).era == "0.31"


def test_memory_comes_from_meminfo_memtotal_and_memfree(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       127601760 kB\nMemFree:        83886080 kB\nMemAvailable:   120000000 kB\n")
    settings = from_environ({"GB10D_SIM_MEMINFO": str(path)})
    memory = settings.memory()
    assert (memory.total_bytes, memory.free_bytes) == (127601760 * 1024, 83886080 * 1024)
    path.write_text("MemTotal:       127601760 kB\nMemFree:        1048576 kB\n")
    assert settings.memory().free_bytes == 1048576 * 1024  # read again at every check
    assert parse_meminfo("Cached: 5 kB\n") == {"Cached": 5120}


def test_colour_codes_only_decorate_the_plain_record() -> None:
    import re

    plain = format_record(LogStyle(wrapper_tag=False), "APIServer", 1, "INFO", WHEN, "a/b.py:3", "hello")
    coloured = format_record(LogStyle(wrapper_tag=False, color=True), "APIServer", 1, "INFO", WHEN, "a/b.py:3", "hello")
    assert "\x1b[" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == plain


def test_no_color_wins_over_everything() -> None:
    from gb10d.sim.settings import use_color

    assert use_color({"NO_COLOR": "1", "VLLM_LOGGING_COLOR": "1"}, 31, True) is False
    assert use_color({"VLLM_LOGGING_COLOR": "1"}, 23, False) is True
    assert use_color({"FORCE_COLOR": "1"}, 23, False) is False
    assert use_color({"FORCE_COLOR": "1"}, 31, False) is True
    assert use_color({}, 23, True) is True
