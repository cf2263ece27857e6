"""Overload is back-pressure, not failure (``gateway.routing.overload``): busy answers told from broken ones,
admission bounds, busy endpoints, and the attempt policy's bookkeeping of each cause."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.pool import Pool
from gateway.config.schema import Defaults, OutlierDetection, Overload
from gateway.errors import (
    NoCapacity,
    Overloaded,
    UpstreamConnectError,
    UpstreamPoolFull,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from gateway.fleet.pools import PoolState
from gateway.observability.metrics import GatewayMetrics
from gateway.routing import overload
from gateway.routing.attempts import AttemptFailure, AttemptPolicy, PoolStatusError

QUEUE_FULL = (
    "HTTP 503 (The engine is currently busy and cannot accept new requests. Please try again later or on a "
    "different instance.)"
)


def pool(endpoints: int = 2, **extra: Any) -> PoolState:
    spec = Pool.model_validate(
        {
            "name": "p",
            "kind": "standard",
            "models": ["m"],
            "endpoints": [{"url": f"http://p{i}:8000", "id": f"p{i}"} for i in range(endpoints)],
            **extra,
        }
    )
    return PoolState.from_spec(spec)


def policy(now: float = 100.0, consecutive: int = 3, workers: int = 1) -> AttemptPolicy:
    defaults = Defaults(outlier_detection=OutlierDetection(consecutive_failures=consecutive))
    spec = Overload(retry_after_s=7, client_send_timeout_s=2)
    return AttemptPolicy(lambda: defaults, GatewayMetrics(), lambda: now, overload_spec=lambda: spec, workers=workers)


@pytest.mark.parametrize(
    ("status", "message", "retry_after", "busy"),
    [
        (429, "HTTP 429", False, True),
        (503, QUEUE_FULL, False, True),
        (503, "HTTP 503 (The engine has reached its prefill token backlog limit.)", False, True),
        (503, "HTTP 503", True, True),  # the pool says when to come back
        (503, "HTTP 503 (EngineCore encountered an issue. See stack trace for the root cause.)", False, False),
        (503, "HTTP 503", False, False),
        (500, "HTTP 500 (server busy)", True, False),  # only 429 and 503 can be back-pressure
        (502, "HTTP 502", False, False),
    ],
)
def test_busy_status(status: int, message: str, retry_after: bool, busy: bool) -> None:
    assert overload.busy_status(status, message, retry_after) is busy


def test_admission_limit_is_sized_from_max_num_seqs() -> None:
    assert overload.admission_limit(pool().spec, 2) is None  # no max_num_seqs: no bound
    p = pool(max_num_seqs=8)
    assert overload.waiting_allowance(p.spec) == 4  # default: half a batch may wait per endpoint
    assert overload.admission_limit(p.spec, 2) == 2 * (8 + 4)
    assert overload.admission_limit(p.spec, 1) == 12  # follows the routable endpoints
    assert overload.admission_limit(p.spec, 2, workers=5) == 5  # 24 / 5 per worker, rounded up
    assert overload.admission_limit(pool(max_num_seqs=1).spec, 1) == 2  # at least one may wait
    explicit = pool(max_num_seqs=8, admission={"max_waiting_per_endpoint": 0})
    assert overload.admission_limit(explicit.spec, 2) == 16
    off = pool(max_num_seqs=8, admission={"enabled": False})
    assert overload.admission_limit(off.spec, 2) is None


def test_admission_needs_max_num_seqs_to_add_to() -> None:
    with pytest.raises(ValueError, match="needs the pool's max_num_seqs"):
        pool(admission={"max_waiting_per_endpoint": 4})


def test_admits_until_the_bound_counting_only_routable_endpoints() -> None:
    p = pool(max_num_seqs=2, admission={"max_waiting_per_endpoint": 1})  # bound 2 x 3 = 6
    p.endpoints[0].in_flight = 3
    p.endpoints[1].in_flight = 2
    assert overload.admits(p)
    p.endpoints[1].in_flight = 3
    assert not overload.admits(p)
    p.endpoints[0].in_flight = p.endpoints[1].in_flight = 1
    p.endpoints[1].healthy = False  # one routable endpoint left: bound 3
    p.endpoints[0].in_flight = 2
    assert not overload.admits(p)
    assert overload.limits({"p": p}) == {"p": 3}


def test_endpoint_busy_by_fresh_scraped_queue_or_own_in_flight() -> None:
    p = pool(max_num_seqs=4, max_connections=10)
    ep, spec = p.endpoints[0], p.spec
    assert not overload.endpoint_busy(ep, spec, 100.0)
    ep.note_queue(3, fresh_until=105.0)
    assert overload.endpoint_busy(ep, spec, 100.0)  # vLLM said it queues
    assert not overload.endpoint_busy(ep, spec, 106.0)  # stale: unknown, not busy
    ep.note_queue(0, fresh_until=200.0)
    ep.in_flight = 4
    assert overload.endpoint_busy(ep, spec, 100.0)  # our own requests fill its batch
    assert not overload.endpoint_busy(ep, spec, 100.0, own=1)  # ... not counting the one asking
    assert overload.endpoint_busy(ep, spec, 100.0, workers=2, own=2)  # 2 others fill this worker's share (4 / 2)
    assert not overload.endpoint_busy(ep, spec, 100.0, workers=2, own=3)
    no_seqs = pool(max_connections=3)
    no_seqs.endpoints[0].in_flight = 3
    assert overload.endpoint_busy(no_seqs.endpoints[0], no_seqs.spec, 100.0)  # every connection taken


def test_classify_tells_a_queueing_timeout_from_a_dead_endpoint() -> None:
    pol = policy()
    p = pool(max_num_seqs=2)
    ep = p.endpoints[0]
    ep.in_flight = 1  # this attempt only
    timeout = UpstreamTimeout("no first event from p0 within 1s")
    assert pol.classify(p, ep, timeout) == "timeout"  # idle and silent: an endpoint failure
    ep.note_queue(5, fresh_until=101.0)
    assert pol.classify(p, ep, timeout) == "queue_timeout"
    ep.note_queue(0, fresh_until=101.0)
    ep.in_flight = 3  # two others fill its batch of 2
    assert pol.classify(p, ep, timeout) == "queue_timeout"
    assert pol.classify(p, ep, UpstreamPoolFull("p0 is busy")) == "pool_full"
    assert pol.classify(p, ep, PoolStatusError(429, "HTTP 429")) == "status_429"
    assert pol.classify(p, ep, PoolStatusError(503, QUEUE_FULL, busy=True)) == "queue_full"
    assert pol.classify(p, ep, PoolStatusError(503, "HTTP 503", busy=False)) == "status_5xx"
    assert pol.classify(p, ep, UpstreamUnreachable("refused")) == "connect_error"


def test_back_pressure_never_counts_toward_ejection_nor_health() -> None:
    pol = policy(consecutive=3)
    p = pool(max_num_seqs=2)
    ep = p.endpoints[0]
    busy = [
        (UpstreamTimeout("late"), "queue_timeout"),
        (UpstreamPoolFull("full"), "pool_full"),
        (PoolStatusError(429, "HTTP 429"), "status_429"),
        (PoolStatusError(503, QUEUE_FULL, busy=True), "queue_full"),
    ]
    for _ in range(5):
        for exc, result in busy:
            pol.failed(ep, exc, [p], result)  # type: ignore[arg-type]
    assert (ep.consecutive_failures, ep.ejected, ep.healthy) == (0, False, True)
    for _ in range(3):  # the same deadline missed by an idle endpoint: a failure
        pol.failed(ep, UpstreamTimeout("late"), [p], "timeout")
    assert ep.ejected


def test_a_refused_connection_still_marks_the_endpoint_down() -> None:
    pol = policy()
    p = pool()
    pol.failed(p.endpoints[0], UpstreamUnreachable("refused"), [p], "connect_error")
    assert not p.endpoints[0].healthy


def test_gave_up_overloaded_only_for_pure_back_pressure() -> None:
    pol = policy()
    bp = AttemptFailure("a", "a0", UpstreamPoolFull("a0 is busy"), "pool_full")
    late = AttemptFailure("b", "b0", UpstreamTimeout("b0 late"), "queue_timeout")
    broken = AttemptFailure("b", "b1", UpstreamConnectError("b1 broke"), "connect_error")
    err = pol.gave_up([bp, late], [])
    assert isinstance(err, Overloaded)
    assert (err.status, err.code, err.reason, err.headers["retry-after"]) == (503, "overloaded", "busy", "7")
    assert "a/a0" in err.message
    assert "b/b0" in err.message
    full = pol.gave_up([], ["a", "b"])
    assert isinstance(full, Overloaded)
    assert full.reason == "admission"
    assert "a, b" in full.message
    mixed = pol.gave_up([bp, broken], [])
    assert isinstance(mixed, NoCapacity)
    assert not isinstance(mixed, Overloaded)
    assert mixed.code == "upstream_unavailable"
