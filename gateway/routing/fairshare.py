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
under its share. Without that, a flood refills every slot the moment it frees, and every request of the
other tenants arrives at a full pool and waits in vLLM's queue past the bound; with it, their next request finds a
free slot of the batch. It costs at most one slot per other tenant present, and only while one is present.

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


def fair_shares(bound: int, active: Mapping[str, TenantWeight]) -> dict[str, float]:
    """Each active tenant's weighted share of ``bound`` in-flight requests."""
    total = sum(t.weight for t in active.values()) or 1.0
    return {name: bound * t.weight / total for name, t in active.items()}


def admit_at_bound(
    tenant: str,
    counts: Mapping[str, int],
    tenants: Mapping[str, TenantWeight],
    bound: int,
    in_flight: int,
    priority: int | None = None,
) -> bool:
    """At a full pool (``in_flight >= bound``): is ``tenant``'s request admitted anyway? ``counts``: the pool's
    in-flight requests per tenant; ``tenants``: every known tenant's weight and priority; ``priority``: this
    request's own (a per-request header), else its tenant's."""
    if in_flight >= 2 * bound:
        return False
    known = tenants.get(tenant)
    if known is None:
        return False
    mine = known if priority is None else TenantWeight(known.weight, priority)
    active = {name: tenants[name] for name, n in counts.items() if n > 0 and name in tenants and name != tenant}
    if any(t.priority > mine.priority for t in active.values()):
        return True  # a worse band holds requests here: it is the one to shed
    # Shares within the request's band, of what the better bands leave of the bound.
    better = sum(counts.get(name, 0) for name, t in active.items() if t.priority < mine.priority)
    band = {name: t for name, t in active.items() if t.priority == mine.priority}
    band[tenant] = mine
    shares = fair_shares(max(0, bound - better), band)
    if counts.get(tenant, 0) + 1 > math.ceil(shares[tenant]):
        return False  # above its share with this request: shed it
    return any(counts.get(name, 0) > shares[name] for name in band if name != tenant)


def hold_back(
    tenant: str,
    counts: Mapping[str, int],
    tenants: Mapping[str, TenantWeight],
    bound: int,
    in_flight: int,
    priority: int | None = None,
) -> bool:
    """Below the bound: must ``tenant``'s request leave the pool's last free slots to the others? Only a tenant above
    its share does: it keeps one slot free for each tenant of a better priority holding requests in the pool and for
    each tenant of its band under its share, whose next request then finds a free slot of the batch instead of
    waiting in vLLM's queue past the bound. A tenant within its share is never held back."""
    if in_flight + len(counts) < bound:
        return False  # more free slots than there are other tenants: nothing to keep
    known = tenants.get(tenant)
    if known is None:
        return False
    mine = known if priority is None else TenantWeight(known.weight, priority)
    active = {name: tenants[name] for name, n in counts.items() if n > 0 and name in tenants and name != tenant}
    if not active:
        return False
    better = sum(counts.get(name, 0) for name, t in active.items() if t.priority < mine.priority)
    band = {name: t for name, t in active.items() if t.priority == mine.priority}
    band[tenant] = mine
    shares = fair_shares(max(0, bound - better), band)
    if counts.get(tenant, 0) + 1 <= math.ceil(shares[tenant]):
        return False  # within its share (as admit_at_bound counts it): it takes the slot
    keep = sum(1 for t in active.values() if t.priority < mine.priority)
    keep += sum(1 for name in band if name != tenant and counts.get(name, 0) < shares[name])
    return in_flight + keep >= bound


def share_of(tenant: str, counts: Mapping[str, int], tenants: Mapping[str, TenantWeight], bound: int) -> float | None:
    """``tenant``'s fair share of a pool whose requests per tenant are ``counts``, as ``admit_at_bound`` reckons it
    (its band's part of what the better bands leave). None for a tenant not in ``tenants``."""
    mine = tenants.get(tenant)
    if mine is None:
        return None
    active = {name: tenants[name] for name, n in counts.items() if n > 0 and name in tenants and name != tenant}
    better = sum(counts.get(name, 0) for name, t in active.items() if t.priority < mine.priority)
    band = {name: t for name, t in active.items() if t.priority == mine.priority}
    band[tenant] = mine
    return fair_shares(max(0, bound - better), band)[tenant]
