"""The gateway's own Prometheus metrics, in a registry of its own (never the global default).

Label values are bounded: class and pool names come from the routing YAML, outcomes from ``Outcome``;
a request that never reached a class or a pool is labelled ``none``.
"""

from __future__ import annotations

from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

Outcome = Literal[
    "ok",  # 2xx, stream completed with [DONE]
    "client_error",  # 4xx decided by the gateway or relayed from the pool
    "upstream_error",  # 5xx relayed from the pool, or the pool failed before the commit point
    "no_capacity",  # 503 from the gateway: no pool could take it
    "stream_error",  # the stream broke after the commit point; ended with an error event
    "client_disconnect",  # the client went away; upstream cancelled
    "gateway_error",  # a bug: 500 from the gateway itself
]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "specgate_requests_total",
            "Requests by traffic class, pool and outcome.",
            ["class", "pool", "outcome"],
            registry=r,
        )
        self.e2e = Histogram(
            "specgate_request_duration_seconds",
            "End-to-end request duration seen by the gateway (arrival to last byte sent).",
            ["class", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "specgate_time_to_first_token_seconds",
            "Streams: arrival to the first event sent to the client.",
            ["class", "pool"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "specgate_gateway_overhead_seconds",
            "Time spent in the gateway itself, excluding waiting for the upstream.",
            ["class"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("specgate_in_flight_requests", "Requests in flight to each pool.", ["pool"], registry=r)
        self.endpoint_up = Gauge(
            "specgate_endpoint_healthy",
            "1 when the endpoint's last health check passed.",
            ["pool", "endpoint"],
            registry=r,
        )
        self.health_checks = Counter(
            "specgate_health_checks_total",
            "Active health checks by result.",
            ["pool", "result"],
            registry=r,
        )

        # Label children looked up once per label set: .labels() takes a lock and builds a tuple each call.
        self._children: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}

    def observe_request(
        self, cls: str, pool: str, outcome: Outcome, e2e_s: float, ttft_s: float | None, overhead_s: float | None
    ) -> None:
        key = (cls, pool, outcome)
        children = self._children.get(key)
        if children is None:
            children = (
                self.requests.labels(cls, pool, outcome),
                self.e2e.labels(cls, pool),
                self.ttft.labels(cls, pool),
                self.overhead.labels(cls),
            )
            self._children[key] = children
        count, e2e, ttft, overhead = children
        count.inc()
        e2e.observe(e2e_s)
        if ttft_s is not None:
            ttft.observe(ttft_s)
        if overhead_s is not None:
            overhead.observe(overhead_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
