"""The stand-in's HTTP side, compared with what the real vLLM 0.23.0 answered (probes.txt)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.request
from typing import Iterator

import pytest

from sim_support import DEADLINE_S, FIXTURES, SPEC, STATS, Sim, StartSim, http, messages, physical_lines, port_refuses, start_sim


def _probe(section: str) -> str:
    """The body recorded under `--- section` in probes.txt."""
    text = (FIXTURES / "probes.txt").read_text()
    part = text.split(f"--- {section}\n", 1)[1].split("\n--- ", 1)[0]
    return part.strip().splitlines()[-1]


def _keys(value: object) -> object:
    """The shape of a JSON value: dict keys (recursively), first list element."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not exported")


def _scrape(port: int) -> str:
    return http(port, "/metrics").body.decode()


@pytest.fixture(scope="module")
def served() -> Iterator[Sim]:
    """One serving stand-in shared by the read-mostly tests (they compare deltas, never absolutes)."""
    s = start_sim(["/srv/models/tiny-llama", "--served-model-name", "tiny", "alias", "--max-model-len", "2048"])
    try:
        s.wait_ready()
        yield s
    finally:
        s.kill_group()


def test_health_ping_and_version_answer_like_vllm(served: Sim) -> None:
    health = http(served.port, "/health")
    assert (health.status, health.body, health.headers["server"], health.headers["content-length"]) == (200, b"", "uvicorn", "0")
    assert http(served.port, "/ping").status == 200
    assert http(served.port, "/version").body == b'{"version":"0.23.0"}'
    # The access-log line is written as the reply goes out, so it may reach the pipe just after it.
    served.wait_text('"GET /health HTTP/1.1" 200 OK')


def test_models_lists_every_served_name_in_vllms_card_shape(served: Sim) -> None:
    body = http(served.port, "/v1/models").json()
    assert _keys(body) == _keys(json.loads(_probe("models")))
    assert [card["id"] for card in body["data"]] == ["tiny", "alias"]
    assert {card["root"] for card in body["data"]} == {"/srv/models/tiny-llama"}
    assert body["data"][0]["max_model_len"] == 2048


def test_completion_has_vllms_shape_and_honours_max_tokens(served: Sim) -> None:
    first = http(served.port, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5}).json()
    again = http(served.port, "/v1/completions", {"model": "alias", "prompt": "Hello", "max_tokens": 5}).json()
    assert _keys(first) == _keys(json.loads(_probe("completion ok")))
    assert first["usage"]["completion_tokens"] == 5
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["choices"][0]["text"] == again["choices"][0]["text"]  # deterministic
    assert again["model"] == "alias"


def test_chat_completion_stops_naturally_or_at_max_tokens(served: Sim) -> None:
    full = http(served.port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).json()
    short = http(served.port, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).json()
    assert full["object"] == "chat.completion"
    assert (full["choices"][0]["finish_reason"], short["choices"][0]["finish_reason"]) == ("stop", "length")
    assert short["usage"]["completion_tokens"] == 3
    assert full["choices"][0]["message"]["content"].startswith(short["choices"][0]["message"]["content"])


def test_streaming_sends_sse_chunks_ending_with_done(served: Sim) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{served.port}/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 6, "stream": True}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in response.read().decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    whole = http(served.port, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 6}).json()
    assert streamed == whole["choices"][0]["text"]


def test_wrong_model_name_gets_vllms_exact_404(served: Sim) -> None:
    reply = http(served.port, "/v1/completions", {"model": "Qwen3.6-27B-FP8", "prompt": "x", "max_tokens": 1})
    assert (reply.status, reply.body.decode()) == (404, _probe("completion wrong model"))
    served.wait_text('"POST /v1/completions HTTP/1.1" 404 Not Found')


@pytest.mark.parametrize("how", ["flag", "env"])
def test_api_key_guards_v1_paths_only(sim: StartSim, how: str) -> None:
    s = sim("m", "--api-key", "s3cret") if how == "flag" else sim("m", env={"VLLM_API_KEY": "s3cret"})
    s.wait_ready()
    denied = http(s.port, "/v1/models")
    assert (denied.status, denied.body) == (401, b'{"error":"Unauthorized"}')
    assert http(s.port, "/v1/models", headers={"authorization": "Bearer s3cret"}).status == 200
    assert [http(s.port, p).status for p in ("/health", "/metrics", "/version", "/ping")] == [200] * 4


