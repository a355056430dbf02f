"""diagnose: verdicts, facts and advice for logs as people paste them, and the `gb10d diagnose` command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gb10d.base.command import Tunables
from gb10d.base.config import Config
from gb10d.core.diagnose import VERDICTS, diagnose
from gb10d.core.diagnose.pasted import read_lines
from gb10d.core.outcome import Cause, Failed
from gb10d.core.policy import History, Retry, next_attempt
from gb10d.vllm.events import FreeMemoryShort

CORPUS = Path(__file__).parent.parent / "corpus"
EXPECTED: dict[str, dict[str, object]] = json.loads((CORPUS / "expected.json").read_text())
REAL = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_log_gets_its_verdict_and_facts(name: str) -> None:
    expected = EXPECTED[name]
    result = diagnose((CORPUS / name).read_text(encoding="utf-8"))
    assert result.verdict == expected["verdict"], result.render()
    facts = expected["facts"]
    assert isinstance(facts, dict)
    assert {k: result.facts.get(k) for k in facts} == facts, result.render()


def test_corpus_covers_every_verdict() -> None:
    assert {e["verdict"] for e in EXPECTED.values()} == set(VERDICTS)


def real(name: str) -> str:
    return (REAL / f"{name}.stdout").read_text(encoding="utf-8") + (REAL / f"{name}.stderr").read_text(encoding="utf-8")


def test_the_real_healthy_start_is_ready_with_its_version_and_throughput() -> None:
    result = diagnose(real("healthy"))
    assert result.verdict == "ready"
    assert result.facts == {"vllm_version": "0.23.0", "generation_tokens_per_second": 0.5}


def test_the_real_engine_death_is_engine_dead() -> None:
    assert diagnose(real("enginedeath")).verdict == "engine_dead"


FREE = ("(EngineCore pid=4300) ERROR 12-02 14:00:22 [core.py:1019] ValueError: Free memory on device cuda:0 "
        "(103.45/123.73 GiB) on startup is less than desired GPU memory utilization (0.92, 113.83 GiB). "
        "Decrease GPU memory utilization or reduce GPU memory used by other processes.")


def test_the_drivers_out_of_memory_line_does_not_outrank_the_error_vllm_named() -> None:
    # Healthy starts on GB10 log one such line too: beside vLLM's own error it is not the cause.
    driver = "Dec 04 12:00:00 spark kernel: NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051)"
    assert diagnose(FREE + "\n" + driver).verdict == "free_memory"
    assert diagnose(driver).verdict == "driver_oom"
    # A start that went on loading after the line and became ready is ready.
    first, rest = real("healthy").split("\n", 1)
    assert diagnose(first + "\n" + driver + "\n" + rest).verdict == "ready"


def test_free_memory_advice_names_the_key_and_the_value() -> None:
    result = diagnose(FREE)
    assert result.verdict == "free_memory"
    assert "vllm.gpu_memory_utilization = 0.82" in result.advice


def shard_log(stamps: list[str], last: str) -> str:
    lines = [f"{stamp} spark gb10d[77]: (EngineCore pid=9) \rLoading safetensors checkpoint shards: "
             f"{n * 100 // 66:3d}% Completed | {n}/66 [00:00<?, ?it/s]" for n, stamp in enumerate(stamps)]
    lines.append(f"{last} spark gb10d[77]: (APIServer pid=8) DEBUG 12-02 14:00:00 [utils.py:1] Waiting for 1 local, "
                 "0 remote core engine proc(s) to start.")
    return "\n".join(lines) + "\n"


def test_silence_longer_than_the_stall_timeout_is_a_stall_and_shorter_is_loading() -> None:
    text = shard_log(["Dec 02 14:00:00", "Dec 02 14:00:30"], "Dec 02 14:06:00")
    stalled = diagnose(text)
    assert (stalled.verdict, stalled.facts) == ("shard_stall", {"shards_loaded": 1, "shards_total": 66})
    assert 'vllm.args.safetensors_load_strategy = "eager"' in stalled.advice
    assert diagnose(text, stall_timeout_s=600).verdict == "loading"


def test_a_slow_but_advancing_load_is_loading() -> None:
    stamps = [f"Dec 02 14:{m:02d}:{s:02d}" for m in range(0, 20) for s in (0, 30)]
    assert diagnose(shard_log(stamps, "Dec 02 14:20:00")).verdict == "loading"


def test_a_stall_is_only_claimed_on_timestamp_evidence() -> None:
    text = "(EngineCore pid=9) \rLoading safetensors checkpoint shards:   0% Completed | 0/66 [00:00<?, ?it/s]\n"
    assert diagnose(text).verdict == "loading"


def test_gb10d_own_stall_line_makes_a_stall_without_timestamps() -> None:
    text = ("(EngineCore pid=9) \rLoading safetensors checkpoint shards:   0% Completed | 0/66 [00:00<?, ?it/s]\n"
            "gb10d: no loading progress for 300 s (startup.stall_timeout_s 300) at shard 0/66, and vLLM's processes "
            "did no I/O; stopping the process group\n")
    assert diagnose(text).verdict == "shard_stall"


def test_the_year_boundary_does_not_look_like_a_stall() -> None:
    text = shard_log(["Dec 31 23:59:50"], "Jan 01 00:00:10")
    assert diagnose(text).verdict == "loading"


@pytest.mark.parametrize(
    "prefix",
    [
        "<3>",
        "[  512.123456] spark gb10d[1234]: ",
        "[pod/vllm-0/vllm] ",
        "2026-12-02T14:00:22.123456+00:00 spark gb10d[1234]: ",
        "Dec  2 14:00:22 spark gb10d.service[1234]: ",
        "vllm_server.1  | 2026-12-02T14:00:22.000000000Z ",
        "Wed 2026-12-02 14:00:22 UTC spark gb10d[1234]: ",
        "1764684022.123456 spark gb10d[1234]: ",
    ],
)
def test_other_wrapper_shapes_are_stripped(prefix: str) -> None:
    assert diagnose(prefix + FREE + "\n").verdict == "free_memory"


@pytest.mark.parametrize("width", [72, 100, 120])
def test_a_paste_wrapped_at_any_terminal_width_is_unwrapped(width: int) -> None:
    text = (CORPUS / "kv_insufficient__0.30__plain.log").read_text(encoding="utf-8")
    wrapped = "\n".join(line[i : i + width] for line in text.splitlines() for i in range(0, max(len(line), 1), width))
    result = diagnose(wrapped)
    assert (result.verdict, result.facts.get("estimated_max_model_len")) == ("kv_cache_insufficient", 40960)


def test_the_latest_start_decides_after_an_earlier_success() -> None:
    ready = (CORPUS / "ready__0.31__plain.log").read_text(encoding="utf-8")
    failed = (CORPUS / "free_memory__0.31__plain.log").read_text(encoding="utf-8").replace("pid=4242", "pid=9999")
    assert diagnose(ready + failed).verdict == "free_memory"
    assert diagnose(failed + ready.replace("pid=4242", "pid=5555")).verdict == "ready"


def test_an_interrupted_start_is_not_a_crash() -> None:
    text = ("(APIServer pid=1) INFO 12-02 14:00:00 [api_utils.py:330] vLLM server version 0.31.0, serving model m\n"
            "(EngineCore pid=2) INFO 12-02 14:00:20 [weight_utils.py:922] Filesystem type for checkpoints: EXT4.\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nKeyboardInterrupt: terminated\n")
    assert diagnose(text).verdict == "loading"


def test_empty_input_is_unknown() -> None:
    result = diagnose("")
    assert result.verdict == "unknown" and result.facts == {}


def test_rendering_shows_verdict_facts_and_advice() -> None:
    text = diagnose(FREE).render()
    assert text.startswith("verdict: free_memory\n")
    assert "  suggested_utilization: 0.82\n" in text and "advice: After this failure gb10d restarts by itself with gpu_memory_utilization 0.82" in text


# --- the command ----------------------------------------------------------------------


def gb10d(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gb10d", "diagnose", *args], input=stdin.decode() if stdin else None,
        capture_output=True, text=True, timeout=60,
    )


@pytest.mark.slow
def test_json_output_is_exactly_one_object_with_three_keys(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(FREE + "\n")
    done = gb10d(str(log), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"verdict", "facts", "advice"} and out["verdict"] == "free_memory"
    assert out["facts"]["suggested_utilization"] == 0.82
    assert done.stdout.count("\n") == 1


@pytest.mark.slow
def test_stdin_and_human_output() -> None:
    done = gb10d("-", stdin=FREE.encode())
    assert done.returncode == 0 and done.stdout.startswith("verdict: free_memory")


@pytest.mark.slow
def test_stall_timeout_option_is_used(tmp_path: Path) -> None:
    log = tmp_path / "stall.log"
    log.write_text(shard_log(["Dec 02 14:00:00"], "Dec 02 14:02:00"))
    assert json.loads(gb10d(str(log), "--json").stdout)["verdict"] == "loading"
    assert json.loads(gb10d(str(log), "--json", "--stall-timeout", "60").stdout)["verdict"] == "shard_stall"


@pytest.mark.slow
def test_a_missing_file_is_one_clear_line_and_exit_66(tmp_path: Path) -> None:
    done = gb10d(str(tmp_path / "nope.log"))
    assert done.returncode == 66
    assert done.stderr.strip().splitlines() == [f"gb10d: cannot read {tmp_path / 'nope.log'}: No such file or directory"]
    assert done.stdout == ""


@pytest.mark.slow
def test_binary_garbage_is_diagnosed_not_a_traceback(tmp_path: Path) -> None:
    log = tmp_path / "junk.bin"
    log.write_bytes(bytes(range(256)) * 10)
    done = gb10d(str(log), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["verdict"] == "unknown"


@pytest.mark.parametrize("era", ["0.30", "0.31"])
def test_a_custom_logging_prefix_is_found_and_understood(era: str) -> None:
    text = (CORPUS / f"kv_insufficient__{era}__plain.log").read_text(encoding="utf-8")
    if era == "0.30":
        prefixed = text.replace(") INFO ", ") [spark-1] INFO ").replace(") ERROR ", ") [spark-1] ERROR ")
    else:
        prefixed = text.replace("(APIServer pid", "[spark-1] (APIServer pid").replace("(EngineCore pid=4300) INFO", "[spark-1] (EngineCore pid=4300) INFO")
    result = diagnose(prefixed)
    assert (result.verdict, result.facts.get("estimated_max_model_len")) == ("kv_cache_insufficient", 40960)
    assert result.facts.get("vllm_version") == ("0.30.0" if era == "0.30" else "0.31.0")


@pytest.mark.parametrize(
    "line",
    [
        "Killed",
        "[1]+  Killed                  nohup vllm serve Qwen/Qwen3.6-27B-FP8",
        "./start-vllm.sh: line 12: 48213 Killed                  vllm serve Qwen/Qwen3.6-27B-FP8",
        "Dec 02 14:20:01 spark systemd[1]: gb10d.service: A process of this unit has been killed by the OOM killer.",
        "Dec 02 14:20:01 spark kernel: Out of memory: Killed process 48213 (VLLM::EngineCor) total-vm:190000000kB",
    ],
)
def test_a_kill_from_outside_mid_load_is_a_crash_with_memory_advice(line: str) -> None:
    text = (CORPUS / "loading__0.31__plain.log").read_text(encoding="utf-8") + line + "\n"
    result = diagnose(text)
    assert result.verdict == "crash" and "OOM killer" in result.advice
    assert "vllm.gpu_memory_utilization = 0.87" in result.advice


def test_a_stall_with_eager_already_on_does_not_advise_eager_again() -> None:
    text = shard_log(["Dec 02 14:00:00"], "Dec 02 14:10:00").replace("checkpoint shards:", "checkpoint shards (eager):")
    result = diagnose(text)
    assert result.verdict == "shard_stall" and '"prefetch"' in result.advice and '= "eager"' not in result.advice


def test_records_run_together_on_one_line_are_split_again() -> None:
    text = ("(APIServer pid=1) INFO 12-02 14:00:00 [api_server.py:583] Starting vLLM server on http://0.0.0.0:8000"
            "INFO:     Waiting for application startup.INFO:     Application startup complete.\n")
    assert diagnose(text).verdict == "ready"
    glued = FREE.replace("(EngineCore", "(APIServer pid=1) INFO 12-02 14:00:00 [x.py:1] Loading weights took 1.0 seconds(EngineCore")
    assert diagnose(glued).facts["free_gib"] == 103.45


def test_an_oom_while_loading_says_so() -> None:
    text = (CORPUS / "cuda_oom_load__0.31__plain.log").read_text(encoding="utf-8")
    assert "while loading the weights" in diagnose(text).summary


def test_journalctl_json_output_is_read_with_its_times() -> None:
    def entry(seconds: int, message: object) -> str:
        return json.dumps({"__REALTIME_TIMESTAMP": str((1764684000 + seconds) * 10**6), "SYSLOG_IDENTIFIER": "gb10d",
                           "MESSAGE": message})

    bar = "(EngineCore pid=9) Loading safetensors checkpoint shards:   1% Completed | 1/66 [00:30<?, ?it/s]"
    lines = [entry(0, list(("\r" + bar).encode())),
             entry(600, "(APIServer pid=8) DEBUG 12-02 14:10:00 [utils.py:1] Waiting for 1 local, 0 remote core engine proc(s) to start.")]
    result = diagnose("\n".join(lines) + "\n")
    assert (result.verdict, result.facts) == ("shard_stall", {"shards_loaded": 1, "shards_total": 66})


def test_lines_of_equal_length_that_each_start_a_record_are_not_joined() -> None:
    access = '(APIServer pid=8) INFO:     127.0.0.1:51236 - "GET /health HTTP/1.1" 200 OK'
    lines = read_lines("\n".join([access] * 5))
    assert [line.text for line in lines] == [access] * 5


def test_a_free_memory_failure_on_the_ray_worker_machine_is_diagnosed_with_its_numbers() -> None:
    log = (
        "(EngineCore pid=18159) (RayWorkerWrapper pid=18177, ip=10.0.0.2) ERROR 12-02 20:29:38 [worker_base.py:362] "
        "Error executing method 'init_device'. This might cause deadlock in distributed execution.\n"
        "(EngineCore pid=18159) (RayWorkerWrapper pid=18177, ip=10.0.0.2) ERROR 12-02 20:29:38 [worker_base.py:362] "
        "ValueError: Free memory on device cuda:0 (40.0/121.69 GiB) on startup is less than desired GPU memory utilization "
        "(0.92, 111.95 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.\n"
        "(EngineCore pid=18159) ERROR 12-02 20:29:38 [core.py:1020] EngineCore failed to start.\n"
    )
    found = diagnose(log)
    assert found.verdict == "free_memory"
    assert (found.facts["free_gib"], found.facts["total_gib"], found.facts["suggested_utilization"]) == (40.0, 121.69, 0.32)


# --- advice is what gb10d itself would do ---------------------------------------------

ADVISED = re.compile(r"gpu_memory_utilization = (-?[\d.]+)")


def free_memory_line(free: float, total: float, util: float) -> str:
    return (f"(EngineCore pid=1) ERROR 12-02 14:00:22 [core.py:1019] ValueError: Free memory on device cuda:0 ({free}/{total} GiB) "
            f"on startup is less than desired GPU memory utilization ({util}, {round(total * util, 2)} GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes.\n")


@pytest.mark.parametrize(("free", "total"), [(0.49, 79.32), (1.54, 22.05), (20.0, 121.69)])
def test_too_little_free_memory_for_the_minimum_says_what_holds_it_not_an_absurd_value(free: float, total: float) -> None:
    result = diagnose(free_memory_line(free, total, 0.9))
    assert result.verdict == "free_memory" and "suggested_utilization" not in result.facts
    assert ADVISED.search(result.advice) is None, result.advice
    assert "below memory.min_gpu_memory_utilization 0.3" in result.advice
    assert "ps -eo pid,rss,comm --sort=-rss" in result.advice and "reboot" in result.advice


@pytest.mark.parametrize("free", [v / 4 for v in range(0, 500)])
def test_free_memory_advice_never_leaves_the_minimum_to_one(free: float) -> None:
    result = diagnose(free_memory_line(free, 121.69, 0.92))
    for value in ADVISED.findall(result.advice):
        assert 0.3 <= float(value) <= 1, result.advice
    if "suggested_utilization" in result.facts:
        assert 0.3 <= result.facts["suggested_utilization"] <= 1


def test_the_advice_is_the_supervisors_decision() -> None:
    cfg = Config.model_validate({"vllm": {"executable": "/usr/bin/vllm", "model": "m", "gpu_memory_utilization": 0.92}})
    event = FreeMemoryShort(60.0, 121.69, 0.92, 111.95)
    decision = next_attempt(Failed(cause=Cause.FREE_MEMORY, failure=event), Tunables(0.92), History(1), cfg)
    assert isinstance(decision, Retry)
    result = diagnose(free_memory_line(60.0, 121.69, 0.92))
    assert result.facts["suggested_utilization"] == decision.tunables.gpu_memory_utilization == 0.48
    assert "vllm.gpu_memory_utilization = 0.48" in result.advice


def test_a_cuda_oom_at_the_minimum_does_not_advise_going_lower() -> None:
    text = ("(APIServer pid=1) INFO 12-02 14:00:00 [api_utils.py:273] non-default args: {'model': 'm', 'gpu_memory_utilization': 0.32}\n"
            "(EngineCore pid=2) ERROR 12-02 14:00:22 [core.py:1019] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")
    result = diagnose(text)
    assert result.verdict == "cuda_oom" and ADVISED.search(result.advice) is None
    assert "below memory.min_gpu_memory_utilization 0.3" in result.advice


def test_the_gated_advice_puts_the_token_where_the_supervisor_does() -> None:
    text = ("OSError: You are trying to access a gated repo.\n401 Client Error. (Request ID: x) Cannot access gated repo for url "
            "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/resolve/main/config.json.\n")
    result = diagnose(text)
    assert result.verdict == "model_not_found" and "HF_TOKEN=... in the file named by vllm.env_file" in result.advice


# --- reading logs in general ---------------------------------------------------------------


def test_every_verdict_has_at_least_two_corpus_logs() -> None:
    counts = {verdict: sum(e["verdict"] == verdict for e in EXPECTED.values()) for verdict in VERDICTS}
    assert all(n >= 2 for n in counts.values()), counts


def test_an_error_only_paste_gets_the_verdict_of_its_last_failure() -> None:
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB.\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "OSError: [Errno 98] Address already in use\n")
    assert diagnose(text).verdict == "port_in_use"


def test_the_hidden_engine_failure_is_only_the_verdict_when_nothing_above_explains_it() -> None:
    recorded = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0-gb10d" / "1-free-memory-failure"
    text = recorded.with_suffix(".stdout").read_text(encoding="utf-8") + recorded.with_suffix(".stderr").read_text(encoding="utf-8")
    assert "Failed core proc(s): {}" in text
    assert diagnose(text).verdict == "free_memory"
    assert diagnose((CORPUS / "hidden_init__0.30__plain.log").read_text(encoding="utf-8")).verdict == "hidden_init_failure"


def test_vllm_026s_healthy_free_memory_line_is_no_failure_and_holds_back_none() -> None:
    healthy = (CORPUS / "ready_026__0.26__plain.log").read_text(encoding="utf-8").splitlines()
    failure = ("(EngineCore pid=20) ERROR 12-04 10:01:11 [core.py:1022] vllm.v1.engine.exceptions.EngineDeadError: "
               "EngineCore encountered an issue.")
    assert diagnose("\n".join(healthy[:2] + [failure]) + "\n").verdict == "engine_dead"


def test_a_generic_error_the_start_went_on_after_does_not_end_it() -> None:
    text = ("(EngineCore pid=2) INFO 12-02 14:00:20 [weight_utils.py:922] Filesystem type for checkpoints: EXT4.\n"
            "ModuleNotFoundError: No module named 'flash_attn_3'\n"
            "(EngineCore pid=2) INFO 12-02 14:00:40 [default_loader.py:397] Loading weights took 20.00 seconds\n")
    assert diagnose(text).verdict == "loading"


@pytest.mark.slow
@pytest.mark.parametrize("verdict", VERDICTS)
def test_diagnose_help_documents_every_verdict(verdict: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gb10d", "diagnose", "--help"], capture_output=True, text=True, timeout=60)
    assert re.search(rf"^  {verdict} +\S", done.stdout, re.M), done.stdout


def test_the_man_page_documents_every_verdict() -> None:
    page = (Path(__file__).parents[2] / "docs" / "gb10d.8").read_text(encoding="utf-8")
    assert all(f".B {verdict}\n" in page for verdict in VERDICTS)


HELD = ("(APIServer pid=1) INFO 12-02 14:00:00 [api_utils.py:273] non-default args: {'model_tag': 'Qwen/Qwen3.6-27B-FP8', "
        "'model': 'Qwen/Qwen3.6-27B-FP8', 'max_model_len': 262144, 'gpu_memory_utilization': 0.92}\n"
        + free_memory_line(38.7, 119.7, 0.92))


def test_much_memory_held_leads_with_what_holds_it_and_the_commands_that_show_it() -> None:
    result = diagnose(HELD)
    assert result.advice.startswith("81.0 of 119.7 GiB are held before vLLM starts; find what holds them first"), result.advice
    for command in ("pgrep -af 'vllm|EngineCore'", "nvidia-smi --query-compute-apps", "/proc/meminfo"):
        assert command in result.advice
    assert result.advice.index("pgrep") < result.advice.index("vllm.gpu_memory_utilization = 0.31")


def test_little_memory_held_leads_with_the_value_that_fits() -> None:
    assert diagnose(FREE).advice.startswith("After this failure gb10d restarts by itself with gpu_memory_utilization 0.82")


def test_the_value_that_fits_is_not_told_as_something_to_set_that_gb10d_sets_anyway() -> None:
    assert "restarts with it by itself" not in diagnose(FREE).advice


def test_a_share_that_leaves_little_beside_the_weights_warns_with_max_model_len() -> None:
    result = diagnose(HELD)
    assert result.facts["weights_gib"] == 25.15
    assert ("Warning: at 0.31 vLLM gets 37.1 GiB; the weights take 25.1 GiB (estimated from the name Qwen/Qwen3.6-27B-FP8), "
            "leaving 12.0 GiB for activations and the KV cache of max_model_len 262144") in result.advice


def test_weights_vllm_loaded_before_count_over_the_name_and_a_share_below_them_cannot_load() -> None:
    loaded = ("(APIServer pid=1) INFO 12-02 13:00:00 [api_utils.py:273] non-default args: {'model': 'Qwen/Qwen3.6-27B-FP8'}\n"
              "(EngineCore pid=2) INFO 12-02 13:01:00 [gpu_model_runner.py:2653] Model loading took 40.5 GiB and 60.1 seconds\n")
    result = diagnose(loaded + HELD)
    assert result.facts["weights_gib"] == 40.5
    assert "less than the model's 40.5 GiB of weights (as vLLM loaded them before): it cannot load at that value" in result.advice


def test_plenty_left_beside_the_weights_gives_no_warning() -> None:
    text = ("(APIServer pid=1) INFO 12-02 14:00:00 [api_utils.py:273] non-default args: {'model': 'Qwen/Qwen3-8B-FP8'}\n"
            + free_memory_line(60.0, 121.69, 0.92))
    assert "arning" not in diagnose(text).advice
