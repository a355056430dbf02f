"""gb10d's Prometheus metrics: its own state, the figures vLLM prints, and optionally vLLM's /metrics.

Everything lives in one private `CollectorRegistry`, so importing gb10d
never adds series to a host program's global registry, and tests can build
as many independent `Metrics` as they like. `Listener` serves a collector
with prometheus-client's own WSGI app and threaded server, for gb10d and for
the front alike; vLLM's own families join gb10d's as a collector read at
scrape time, and the listener is closed and reopened on another address when
the config is reloaded.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from .. import __version__
from ..core.phases import Phase
from ..vllm import failures
from ..vllm.events import Event, SpecDecodingLogged, StatsLogged
from .probe import Prober


def restart_causes() -> tuple[str, ...]:
    """The causes of a restart: the failure kinds a retry may mend (those no retry can fix never restart), and
    node_lost (a machine of a pair left). Known label values are created at zero, so `rate()` and alerts see
    the series before the first increment instead of a gap."""
    return (*failures.restart_labels(), "node_lost")


# Each phase is one series of the `gb10d_phase` state set, so a dashboard sees
# a 0 for every phase that is not current rather than a missing series.
PHASES: tuple[str, ...] = tuple(phase.value for phase in Phase)

LIVENESS_CAUSES: tuple[str, ...] = ("health", "hung", "probe_timeout", "engine_dead", "asleep")

# A scrape must not hang on a wedged vLLM: Prometheus' own default timeout is 10 s.
PROXY_TIMEOUT_S = 2.0


def vllm_families(exposition: str) -> str:
    """The `vllm:` series of vLLM's /metrics text, without its Python process series.

    vLLM's /metrics also exports `python_gc_*` and `process_*` of the API
    server; those names would describe a different process under the same
    scrape target, so only vLLM's own families are passed on.
    """
    kept: list[str] = []
    for line in exposition.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split(" ", 3)[2] if line.count(" ") >= 2 else ""
        elif line.startswith("#") or not line.strip():
            continue
        else:
            name = line
        if name.startswith("vllm:"):
            kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


# The states of gb10d_sleep_state: DaemonState's values for them.
SLEEP_STATES = ("serving", "parking", "asleep", "waking", "parked")


class Metrics(Collector):
    """The gauges and counters gb10d updates (through the Reporter, mostly), and the listener Prometheus scrapes."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

        def gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, documentation, labels, registry=self.registry)

        def counter(name: str, documentation: str, label: str) -> Counter:
            return Counter(name, documentation, (label,), registry=self.registry)

        Info("gb10d_build", "gb10d version.", registry=self.registry).info({"version": __version__})
        self._phase = _PhaseSet()
        self.registry.register(self._phase)
        self._ready = gauge("gb10d_ready", "1 when vLLM serves and systemd was told READY=1.")
        self._vllm_up = gauge("gb10d_vllm_up", "1 while a vLLM process is running.")
        self._attempts = counter("gb10d_start_attempts", "vLLM starts, by why the start happened.", "reason")
        self._restarts = counter("gb10d_restarts", "vLLM restarts, by the failure that caused them.", "cause")
        self._liveness = counter("gb10d_liveness_failures", "Failed liveness checks of a serving vLLM.", "cause")
        self._xid = counter("gb10d_gpu_xid", "NVIDIA Xid errors the kernel logged, by Xid number.", "xid")
        self._driver_oom = counter(
            "gb10d_driver_oom_lines",
            "The NVIDIA driver's out-of-memory lines the kernel logged, by the evidence that came with them (none: only told).",
            "evidence",
        )
        self._startup = gauge("gb10d_last_startup_seconds", "Seconds the last successful start took until ready.")
        self._progress = gauge("gb10d_load_progress_ratio", "Checkpoint shards loaded, as a fraction of all.")
        self._utilization = gauge(
            "gb10d_gpu_memory_utilization", "The gpu_memory_utilization vLLM was started with (after any lowering)."
        )
        self._requested = gauge("gb10d_gpu_memory_utilization_requested", "The gpu_memory_utilization the config asks for.")
        self._mem_total = gauge("gb10d_mem_total_bytes", "MemTotal of the unified memory.")
        self._mem_available = gauge("gb10d_mem_available_bytes", "MemAvailable of the unified memory.")
        self._mem_free = gauge("gb10d_mem_free_bytes", "MemFree: what CUDA reports as free on GB10.")
        self._page_cache = gauge("gb10d_page_cache_bytes", "Page cache (Cached), which CUDA counts as used on GB10.")
        self._cluster_nodes = gauge(
            "gb10d_cluster_nodes_up", "Machines with a GPU alive in the Ray cluster of a pair of GB10s (0 on a single machine)."
        )
        # `instance_name`, not `instance`: Prometheus gives every scraped series an `instance` label of its own.
        self._reservation = gauge(
            "gb10d_memory_reservation_bytes",
            "This instance's share in the machine's memory ledger: gpu_memory_utilization x MemTotal + headroom.",
            ("instance_name",),
        )
        self._real_use = gauge(
            "gb10d_memory_real_use_bytes",
            "MemAvailable drop over this instance's last start, when no other start overlapped it.",
            ("instance_name",),
        )
        self._sleep_state = gauge(
            "gb10d_sleep_state", "1 for the state of an instance that parks by sleep: serving, parking, asleep or waking.", ("state",)
        )
        self._wakes = counter("gb10d_wakes", "Wakes from sleep, by result: ok, or why gb10d started vLLM cold instead.", "result")
        self._wake_seconds = gauge("gb10d_last_wake_seconds", "Seconds the last checked wake from sleep took (calls and check generation).")
        self._memory_waiting = gauge("gb10d_memory_waiting", "1 while this instance's start waits for other gb10d instances' starts.")

        engine = ("engine",)
        self._prompt = gauge(
            "gb10d_vllm_prompt_throughput_tokens_per_second", "Prompt throughput in vLLM's last stats line.", engine
        )
        self._generation = gauge(
            "gb10d_vllm_generation_throughput_tokens_per_second",
            "Generation throughput in vLLM's last stats line.",
            engine,
        )
        self._running = gauge("gb10d_vllm_requests_running", "Requests running, from vLLM's stats line.", engine)
        self._waiting = gauge("gb10d_vllm_requests_waiting", "Requests waiting, from vLLM's stats line.", engine)
        self._kv_usage = gauge("gb10d_vllm_kv_cache_usage_ratio", "KV cache in use, from vLLM's stats line.", engine)
        self._prefix_hit = gauge(
            "gb10d_vllm_prefix_cache_hit_ratio", "Prefix cache hit rate, from vLLM's stats line.", engine
        )
        self._mean_len = gauge(
            "gb10d_vllm_spec_decode_mean_acceptance_length",
            "Mean tokens per step with speculative decoding (1 + accepted drafts).",
        )
        self._accept = gauge("gb10d_vllm_spec_decode_acceptance_ratio", "Drafted tokens accepted, as a fraction.")
        self._accepted = gauge("gb10d_vllm_spec_decode_accepted_tokens_per_second", "Draft tokens accepted per second.")
        self._drafted = gauge("gb10d_vllm_spec_decode_drafted_tokens_per_second", "Draft tokens proposed per second.")
        self._position = gauge(
            "gb10d_vllm_spec_decode_position_acceptance_ratio",
            "Acceptance rate of each draft position (0 = the first drafted token).",
            ("position",),
        )
        # Figures vLLM printed describe one vLLM process; they go stale with it.
        self._stats = (
            self._prompt, self._generation, self._running, self._waiting, self._kv_usage, self._prefix_hit,
            self._mean_len, self._accept, self._accepted, self._drafted, self._position,
        )
        restarts = restart_causes()
        for reason in ("initial", "reload", *restarts):
            self._attempts.labels(reason=reason)
        for cause in restarts:
            self._restarts.labels(cause=cause)
        for cause in LIVENESS_CAUSES:
            self._liveness.labels(cause=cause)
        self._vllm_target: str | None = None
        # Held by a scrape while it renders gb10d's series, and by `batch()`: a scrape never shows half
        # of a change that spans several series (phase "ready" but gb10d_ready still 0).
        self._lock = threading.RLock()
        self._listener: Listener | None = None

    # --- what gb10d reports ------------------------------------------------

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make the updates inside one change as far as a scrape can tell."""
        with self._lock:
            yield

    def set_phase(self, phase: str) -> None:
        """Make `phase` the one current phase of the state set."""
        self._phase.current = phase

    def set_ready(self, ready: bool) -> None:
        self._ready.set(1 if ready else 0)

    def set_vllm_up(self, up: bool) -> None:
        """Record whether vLLM runs; when it stops, its last printed figures are dropped as stale."""
        self._vllm_up.set(1 if up else 0)
        if not up:
            for gauge in self._stats:
                gauge.clear()

    def start_attempt(self, reason: str) -> None:
        self._attempts.labels(reason=reason).inc()

    def set_sleep_state(self, state: str) -> None:
        for name in SLEEP_STATES:
            self._sleep_state.labels(state=name).set(1 if name == state else 0)

    def wake(self, result: str, seconds: float | None = None) -> None:
        self._wakes.labels(result=result).inc()
        if seconds is not None:
            self._wake_seconds.set(seconds)

    def restart(self, cause: str) -> None:
        self._restarts.labels(cause=cause).inc()

    def liveness_failure(self, cause: str) -> None:
        self._liveness.labels(cause=cause).inc()

    def xid(self, number: int) -> None:
        self._xid.labels(xid=str(number)).inc()

    def driver_oom_line(self, evidence: str) -> None:
        self._driver_oom.labels(evidence=evidence).inc()

    def set_startup_seconds(self, seconds: float) -> None:
        self._startup.set(seconds)

    def set_load_progress(self, ratio: float) -> None:
        self._progress.set(ratio)

    def set_utilization(self, utilization: float, requested: float) -> None:
        """What vLLM starts with, beside what the config asks for: a dashboard shows the lowering as the gap."""
        self._utilization.set(utilization)
        self._requested.set(requested)

    def set_memory(self, total: int, available: int, free: int, cached: int) -> None:
        """Record /proc/meminfo's figures, in bytes."""
        self._mem_total.set(total)
        self._mem_available.set(available)
        self._mem_free.set(free)
        self._page_cache.set(cached)

    def set_cluster_nodes(self, count: int) -> None:
        self._cluster_nodes.set(count)

    def set_reservation(self, name: str, reserved: int, real_use: int | None, waiting: bool) -> None:
        """This instance's record in the memory ledger."""
        self._reservation.labels(instance_name=name).set(reserved)
        if real_use is not None:
            self._real_use.labels(instance_name=name).set(real_use)
        self._memory_waiting.set(1 if waiting else 0)

    def observe(self, event: Event) -> None:
        """Take the figures of a periodic vLLM stats line; other events are ignored."""
        if isinstance(event, StatsLogged):
            engine = event.engine
            self._prompt.labels(engine=engine).set(event.prompt_tokens_per_s)
            self._generation.labels(engine=engine).set(event.generation_tokens_per_s)
            self._running.labels(engine=engine).set(event.running)
            self._waiting.labels(engine=engine).set(event.waiting)
            if event.kv_cache_usage_percent is not None:
                self._kv_usage.labels(engine=engine).set(event.kv_cache_usage_percent / 100)
            if event.prefix_cache_hit_percent is not None:
                self._prefix_hit.labels(engine=engine).set(event.prefix_cache_hit_percent / 100)
        elif isinstance(event, SpecDecodingLogged):
            self._mean_len.set(event.mean_acceptance_length)
            self._accepted.set(event.accepted_tokens_per_s)
            self._drafted.set(event.drafted_tokens_per_s)
            if event.acceptance_rate_percent is not None:
                self._accept.set(event.acceptance_rate_percent / 100)
            elif event.drafted:
                self._accept.set(event.accepted / event.drafted)
            for position, rate in enumerate(event.per_position):
                self._position.labels(position=str(position)).set(rate)

    def set_vllm_target(self, url: str | None) -> None:
        """Append the `vllm:` families of vLLM's own /metrics, vLLM being at base `url`, to every scrape, or stop
        doing so (None)."""
        self._vllm_target = url

    # --- the listener --------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        """What one scrape holds: gb10d's series, then vLLM's when a target is set and answers."""
        with self._lock:
            own = list(self.registry.collect())
        yield from own
        target = self._vllm_target
        if target is not None:
            yield from _vllm_metrics(target)

    def exposition(self) -> bytes:
        """One scrape in Prometheus' text format."""
        return generate_latest(self)

    def serve(self, host: str, port: int) -> None:
        """Listen for scrapes on host:port (port 0 picks a free one); raises OSError if it cannot bind.

        Any listener already open is closed first, so a reload can move it.
        """
        self.close()
        self._listener = Listener(self, host, port)

    @property
    def port(self) -> int | None:
        """The port actually bound, or None when not listening."""
        return None if self._listener is None else self._listener.port

    def close(self) -> None:
        """Stop listening and release the port; harmless when not listening."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()


def _vllm_metrics(url: str) -> list[Metric]:
    """The `vllm:` families vLLM at `url` answers now, read by the Prober as liveness reads them; none when it is
    down, still loading or answers what cannot be parsed (gb10d_vllm_up says which)."""

    async def read() -> str | None:
        prober = Prober(url)
        try:
            return await prober.metrics_text(PROXY_TIMEOUT_S)
        finally:
            await prober.close()

    # The listener's threads run no event loop: each scrape runs its one read in a loop of its own.
    text = asyncio.run(read())
    if text is None:
        return []
    try:
        return list(text_string_to_metric_families(vllm_families(text)))
    except ValueError:
        return []


class Listener:
    """/metrics of one collector on host:port, in threads of their own: prometheus-client's WSGI app and threaded
    server; any other path is 404. Raises OSError when it cannot bind (port 0 picks a free port)."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
        self._server: ThreadingWSGIServer = make_server(host, port, _metrics_only(make_wsgi_app(collector)), server_class, _Quiet)
        self.port = int(self._server.server_address[1])
        # The poll interval only bounds how long close() waits for the thread.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="gb10d-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop listening and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


