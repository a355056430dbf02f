"""metrics: every series is checked by scraping a real listener on an ephemeral port."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gb10d.daemon.metrics import PHASES, Metrics, vllm_families
from gb10d.vllm.events import ShardsProgressed, SpecDecodingLogged, StatsLogged
from harness import GIB_KB, Daemon, NotifySocket, Setup, free_port, wait_until

# As vLLM 0.23.0's /metrics answered, plus the process series it also exports.
VLLM_EXPOSITION = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.2e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 5.0
"""


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics()
    m.serve("127.0.0.1", 0)
    yield m
    m.close()


def scrape_port(port: int) -> str:
    # trust_env=False: the test machine's proxy settings must not reach loopback.
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, trust_env=False)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return response.text


def scrape(m: Metrics) -> str:
    assert m.port is not None
    return scrape_port(m.port)


def value(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_the_memory_ledger_share_is_exported_by_instance_name(metrics: Metrics) -> None:
    metrics.set_reservation("gb10d@chat", 53_351_796_736, None, waiting=True)
    text = scrape(metrics)
    assert value(text, "gb10d_memory_reservation_bytes", instance_name="gb10d@chat") == 53_351_796_736
    assert value(text, "gb10d_memory_waiting") == 1
    assert value(text, "gb10d_memory_real_use_bytes", instance_name="gb10d@chat") is None  # not measured yet
    metrics.set_reservation("gb10d@chat", 53_351_796_736, 51_000_000_000, waiting=False)
    text = scrape(metrics)
    assert value(text, "gb10d_memory_waiting") == 0
    assert value(text, "gb10d_memory_real_use_bytes", instance_name="gb10d@chat") == 51_000_000_000


def test_phase_is_a_state_set_with_exactly_one_current_phase(metrics: Metrics) -> None:
    for phase in PHASES:
        metrics.set_phase(phase)
        text = scrape(metrics)
        current = [p for p in PHASES if value(text, "gb10d_phase", phase=p) == 1]
        assert current == [phase]
        assert all(value(text, "gb10d_phase", phase=p) == 0 for p in PHASES if p != phase)


def test_a_phase_unknown_to_this_version_still_shows_as_current(metrics: Metrics) -> None:
    metrics.set_phase("draining")
    text = scrape(metrics)
    assert value(text, "gb10d_phase", phase="draining") == 1
    assert all(value(text, "gb10d_phase", phase=p) == 0 for p in PHASES)


def test_ready_and_vllm_up_follow_what_the_supervisor_reports(metrics: Metrics) -> None:
    assert value(scrape(metrics), "gb10d_ready") == 0
    metrics.set_vllm_up(True)
    metrics.set_ready(True)
    text = scrape(metrics)
    assert value(text, "gb10d_ready") == 1 and value(text, "gb10d_vllm_up") == 1
    metrics.set_ready(False)
    metrics.set_vllm_up(False)
    text = scrape(metrics)
    assert value(text, "gb10d_ready") == 0 and value(text, "gb10d_vllm_up") == 0


def test_start_attempts_restarts_and_liveness_failures_count_by_label(metrics: Metrics) -> None:
    text = scrape(metrics)
    assert value(text, "gb10d_start_attempts_total", reason="free_memory") == 0, "known reasons exist from the start"
    metrics.start_attempt("initial")
    metrics.start_attempt("free_memory")
    metrics.restart("free_memory")
    metrics.start_attempt("free_memory")
    metrics.restart("free_memory")
    metrics.liveness_failure("health")
    metrics.restart("something_new")
    text = scrape(metrics)
    assert value(text, "gb10d_start_attempts_total", reason="initial") == 1
    assert value(text, "gb10d_start_attempts_total", reason="free_memory") == 2
    assert value(text, "gb10d_restarts_total", cause="free_memory") == 2
    assert value(text, "gb10d_restarts_total", cause="something_new") == 1
    assert value(text, "gb10d_liveness_failures_total", cause="health") == 1


def test_startup_progress_utilization_and_memory_gauges(metrics: Metrics) -> None:
    shards = ShardsProgressed(done=12, total=66)
    metrics.set_load_progress(shards.done / shards.total)
    metrics.set_utilization(0.49, requested=0.8)
    metrics.set_startup_seconds(412.5)
    metrics.set_memory(total=128_526_778_368, available=65_821_179_904, free=44_023_414_784, cached=21_474_836_480)
    text = scrape(metrics)
    assert value(text, "gb10d_load_progress_ratio") == pytest.approx(12 / 66)
    assert value(text, "gb10d_gpu_memory_utilization") == 0.49
    assert value(text, "gb10d_gpu_memory_utilization_requested") == 0.8
    assert value(text, "gb10d_last_startup_seconds") == 412.5
    assert value(text, "gb10d_mem_total_bytes") == 128_526_778_368
    assert value(text, "gb10d_mem_available_bytes") == 65_821_179_904
    assert value(text, "gb10d_mem_free_bytes") == 44_023_414_784
    assert value(text, "gb10d_page_cache_bytes") == 21_474_836_480


def test_stats_line_figures_are_exposed_with_percentages_as_ratios(metrics: Metrics) -> None:
    metrics.observe(
        StatsLogged(
            prompt_tokens_per_s=1234.5,
            generation_tokens_per_s=57.3,
            running=3,
            waiting=1,
            kv_cache_usage_percent=12.5,
            prefix_cache_hit_percent=40.0,
        )
    )
    text = scrape(metrics)
    assert value(text, "gb10d_vllm_prompt_throughput_tokens_per_second", engine="000") == 1234.5
    assert value(text, "gb10d_vllm_generation_throughput_tokens_per_second", engine="000") == 57.3
    assert value(text, "gb10d_vllm_requests_running", engine="000") == 3
    assert value(text, "gb10d_vllm_requests_waiting", engine="000") == 1
    assert value(text, "gb10d_vllm_kv_cache_usage_ratio", engine="000") == 0.125
    assert value(text, "gb10d_vllm_prefix_cache_hit_ratio", engine="000") == 0.4


def test_spec_decoding_figures_include_each_draft_position(metrics: Metrics) -> None:
    metrics.observe(
        SpecDecodingLogged(
            mean_acceptance_length=2.47,
            accepted_tokens_per_s=30.1,
            drafted_tokens_per_s=61.5,
            accepted=301,
            drafted=615,
            per_position=(0.81, 0.45, 0.21),
            acceptance_rate_percent=48.9,
        )
    )
    text = scrape(metrics)
    assert value(text, "gb10d_vllm_spec_decode_mean_acceptance_length") == 2.47
    assert value(text, "gb10d_vllm_spec_decode_acceptance_ratio") == pytest.approx(0.489)
    assert value(text, "gb10d_vllm_spec_decode_accepted_tokens_per_second") == 30.1
    assert value(text, "gb10d_vllm_spec_decode_drafted_tokens_per_second") == 61.5
    for position, rate in enumerate((0.81, 0.45, 0.21)):
        assert value(text, "gb10d_vllm_spec_decode_position_acceptance_ratio", position=str(position)) == rate


def test_acceptance_ratio_is_derived_from_counts_when_vllm_prints_no_rate(metrics: Metrics) -> None:
    metrics.observe(SpecDecodingLogged(2.0, 10.0, 20.0, accepted=100, drafted=400))
    assert value(scrape(metrics), "gb10d_vllm_spec_decode_acceptance_ratio") == 0.25


def test_vllm_figures_disappear_when_vllm_stops(metrics: Metrics) -> None:
    metrics.set_vllm_up(True)
    metrics.observe(StatsLogged(1.0, 2.0, running=1, waiting=0))
    assert value(scrape(metrics), "gb10d_vllm_requests_running", engine="000") == 1
    metrics.set_vllm_up(False)
    assert value(scrape(metrics), "gb10d_vllm_requests_running", engine="000") is None


def test_only_metrics_path_is_served(metrics: Metrics) -> None:
    assert httpx.get(f"http://127.0.0.1:{metrics.port}/", timeout=30, trust_env=False).status_code == 404


def test_listener_moves_to_a_new_address_and_releases_the_old_port(metrics: Metrics) -> None:
    old_port = metrics.port
    metrics.serve("127.0.0.1", 0)
    assert metrics.port != old_port
    assert value(scrape(metrics), "gb10d_ready") == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{old_port}/metrics", timeout=30, trust_env=False)


def test_close_releases_the_port_for_the_next_listener() -> None:
    first = Metrics()
    first.serve("127.0.0.1", 0)
    port = first.port
    assert port is not None
    first.close()
    assert first.port is None
    second = Metrics()
    second.serve("127.0.0.1", port)
    try:
        assert second.port == port
        assert value(scrape(second), "gb10d_ready") == 0
    finally:
        second.close()


def test_serving_on_a_taken_port_raises_oserror() -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    m = Metrics()
    try:
        with pytest.raises(OSError):
            m.serve("127.0.0.1", taken.getsockname()[1])
        assert m.port is None
    finally:
        taken.close()
        m.close()


def test_ipv6_loopback_listener_answers() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    m = Metrics()
    try:
        m.serve("::1", 0)
    except OSError as exc:
        pytest.skip(f"cannot bind ::1 here: {exc}")
    try:
        assert httpx.get(f"http://[::1]:{m.port}/metrics", timeout=30, trust_env=False).status_code == 200
    finally:
        m.close()


def test_two_instances_do_not_share_series() -> None:
    a, b = Metrics(), Metrics()
    a.set_ready(True)
    assert value(a.exposition().decode(), "gb10d_ready") == 1
    assert value(b.exposition().decode(), "gb10d_ready") == 0


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    """A real HTTP server answering /metrics the way vLLM does."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = VLLM_EXPOSITION.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_vllm_series_are_appended_to_the_scrape_when_a_target_is_set(metrics: Metrics, fake_vllm: str) -> None:
    metrics.set_vllm_target(fake_vllm)
    text = scrape(metrics)
    assert value(text, "gb10d_ready") == 0
    assert value(text, "vllm:num_requests_running", model_name="tiny") == 0
    assert value(text, "vllm:generation_tokens_total", model_name="tiny") == 5
    assert "python_gc_objects_collected_total" not in text
    assert "process_resident_memory_bytes" not in text
    metrics.set_vllm_target(None)
    assert "vllm:" not in scrape(metrics)


def test_scrape_still_answers_when_vllm_is_down(metrics: Metrics) -> None:
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    metrics.set_vllm_target(f"http://127.0.0.1:{port}")
    text = scrape(metrics)
    assert value(text, "gb10d_vllm_up") == 0
    assert "vllm:" not in text


def test_vllm_families_keeps_help_type_and_samples_of_vllm_only() -> None:
    assert vllm_families(VLLM_EXPOSITION).splitlines() == [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
        "# TYPE vllm:generation_tokens_total counter",
        'vllm:generation_tokens_total{engine="0",model_name="tiny"} 5.0',
    ]
    assert vllm_families("") == ""


# --- scraped while the real daemon starts gb10d.sim --------------------------------


@dataclass
class Sample:
    phase: list[str]
    text: str

    def get(self, name: str, **labels: str) -> float | None:
        return value(self.text, name, **labels)


def sample_while(port: int, running: threading.Event) -> tuple[list[Sample], threading.Thread]:
    """Scrape gb10d's listener over and over until `running` is cleared, recording each answer."""
    samples: list[Sample] = []

    def scrape_loop() -> None:
        with httpx.Client(timeout=30, trust_env=False) as client:
            while running.is_set():
                try:
                    text = client.get(f"http://127.0.0.1:{port}/metrics").text
                except httpx.HTTPError:
                    pass  # the listener opens a moment after gb10d starts
                else:
                    current = [p for p in PHASES if value(text, "gb10d_phase", phase=p) == 1]
                    samples.append(Sample(current, text))
                running.wait(0.02)  # pacing only, so the sampler leaves CPU to the daemon and the sim

    thread = threading.Thread(target=scrape_loop, daemon=True)
    thread.start()
    return samples, thread


@pytest.mark.slow
def test_scrapes_during_a_sim_start_follow_every_phase_to_ready(tmp_path: Path, notify: NotifySocket) -> None:
    port = free_port()
    # Stats lines every 5 s of wall time (100 s of the stand-in's at speed 0.05): a throughput figure
    # stays on the gauge until the next line, long enough for any scrape to find it.
    setup = Setup(tmp_path, speed=0.05, extra={"metrics.listen": f"127.0.0.1:{port}"}, sim_env={"VLLM_LOG_STATS_INTERVAL": "100"})
    running = threading.Event()
    running.set()
    samples, sampler = sample_while(port, running)
    daemon = Daemon(setup, notify)
    try:
        notify.wait_for(lambda m: m.get("READY") == "1", 120)
        final = Sample([], scrape_port(port))
        # The metrics say ready before READY=1 is sent, so the sampler's next scrape sees it.
        wait_until(lambda: any(s.phase == ["ready"] for s in samples), 60, "a scrape during the run that shows ready")
        running.clear()
        sampler.join(60)

        # Until the supervisor names its first phase, none is current.
        first = next(i for i, s in enumerate(samples) if s.phase)
        assert all(len(s.phase) == 1 for s in samples[first:]), "exactly one current phase in every scrape"
        seen = [s.phase[0] for s in samples[first:]]
        order = [PHASES.index(p) for p in seen]
        assert order == sorted(order), f"phases went backwards: {seen}"
        assert {"loading_weights", "ready"} <= set(seen), seen
        progress = [s.get("gb10d_load_progress_ratio") or 0.0 for s in samples]
        assert progress == sorted(progress), "load progress never goes back within one start"
        loading = [s for s in samples if s.phase == ["loading_weights"]]
        assert any(0 < (s.get("gb10d_load_progress_ratio") or 0) < 1 for s in loading), "a shard step in between"
        assert all(s.get("gb10d_vllm_up") == 1 for s in loading)
        assert all(s.get("gb10d_ready") == 0 for s in samples if s.phase != ["ready"])

        assert final.get("gb10d_ready") == 1
        assert final.get("gb10d_vllm_up") == 1
        assert final.get("gb10d_phase", phase="ready") == 1
        assert final.get("gb10d_load_progress_ratio") == 1
        assert final.get("gb10d_start_attempts_total", reason="initial") == 1
        assert final.get("gb10d_gpu_memory_utilization") == 0.8
        assert final.get("gb10d_mem_total_bytes") == int(setup.total_gib * GIB_KB) * 1024
        assert (final.get("gb10d_last_startup_seconds") or 0) > 0
        assert final.get("vllm:num_requests_running", model_name="tiny") is not None, "vLLM's own series are appended"

        response = httpx.post(
            f"http://127.0.0.1:{setup.port}/v1/completions",
            json={"model": "tiny", "prompt": "Hello", "max_tokens": 8},
            timeout=60,
            trust_env=False,
        )
        assert response.status_code == 200
        daemon.wait_line(r"Avg generation throughput: (?!0\.0 )\d")  # any figure but 0.0
        # The loop takes the parsed line a moment after it was forwarded.
        wait_until(
            lambda: (value(scrape_port(port), "gb10d_vllm_generation_throughput_tokens_per_second", engine="000")
                     or 0) > 0,
            60,
            "generation throughput from vLLM's stats line",
        )
    finally:
        running.clear()
        daemon.stop()
        daemon.kill_everything()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, trust_env=False)


@pytest.mark.slow
def test_free_memory_restart_is_counted_by_reason_and_cause(tmp_path: Path, notify: NotifySocket) -> None:
    port = free_port()
    setup = Setup(
        tmp_path, free_gib=103.45, utilization=0.92,
        extra={"memory.preflight": False, "metrics.listen": f"127.0.0.1:{port}"},
    )
    daemon = Daemon(setup, notify)
    try:
        notify.wait_for(lambda m: m.get("READY") == "1", 120)
        text = scrape_port(port)
    finally:
        daemon.stop()
        daemon.kill_everything()
    assert value(text, "gb10d_start_attempts_total", reason="initial") == 1
    assert value(text, "gb10d_start_attempts_total", reason="free_memory") == 1
    assert value(text, "gb10d_restarts_total", cause="free_memory") == 1
    assert value(text, "gb10d_gpu_memory_utilization") == 0.84
