"""Prometheus metrics of one router, under the `radixray_` prefix, in their own registry.

A registry per router (not the process-global one) lets several routers live in one process,
as they do in tests and in a Ray Serve replica that is rebuilt.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class HitReport(Protocol):
    """What `RouterMetrics.hit` reads of a served prompt (`dispatch.Choice`)."""

    first_worker: str
    first_predicted: int
    cached_tokens: int
    block_size: int


class RouterMetrics:
    """All the router's series; names are a contract that dashboards and tests rely on."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "radixray_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "radixray_ttft_seconds", "time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "radixray_inter_token_seconds",
            "time between streamed chunks per token",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixray_e2e_seconds",
            "request latency end to end",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.routed = Counter(
            "radixray_routed",
            "routing decisions by worker and reason",
            ["worker", "reason"],
            registry=r,
        )
        self.cached_predicted = Counter(
            "radixray_cached_tokens_predicted",
            "prompt tokens the index expected cached",
            registry=r,
        )
        self.cached_actual = Counter(
            "radixray_cached_tokens_actual",
            "prompt tokens the workers reported reused",
            registry=r,
        )
        self.worker_cached_predicted = Counter(
            "radixray_worker_cached_tokens_predicted",
            "prompt tokens the index expected cached on the worker a request was routed to",
            ["worker"],
            registry=r,
        )
        self.worker_cached_actual = Counter(
            "radixray_worker_cached_tokens_actual",
            "prompt tokens that worker reported reused",
            ["worker"],
            registry=r,
        )
        self.false_hits = Counter(
            "radixray_false_hits",
            "requests routed for a predicted hit of at least one block that the worker then "
            "reported as 0 cached tokens",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens = Counter("radixray_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "radixray_generation_tokens", "generated tokens", registry=r
        )
        self.index_blocks = Gauge("radixray_index_blocks", "blocks in the prefix index", registry=r)
        self.sessions = Gauge(
            "radixray_sessions", "sessions this router pinned or a worker holds", registry=r
        )
        self.kv_free = Gauge("radixray_worker_kv_free", "free KV slots", ["worker"], registry=r)
        self.running = Gauge("radixray_worker_running", "running requests", ["worker"], registry=r)
        self.waiting = Gauge("radixray_worker_waiting", "waiting requests", ["worker"], registry=r)
        self.failovers = Counter(
            "radixray_failovers", "requests moved off a failed worker", registry=r
        )
        self.stalls = Counter(
            "radixray_stalls",
            "attempts whose worker sent nothing for the stall timeout",
            registry=r,
        )
        self.rejected = Counter(
            "radixray_rejected", "requests answered 429 at the concurrency limit", registry=r
        )
        self.slow_readers = Counter(
            "radixray_slow_readers",
            "responses dropped after their client read nothing for the send timeout",
            registry=r,
        )
        self.in_flight = Gauge(
            "radixray_in_flight", "generation requests in flight on this router", registry=r
        )

    def hit(self, run: HitReport) -> None:
        """One prompt's predicted and real prefix hit on the worker that served it first."""
        worker = run.first_worker
        if not worker:
            return
        self.worker_cached_predicted.labels(worker).inc(run.first_predicted)
        self.worker_cached_actual.labels(worker).inc(run.cached_tokens)
        if run.block_size and run.first_predicted >= run.block_size and run.cached_tokens == 0:
            self.false_hits.labels(worker).inc()

    def worker_joined(self, worker: object) -> None:
        """(Registry listener.) Series appear with the worker's first stats."""

    def worker_left(self, worker_id: str) -> None:
        """(Registry listener.) Drops the labelled series of a worker that left routing."""
        for gauge in (self.kv_free, self.running, self.waiting):
            try:
                gauge.remove(worker_id)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
