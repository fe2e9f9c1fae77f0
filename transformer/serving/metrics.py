"""The server's Prometheus metrics (`GET /metrics`), in a registry of each app's own (two apps in one
process, as in tests, never share counts): requests by endpoint and status, latency, model calls' sizes,
queue depth."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "aiayn_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "aiayn_request_seconds",
            "Time from a request's arrival to its answer",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_segments = Histogram(
            "aiayn_batch_segments",
            "Segments per model call (dynamic batching)",
            ["model"],
            buckets=_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "aiayn_batch_requests",
            "Requests per model call (dynamic batching)",
            ["model"],
            buckets=_SIZE_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "aiayn_requests_in_flight", "Requests being answered now, by endpoint", ["endpoint"], registry=r
        )
        self.queue_depth = Gauge("aiayn_queue_depth", "Requests waiting for a model", ["model"], registry=r)
        self.model_errors = Counter(
            "aiayn_model_errors",
            "Model calls that failed (their requests answered 500)",
            ["model"],
            registry=r,
        )

    def text(self) -> bytes:
        return generate_latest(self.registry)
