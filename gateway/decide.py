"""The routing decision: traffic class + live pool view → ordered attempt plan. Pure, no I/O.

The plan is the preferred pool (or the ``saturated`` pool while the preferred one is saturated), then the
class's fallbacks in order; pools that do not serve the requested model, or have no routable endpoint, are left
out, and the reason for each choice is kept so that a response header and ``specgate explain`` can show it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.rules.schema import Route


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the decision needs to know about one pool right now."""

    name: str
    kind: str
    models: frozenset[str]
    routable_endpoints: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class Plan:
    pools: tuple[str, ...]
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        return not self.pools


def is_saturated(route: Route, pool: PoolView) -> bool:
    limit = route.saturation.max_inflight_per_endpoint
    if limit is None or pool.routable_endpoints == 0:
        return False
    return pool.in_flight >= limit * pool.routable_endpoints


def controller_candidates(route: Route, pools: Mapping[str, PoolView]) -> dict[str, str] | None:
    """The class's controller candidates by pool kind (``{"speculative": name, "standard": name}``) among
    ``route.preferred`` / ``route.saturated``; None when they are not one of each (the loader checks this)."""
    if route.saturated is None:
        return None
    by_kind: dict[str, str] = {}
    for name in (route.preferred, route.saturated):
        view = pools.get(name)
        if view is None or view.kind in by_kind:
            return None
        by_kind[view.kind] = name
    return by_kind if set(by_kind) == {"speculative", "standard"} else None


def plan_route(
    route: Route, model: str, pools: Mapping[str, PoolView], *, route_state: str | None = None, split: bool = False
) -> Plan:
    """Order the candidate pools for one request of a class, by the class's route and the pools' state.

    ``route_state`` is the pool kind the class controller picked for this request (``"speculative"`` /
    ``"standard"``; None: no controller): the candidate of that kind goes first, the other second, then the
    fallbacks (reason ``controller:<kind>``, or ``controller:split:<kind>`` when ``split``: the controller sends
    a share of the class to each pool and this request drew ``<kind>``).
    The in-flight saturation rule still applies on top while the controller picks ``route.preferred``: it reacts
    within a scrape interval, the controller only once per round. When the controller picks ``route.saturated``
    that pool is not checked (the limit is defined for the preferred pool only).
    """
    preferred = pools.get(route.preferred)
    reason = "preferred"
    order: list[str] = [route.preferred]
    candidates = controller_candidates(route, pools) if route_state is not None else None
    if candidates is not None and route_state in candidates:
        first = candidates[route_state]
        second = route.saturated if first == route.preferred else route.preferred
        assert second is not None  # candidates exist only with route.saturated
        order = [first, second]
        reason = f"controller:split:{route_state}" if split else f"controller:{route_state}"
    if (
        (candidates is None or order[0] == route.preferred)
        and route.saturated is not None
        and preferred is not None
        and preferred.routable_endpoints > 0
        and is_saturated(route, preferred)
    ):
        order = [route.saturated, route.preferred]
        reason = "saturated"
    order.extend(route.fallback)

    chosen: list[str] = []
    skipped: list[tuple[str, str]] = []
    for name in order:
        if name in chosen:
            continue
        view = pools.get(name)
        if view is None:
            skipped.append((name, "unknown pool"))
        elif model not in view.models:
            skipped.append((name, "model not served"))
        elif view.routable_endpoints == 0:
            skipped.append((name, "no routable endpoint"))
        else:
            chosen.append(name)
    if chosen and chosen[0] != order[0] and reason == "preferred":
        reason = f"{order[0]} unavailable"
    return Plan(tuple(chosen), reason, tuple(skipped))
