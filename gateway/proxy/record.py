"""What the gateway remembers of one request: timestamps, decision, attempts; finished exactly once.

``finish`` observes the metrics and writes the one JSON log line of the request.
Overhead is the time spent in the gateway itself: from arrival until the first upstream request left, plus
(non-streaming) from the upstream body's last byte until the response was handed to the server, or
(streaming) from the first upstream event until it was handed to the server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.observability.acceptance import SpecSample
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics, Outcome
from gateway.observability.tracing import RequestTrace


@dataclass(slots=True)
class AttemptRecord:
    """One upstream attempt of a request: where it went, the status it got or the error, and how long it took."""

    pool: str
    endpoint: str
    status: int | None
    error: str | None
    duration_s: float
    result: str | None = None  # failed: why, as the attempt policy classed it (the span's error.type)

    def as_dict(self) -> dict[str, object]:
        return {
            "pool": self.pool,
            "endpoint": self.endpoint,
            "status": self.status,
            "error": self.error,
            "duration_ms": round(self.duration_s * 1000, 3),
        }


@dataclass(slots=True)
class RequestRecord:
    """Everything the gateway learns about one request while serving it: its class, task type, route reason,
    attempts, timings, status, error, spec-decode sample and Idempotency-Key result. ``finish`` turns it, once,
    into the metrics and the access log line."""

    request_id: str
    path: str
    arrived: float = field(default_factory=time.perf_counter)
    traffic_class: str = "none"
    task_type: str | None = None
    route_reason: str | None = None
    stream: bool = False
    pool: str = "none"
    endpoint: str | None = None
    status: int = 0
    attempts: list[AttemptRecord] = field(default_factory=list)
    upstream_start: float | None = None
    upstream_first: float | None = None  # headers (non-stream) or first event (stream) received
    upstream_done: float | None = None  # non-stream: body read
    first_sent: float | None = None
    error: str | None = None
    temperature_band: str = "unset"  # gateway.observability.acceptance.temperature_band of the client's temperature
    spec: SpecSample | None = None  # the pool's per-request spec-decode metrics, when it returned them
    idempotency: str | None = None  # gateway.proxy.idempotency.Result, for requests with an Idempotency-Key
    cached_tokens: int | None = None  # prompt tokens the pool found in its prefix cache, when its usage said so
    tenant: str | None = None  # the tenant of its key (tenants configured only)
    # Tracing on (gateway.observability.tracing): the request's spans, recorded when its trace is sampled or kept;
    # an unsampled one is ``quiet`` until the tail decision keeps it (``keep_trace``), if ever
    trace: RequestTrace | None = None
    quiet: RequestTrace | None = None
    outcome: Outcome = "ok"  # how a forwarded request ended so far (its exchange and its client's presence set it)
    _finished: bool = False

    def attempt(
        self, pool: str, endpoint: str, started: float, status: int | None, error: str | None, result: str | None = None
    ) -> None:
        self.attempts.append(AttemptRecord(pool, endpoint, status, error, time.perf_counter() - started, result))

    def keep_trace(self) -> RequestTrace | None:
        """The tail decision keeps the request's quiet trace (it fell back, or failed): it records from now on
        (``trace``), its quiet attempt made of what this record says of the first attempt."""
        quiet = self.quiet
        if quiet is None:
            return self.trace
        self.quiet = None
        first = None
        if self.attempts:
            a = self.attempts[0]
            ttft = None
            if a.result is None and self.upstream_first is not None and self.upstream_start is not None:
                ttft = self.upstream_first - self.upstream_start
            first = (a.status, a.result, a.duration_s, ttft)
        quiet.keep(first)
        self.trace = quiet
        return quiet

    def overhead_s(self, end: float) -> float | None:
        if self.upstream_start is None:
            return None
        before = self.upstream_start - self.arrived
        if self.stream and self.upstream_first is not None and self.first_sent is not None:
            return before + max(0.0, self.first_sent - self.upstream_first)
        if self.upstream_done is not None:
            return before + max(0.0, end - self.upstream_done)
        return before

    def finish(self, outcome: Outcome, metrics: GatewayMetrics, access_log: AccessLog) -> None:
        if self._finished:
            return
        self._finished = True
        end = time.perf_counter()
        e2e = end - self.arrived
        cls, pool = self.traffic_class, self.pool
        ttft = self.first_sent - self.arrived if self.stream and self.first_sent is not None else None
        overhead = self.overhead_s(end)
        spec = self.spec
        trace = self.trace
        quiet = self.quiet
        if quiet is not None and quiet.kept(outcome, len(self.attempts), pool):  # failed: kept by the tail decision
            trace = self.keep_trace()
        if trace is not None:
            exported = trace.kept(outcome, len(self.attempts), pool) and trace.finish(
                status=self.status,
                outcome=outcome,
                pool=pool,
                endpoint=self.endpoint,
                attempts=len(self.attempts),
                commit_s=None if self.first_sent is None else self.first_sent - self.arrived,
                accepted=None if spec is None else spec.accepted,
                drafted=None if spec is None else spec.drafted,
                idempotency=self.idempotency,
            )
            # an exemplar only names a trace that is exported (a link to a dropped one would lead nowhere)
            metrics.observe_request(cls, pool, outcome, e2e, ttft, overhead, trace.trace_id if exported else None)
        else:
            metrics.observe_request(cls, pool, outcome, e2e, ttft, overhead)
        if self.route_reason is not None:
            metrics.route_decided(cls, self.route_reason)
        if spec is not None:
            metrics.observe_acceptance(cls, self.temperature_band, spec)
        if access_log.enabled:
            line = {
                "event": "request",
                "request_id": self.request_id,
                "path": self.path,
                "class": cls,
                "task_type": self.task_type,
                "route_reason": self.route_reason,
                "pool": pool,
                "endpoint": self.endpoint,
                "stream": self.stream,
                "status": self.status,
                "outcome": outcome,
                "duration_ms": round(e2e * 1000, 3),
                "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
                "overhead_ms": None if overhead is None else round(overhead * 1000, 3),
                "attempts": [a.as_dict() for a in self.attempts],
                "accepted": None if spec is None else spec.accepted,
                "drafted": None if spec is None else spec.drafted,
            }
            if self.cached_tokens is not None:
                line["cached_tokens"] = self.cached_tokens
            if self.error:
                line["error"] = self.error
            if self.idempotency is not None:
                line["idempotency"] = self.idempotency
            if self.tenant is not None:
                line["tenant"] = self.tenant
            named = quiet if trace is None else trace
            if named is not None:
                line["trace_id"] = named.trace_id
            access_log.write(line)
