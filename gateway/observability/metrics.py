"""The gateway's own Prometheus metrics, in a registry of its own (never the global default).

Label values are bounded: class and pool names come from the routing YAML, outcomes from ``Outcome``;
a request that never reached a class or a pool is labelled ``none``.

With ``--workers N``, ``/metrics`` renders the merge of every worker's values (``metrics_workers``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.observability.acceptance import ACCEPTANCE_BUCKETS, AcceptanceWindow, SpecSample
from gateway.observability.exemplars import ExemplarGate
from gateway.observability.fast_child import Counting, Observing
from gateway.observability.latency_window import LatencyWindow
from gateway.observability.metrics_fleet import FleetMetrics
from gateway.observability.metrics_workers import forget_dead_processes, forget_process
from gateway.observability.metrics_workers import multiprocess_dir as multiprocess_dir  # the app's import

Outcome = Literal[
    "ok",  # 2xx, stream completed with [DONE]
    "client_error",  # 4xx decided by the gateway or relayed from the pool
    "upstream_error",  # 5xx relayed from the pool, or the pool failed before the commit point
    "no_capacity",  # 503 from the gateway: no pool could take it
    "overloaded",  # 503 from the gateway with Retry-After: shed by admission control, or every pool busy
    "stream_error",  # the stream broke after the commit point; ended with an error event
    "client_disconnect",  # the client went away; upstream cancelled
    "client_stalled",  # the client read nothing for the send deadline: cut off, upstream cancelled
    "gateway_error",  # a bug: 500 from the gateway itself
]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CONTENT_TYPE = CONTENT_TYPE_LATEST
OPENMETRICS = "application/openmetrics-text"
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

# Why the tracing drops spans: before its export process had them (the pipe's bound, no export process, a trace that
# could not be recorded), and in the export process (its queue's bound, a failed export, a span not written).
TRACE_DROP_REASONS = ("pipe_full", "export_process_down", "queue_full", "export_failed", "unwritable")


class GatewayMetrics(FleetMetrics):
    """The gateway's ``specgate_*`` Prometheus metrics in their own registry (requests, latency, attempts,
    fallbacks, in-flight, acceptance, idempotency, config), with the helpers the request path records through;
    what is measured of the fleet itself is declared by ``FleetMetrics`` (``metrics_fleet``).
    With ``--workers N`` it writes to prometheus_client's multiprocess directory (``share_across_workers``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        super().__init__(r)
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
        # multiprocess_mode only matters with several workers (ignored otherwise). In flight: the sum over the
        # live workers. "liveall" would add a ``pid`` label, one series per worker that changes on every worker
        # restart; plain "max" would keep a dead worker's last value forever.
        self.in_flight = Gauge(
            "specgate_in_flight_requests",
            "Requests in flight to each pool.",
            ["pool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        # The attempt loop (gateway.proxy.forward, gateway.routing.attempts): every upstream attempt, every move
        # to another pool, and passive outlier ejection (1 while the endpoint is ejected in any live worker).
        self.upstream_attempts = Counter(
            "specgate_upstream_attempts",
            "Upstream attempts by pool and result. Endpoint failures: status_5xx, connect_error, timeout, "
            "stream_error_before_first_chunk. Back-pressure (never ejection): status_429, queue_full, queue_timeout, "
            "pool_full. Also ok, status_4xx; budget_exhausted: a retry the retry budget refused, not sent.",
            ["pool", "result"],
            registry=r,
        )
        self.fallbacks = Counter(
            "specgate_fallbacks",
            "Retries on another pool before the commit point, by the failed attempt's result.",
            ["class", "from_pool", "to_pool", "reason"],
            registry=r,
        )
        self.endpoint_ejected = Gauge(
            "specgate_endpoint_ejected",
            "1 while the endpoint is ejected by passive outlier detection.",
            ["pool", "endpoint"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.endpoint_ejections = Counter(
            "specgate_endpoint_ejections",
            "Ejections of the endpoint by passive outlier detection.",
            ["pool", "endpoint"],
            registry=r,
        )
        # Overload (gateway.routing.overload, gateway.proxy.stall): requests answered 503 overloaded, the admission
        # bound in force, and clients cut off for reading nothing.
        self.shed = Counter(
            "specgate_shed",
            "Requests answered 503 overloaded with Retry-After, by class, first planned pool and reason (admission: "
            "no planned pool admitted it; busy: every attempt met back-pressure and no pool had headroom).",
            ["class", "pool", "reason"],
            registry=r,
        )
        self.admission_limit = Gauge(
            "specgate_admission_limit",
            "Requests this gateway admits in flight to the pool (admission control); absent when unbounded.",
            ["pool"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.client_stalled = Counter(
            "specgate_client_stalled",
            "Clients cut off after reading nothing for overload.client_send_timeout_s (upstream cancelled, slot "
            "freed).",
            ["pool"],
            registry=r,
        )
        self.idempotency = Counter(
            "specgate_idempotency_total",
            "Idempotency-Key handling by result (gateway.proxy.idempotency.Result).",
            ["result"],
            registry=r,
        )
        self.route_decisions = Counter(
            "specgate_route_decisions_total",
            "Requests by class and route reason: the x-specgate-route value (gateway.routing.plan.route_reason).",
            ["class", "route"],
            registry=r,
        )
        self.limit_refusals = Counter(
            "specgate_limit_refusals_total",
            "Requests or upstream responses stopped by a size or count limit (docs/limits.md), by limit.",
            ["limit"],
            registry=r,
        )
        self.store_rejected = Counter(
            "specgate_store_rejected_records_total",
            "Records read back from Redis that failed validation and were ignored, by kind (idempotency, snapshot, "
            "contribution, override).",
            ["kind"],
            registry=r,
        )

        # Label children looked up once per label set: .labels() takes a lock and builds a tuple each call.
        # Wrapped (``fast_child``): updated without the library's checks on every call.
        self._children: dict[tuple[str, str, str], tuple[Counting, Observing, Observing, Observing]] = {}
        self._exemplar_gate = ExemplarGate(LATENCY_BUCKETS)
        self._in_flight: dict[str, Counting] = {}
        self._attempts: dict[tuple[str, str], Counting] = {}
        self._routes: dict[tuple[str, str], Counting] = {}
        self._acceptance: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._acceptance_bands: dict[tuple[str, str], Any] = {}
        # Set by the multi-worker app factory (``share_across_workers``): the directory to merge for /metrics.
        self.shared_dir: str | None = None

        # Per-class acceptance from the responses of speculative pools (gateway.observability.acceptance): a sliding
        # window of
        # each class's recent requests in this process, pooled from the counts; NaN until a request drafted.
        self.class_acceptance = Gauge(
            "specgate_class_acceptance_ratio",
            "Draft acceptance rate of the class over its recent requests (accepted / draft tokens); NaN when none.",
            ["class"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.class_acceptance_length = Gauge(
            "specgate_class_mean_acceptance_length",
            "Mean acceptance length of the class over its recent requests (1 + accepted / steps); NaN when none.",
            ["class"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.class_acceptance_requests = Histogram(
            "specgate_class_acceptance",
            "Per-request draft acceptance rate (accepted / draft tokens) by class and temperature band.",
            ["class", "temperature_band"],
            buckets=ACCEPTANCE_BUCKETS,
            registry=r,
        )
        self.class_draft_tokens = Counter(
            "specgate_class_draft_tokens",
            "Draft tokens of the class's requests, as their speculative pool reported them.",
            ["class"],
            registry=r,
        )
        self.class_accepted_tokens = Counter(
            "specgate_class_accepted_draft_tokens",
            "Accepted draft tokens of the class's requests, as their speculative pool reported them.",
            ["class"],
            registry=r,
        )
        self.class_windows: dict[str, AcceptanceWindow] = {}
        # The routing YAML (gateway.runtime.reload): the config in force, and every reload attempt by result.
        self.config_info = Gauge(
            "specgate_config_info",
            "1 for the routing YAML in force (version: its `version` field; hash: sha256 prefix of its text).",
            ["version", "hash"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.config_reloads = Counter(
            "specgate_config_reload_total",
            "Reloads of the routing YAML by result (ok, unchanged, invalid, error).",
            ["result"],
            registry=r,
        )
        for result in ("ok", "unchanged", "invalid", "error"):
            self.config_reloads.labels(result)
        self._config_labels: tuple[str, str] | None = None
        # Tracing (gateway.observability.tracing; only with --tracing): the spans sent to the collector, and those
        # dropped by why (the pipe to the export process, the export process's queue, a failed export).
        self.trace_spans_exported = Counter(
            "specgate_trace_spans_exported",
            "Spans sent to the OTLP collector (tracing on).",
            registry=r,
        )
        self.trace_spans_dropped = Counter(
            "specgate_trace_spans_dropped",
            "Spans dropped (tracing on), by reason: " + ", ".join(TRACE_DROP_REASONS) + ".",
            ["reason"],
            registry=r,
        )
        for reason in TRACE_DROP_REASONS:
            self.trace_spans_dropped.labels(reason)
        self._trace_seen: dict[str, int] = {}
        self.latency_windows: dict[tuple[str, str], LatencyWindow] = {}  # (class, pool): successful requests' E2E

    def set_config(self, version: str, digest: str) -> None:
        """``specgate_config_info``: 1 for this config; the previous label set is removed (0 first, for the
        multiprocess files, which keep a removed child's last value)."""
        labels = (version, digest)
        previous, self._config_labels = self._config_labels, labels
        if previous is not None and previous != labels:
            self.config_info.labels(*previous).set(0)
            self.config_info.remove(*previous)
        self.config_info.labels(*labels).set(1)

    def trace_spans(self, counts: Mapping[str, int]) -> None:
        """The tracing's totals so far (``exported`` and each drop reason): the counters move by what is new."""
        seen = self._trace_seen
        for key, total in counts.items():
            new = total - seen.get(key, 0)
            if new <= 0:
                continue
            seen[key] = total
            if key == "exported":
                self.trace_spans_exported.inc(new)
            else:
                self.trace_spans_dropped.labels(key).inc(new)

    def share_across_workers(self, path: str) -> None:
        """Render /metrics from every worker's files in ``path`` (this process's values must be written there)."""
        self.shared_dir = path

    def worker_exited(self) -> None:
        """Lifespan shutdown of a worker: its gauges stop counting (its counters and histograms stay)."""
        if self.shared_dir is not None:
            forget_process(os.getpid(), self.shared_dir)

    def pool_in_flight(self, pool: str) -> Counting:
        """The ``in_flight`` child of ``pool``, looked up once (the attempt loop moves it twice per request):
        ``inc(1)``, ``dec()``."""
        child = self._in_flight.get(pool)
        if child is None:
            child = self._in_flight[pool] = Counting(self.in_flight.labels(pool))
        return child

    def limit_refused(self, limit: str) -> None:
        """Count one refusal by a limit (``limit_refusals``); ``limit`` is one of a fixed set of names."""
        self.limit_refusals.labels(limit).inc()

    def attempt_done(self, pool: str, result: str) -> None:
        """Count one upstream attempt (``upstream_attempts``), its child looked up once per label set."""
        key = (pool, result)
        child = self._attempts.get(key)
        if child is None:
            child = self._attempts[key] = Counting(self.upstream_attempts.labels(pool, result))
        child.inc(1)

    def route_decided(self, cls: str, route: str) -> None:
        """Count one request's route reason (``route_decisions``), its child looked up once per label set."""
        key = (cls, route)
        child = self._routes.get(key)
        if child is None:
            child = self._routes[key] = Counting(self.route_decisions.labels(cls, route))
        child.inc(1)

    def observe_request(
        self,
        cls: str,
        pool: str,
        outcome: Outcome,
        e2e_s: float,
        ttft_s: float | None,
        overhead_s: float | None,
        trace_id: str | None = None,
    ) -> None:
        """One finished request. ``trace_id`` (tracing on): an exemplar on its latency observations, shown by the
        OpenMetrics exposition (``render(openmetrics=True)``)."""
        key = (cls, pool, outcome)
        children = self._children.get(key)
        if children is None:
            children = (
                Counting(self.requests.labels(cls, pool, outcome)),
                Observing(self.e2e.labels(cls, pool)),
                Observing(self.ttft.labels(cls, pool)),
                Observing(self.overhead.labels(cls)),
            )
            self._children[key] = children
        count, e2e, ttft, overhead = children
        count.inc(1)
        now = time.monotonic()
        if trace_id is None or self.shared_dir is not None:
            e2e.observe(e2e_s)
            if ttft_s is not None:
                ttft.observe(ttft_s)
        else:  # at most one exemplar per bucket per second (``exemplars``)
            gate, exemplar = self._exemplar_gate, {"trace_id": trace_id}
            e2e.child.observe(e2e_s, exemplar if gate.due((e2e.child, 0), e2e_s, now) else None)
            if ttft_s is not None:
                ttft.child.observe(ttft_s, exemplar if gate.due((ttft.child, 1), ttft_s, now) else None)
        if outcome == "ok":
            window = self.latency_windows.get((cls, pool))
            if window is None:
                window = self.latency_windows[(cls, pool)] = LatencyWindow()
            window.add(now, e2e_s)
        if overhead_s is not None:
            overhead.observe(overhead_s)

    def latency_p95(self, cls: str, pool: str, since: float) -> float | None:
        """p95 end-to-end latency of the class's successful requests on the pool since ``since`` (monotonic)."""
        window = self.latency_windows.get((cls, pool))
        return None if window is None else window.quantile(0.95, since)

    def observe_acceptance(self, cls: str, band: str, sample: SpecSample) -> None:
        """One request's spec-decode metrics: the class's window, its gauges, the histogram and the counters."""
        window = self.class_windows.get(cls)
        if window is None:
            window = self.class_windows[cls] = AcceptanceWindow()
        window.add(sample)
        children = self._acceptance.get(cls)
        if children is None:
            children = self._acceptance[cls] = (
                self.class_acceptance.labels(cls),
                self.class_acceptance_length.labels(cls),
                self.class_draft_tokens.labels(cls),
                self.class_accepted_tokens.labels(cls),
            )
        ratio, length, drafted, accepted = children
        ratio.set(window.ratio)
        length.set(window.mean_acceptance_length)
        drafted.inc(sample.drafted)
        accepted.inc(sample.accepted)
        rate = sample.rate
        if rate is not None:
            hist = self._acceptance_bands.get((cls, band))
            if hist is None:
                hist = self._acceptance_bands[(cls, band)] = self.class_acceptance_requests.labels(cls, band)
            hist.observe(rate)

    def render(self, openmetrics: bool = False) -> bytes:
        """The exposition; ``openmetrics``: the OpenMetrics format, which carries the latency exemplars (one
        process only: prometheus_client keeps no exemplars across workers)."""
        if self.shared_dir is None:
            if openmetrics:
                from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

                body: bytes = generate_openmetrics(self.registry)  # type: ignore[no-untyped-call]
                return body
            return generate_latest(self.registry)
        forget_dead_processes(self.shared_dir)
        merged = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(merged, path=self.shared_dir)  # type: ignore[no-untyped-call]
        return generate_latest(merged)
