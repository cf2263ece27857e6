"""The attempt policy of the forwarding loop (``gateway.proxy.forward``): the order of the attempts, which failures are
retryable and how they are labelled, the process-wide retry budget, passive outlier ejection, and the 503 of an
exhausted request.

Retryable before the commit point (another pool may do better): connect errors and timeouts, 429, 500/502/503/504,
no first event within the TTFT deadline, an error or a broken connection before the first event, and a pool
refusing the gateway's own credentials (401/403: the client's key never reaches a pool, so this says the YAML's
``api_key_env`` is wrong for that pool, not that the client is; another pool may still answer). Everything else
the pool answers (400/404/413/422, …) is the answer: the same request would fail the same way anywhere.

The retry budget (Envoy's): retries in progress may not exceed ``ratio`` x requests in progress, with a floor of
``min_retries``, so a failing pool cannot double the load on the healthy one. A request holds its lease from its
first attempt until its upstream response is closed; a retry holds a slot for as long.

Back-pressure is not failure (``gateway.routing.overload``): a 429, a queue-full 503, a full connection pool and a
first-event deadline missed by a busy endpoint are labelled as such, never counted toward ejection, never mark the
endpoint unhealthy, and move the request on only to an endpoint that is not busy itself.

Outlier ejection: ``consecutive_failures`` endpoint failures in a row eject the endpoint for base x 2^(k-1) s
(``EndpointState.eject``), unless that would leave a model of its pool without any routable endpoint; a health
check brings it back once the time is over.

The retry budget is per process (each replica and each worker has its own): it bounds a ratio, retries to requests
in progress, which each replica's share of the traffic keeps the same as the cluster's, and it is checked on every
retry, where a Redis round trip would add latency to the request that can least afford it. Ejections start in the
process that saw the failures; in a cluster each replica shares its own ejections with the others through the
shared counts (``gateway.cluster``), which apply them for the time left.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

from gateway.config.schema import Defaults, OutlierDetection, Overload
from gateway.config.schema import RetryBudget as RetryBudgetSpec
from gateway.errors import (
    NoCapacity,
    Overloaded,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolFull,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from gateway.fleet.pools import EndpointState, PoolState
from gateway.observability.metrics import GatewayMetrics
from gateway.routing import overload
from gateway.routing.plan import Plan

logger = logging.getLogger("specgate.attempts")

AttemptResult = Literal[
    "ok",  # a 2xx answer (for a stream: its first event)
    "status_4xx",  # a 4xx answer passed through, or the pool refusing the gateway's credentials (retried)
    "status_429",
    "status_5xx",
    "connect_error",  # connect refused / timed out, or the connection broke before the response
    "timeout",  # no response (or, for a stream, no first event) in time
    "stream_error_before_first_chunk",  # a 200 stream that failed before its first event
    "budget_exhausted",  # a retry the retry budget refused (not sent)
    # back-pressure (gateway.routing.overload), besides status_429: never counted toward ejection
    "queue_full",  # a 503 saying the engine's queue is full (or with Retry-After)
    "queue_timeout",  # no first event in time from an endpoint that was busy (queueing)
    "pool_full",  # no free pooled connection before the first-byte deadline
]

BACKPRESSURE_RESULTS = frozenset({"status_429", "queue_full", "queue_timeout", "pool_full"})

# Statuses after which another pool may be tried (before the commit point): overload and server errors.
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
CREDENTIAL_STATUS = frozenset({401, 403})


class PoolStatusError(UpstreamError):
    """The pool answered a status that is an attempt failure, not an answer (see ``RETRYABLE_STATUS``)."""

    def __init__(self, status: int, message: str, *, busy: bool | None = None) -> None:
        super().__init__(message)
        self.upstream_status = status
        # back-pressure rather than a broken endpoint (429, queue-full 503: gateway.routing.overload.busy_status)
        self.busy = status == 429 if busy is None else busy

    @property
    def brief(self) -> str:
        return f"HTTP {self.upstream_status}"  # the status only: the pool's own text is for the log

    @property
    def permanent(self) -> bool:
        """A retry by the client cannot help either (the gateway's credentials for the pool are wrong)."""
        return self.upstream_status in CREDENTIAL_STATUS


class StreamStartError(UpstreamConnectError):
    """A 200 event stream that failed before its first event (error event, broken connection, not SSE)."""

    kind = "the pool's stream failed before its first event"


def status_result(status: int) -> AttemptResult:
    if status < 400:
        return "ok"
    if status == 429:
        return "status_429"
    return "status_4xx" if status < 500 else "status_5xx"


def failure_result(exc: UpstreamError, *, queueing: bool = False) -> AttemptResult:
    """The label of a failed attempt; ``queueing``: the endpoint was busy when its deadline passed."""
    if isinstance(exc, PoolStatusError):
        if exc.busy and exc.upstream_status != 429:
            return "queue_full"
        return status_result(exc.upstream_status)
    if isinstance(exc, UpstreamPoolFull):
        return "pool_full"
    if isinstance(exc, StreamStartError):
        return "stream_error_before_first_chunk"
    if isinstance(exc, UpstreamTimeout):
        return "queue_timeout" if queueing else "timeout"
    if isinstance(exc, UpstreamConnectError):
        return "connect_error"
    return "stream_error_before_first_chunk"  # a stream's protocol error raised as a plain UpstreamError


# --- the order of attempts


def attempt_order(
    plan: Plan, pools: Mapping[str, PoolState], rng: random.Random, prompt: Sequence[int] = ()
) -> Iterator[tuple[PoolState, EndpointState]]:
    """Pools in plan order, one endpoint each, then round again with endpoints not yet tried. ``prompt``: the
    request's chunk hashes, for the pools' prefix affinity (``PoolState.pick``)."""
    tried: set[str] = set()
    while True:
        progressed = False
        for name in plan.pools:
            pool = pools.get(name)
            if pool is None:
                continue
            ep = pool.pick(rng, exclude=tried, prompt=prompt)
            if ep is None:
                continue
            tried.add(ep.id)
            progressed = True
            yield pool, ep
        if not progressed:
            return


# --- the retry budget --------------------------------------------------------------------------------------


class RetryBudget:
    """Concurrent retries ≤ max(min_retries, ratio x active requests), across the process. ``spec`` is read on
    every decision, so a reloaded config applies at once."""

    def __init__(self, spec: Callable[[], RetryBudgetSpec]) -> None:
        self._spec = spec
        self.active = 0  # requests holding a lease
        self.retries = 0  # retries in progress

    def limit(self) -> int:
        s = self._spec()
        return max(s.min_retries, math.floor(s.ratio * self.active + 1e-9))

    def lease(self) -> BudgetLease:
        """A request starts: it counts as active until ``BudgetLease.close``."""
        self.active += 1
        return BudgetLease(self)


class BudgetLease:
    """One request's share of the budget: itself, and the retries it was granted. ``close`` is idempotent."""

    __slots__ = ("_budget", "_closed", "retries")

    def __init__(self, budget: RetryBudget) -> None:
        self._budget = budget
        self._closed = False
        self.retries = 0

    def try_retry(self) -> bool:
        b = self._budget
        if self._closed or b.retries + 1 > b.limit():
            return False
        b.retries += 1
        self.retries += 1
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._budget.active -= 1
        self._budget.retries -= self.retries


# --- outlier ejection --------------------------------------------------------------------------------------


def would_strand(ep: EndpointState, pools: Iterable[PoolState]) -> bool:
    """True when taking ``ep`` out would leave a model of its pool with no routable endpoint in any pool."""
    pools = list(pools)
    own = next((p for p in pools if p.name == ep.pool), None)
    if own is None:
        return False
    for model in own.models:
        if not any(e is not ep and e.routable for p in pools if model in p.models for e in p.endpoints):
            return True
    return False


def note_failure(
    ep: EndpointState,
    reason: str,
    pools: Iterable[PoolState],
    spec: OutlierDetection,
    now: float,
    *,
    unreachable: bool = False,
) -> float | None:
    """Record a failed attempt on ``ep``; eject it when it reached ``spec.consecutive_failures`` in a row.
    Returns the ejection time when it was ejected now. ``unreachable`` (connect refused / timed out) also takes
    it out until the next passing health check, as before."""
    if unreachable:
        ep.mark_failure(reason)
    else:
        ep.count_failure(reason)
    count = ep.consecutive_failures
    if ep.ejected or count < spec.consecutive_failures:
        return None
    if would_strand(ep, pools):
        logger.warning(
            "endpoint %s/%s failed %d times in a row, but it is the last routable endpoint for a model: not ejected",
            ep.pool,
            ep.id,
            count,
        )
        return None
    duration = ep.eject(now, spec.base_ejection_s, spec.max_ejection_s)
    logger.warning(
        "endpoint %s/%s ejected for %gs after %d failures in a row (ejection #%d): %s",
        ep.pool,
        ep.id,
        duration,
        count,
        ep.ejections,
        reason,
    )
    return duration


# --- the policy a ProxyExchange uses -----------------------------------------------------------------------


class AttemptPolicy:
    """The process-wide part of the attempt loop: the retry budget, the outlier settings and admission control,
    read from the live config (``defaults`` and ``overload`` are called on each use, so a reload takes effect).
    ``workers``: the gateway's worker processes (admission and busy bounds are split over them)."""

    def __init__(
        self,
        defaults: Callable[[], Defaults],
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
        *,
        overload_spec: Callable[[], Overload] = Overload,
        workers: int = 1,
    ) -> None:
        self._defaults = defaults
        self._overload = overload_spec
        self.metrics = metrics
        self.clock = clock
        self.workers = workers
        # True while a cluster's shared in-flight counts are fresh (``EndpointState.remote_in_flight``): then the
        # admission and busy bounds are the whole ones, compared with the cluster's totals, not split over workers.
        self.shared_counts: Callable[[], bool] = lambda: False
        self.budget = RetryBudget(lambda: self._defaults().retry_budget)

    def _split(self) -> int:
        return 1 if self.shared_counts() else self.workers

    # --- back-pressure and admission (gateway.routing.overload)

    def classify(self, pool: PoolState, ep: EndpointState, exc: UpstreamError) -> AttemptResult:
        """The label of a failed attempt on ``ep`` (which this attempt still counts in flight)."""
        queueing = isinstance(exc, UpstreamTimeout) and overload.endpoint_busy(
            ep, pool.spec, self.clock(), workers=self._split(), own=1
        )
        return failure_result(exc, queueing=queueing)

    def admits(self, pool: PoolState) -> bool:
        return overload.admits(pool, self._split())

    def admission(self, pool: PoolState) -> tuple[int, int | None]:
        """The pool's requests in flight against its admission bound, and the bound."""
        return overload.load(pool, self._split())

    def busy(self, pool: PoolState, ep: EndpointState) -> bool:
        """After a back-pressure failure: ``ep`` is busy too (or its pool admits no more), so not worth trying."""
        return not self.admits(pool) or overload.endpoint_busy(ep, pool.spec, self.clock(), workers=self._split())

    def gave_up(self, failures: list[AttemptFailure], full: list[str]) -> NoCapacity:
        """The answer of a request whose attempts are over: 503 ``overloaded`` when it met only back-pressure (or
        was never sent: every planned pool full), else the 503 of ``exhausted``."""
        if failures and all(f.backpressure for f in failures):
            what = "every pool that can serve this request is busy"
            busy = self.overloaded(f"{what}: {log_listing(failures)}", "busy")
            busy.public = f"{what}: {client_listing(failures)}"
            return busy
        if not failures and full:
            return self.overloaded(f"every pool that can serve this request is full ({', '.join(full)})", "admission")
        return exhausted(failures)

    def client_send_timeout_s(self) -> float:
        return self._overload().client_send_timeout_s

    def overloaded(self, message: str, reason: str) -> Overloaded:
        return Overloaded(message, reason=reason, retry_after_s=self._overload().retry_after_s)

    def failed(
        self, ep: EndpointState, exc: UpstreamError, pools: Iterable[PoolState], result: AttemptResult | None = None
    ) -> None:
        """Bookkeeping of a failed attempt: the endpoint's failure count, and its ejection when due. Back-pressure
        (``result`` in ``BACKPRESSURE_RESULTS``, or a 429 / busy status) counts for nothing."""
        if result in BACKPRESSURE_RESULTS or (isinstance(exc, PoolStatusError) and exc.busy):
            return  # back-pressure, not a broken endpoint
        self._note(ep, exc.message, pools, unreachable=isinstance(exc, UpstreamUnreachable))

    def answered(self, ep: EndpointState, status: int, pools: Iterable[PoolState]) -> None:
        """An attempt that got an answer: a 5xx passed through counts as a failure, anything else resets it."""
        if status >= 500:
            self._note(ep, f"HTTP {status}", pools)
        else:
            ep.mark_success()

    def _note(self, ep: EndpointState, reason: str, pools: Iterable[PoolState], *, unreachable: bool = False) -> None:
        spec = self._defaults().outlier_detection
        if note_failure(ep, reason, pools, spec, self.clock(), unreachable=unreachable) is not None:
            self.metrics.endpoint_ejected.labels(ep.pool, ep.id).set(1)
            self.metrics.endpoint_ejections.labels(ep.pool, ep.id).inc()


def log_listing(failures: list[AttemptFailure]) -> str:
    """Every attempt's error as the log shows it: endpoint and all (``pool/endpoint: message; ...``)."""
    return "; ".join(f"{f.pool}/{f.endpoint}: {f.error.message}" for f in failures)


def client_listing(failures: list[AttemptFailure]) -> str:
    """Every attempt's error as a client reads it: the pool and the kind of failure (``pool: brief; ...``), never
    the endpoint, its URL or what the pool said (those are in the log line of the same request id)."""
    return "; ".join(f"{f.pool}: {f.error.brief}" for f in failures)


@dataclass(frozen=True, slots=True)
class AttemptFailure:
    """An attempt that failed before the commit point: where, the error, and its result label."""

    pool: str
    endpoint: str
    error: UpstreamError
    result: AttemptResult

    @property
    def backpressure(self) -> bool:
        return self.result in BACKPRESSURE_RESULTS


def exhausted(failures: list[AttemptFailure], *, budget_refused: bool = False) -> NoCapacity:
    """The 503 of a request whose attempts are used up: every attempt's error in the message (the client's names the
    pool and the kind of failure only: ``client_listing``), ``Retry-After``,
    and ``x-should-retry: false`` when every attempt failed in a way a client retry cannot change."""
    if not failures:
        return NoCapacity("no endpoint of the planned pools can take the request", retry_after_s=2)
    n = len(failures)
    if budget_refused:
        what = f"{n} attempt(s) failed and the retry budget allows no retry now"
        code = "retry_budget_exhausted"
    else:
        what = f"all {n} attempt(s) failed"
        code = "upstream_timeout" if isinstance(failures[-1].error, UpstreamTimeout) else "upstream_unavailable"
    headers = {}
    if all(isinstance(f.error, PoolStatusError) and f.error.permanent for f in failures):
        headers["x-should-retry"] = "false"
    return NoCapacity(
        f"{what}: {log_listing(failures)}",
        retry_after_s=2,
        code=code,
        headers=headers,
        public=f"{what}: {client_listing(failures)}",
    )


def describe_status(status: int, body: bytes) -> str:
    """``HTTP 503`` plus the pool's own error message when its body has one (vLLM's envelope, or the older flat
    ``{"object": "error", "message": ...}``), shortened."""
    text = f"HTTP {status}"
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return text
    inner = data.get("error", data) if isinstance(data, dict) else None
    message = inner.get("message") if isinstance(inner, dict) else None
    if isinstance(message, str) and message:
        text += f" ({message[:200]})"
    return text