def test_metrics_use_vllms_names_and_move_with_requests(served: Sim) -> None:
    before = _scrape(served.port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
        _metric(before, name, model_name="tiny", engine="0")
    assert "# TYPE vllm:prompt_tokens_total counter" in before
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in before
    assert "vllm:gpu_cache_usage_perc" not in before
    http(served.port, "/v1/completions", {"model": "tiny", "prompt": "one two three", "max_tokens": 4})
    after = _scrape(served.port)
    assert _metric(after, "vllm:prompt_tokens_total") - _metric(before, "vllm:prompt_tokens_total") == 4
    assert _metric(after, "vllm:generation_tokens_total") - _metric(before, "vllm:generation_tokens_total") == 4
    assert _metric(after, "vllm:request_success_total", finished_reason="length") == _metric(before, "vllm:request_success_total", finished_reason="length") + 1


def test_stats_line_follows_served_requests(sim: StartSim) -> None:
    served = sim("m", "--served-model-name", "tiny")
    served.wait_ready()
    http(served.port, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 5})

    def generated(out: bytes) -> float:
        """Tokens the stats lines account for (throughput times the 10 s interval)."""
        lines = [m for m in messages(out) if m.startswith("Engine 000:")]
        assert all(STATS.match(m) for m in lines), lines
        return sum(float(m.split("Avg generation throughput: ")[1].split(" ")[0]) * 10 for m in lines)

    # The 5 tokens may straddle two intervals; the lines must account for all of them.
    served.wait_output(lambda out, err: generated(out) >= 5)
    assert round(generated(bytes(served.stdout))) == 5


def test_speculative_config_adds_spec_decoding_lines_and_counters(sim: StartSim) -> None:
    s = sim("m", "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}')
    s.wait_ready()
    http(s.port, "/v1/completions", {"prompt": "Hello", "max_tokens": 40})
    s.wait_output(lambda out, err: any(m.startswith("SpecDecoding metrics:") for m in messages(out)))
    found = messages(bytes(s.stdout))
    index = next(i for i, m in enumerate(found) if m.startswith("SpecDecoding metrics:"))
    assert found[index - 1].startswith("Engine 000:")
    match = SPEC.match(found[index])
    assert match and len(match.group(6).split(", ")) == 3
    text = _scrape(s.port)
    assert _metric(text, "vllm:spec_decode_num_drafts_total") > 0
    assert _metric(text, "vllm:generation_tokens_total") == 40


def _wait_status(port: int, wanted: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while http(port, "/health").status != wanted:
        assert time.monotonic() < deadline, f"/health never answered {wanted}"


def test_killed_engine_core_turns_health_503_with_the_recorded_lines(sim: StartSim) -> None:
    s = sim("m", env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    s.wait_ready()
    os.kill(s.engine_pid(), signal.SIGKILL)
    _wait_status(s.port, 503)
    # /health may turn 503 a moment before the lines reach the pipe.
    s.wait_text("EngineDeadError: EngineCore encountered an issue.")
    found = messages(bytes(s.stdout))
    assert "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" in found
    assert "AsyncLLM output_handler failed." in found
    assert "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause." in found
    assert http(s.port, "/v1/completions", {"prompt": "x"}).status == 500


def test_after_engine_death_the_port_closes_and_the_api_server_exits_0(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "engine_dies_after=1"})
    s.wait_text("Application startup complete.", "stderr")
    assert s.wait_exit() == 0
    s.drain()
    assert port_refuses(s.port)
    assert "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" in messages(bytes(s.stdout))
    assert physical_lines(bytes(s.stderr))[-1] == f"(APIServer pid={s.process.pid}) INFO:     Finished server process [{s.process.pid}]"
    assert s.group_pids() == []


def test_hung_engine_keeps_health_200_but_never_finishes_a_completion(sim: StartSim) -> None:
    s = sim("m", env={"GB10D_SIM_SCENARIO": "hang_after=0"})
    s.wait_ready()
    before = _metric(_scrape(s.port), "vllm:generation_tokens_total")
    with pytest.raises((socket.timeout, TimeoutError)):
        http(s.port, "/v1/completions", {"prompt": "x", "max_tokens": 2}, timeout=1.0)
    assert http(s.port, "/health").status == 200
    assert _metric(_scrape(s.port), "vllm:generation_tokens_total") == before
    assert _metric(_scrape(s.port), "vllm:num_requests_running") == 1


def test_concurrent_completions_are_all_served(served: Sim) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def one(index: int) -> int:
        return int(http(served.port, "/v1/completions", {"model": "tiny", "prompt": f"request {index}", "max_tokens": 20}).json()["usage"]["completion_tokens"])

    with ThreadPoolExecutor(max_workers=6) as pool:
        assert list(pool.map(one, range(6))) == [20] * 6


def test_unknown_paths_and_methods_get_fastapis_answers(served: Sim) -> None:
    assert (http(served.port, "/nope").status, http(served.port, "/nope").body) == (404, b'{"detail":"Not Found"}')
    assert http(served.port, "/v1/models", {"x": 1}).status == 405


def test_idle_stats_lines_are_debug_records_with_the_relative_source(sim: StartSim) -> None:
    s = sim("m", env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    s.wait_ready()
    s.wait_text("[v1/metrics/loggers.py:271] Engine 000:")
    line = next(line for line in physical_lines(bytes(s.stdout)) if "Engine 000:" in line)
    assert " DEBUG " in line and line.endswith("Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, Prefix cache hit rate: 0.0%")
