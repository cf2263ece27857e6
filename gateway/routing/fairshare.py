"""Fair share of a full pool between tenants: who may still be admitted when the pool is at its admission bound.

Below the bound every request is admitted, first come first served. At the bound, a request is not simply shed:

1. **priority bands**: a request of a better (lower) priority than some tenant holding requests in the pool is
   admitted: the worse band is what gets shed. A request never gets in past the bound over a better band;
2. **weighted fair share within a band**: each tenant of the request's priority with requests in the pool (and
   the arriving one) has a share of what the better bands leave of the bound, in proportion to its weight. A
   tenant at or under its share is admitted while another tenant of its band is above its share; a tenant above
   its share is shed.

Admitting at the bound takes the pool over it: nothing running is preempted. The tenants above their share get no
more requests in, so the pool comes back under the bound as theirs finish. The overshoot is bounded: only tenants
under their share get in past the bound, so in-flight stays under ``2 x bound`` (a hard cap here as well).

Just below the bound (``hold_back``), a request of a tenant above its share leaves the last free slots to the
others: one for each tenant of a better priority holding requests in the pool and one for each tenant of its band
under its share. And while a better priority is configured, no request of a worse one takes the pool's last free
slot, whoever holds it: the fast lane for the better priority's next request. Without that, a flood refills every
slot the moment it frees, and the other tenants' requests arrive at a full pool and wait in vLLM's queue past the
bound: vLLM's priority policy orders its queue, and preempts when the KV cache is full, not when the batch is, so
even a request of the best priority waits there for the next sequence to finish. With it, their next request finds
a free slot of the batch. It costs one slot per other tenant present, only to tenants above their share, and the
fast lane's one slot to the worse priorities.

Pure: plain numbers in, a decision out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantWeight:
    """What fair share needs of a tenant: its share weight and priority (lower = more important)."""

    weight: float
    priority: int


@dataclass(frozen=True, slots=True)
class PoolTenants:
    """A pool as fair share sees it: its requests in flight per tenant (``counts``), every known tenant's weight and
    priority (``tenants``), its admission bound and its requests in flight."""

    counts: Mapping[str, int]
    tenants: Mapping[str, TenantWeight]
    bound: int
    in_flight: int


def fair_shares(bound: int, active: Mapping[str, TenantWeight]) -> dict[str, float]:
    """Each active tenant's weighted share of ``bound`` in-flight requests."""
    total = sum(t.weight for t in active.values()) or 1.0
    return {name: bound * t.weight / total for name, t in active.items()}


def admit_at_bound(tenant: str, pool: PoolTenants, priority: int | None = None) -> bool:
    """At a full pool (``pool.in_flight >= pool.bound``): is ``tenant``'s request admitted anyway? ``priority``:
    this request's own (a per-request header), else its tenant's."""
    counts = pool.counts
    if pool.in_flight >= 2 * pool.bound:
        return False
    band = _band(tenant, counts, pool.tenants, pool.bound, priority)
    if band is None:
        return False
    if any(t.priority > band.mine.priority for t in band.active.values()):
        return True  # a worse band holds requests here: it is the one to shed
    if counts.get(tenant, 0) + 1 > math.ceil(band.shares[tenant]):
        return False  # above its share with this request: shed it
    return any(counts.get(name, 0) > share for name, share in band.shares.items() if name != tenant)


def hold_back(tenant: str, pool: PoolTenants, *, priority: int | None = None, best: int | None = None) -> bool:
    """Below the bound: must ``tenant``'s request leave the pool's last free slots to the others? A request of a
    worse priority than ``best`` (the best priority configured) never takes the last free slot: the fast lane, for
    a better priority's next request. Beyond that only a tenant above its share is held back: it keeps one slot
    free for each tenant of a better priority holding requests in the pool (at least the fast lane) and for each
    tenant of its band under its share, whose next request then finds a free slot of the batch instead of waiting in
    vLLM's queue past the bound."""
    counts, tenants, bound, in_flight = pool.counts, pool.tenants, pool.bound, pool.in_flight
    if in_flight + len(counts) + 1 < bound:
        return False  # more free slots than there are other tenants (and the fast lane): nothing to keep
    band = _band(tenant, counts, tenants, bound, priority)
    if band is None:
        return False
    mine = band.mine
    if best is None:
        best = min(t.priority for t in tenants.values())
    if best < mine.priority and in_flight + 1 >= bound:
        return True  # the fast lane: the last free slot is for a better priority's next request
    if not band.active:
        return False
    if counts.get(tenant, 0) + 1 <= math.ceil(band.shares[tenant]):
        return False  # within its share (as admit_at_bound counts it): it takes the slot
    keep = max(1 if best < mine.priority else 0, sum(1 for t in band.active.values() if t.priority < mine.priority))
    keep += sum(1 for name, share in band.shares.items() if name != tenant and counts.get(name, 0) < share)
    return in_flight + keep >= bound


def share_of(tenant: str, counts: Mapping[str, int], tenants: Mapping[str, TenantWeight], bound: int) -> float | None:
    """``tenant``'s fair share of a pool whose requests per tenant are ``counts``, as ``admit_at_bound`` reckons it
    (its band's part of what the better bands leave). None for a tenant not in ``tenants``."""
    band = _band(tenant, counts, tenants, bound, None)
    return None if band is None else band.shares[tenant]


@dataclass(frozen=True, slots=True)
class _Band:
    """A request's tenant among the others holding requests in a pool."""

    mine: TenantWeight  # its weight, and its priority (the request's own when it has one)
    active: dict[str, TenantWeight]  # the other known tenants holding requests in the pool
    shares: dict[str, float]  # its band's fair shares (itself included) of what the better bands leave of the bound


def _band(
    tenant: str, counts: Mapping[str, int], tenants: Mapping[str, TenantWeight], bound: int, priority: int | None
) -> _Band | None:
    """``tenant``'s band in a pool with ``counts`` requests per tenant; None for a tenant not in ``tenants``."""
    known = tenants.get(tenant)
    if known is None:
        return None
    mine = known if priority is None else TenantWeight(known.weight, priority)
    active = {name: tenants[name] for name, n in counts.items() if n > 0 and name in tenants and name != tenant}
    better = sum(counts.get(name, 0) for name, t in active.items() if t.priority < mine.priority)
    band = {name: t for name, t in active.items() if t.priority == mine.priority}
    band[tenant] = mine
    return _Band(mine, active, fair_shares(max(0, bound - better), band))
