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
