"""logparse: framing, classification, bar collapsing and events, as the specification of what vLLM prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from gb10d.vllm.events import (
    ArgsSeen,
    BadArgument,
    CompileProgressed,
    CudaOutOfMemory,
    DownloadProgressed,
    EngineDied,
    EngineInitialized,
    EngineStartFailed,
    ExceptionRaised,
    Failure,
    FreeMemoryShort,
    GpuXid,
    GraphsProgressed,
    HiddenInitFailure,
    InternalPortInUse,
    KvCacheInsufficient,
    KvCacheSized,
    LoadStarted,
    ModelGated,
    ModelNotFound,
    NoKvCacheMemory,
    PortInUse,
    PtxasArchUnsupported,
    RayWorkerLost,
    ServerStarting,
    ShardsProgressed,
    ShutdownStarted,
    SpecDecodingLogged,
    StartupCompleted,
    StatsLogged,
    VersionSeen,
    WeightsLoaded,
)
from gb10d.vllm.logparse import (
    MAX_LINE_BYTES,
    BarCollapser,
    Classifier,
    EventScanner,
    Kind,
    Line,
    LineFramer,
    classify,
    message_of,
    parse_line,
)

REAL = Path(__file__).parent.parent / "fixtures" / "real-vllm-0.23.0"

# Record prefixes of both eras: 0.23-0.30's stream tag and 0.31+'s format tag look
# alike for records; an untagged form is what VLLM_CONFIGURE_LOGGING=0 or early lines give.
API = "(APIServer pid=4242) INFO 03-14 09:26:53 [api_server.py:1011] "
ENGINE = "(EngineCore pid=4300) INFO 03-14 09:27:10 [gpu_worker.py:480] "
ENGINE_ERR = "(EngineCore pid=4300) ERROR 03-14 09:27:10 [core.py:1010] "
UNTAGGED = "INFO 03-14 09:26:53 [api_server.py:1011] "
PREFIXES = [API, ENGINE, UNTAGGED, ""]


def frame(*chunks: bytes) -> list[Line]:
    framer = LineFramer()
    out: list[Line] = []
    for chunk in chunks:
        out.extend(framer.feed(chunk))
    return out + framer.flush()


# --- framing ----------------------------------------------------------------------


def test_lines_are_framed_on_newline_and_a_crlf_continuation_is_one_line_each() -> None:
    lines = frame(b"first\r\nsecond\r\nthird\n")
    assert [line.text for line in lines] == ["first", "second", "third"]
    assert not any(line.redraw for line in lines)


def test_multibyte_characters_split_across_reads_survive() -> None:
    data = "█ version 0.23.0 — ok\n".encode()
    for cut in range(1, len(data)):
        assert [line.text for line in frame(data[:cut], data[cut:])] == ["█ version 0.23.0 — ok"]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert frame(b"bad \xff\xfe byte\n")[0].text == "bad \ufffd\ufffd byte"


def test_ansi_colour_codes_are_stripped() -> None:
    assert frame(b"\x1b[32mINFO\x1b[0m 03-14 09:26:53 [x.py:1] hi\n")[0].text == "INFO 03-14 09:26:53 [x.py:1] hi"


def test_cuda_graph_redraws_come_out_as_they_happen_before_the_newline() -> None:
    framer = LineFramer()
    tag = b"(EngineCore pid=2835) "
    assert framer.feed(tag + b"\rCapturing CUDA graphs (FULL):   0%|          | 0/51 [00:00<?, ?it/s]") == []
    got = framer.feed(b"\rCapturing CUDA graphs (FULL):  22%|##        | 11/51 [00:00<00:00, 101.50it/s]")
    assert got == [Line("(EngineCore pid=2835) Capturing CUDA graphs (FULL):   0%|          | 0/51 [00:00<?, ?it/s]", True)]
    got = framer.feed(b"\n")
    assert got == [Line("(EngineCore pid=2835) Capturing CUDA graphs (FULL):  22%|##        | 11/51 [00:00<00:00, 101.50it/s]", True)]


def test_a_trailing_carriage_return_waits_for_the_next_read_to_tell_crlf_from_redraw() -> None:
    framer = LineFramer()
    assert framer.feed(b"record one\r") == []
    assert framer.feed(b"\nrecord two\n") == [Line("record one"), Line("record two")]


def test_framing_is_the_same_for_any_read_size() -> None:
    for name in ("healthy.stderr", "healthy.stdout", "enginedeath.stdout"):
        data = (REAL / name).read_bytes()
        whole = frame(data)
        for size in (1, 7, 64, 4096):
            assert frame(*(data[i : i + size] for i in range(0, len(data), size))) == whole, (name, size)


def test_tqdm_padding_before_a_carriage_return_is_not_a_line() -> None:
    lines = frame(b"\rLoading safetensors checkpoint shards:   0% Completed | 0/4 [00:00<?, ?it/s]\n"
                  b"      \rLoading safetensors checkpoint shards:  25% Completed | 1/4 [00:12<00:36, 12.04s/it]\n")
    assert [line.text.split("| ")[1] for line in lines] == ["0/4 [00:00<?, ?it/s]", "1/4 [00:12<00:36, 12.04s/it]"]
    assert all(line.redraw for line in lines)


def test_a_runaway_line_is_capped_and_the_rest_of_it_dropped() -> None:
    framer = LineFramer()
    out: list[Line] = []
    for _ in range(200):
        out.extend(framer.feed(b"x" * 1000))
    out.extend(framer.feed(b"tail\nnext\n"))
    assert len(out) == 2
    assert out[0].truncated and len(out[0].text) <= MAX_LINE_BYTES
    assert out[1] == Line("next")


def test_a_capped_line_is_not_cut_inside_a_character() -> None:
    lines = frame("é".encode() * MAX_LINE_BYTES + b"\n")
    assert lines[0].truncated and "\ufffd" not in lines[0].text


def test_flush_returns_an_unterminated_last_line() -> None:
    framer = LineFramer()
    assert framer.feed(b"done\npartial") == [Line("done")]
    assert framer.flush() == [Line("partial")]
    assert framer.flush() == []


def test_real_shard_bar_keeps_its_engine_tag() -> None:
    lines = frame((REAL / "healthy.stderr").read_bytes())
    bars = [line.text for line in lines if "checkpoint shards" in line.text]
    assert bars == [
        "(EngineCore pid=2835) Loading safetensors checkpoint shards:   0% Completed | 0/6 [00:00<?, ?it/s]",
        "(EngineCore pid=2835) Loading safetensors checkpoint shards: 100% Completed | 6/6 [00:00<00:00, 571.70it/s]",
    ]


# --- classification ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "priority", "tag", "level"),
    [
        (API + "Starting vLLM server on http://0.0.0.0:8000", Kind.VLLM, 6, "APIServer", "INFO"),
        ("(APIServer pid=1) WARNING 03-14 09:26:53 [x.py:1] careful", Kind.VLLM, 4, "APIServer", "WARNING"),
        ("(APIServer pid=1) ERROR 03-14 09:26:53 [x.py:1]   File \"a.py\", line 1", Kind.VLLM, 3, "APIServer", "ERROR"),
        ("CRITICAL 03-14 09:26:53 [x.py:1] boom", Kind.VLLM, 3, None, "CRITICAL"),
        ("(Worker_TP0 pid=9) DEBUG 03-14 09:26:53 [v1/metrics/loggers.py:283] idle", Kind.VLLM, 7, "Worker_TP0", "DEBUG"),
        ("INFO 03-14 09:26:53 api_server.py:1011] pre-0.23 bracketless source", Kind.VLLM, 6, None, "INFO"),
        ("(VllmWorker rank=0 pid=77) ERROR 03-14 09:26:53 [multiproc_executor.py:1] 0.9-era worker tag", Kind.VLLM, 3,
         "VllmWorker rank=0", "ERROR"),
        ("(EngineCore_DP0 pid=77) WARNING 03-14 09:26:53 [core.py:1] dp tag", Kind.VLLM, 4, "EngineCore_DP0", "WARNING"),
        ("(APIServer pid=2700) INFO:     Application startup complete.", Kind.UVICORN, 6, "APIServer", "INFO"),
        ("WARNING:  Invalid HTTP request received.", Kind.UVICORN, 4, None, "WARNING"),
        ("ERROR:    Exception in ASGI application", Kind.UVICORN, 3, None, "ERROR"),
        ("Traceback (most recent call last):", Kind.TRACEBACK, 3, None, None),
        ("(EngineCore pid=7) Process EngineCore:", Kind.TRACEBACK, 3, "EngineCore", None),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.71 GiB.", Kind.TRACEBACK, 3, None, None),
        ("[W1202 14:08:21.967791653 socket.cpp:207] [c10d] hostname", Kind.RAW, 4, None, None),
        ("/usr/lib/python3.12/x.py:254: UserWarning: leaked", Kind.RAW, 4, None, None),
        ("some third-party text", Kind.RAW, 6, None, None),
        ("Capturing CUDA graphs (PIECEWISE):  10%|#         | 5/51 [00:00<00:01, 44.32it/s]", Kind.BAR, 6, None, None),
        ("Downloading (incomplete total...): 2.23GB [00:31, 70.9MB/s]", Kind.BAR, 6, None, None),
        ("(EngineCore pid=7) Loading safetensors checkpoint shards:  50% Completed | 3/6 [00:01<00:01,  2.00it/s]",
         Kind.BAR, 6, "EngineCore", None),
    ],
)
def test_each_line_kind_gets_its_journal_priority(text: str, kind: Kind, priority: int, tag: str | None, level: str | None) -> None:
    record = classify(text)
    assert (record.kind, record.priority, record.tag, record.level) == (kind, priority, tag, level)


def test_vllm_record_fields_are_split_out() -> None:
    record = classify("(EngineCore pid=4300) INFO 03-14 09:27:10 [gpu_worker.py:480] Available KV cache memory: 41.58 GiB")
    assert (record.pid, record.ts, record.source, record.lineno, record.message) == (
        4300, "03-14 09:27:10", "gpu_worker.py", 480, "Available KV cache memory: 41.58 GiB")


def test_logging_prefix_is_understood_in_both_eras() -> None:
    old = Classifier("[gpu] ").classify("(APIServer pid=1) [gpu] INFO 03-14 09:26:53 [x.py:1] hello")
    new = Classifier("[gpu] ").classify("[gpu] (APIServer pid=1) WARNING 03-14 09:26:53 [x.py:1] hello")
    assert (old.kind, old.tag, old.message) == (Kind.VLLM, "APIServer", "hello")
    assert (new.kind, new.priority, new.tag) == (Kind.VLLM, 4, "APIServer")


def test_a_whole_untagged_traceback_is_an_error_and_the_next_record_is_not() -> None:
    lines = [
        "Process EngineCore:",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.12/multiprocessing/process.py", line 314, in _bootstrap',
        "    self.run()",
        "    ^^^^^^^^^^",
        "ValueError: Invalid repository ID or local directory specified: 'nope'.",
        "Please verify the following requirements:",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]
    classifier = Classifier()
    assert [classifier.classify(text).priority for text in lines] == [3] * len(lines)
    assert classifier.classify("(APIServer pid=1) INFO 03-14 09:26:53 [x.py:1] next").priority == 6
    assert classifier.classify("ordinary text").priority == 6


def test_tagged_tracebacks_of_two_processes_do_not_mix() -> None:
    classifier = Classifier()
    classifier.classify("(EngineCore pid=7) Traceback (most recent call last):")
    assert classifier.classify("(EngineCore pid=7)     self.run()").priority == 3
    assert classifier.classify("(APIServer pid=1)     indented but not a traceback").priority == 6


def test_a_python_warning_and_its_source_line_are_warnings() -> None:
    classifier = Classifier()
    assert classifier.classify("/usr/lib/python3.12/multiprocessing/resource_tracker.py:254: UserWarning: x").priority == 4
    assert classifier.classify("  warnings.warn('resource_tracker: There appear to be %d '").priority == 4
    assert classifier.classify("plain").priority == 6


def test_the_real_healthy_start_has_no_error_lines() -> None:
    for name in ("healthy.stdout", "healthy.stderr"):
        classifier = Classifier()
        for line in frame((REAL / name).read_bytes()):
            assert classifier.classify(line.text).priority >= 4, line.text


def test_every_real_stdout_line_is_a_vllm_or_uvicorn_record() -> None:
    for name in ("healthy.stdout", "enginedeath.stdout"):
        classifier = Classifier()
        kinds = {classifier.classify(line.text).kind for line in frame((REAL / name).read_bytes())}
        assert kinds == {Kind.VLLM, Kind.UVICORN}, name


def test_real_stderr_lines_are_bars_uvicorn_and_raw_text() -> None:
    classifier = Classifier()
    records = [classifier.classify(line.text) for line in frame((REAL / "healthy.stderr").read_bytes())]
    assert sum(r.kind is Kind.BAR for r in records) == 15
    assert {r.kind for r in records} == {Kind.BAR, Kind.UVICORN, Kind.RAW}


def test_the_real_engine_death_traceback_is_all_errors() -> None:
    classifier = Classifier()
    records = [classifier.classify(line.text) for line in frame((REAL / "enginedeath.stdout").read_bytes())]
    tb = [r for r in records if r.source == "async_llm.py"]
    assert len(tb) == 8 and all(r.priority == 3 for r in tb)


# --- bar collapsing ------------------------------------------------------------------


def shard(n: int, total: int, tag: str = "(EngineCore pid=7) ") -> str:
    pct = n * 100 // total
    return f"{tag}Loading safetensors checkpoint shards: {pct:3d}% Completed | {n}/{total} [00:12<00:36, 12.04s/it]"


def test_shard_bar_is_forwarded_once_per_step_and_the_repeated_final_state_is_not() -> None:
    collapser = BarCollapser()
    states = [shard(0, 4), shard(1, 4), shard(1, 4), shard(2, 4), shard(4, 4), shard(4, 4)]
    assert [collapser.forward(s) for s in states] == [True, True, False, True, True, False]


def test_mtp_second_pass_of_the_shard_bar_is_forwarded() -> None:
    collapser = BarCollapser()
    for n in range(5):
        collapser.forward(shard(n, 4))
    assert collapser.forward(shard(0, 4)) and collapser.forward(shard(1, 4))


def test_graph_bar_is_forwarded_at_the_first_state_each_decile_and_the_end() -> None:
    collapser = BarCollapser()
    forwarded = []
    for n in range(52):
        pct = n * 100 // 51
        text = f"Capturing CUDA graphs (FULL): {pct:3d}%|#         | {n}/51 [00:00<00:00, 100.00it/s]"
        if collapser.forward(text):
            forwarded.append(n)
        if n == 51:
            assert not collapser.forward(text)  # tqdm's close repeats the final state
    assert forwarded[0] == 0 and forwarded[-1] == 51 and len(forwarded) == 11


def test_download_bars_of_different_files_are_collapsed_separately() -> None:
    collapser = BarCollapser()
    a = "model-00001-of-00066.safetensors:  45%|####5     | 2.23G/4.95G [00:31<00:38, 70.9MB/s]"
    a2 = "model-00001-of-00066.safetensors:  46%|####6     | 2.28G/4.95G [00:32<00:37, 70.9MB/s]"
    b = "model-00002-of-00066.safetensors:  45%|####5     | 2.23G/4.95G [00:31<00:38, 70.9MB/s]"
    assert [collapser.forward(t) for t in (a, a2, b)] == [True, False, True]


def test_a_bar_without_total_is_forwarded_once_per_30_seconds_of_its_time() -> None:
    collapser = BarCollapser()
    states = [f"Downloading (incomplete total...): {n / 10:.2f}GB [00:{n:02d}, 70.9MB/s]" for n in range(0, 60, 3)]
    forwarded = [s for s in states if collapser.forward(s)]
    assert forwarded == [states[0], states[10]]


def test_non_bar_lines_are_always_forwarded_and_blank_ones_dropped() -> None:
    collapser = BarCollapser()
    assert collapser.forward(API + "GPU KV cache usage: 7.9%")
    assert collapser.forward(API + "hello") and collapser.forward(API + "hello")
    assert not collapser.forward("(EngineCore pid=2835) ")
    assert not collapser.forward("")


# --- events ---------------------------------------------------------------------------

PROGRESS_CASES = [
    ("Loading safetensors checkpoint shards:   0% Completed | 0/66 [00:00<?, ?it/s]", [ShardsProgressed(0, 66)]),
    ("Loading safetensors checkpoint shards (eager):  50% Completed | 33/66 [05:00<05:00,  9.02s/it]",
     [ShardsProgressed(33, 66, eager=True)]),
    ("model-00001-of-00066.safetensors:  45%|####5     | 2.23G/4.95G [00:31<00:38, 70.9MB/s]",
     [DownloadProgressed(2.23e9, 4.95e9, "model-00001-of-00066.safetensors")]),
    ("Fetching 75 files:  12%|#2        | 9/75 [00:03<00:25, 2.60it/s]", [DownloadProgressed(9, 75, "Fetching 75 files")]),
    ("Downloading (incomplete total...): 2.23GB [00:31, 70.9MB/s]",
     [DownloadProgressed(2.23e9, None, "Downloading (incomplete total...)")]),
    ("Starting to load model Qwen/Qwen3.6-27B-FP8...", [LoadStarted()]),
    ("Filesystem type for checkpoints: EXT4. Checkpoint size: 29.10 GiB. Available RAM: 115.80 GiB.", [LoadStarted()]),
    ("Loading weights took 312.50 seconds", [WeightsLoaded(seconds=312.5)]),
    ("Model loading took 28.9 GiB memory and 318.204511 seconds", [WeightsLoaded(seconds=318.204511, gib=28.9)]),
    ("Model loading took 0.01 GiB and 1.503717 seconds", [WeightsLoaded(seconds=1.503717, gib=0.01)]),
    ("Dynamo bytecode transform time: 3.07 s", [CompileProgressed(False, 3.07)]),
    ("Compiling a graph for compile range (1, 8192) takes 7.24 s", [CompileProgressed(False, 7.24)]),
    ("Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 0.412 s",
     [CompileProgressed(False, 0.412)]),
    ("vLLM's torch.compile cache is disabled.", [CompileProgressed(False, None)]),
    ("Starting torch.compile", [CompileProgressed(False, None)]),
    ("torch.compile took 11.28 s in total", [CompileProgressed(True, 11.28)]),
    ("[backbone] torch.compile took 9.50 s in total", [CompileProgressed(True, 9.5)]),
    ("[backbone] torch.compile and initial profiling/warmup run together took 14.25 s in total", [CompileProgressed(True, 14.25)]),
    ("Available KV cache memory: 41.58 GiB", [KvCacheSized(available_gib=41.58)]),
    ("GPU KV cache size: 10,900,144 tokens", [KvCacheSized(tokens=10900144)]),
    ("Maximum concurrency for 2,048 tokens per request: 5322.34x", [KvCacheSized(max_concurrency=5322.34)]),
    ("GPU KV cache size: 1,234,560 tokens, Maximum concurrency for 131,072 tokens per request: 9.42x",
     [KvCacheSized(tokens=1234560, max_concurrency=9.42)]),
    ("GPU + host KV cache size: 2,000 tokens, Maximum concurrency for 1,000 tokens per request: 2.00x",
     [KvCacheSized(tokens=2000, max_concurrency=2.0)]),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  43%|####3     | 22/51 [00:00<00:00, 75.36it/s]",
     [GraphsProgressed(22, 51)]),
    ("Graph capturing finished in 2 secs, took 0.16 GiB", [GraphsProgressed(finished=True, gib=0.16)]),
    ("init engine (profile, create kv cache, warmup model) took 27.16 s (compilation: 11.28 s)", [EngineInitialized(27.16)]),
    ("Starting vLLM server on http://0.0.0.0:8000", [ServerStarting("http://0.0.0.0:8000")]),
    ("Starting vLLM API server on http://[::1]:8000", [ServerStarting("http://[::1]:8000")]),
    ("Application startup complete.", [StartupCompleted()]),
    ("vLLM server version 0.34.0, serving model Qwen/Qwen3.6-27B-FP8", [VersionSeen("0.34.0")]),
    (" \u2584\u2584 \u2584\u2588 \u2588     \u2588  version 0.23.0", [VersionSeen("0.23.0")]),
    ("Initializing a V1 LLM engine (v0.23.0) with config: model='x'", [VersionSeen("0.23.0")]),
    ("non-default args: {'model': 'x', 'port': 8001}", [ArgsSeen("{'model': 'x', 'port': 8001}")]),
    ("[shutdown] API server: shutdown triggered", [ShutdownStarted()]),
    ("Shutting down", [ShutdownStarted()]),
    ("Loading model weights took 14.9935 GB", [WeightsLoaded(gib=14.9935)]),
    ("# GPU blocks: 2345, # CPU blocks: 512", [KvCacheSized()]),
    ("Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)", [ServerStarting("http://0.0.0.0:8000")]),
    ("[shutdown] EngineCore: trigger received signal=SIGTERM", [ShutdownStarted()]),
    ("Using FlashAttention version 3", []),
    ("Route: /v1/models, Methods: GET", []),
]


@pytest.mark.parametrize(("message", "expected"), PROGRESS_CASES)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_progress_lines_give_their_events_in_both_eras(prefix: str, message: str, expected: list[object]) -> None:
    # Bars and uvicorn lines are never vLLM records, but a tag may precede them (0.23-0.30).
    if "%|" in message or "% Completed" in message or "/s]" in message or message in ("Application startup complete.", "Shutting down"):
        prefix = {API: "(EngineCore pid=4300) ", ENGINE: "(EngineCore pid=4300) ", UNTAGGED: ""}.get(prefix, "")
        if message in ("Application startup complete.", "Shutting down"):
            prefix += "INFO:     "
    assert parse_line(prefix + message) == expected


def test_stats_line_is_parsed_key_by_key_with_optional_parts_in_the_middle() -> None:
    line = API + ("Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 21.6 tokens/s, "
                  "Running: 2 reqs, Waiting: 1 reqs, Deferred: 3 reqs, Preemptions: 4, GPU KV cache usage: 7.9%, "
                  "Prefix cache hit rate: 38.2%, MM cache hit rate: 1.0%")
    assert parse_line(line) == [StatsLogged(812.4, 21.6, 2, 1, 7.9, 38.2, "000")]


def test_stats_line_without_prefix_cache_and_aggregated_engines() -> None:
    line = API + ("2 Engines Aggregated: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
                  "Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%")
    assert parse_line(line) == [StatsLogged(0.0, 5.0, 0, 0, 0.0, None, "2 aggregated")]


def test_v0_engine_stats_line_without_engine_head() -> None:
    line = UNTAGGED + ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 30.5 tokens/s, Running: 1 reqs, "
                       "Swapped: 0 reqs, Pending: 2 reqs, GPU KV cache usage: 3.5%, CPU KV cache usage: 0.0%.")
    assert parse_line(line) == [StatsLogged(10.0, 30.5, 1, 2, 3.5, None, "000")]


def test_spec_decoding_line_keeps_per_position_rates() -> None:
    line = API + ("SpecDecoding metrics: Mean acceptance length: 2.71, Accepted throughput: 12.30 tokens/s, "
                  "Drafted throughput: 21.60 tokens/s, Accepted: 123 tokens, Drafted: 216 tokens, "
                  "Per-position acceptance rate: 0.831, 0.566, 0.313, Avg Draft acceptance rate: 56.9%")
    assert parse_line(line) == [SpecDecodingLogged(2.71, 12.3, 21.6, 123, 216, (0.831, 0.566, 0.313), 56.9)]


FREE = ("Free memory on device cuda:0 (103.45/123.73 GiB) on startup is less than desired GPU memory utilization "
        "(0.92, 113.83 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.")

FAILURE_CASES = [
    ("ValueError: " + FREE, [FreeMemoryShort(103.45, 123.73, 0.92, 113.83, "cuda:0")]),
    ("ValueError: " + FREE.replace("device cuda:0 ", "device "), [FreeMemoryShort(103.45, 123.73, 0.92, 113.83)]),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.71 GiB. GPU 0 has a total capacity of 119 GiB",
     [CudaOutOfMemory(1.71)]),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 has", [CudaOutOfMemory(0.5)]),
    ("Failed to load model - not enough GPU memory. Try lowering --gpu-memory-utilization to free memory for weights, "
     "increasing --tensor-parallel-size, or using --quantization. See https://docs.vllm.ai/en/latest/configuration/"
     "conserving_memory/ for more tips. (original error: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has)",
     [CudaOutOfMemory(2.0, during_load=True)]),
    ("ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (5.12 GiB). Based on the available memory, the estimated "
     "maximum model length is 40960. Try increasing `gpu_memory_utilization` (which also controls CPU memory on the "
     "CPU backend) or decreasing `max_model_len` when initializing the engine. See https://docs.vllm.ai/en/latest/"
     "configuration/conserving_memory/ for more details.", [KvCacheInsufficient(131072, 16.0, 5.12, 40960)]),
    ("ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (5.12 GiB). Try increasing `gpu_memory_utilization`",
     [KvCacheInsufficient(131072, 16.0, 5.12, None)]),
    ("ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (5.12 GiB). Based on the available memory, the estimated "
     "maximum model length is 40960. Lower --device-memory-utilization... Decreasing `max_model_len` also reduces "
     "what is needed. See https://docs.vllm.ai/", [KvCacheInsufficient(131072, 16.0, 5.12, 40960)]),
    ("ValueError: The model's max seq len (131072) is larger than the maximum number of tokens that can be stored in "
     "KV cache (45000). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
     [KvCacheInsufficient(131072, None, None, 45000)]),
    ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing",
     [NoKvCacheMemory()]),
    # vLLM 0.34's extensible KV cache names itself in both of its hints.
    ("ValueError: No available memory for the cache blocks. The KV cache gets what is left after the model and its "
     "activations within `gpu_memory_utilization`=0.8; increase it (with the extensible KV cache it defaults to 1.0) or "
     "decrease `max_model_len` or `max_num_seqs`. See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ "
     "for more details.", [NoKvCacheMemory(extensible=True)]),
    ("ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
     "which is larger than the available KV cache memory (5.12 GiB). The extensible KV cache already takes all device "
     "memory left after the model and its activations; decrease `max_model_len` or `max_num_seqs`, or the model needs a "
     "device with more memory. Decreasing `max_model_len` also reduces what is needed. See https://docs.vllm.ai/",
     [KvCacheInsufficient(131072, 16.0, 5.12, None, extensible=True)]),
    ("OSError: [Errno 98] Address already in use", [PortInUse(None)]),
    ("ERROR:    [Errno 98] error while attempting to bind on address ('0.0.0.0', 8000): address already in use",
     [PortInUse(8000)]),
    ("OSError: nope/missing is not a local folder and is not a valid model identifier listed on "
     "'https://huggingface.co/models'", [ModelNotFound("nope/missing")]),
    ("ValueError: Invalid repository ID or local directory specified: '/srv/models/gone'.", [ModelNotFound("/srv/models/gone")]),
    ("OSError: You are trying to access a gated repo.", [ModelGated(None)]),
    ("huggingface_hub.errors.RepositoryNotFoundError: 404 Client Error. (Request ID: x) Repository Not Found for url: "
     "https://huggingface.co/api/models/Qwen/Qwen3.6-27B-FP9/revision/main.", [ModelNotFound("Qwen/Qwen3.6-27B-FP9")]),
    ("OSError: Can't load the configuration of '/srv/models/x'. If you were trying to load it from "
     "'https://huggingface.co/models', make sure you don't have a local directory with the same name.",
     [ModelNotFound("/srv/models/x")]),
    ("RuntimeError: CUDA error: out of memory", [CudaOutOfMemory(None)]),
    ("401 Client Error. (Request ID: x) Cannot access gated repo for url "
     "https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct/resolve/main/config.json.",
     [ModelGated("meta-llama/Llama-3.3-70B-Instruct")]),
    ("KeyError: 'invalid tool call parser: qwen9 (chose from { hermes,qwen3_xml })'",
     [BadArgument("invalid tool call parser: qwen9 (chose from { hermes,qwen3_xml })", "--tool-call-parser", "qwen9")]),
    ("KeyError: 'invalid reasoning parser: nope (chose from { qwen3 })'",
     [BadArgument("invalid reasoning parser: nope (chose from { qwen3 })", "--reasoning-parser", "nope")]),
    ("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser",
     [BadArgument("--enable-auto-tool-choice requires --tool-call-parser", "--tool-call-parser")]),
    ("vllm: error: unrecognized arguments: --frobnicate",
     [BadArgument("unrecognized arguments: --frobnicate", "--frobnicate", None)]),
    ("vllm serve: error: argument --kv-cache-dtype: invalid choice: 'fp7' (choose from 'auto', 'fp8')",
     [BadArgument("argument --kv-cache-dtype: invalid choice: 'fp7' (choose from 'auto', 'fp8')", "--kv-cache-dtype", "fp7")]),
    ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
     [EngineDied("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.")]),
    ("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup",
     [EngineDied("[shutdown] MPClient: engine core exited unexpectedly; starting cleanup")]),
    ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", [HiddenInitFailure()]),
    ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}",
     [EngineStartFailed()]),
    ("EngineCore failed to start.", [EngineStartFailed()]),
    ("Exception: WorkerProc initialization failed due to an exception in a background process.", [EngineStartFailed()]),
    ("RuntimeError: Frontend process failed during engine core initialization. See root cause above.", [EngineStartFailed()]),
    ("AssertionError: something odd", [ExceptionRaised("AssertionError", "something odd")]),
    ("KeyboardInterrupt: terminated", [ExceptionRaised("KeyboardInterrupt", "terminated")]),
    ("UserWarning: harmless", []),
    ("zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:55217')",
     [InternalPortInUse(55217, "tcp://127.0.0.1:55217")]),
    ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: 29500, "
     "useIPv6: 0, code: -98, name: EADDRINUSE, message: address already in use", [InternalPortInUse(29500)]),
    ("Address already in use. Retrying with a new port.", []),
    ("huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
     "'/models/x'. Use `repo_type` argument if needed.", [ModelNotFound("/models/x")]),
    ("OSError: /models/llama does not appear to have a file named config.json. Checkout "
     "'https://huggingface.co//models/llama/tree/None' for available files.", [ModelNotFound("/models/llama")]),
    ("FileNotFoundError: [Errno 2] No such file or directory: '/srv/qwen/config.json'", [ModelNotFound("/srv/qwen")]),
    ("OSError: We couldn't connect to 'https://huggingface.co' to load this file, couldn't find it in the cached files and "
     "it looks like Qwen/Qwen3-8B is not the path to a directory containing a file named config.json.",
     [ModelNotFound("Qwen/Qwen3-8B", unreachable=True)]),
    ("huggingface_hub.errors.LocalEntryNotFoundError: An error happened while trying to locate the file on the Hub",
     [ModelNotFound("", unreachable=True)]),
    ("KeyError: \"Tool parser 'qwen9' not found.\"", [BadArgument("Tool parser 'qwen9' not found.", "--tool-call-parser", "qwen9")]),
    ("KeyError: \"Reasoning parser 'r9' not found. Available parsers: qwen3\"",
     [BadArgument("Reasoning parser 'r9' not found.", "--reasoning-parser", "r9")]),
    ("TypeError: Error: --enable-auto-tool-choice requires tool_parser:'x9' which has not been registered",
     [BadArgument("tool_parser:'x9' which has not been registered", "--tool-call-parser", "x9")]),
    ("api_server.py: error: argument --pipeline-parallel-size/-pp: invalid int value: '8000:8000'",
     [BadArgument("argument --pipeline-parallel-size/-pp: invalid int value: '8000:8000'", "--pipeline-parallel-size", "8000:8000")]),
    ("vllm: error: unrecognized arguments: 8000:8000", [BadArgument("unrecognized arguments: 8000:8000", None, "8000:8000")]),
    ("vllm serve: error: the following arguments are required: model_tag",
     [BadArgument("the following arguments are required: model_tag", "model_tag")]),
    ("ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'",
     [PtxasArchUnsupported("sm_121a", detail="ptxas fatal   : Value 'sm_121a' is not defined for option 'gpu-name'")]),
]


@pytest.mark.parametrize(("message", "expected"), FAILURE_CASES)
@pytest.mark.parametrize("prefix", [ENGINE_ERR, "(EngineCore pid=4300) ", ""])
def test_failure_signatures_give_their_events(prefix: str, message: str, expected: list[object]) -> None:
    if message.startswith("ERROR:    "):
        prefix = prefix if prefix.endswith(") ") else ""
    assert parse_line(prefix + message) == expected


def test_the_real_recordings_give_the_startup_events_in_order() -> None:
    kinds = []
    for name in ("healthy.stdout", "healthy.stderr"):
        for line in frame((REAL / name).read_bytes()):
            kinds.extend(type(e).__name__ for e in parse_line(line.text))
    for wanted in ("VersionSeen", "ArgsSeen", "LoadStarted", "ShardsProgressed", "WeightsLoaded", "CompileProgressed",
                   "KvCacheSized", "GraphsProgressed", "EngineInitialized", "ServerStarting", "StartupCompleted",
                   "StatsLogged", "ShutdownStarted"):
        assert wanted in kinds
    assert not any(issubclass(type(e), Failure) for name in ("healthy.stdout", "healthy.stderr")
                   for line in frame((REAL / name).read_bytes()) for e in parse_line(line.text))


def test_the_real_engine_death_is_found() -> None:
    events = [e for line in frame((REAL / "enginedeath.stdout").read_bytes()) for e in parse_line(line.text)]
    died = [e for e in events if isinstance(e, EngineDied)]
    assert len(died) == 2 and "EngineDeadError" in died[1].message
    assert not [e for e in events if isinstance(e, Failure) and not isinstance(e, EngineDied)]


def test_message_of_strips_every_prefix_kind() -> None:
    assert message_of(API + "hello") == "hello"
    assert message_of("(APIServer pid=1) INFO:     Started server process [1]") == "Started server process [1]"
    assert message_of("(EngineCore pid=1) Traceback (most recent call last):") == "Traceback (most recent call last):"


# --- split failures ---------------------------------------------------------------------


@pytest.mark.parametrize("cut", [40, 60, 97, 120, 150, 180])
def test_free_memory_message_split_over_two_lines_is_joined(cut: int) -> None:
    text = "ValueError: " + FREE
    scanner = EventScanner()
    first = scanner.feed(ENGINE_ERR + text[:cut])
    second = scanner.feed(ENGINE_ERR + text[cut:])
    assert first + second == [FreeMemoryShort(103.45, 123.73, 0.92, 113.83, "cuda:0")]


def test_a_split_at_a_space_is_joined_with_the_space() -> None:
    scanner = EventScanner()
    first, second = FREE.split(" on startup ")
    events = scanner.feed(first + " on") + scanner.feed("startup " + second)
    assert events == [FreeMemoryShort(103.45, 123.73, 0.92, 113.83, "cuda:0")]


def test_kv_message_split_before_the_estimate_keeps_the_estimate() -> None:
    scanner = EventScanner()
    events = scanner.feed(ENGINE_ERR + "ValueError: To serve at least one request with the model's max seq len (131072), "
                          "(16.0 GiB KV cache is needed, which is larger than the available KV cache memory (5.12 GiB).")
    events += scanner.feed(ENGINE_ERR + "Based on the available memory, the estimated maximum model length is 40960. Try")
    assert events == [KvCacheInsufficient(131072, 16.0, 5.12, 40960)]


def test_an_unfinished_failure_is_reported_as_soon_as_a_line_does_not_continue_it() -> None:
    scanner = EventScanner()
    oom = "torch.OutOfMemoryError: CUDA out of memory."
    assert scanner.feed(oom) == []
    assert scanner.feed(API + "Loading weights took 0.00 seconds") == [CudaOutOfMemory(None), WeightsLoaded(seconds=0.0)]
    assert scanner.feed(oom) == [] and scanner.flush() == [CudaOutOfMemory(None)]


# vLLM 0.26 logs this on every healthy start (seen on a real GPU machine); it begins like the free-memory failure.
HEALTHY_026 = (
    "Free memory on device (38.77/139.8 GiB) on startup. Desired GPU memory utilization is (0.9, 125.82 GiB). "
    "Actual usage is 0.94 GiB for weight, 1.41 GiB for peak activation, 0.1 GiB for non-torch memory, and 0.06 GiB "
    "for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=131524157184` (122.49 GiB) "
    "to fit into requested memory, or `--kv-cache-memory=38221062963` (35.6 GiB) to fully utilize gpu memory. "
    "Current kv cache memory in use is 123.28 GiB."
)


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_healthy_line_that_begins_like_a_failure_holds_nothing_back(wrapped: bool) -> None:
    scanner = EventScanner(wrapped=wrapped)
    assert scanner.feed("(EngineCore pid=7) INFO 12-04 10:00:00 [gpu_worker.py:861] " + HEALTHY_026) == []
    died = "(EngineCore pid=7) ERROR 12-04 10:00:01 [core.py:1022] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."
    assert [type(e) for e in scanner.feed(died)] == [EngineDied]
    assert scanner.flush() == []


def test_a_failure_begun_on_one_line_and_followed_by_another_failure_reports_both_at_once() -> None:
    scanner = EventScanner()
    assert scanner.feed(ENGINE_ERR + "ValueError: To serve at least one request with the model's max seq len (131072), (16.0") == []
    events = scanner.feed(ENGINE_ERR + "EngineCore failed to start.")
    assert events == [KvCacheInsufficient(131072, None, None, None), EngineStartFailed()]


@pytest.mark.parametrize(
    ("cut_after", "expected"),
    [
        ("KV cach", KvCacheInsufficient(131072, 16.0, None, None)),
        ("memory (5.1", KvCacheInsufficient(131072, 16.0, None, None)),
        ("memory (5.12 GiB).", KvCacheInsufficient(131072, 16.0, 5.12, None)),
        ("max seq len (131072), (16.0 GiB", KvCacheInsufficient(131072, 16.0, None, None)),
    ],
)
def test_a_kv_message_cut_short_still_gives_what_it_had(cut_after: str, expected: KvCacheInsufficient) -> None:
    full = ("ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
            "which is larger than the available KV cache memory (5.12 GiB). Try increasing `gpu_memory_utilization`")
    cut = full[: full.index(cut_after) + len(cut_after)]
    scanner = EventScanner(wrapped=True)
    assert scanner.feed(cut) + scanner.flush() == [expected]


def test_the_models_s_wording_of_some_releases_is_the_same_failure() -> None:
    line = ("ValueError: To serve at least one request with the models's max seq len (32768), (4.0 GiB KV cache is needed, "
            "which is larger than the available KV cache memory (2.5 GiB). Try increasing `gpu_memory_utilization`")
    assert parse_line(line) == [KvCacheInsufficient(32768, 4.0, 2.5, None)]


@pytest.mark.parametrize("width", [60, 80, 120])
def test_a_record_wrapped_by_a_terminal_is_joined(width: int) -> None:
    text = ENGINE_ERR + "ValueError: " + FREE
    scanner = EventScanner(wrapped=True)
    events = [e for i in range(0, len(text), width) for e in scanner.feed(text[i : i + width])] + scanner.flush()
    assert events == [FreeMemoryShort(103.45, 123.73, 0.92, 113.83, "cuda:0")]


def test_scanner_passes_ordinary_lines_straight_through() -> None:
    scanner = EventScanner()
    assert scanner.feed(API + "Starting vLLM server on http://0.0.0.0:8000") == [ServerStarting("http://0.0.0.0:8000")]
    assert scanner.feed("ValueError: " + FREE) == [FreeMemoryShort(103.45, 123.73, 0.92, 113.83, "cuda:0")]


# --- lines Ray forwards from vLLM's workers on other machines ------------------

RAY_WORKER_FREE_MEMORY = (
    "(EngineCore pid=18159) (RayWorkerWrapper pid=18177, ip=10.213.0.2) ERROR 12-02 20:29:38 [worker_base.py:362] "
    "ValueError: Free memory on device cuda:0 (40.0/121.69 GiB) on startup is less than desired GPU memory "
    "utilization (0.92, 111.95 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
)


def test_a_remote_ray_workers_record_keeps_its_level_and_names_its_machine() -> None:
    record = classify(RAY_WORKER_FREE_MEMORY)
    assert (record.kind, record.priority, record.tag, record.pid, record.node) == (Kind.VLLM, 3, "RayWorkerWrapper", 18177, "10.213.0.2")
    assert record.message.startswith("ValueError: Free memory on device cuda:0")


def test_a_ray_worker_on_the_drivers_own_machine_has_no_node_address() -> None:
    record = classify("(RayWorkerWrapper pid=2207) INFO 12-02 18:00:00 [default_loader.py:1] Loading weights took 3.00 seconds")
    assert (record.kind, record.tag, record.pid, record.node) == (Kind.VLLM, "RayWorkerWrapper", 2207, None)


def test_a_remote_workers_shard_bar_and_traceback_are_recognised_through_the_ray_prefix() -> None:
    bar = classify("(RayWorkerWrapper pid=2316, ip=10.213.0.2) Loading safetensors checkpoint shards:  50% Completed | 3/6 [00:01<00:01,  2.00it/s]")
    assert (bar.kind, bar.node) == (Kind.BAR, "10.213.0.2")
    assert parse_line("(RayWorkerWrapper pid=2316, ip=10.213.0.2) Loading safetensors checkpoint shards:  50% Completed | 3/6 [00:01<00:01,  2.00it/s]") == [ShardsProgressed(3, 6, False)]
    tb = Classifier()
    assert tb.classify("(RayWorkerWrapper pid=2316, ip=10.213.0.2) Traceback (most recent call last):").kind is Kind.TRACEBACK
    assert tb.classify('(RayWorkerWrapper pid=2316, ip=10.213.0.2)   File "worker_base.py", line 354, in execute_method').kind is Kind.TRACEBACK


def test_a_remote_workers_free_memory_failure_is_parsed_with_its_numbers() -> None:
    (event,) = parse_line(RAY_WORKER_FREE_MEMORY)
    assert (event.free_gib, event.total_gib, event.requested_utilization) == (40.0, 121.69, 0.92)


# vLLM 0.23's default Ray executor (V2): Ray's `(RayWorkerProc pid=N[, ip=A])` sits between the EngineCore's
# tag and vLLM's own `(Worker pid=N)` in the actor (as captured from a real vLLM 0.23.0, cyan escapes removed).
V2_CHAIN = "(EngineCore pid=1285) (RayWorkerProc pid=2100, ip=10.213.0.2) (Worker pid=2100) "


def test_a_v2_ray_workers_record_behind_three_tags_keeps_its_level_and_names_its_machine() -> None:
    record = classify(V2_CHAIN + "ERROR 12-03 15:16:57 [gpu_worker.py:303] boom")
    assert (record.kind, record.priority, record.tag, record.pid, record.node, record.message) == (
        Kind.VLLM, 3, "Worker", 2100, "10.213.0.2", "boom"
    )
    local = classify("(EngineCore pid=1285) (RayWorkerProc pid=2100) (Worker pid=2100) INFO 12-03 15:16:59 "
                     "[default_loader.py:397] Loading weights took 0.02 seconds")
    assert (local.kind, local.tag, local.node) == (Kind.VLLM, "Worker", None)


def test_a_v2_ray_workers_shard_bar_and_traceback_are_recognised_behind_three_tags() -> None:
    line = V2_CHAIN + "Loading safetensors checkpoint shards: 100% Completed | 6/6 [00:00<00:00, 458.11it/s]"
    record = classify(line)
    assert (record.kind, record.node) == (Kind.BAR, "10.213.0.2")
    assert parse_line(line) == [ShardsProgressed(6, 6, False)]
    tb = Classifier()
    assert tb.classify(V2_CHAIN + "Traceback (most recent call last):").kind is Kind.TRACEBACK
    assert tb.classify(V2_CHAIN + '  File "gpu_worker.py", line 240, in init_device').priority == 3


def test_a_bar_redrawn_behind_a_tag_chain_keeps_the_whole_chain_on_every_state() -> None:
    framer = LineFramer()
    lines = framer.feed((V2_CHAIN + "\rLoading safetensors checkpoint shards:   0% Completed | 0/6 [00:00<?, ?it/s]"
                         "\rLoading safetensors checkpoint shards: 100% Completed | 6/6 [00:00<00:00, 458.11it/s]\n").encode())
    assert [line.text for line in lines] == [
        V2_CHAIN + "Loading safetensors checkpoint shards:   0% Completed | 0/6 [00:00<?, ?it/s]",
        V2_CHAIN + "Loading safetensors checkpoint shards: 100% Completed | 6/6 [00:00<00:00, 458.11it/s]",
    ]


# --- failures of Ray workers ------------------------------------------------------


def test_a_dead_ray_actor_means_a_lost_worker_not_just_a_dead_engine() -> None:
    assert parse_line(ENGINE_ERR + "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.") == [
        RayWorkerLost("ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.")
    ]
    assert [type(e) for e in parse_line(ENGINE_ERR + "ray.exceptions.RayActorError: The actor died because of an error raised in its creation task")] == [RayWorkerLost]


def test_the_v2_executors_worker_monitor_reporting_a_dead_worker_means_a_lost_worker() -> None:
    line = "(EngineCore pid=1285) ERROR 12-03 15:20:01 [ray_executor_v2.py:464] RayWorkerProc rank=[1] died unexpectedly, shutting down executor."
    assert parse_line(line) == [RayWorkerLost("RayWorkerProc rank=[1] died unexpectedly, shutting down executor.")]


def test_a_workers_exception_re_raised_in_the_driver_carries_the_workers_machine() -> None:
    scanner = EventScanner()
    assert scanner.feed(
        "(EngineCore pid=9) ray.exceptions.RayTaskError(ValueError): \x1b[36mray::RayWorkerWrapper.execute_method()\x1b[39m "
        "(pid=2316, ip=10.213.0.2, actor_id=5c1e, repr=<vllm.v1.executor.ray_utils.RayWorkerWrapper object at 0x7f>)"
    ) == []
    assert scanner.feed('(EngineCore pid=9)   File "worker_base.py", line 363, in execute_method') == []
    (event,) = scanner.feed("(EngineCore pid=9) ValueError: " + FREE) + scanner.flush()
    assert isinstance(event, FreeMemoryShort) and event.node == "10.213.0.2"
    # The machine belongs to that one exception only.
    (later,) = scanner.feed("(EngineCore pid=9) ValueError: " + FREE) + scanner.flush()
    assert later.node is None


def test_rays_own_log_lines_keep_their_level() -> None:
    warning = classify("(EngineCore pid=1285) 2026-12-03 15:16:30,441\tWARNING worker.py:2100 -- Ray is slow")
    info = classify("(EngineCore pid=1285) 2026-12-03 15:16:30,475\tINFO worker.py:2038 -- Connected to Ray cluster.")
    assert (warning.kind, warning.priority, info.priority) == (Kind.RAW, 4, 6)


def test_the_v0_engines_zero_gpu_blocks_mean_no_memory_for_the_kv_cache() -> None:
    assert parse_line("INFO 05-02 10:00:03 executor_base.py:108] # CUDA blocks: 0, # CPU blocks: 2048") == [NoKvCacheMemory()]
    assert parse_line("INFO 05-02 10:00:03 executor_base.py:108] # GPU blocks: 1024, # CPU blocks: 2048") == [KvCacheSized()]


def test_a_known_issues_exception_line_is_also_an_exception_for_the_crash_detail() -> None:
    events = parse_line("torch.AcceleratorError: CUDA error: no kernel image is available for execution on the device")
    assert [type(e).__name__ for e in events] == ["UnsupportedBuild", "ExceptionRaised"]


def test_kernel_lines_in_a_paste_give_the_drivers_events() -> None:
    (xid,) = parse_line("Dec 04 13:10:00 spark kernel: NVRM: Xid (PCI:000f:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    assert isinstance(xid, GpuXid) and (xid.xid, xid.pci) == (79, "000f:01:00")
