"""The front's Prometheus metrics, per instance: requests passed on, held now, time held, rejected, parks, evictions
and wakes, and how long a wake took."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..daemon.metrics import Listener

# A hold is a model's start: seconds to many minutes.
HOLD_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800)


class FrontMetrics:
    """One private registry (nothing of the process's default one), served on [front] metrics_listen."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("gb10d_front_requests", "Requests passed on to an instance.", ["instance"], registry=self.registry)
        self.held = Gauge("gb10d_front_held_requests", "Requests waiting now for their instance to serve.", ["instance"], registry=self.registry)
        self.hold_seconds = Histogram(
            "gb10d_front_hold_seconds", "How long requests that were held waited for their instance.", ["instance"],
            buckets=HOLD_BUCKETS, registry=self.registry,
        )
        self.swaps = Counter("gb10d_front_swaps", "Parks (idle), evictions (parks to make room) and wakes the front asked of on-demand instances.", ["instance", "kind"], registry=self.registry)
        self.swap_seconds = Histogram(
            "gb10d_front_swap_seconds", "How long a parked instance took from the front's wake to serving (a start, or a wake from sleep).",
            ["instance"], buckets=HOLD_BUCKETS, registry=self.registry,
        )
        self.rejected = Counter("gb10d_front_rejected_requests", "Requests answered with an error by the front itself.", ["instance", "status"], registry=self.registry)
        self.listener: Listener | None = None

    def serve(self, host: str, port: int) -> None:
        """Listen as gb10d's own metrics do (`Listener`); an address in use is an OSError for the caller."""
        self.listener = Listener(self.registry, host, port)