_Wsgi = Callable[[dict[str, object], Callable[..., object]], Iterable[bytes]]


def _metrics_only(app: _Wsgi) -> _Wsgi:
    """`app` at GET /metrics; 404 elsewhere, where prometheus-client would answer every path."""

    def only(environ: dict[str, object], start_response: Callable[..., object]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"gb10d serves /metrics only\n"]
        # Prometheus' text format whatever the scraper asks, the whole collector whatever the query: vLLM's
        # families pass on as vLLM wrote them, and the scrape is what it always was.
        plain = {key: value for key, value in environ.items() if key not in ("HTTP_ACCEPT", "QUERY_STRING")}
        return app(plain, start_response)

    return only


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        # Scrapes every 15 s would bury the journal; errors reach the scraper.
        pass


class _PhaseSet(Collector):
    """`gb10d_phase` as a state set, read in one step so a scrape never sees zero or two current phases.

    Setting one labelled gauge to 0 and another to 1 would be two steps, and
    the listener thread may collect between them.
    """

    def __init__(self) -> None:
        self.current: str | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        current = self.current
        family = GaugeMetricFamily(
            "gb10d_phase", "Current startup phase: 1 for the current one, 0 for the others.", labels=("phase",)
        )
        names = PHASES if current is None or current in PHASES else (*PHASES, current)
        for name in names:
            family.add_metric((name,), 1.0 if name == current else 0.0)
        yield family
