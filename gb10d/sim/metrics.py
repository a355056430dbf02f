"""vLLM's `vllm:` metrics of one engine: the counters and histograms the API server keeps, and their text on /metrics.

Apart from the routes because they are a schema of their own (names, help
texts, buckets and label order as the recording shows them): gb10d's
liveness checks read them, and the periodic stats line counts the same figures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .devapi import SLEEP_STATES

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.count += 1


@dataclass
class Metrics:
    """vLLM's `vllm:` metrics of REFERENCE §4, for one engine."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    success: dict[str, int] = field(default_factory=lambda: {r: 0 for r in FINISHED_REASONS})
    prefix_queries: int = 0
    prefix_hits: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_per_pos: list[int] = field(default_factory=list)
    ttft: Histogram = field(default_factory=lambda: Histogram(_TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(_ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(_LATENCY_BUCKETS))
    iteration: Histogram = field(default_factory=lambda: Histogram(_ITERATION_BUCKETS))
    created: float = field(default_factory=time.time)


def _labels(values: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(values.items())) + "}"


def render_metrics(m: Metrics, model_name: str, running: int, kv_usage: float, spec_k: int | None, utilization: float, sleep_level: int = 0) -> str:
    """The Prometheus text exposition of the vllm: metrics (labels sorted, as the recording shows)."""
    base = {"engine": "0", "model_name": model_name}
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, dict[str, str], float]]) -> None:
        # prometheus_client names a counter family after its _total sample and
        # exposes the _created samples as a gauge family of their own.
        head = f"{name}_total" if kind == "counter" else name
        out.append(f"# HELP {head} {help_text}")
        out.append(f"# TYPE {head} {kind}")
        created = [s for s in samples if s[0] == "_created"]
        for suffix, extra, value in samples:
            if suffix != "_created":
                out.append(f"{name}{suffix}{_labels({**base, **extra})} {float(value)!r}")
        if created:
            out.append(f"# HELP {name}_created {help_text}")
            out.append(f"# TYPE {name}_created gauge")
            out.extend([f"{name}_created{_labels({**base, **extra})} {float(value)!r}" for _, extra, value in created])

    def counter(value: float) -> list[tuple[str, dict[str, str], float]]:
        return [("_total", {}, value), ("_created", {}, m.created)]

    def histogram(name: str, help_text: str, h: Histogram) -> None:
        samples: list[tuple[str, dict[str, str], float]] = [("_bucket", {"le": repr(b)}, c) for b, c in zip(h.buckets, h.counts)]
        samples += [("_bucket", {"le": "+Inf"}, h.count), ("_count", {}, h.count), ("_sum", {}, h.total), ("_created", {}, m.created)]
        family(name, "histogram", help_text, samples)

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", [("", {}, running)])
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", [("", {}, 0)])
    family("vllm:num_requests_waiting_by_reason", "gauge", "Number of requests waiting, by reason.", [("", {"reason": r}, 0) for r in ("capacity", "deferred")])
    family("vllm:engine_sleep_state", "gauge", "Engine sleep state; awake = 0 means engine is sleeping.", [("", {"sleep_state": s}, int(s == SLEEP_STATES[sleep_level])) for s in SLEEP_STATES])
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", [("", {}, kv_usage)])
    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig", [("", {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "gpu_memory_utilization": repr(utilization)}, 1)])
    family("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in terms of number of queried tokens.", counter(m.prefix_queries))
    family("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.", counter(m.prefix_hits))
    family("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.", counter(0))
    family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", counter(m.prompt_tokens))
    family("vllm:generation_tokens", "counter", "Number of generation tokens processed.", counter(m.generation_tokens))
    success: list[tuple[str, dict[str, str], float]] = []
    for reason in FINISHED_REASONS:
        success += [("_total", {"finished_reason": reason}, m.success[reason])]
    success += [("_created", {"finished_reason": reason}, m.created) for reason in FINISHED_REASONS]
    family("vllm:request_success", "counter", "Count of successfully processed requests.", success)
    histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", m.iteration)
    histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft)
    histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl)
    histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", m.e2e)
    histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", m.queue_time)
    histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", m.prefill)
    histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", m.decode)
    if spec_k:
        family("vllm:spec_decode_num_drafts", "counter", "Number of spec decoding drafts.", counter(m.spec_drafts))
        family("vllm:spec_decode_num_draft_tokens", "counter", "Number of draft tokens.", counter(m.spec_draft_tokens))
        family("vllm:spec_decode_num_accepted_tokens", "counter", "Number of accepted tokens.", counter(m.spec_accepted))
        per_pos = [("_total", {"position": str(p)}, m.spec_per_pos[p] if p < len(m.spec_per_pos) else 0) for p in range(spec_k)]
        family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.", per_pos)
    return "\n".join(out) + "\n"
