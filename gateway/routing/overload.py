"""Overload is back-pressure, not failure: the causes of a failed attempt told apart, and admission control.
Pure functions on plain data (time is passed in).

A failed attempt has one of two causes:

- **endpoint failure**: connect refused or reset, a 5xx (other than a queue-full 503), a protocol error, an error
  before the first event, or a first-event deadline missed by an endpoint that was *not* busy. These count toward
  outlier ejection (``gateway.routing.attempts``), and a connect failure takes the endpoint out until its next
  passing health check.
- **back-pressure**: a 429; a 503 that says the engine's queue is full (vLLM's ``--max-num-queued-reqs``) or carries
  ``Retry-After``; no free pooled connection before the first-byte deadline; a first-event deadline missed while
  the endpoint was busy (its fresh scraped queue was not empty, or the gateway's own in-flight count on it had
  reached ``max_num_seqs`` or ``max_connections``). Never ejection, never unhealthy. The request may move to another
  planned pool only if that pool has headroom by the same numbers; otherwise the client gets 503 ``overloaded``
  with ``Retry-After`` at once.

Admission control: at most routable endpoints x (``max_num_seqs`` + ``admission.max_waiting_per_endpoint``)
requests of one gateway process in flight to a pool (with ``--workers N`` each worker takes 1/N of it, rounded up;
in a cluster whose shared counts are fresh, the whole cluster's requests against the whole bound).
A request beyond it goes to the next planned pool that admits it, or is shed (503 ``overloaded``, ``Retry-After``)
without waiting for anything.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from gateway.config.pool import Pool as PoolSpec
from gateway.fleet.pools import EndpointState, PoolState

# The words of an engine saying it is too busy (vLLM's queue-full 503: "The engine is currently busy and cannot accept
# new requests. Please try again later or on a different instance."; "... prefill token backlog limit ...").
_BUSY_WORDS = re.compile(r"busy|queue|overload|capacity|backlog|try again later|too many", re.IGNORECASE)


def busy_status(status: int, message: str, retry_after: bool) -> bool:
    """A pool's answer that says "busy", not "broken": 429 always; 503 when it says its queue is full (or that it
    is overloaded / busy), or when it tells the client when to come back."""
    if status == 429:
        return True
    return status == 503 and (retry_after or _BUSY_WORDS.search(message) is not None)


def waiting_allowance(spec: PoolSpec) -> int:
    """Requests per endpoint admitted beyond ``max_num_seqs`` (0 without ``max_num_seqs``)."""
    if spec.max_num_seqs is None:
        return 0
    given = spec.admission.max_waiting_per_endpoint
    return given if given is not None else max(1, spec.max_num_seqs // 2)


def admission_limit(spec: PoolSpec, routable: int, workers: int = 1) -> int | None:
    """This process's bound on requests in flight to the pool; None: no bound (admission off, or no
    ``max_num_seqs`` to size it from)."""
    if not spec.admission.enabled or spec.max_num_seqs is None:
        return None
    total = routable * (spec.max_num_seqs + waiting_allowance(spec))
    return math.ceil(total / max(1, workers))


def admits(pool: PoolState, workers: int = 1) -> bool:
    """The pool takes one more request of this process (admission control). In a cluster with fresh shared counts
    the other replicas' requests count too (``remote_in_flight``, else 0) and ``workers`` is 1: one bound for all."""
    limit = admission_limit(pool.spec, sum(1 for e in pool.endpoints if e.routable), workers)
    return limit is None or pool.in_flight + sum(e.remote_in_flight for e in pool.endpoints) < limit


def load(pool: PoolState, workers: int = 1) -> tuple[int, int | None]:
    """The requests in flight to the pool that count against its admission bound, and the bound (None: none)."""
    limit = admission_limit(pool.spec, sum(1 for e in pool.endpoints if e.routable), workers)
    return pool.in_flight + sum(e.remote_in_flight for e in pool.endpoints), limit


def endpoint_busy(ep: EndpointState, spec: PoolSpec, now: float, *, workers: int = 1, own: int = 0) -> bool:
    """The endpoint is busy: vLLM's queue was not empty at the last fresh scrape, or this process's other requests
    on it (``own``: this request's share of ``ep.in_flight``) fill its batch (``max_num_seqs``, split over the
    workers) or its connection pool (``max_connections``)."""
    if ep.queueing(now):
        return True
    others = ep.in_flight + ep.remote_in_flight - own
    if spec.max_num_seqs is not None and others >= math.ceil(spec.max_num_seqs / max(1, workers)):
        return True
    return others >= spec.max_connections


def limits(pools: Mapping[str, PoolState], workers: int = 1) -> dict[str, int | None]:
    """Each pool's current admission bound in this process (for the gauge and ``specgate explain``)."""
    return {
        name: admission_limit(p.spec, sum(1 for e in p.endpoints if e.routable), workers) for name, p in pools.items()
    }
