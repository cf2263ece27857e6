"""The routing decision: traffic class + live pool view → ordered attempt plan. Pure, no I/O.

The plan is the preferred pool (or the ``saturated`` pool while the preferred one is saturated), then the
class's fallbacks in order; pools that do not serve the requested model, or have no routable endpoint, are left
out, and the reason for each choice is kept so that a response header and ``specgate explain`` can show it.
With ``route.fallback_model``, fallback pools that do not serve the requested model but serve that one come last,
with the model to ask them for (``Plan.models``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config.schema import Route
from gateway.errors import NoCapacity

# The route reason of a Responses API follow-up: it goes only to the endpoint holding its conversation.
STICKY = "sticky"

# Skip reasons that no client retry can change (only a config change or an operator can).
PERMANENT_SKIPS = frozenset({"unknown pool", "model not served", "drained"})


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the decision needs to know about one pool right now."""

    name: str
    kind: str
    models: frozenset[str]
    routable_endpoints: int
    in_flight: int
    drained: bool = False  # every endpoint has weight 0
    # In flight per endpoint at which the classes at home here start to spill (RoutingRules.home_spill_limit):
    # a class drawn here from another home goes home instead from then on. None: no limit.
    home_spill_limit: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """The ordered pools a request may try, and why the first was chosen (``reason``, see ``route_reason``: the
    one value the route header, the access log, the route metric and explain show). ``skipped`` names the pools
    left out and why (an empty plan answers 503 from it); ``models`` the pools asked for another model
    (``route.fallback_model``); ``ttft_deadline_s`` the class's first-event deadline for streams. Pure data,
    built by ``plan_route``."""

    pools: tuple[str, ...]
    reason: str
    skipped: tuple[tuple[str, str], ...] = ()
    models: tuple[tuple[str, str], ...] = ()  # (pool, model): ask that pool for another model (route.fallback_model)
    ttft_deadline_s: float | None = None  # streams: the class's first-event deadline (None: the pool's first_byte_s)

    @property
    def empty(self) -> bool:
        return not self.pools

    def model_for(self, pool: str) -> str | None:
        """The model to ask ``pool`` for instead of the requested one; None: the requested one."""
        for name, model in self.models:
            if name == pool:
                return model
        return None

    def unavailable(self) -> NoCapacity:
        """The 503 for an empty plan; ``x-should-retry: false`` when no pool could take it whatever the timing
        (unknown / model not served / drained), since a client retry cannot change that."""
        skipped = ", ".join(f"{p}: {why}" for p, why in self.skipped) or "no candidate pool"
        headers = {}
        if self.skipped and all(why in PERMANENT_SKIPS for _, why in self.skipped):
            headers["x-should-retry"] = "false"
        return NoCapacity(f"no pool can take this request now ({skipped})", retry_after_s=5, headers=headers)


def is_saturated(route: Route, pool: PoolView) -> bool:
    limit = route.saturation.max_inflight_per_endpoint
    if limit is None or pool.routable_endpoints == 0:
        return False
    return pool.in_flight >= limit * pool.routable_endpoints


def full_for_visitors(pool: PoolView | None) -> bool:
    """The pool has as many requests in flight as its home classes take before they spill: a share of another
    class drawn onto it goes home instead, so that visitors never push the pool's own traffic off it."""
    if pool is None or pool.home_spill_limit is None or pool.routable_endpoints == 0:
        return False
    return pool.in_flight >= pool.home_spill_limit * pool.routable_endpoints


def _per_endpoint(pool: PoolView) -> float:
    return pool.in_flight / pool.routable_endpoints if pool.routable_endpoints else float("inf")


def should_spill(
    route: Route, preferred: PoolView, saturated: PoolView | None, speeds: Mapping[str, float] | None = None
) -> bool:
    """Spill to ``route.saturated``: the preferred pool is over its in-flight limit AND the saturated pool is the
    less loaded one. Without the second condition a burst moves the whole class onto a pool that may be busier
    still (measured: a class spilling 71% of its requests onto an already saturated standard pool, whose p50 went
    from 4 s to 19 s, while the speculative pool had room).

    "Less loaded" counts requests per endpoint, each weighted by the class's time per output token on that pool
    when its controller knows both (``speeds``: pool → seconds, from its last round): a pool where this class
    decodes three times slower is not less loaded with half the requests (measured: a copy-heavy class spilling a
    fifth of its requests at 30% load onto a standard pool that decoded it 3x slower, p99 +30%)."""
    if saturated is None or saturated.routable_endpoints == 0 or not is_saturated(route, preferred):
        return False
    here, there = _per_endpoint(preferred), _per_endpoint(saturated)
    if speeds:
        slow_here, slow_there = speeds.get(preferred.name), speeds.get(saturated.name)
        if slow_here and slow_there and slow_here > 0 and slow_there > 0:
            return (there + 1.0) * slow_there < (here + 1.0) * slow_here
    return there < here


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
    route: Route,
    model: str,
    pools: Mapping[str, PoolView],
    *,
    route_state: str | None = None,
    split: bool = False,
    forced: bool = False,
    candidates: Mapping[str, str] | None = None,
    probe: bool = False,
    speeds: Mapping[str, float] | None = None,
    visitor: bool = False,
    why: str | None = None,
) -> Plan:
    """Order the candidate pools for one request of a class, by the class's route and the pools' state.

    ``route_state`` is the pool kind the class controller picked for this request (``"speculative"`` /
    ``"standard"``; None: no controller): the candidate of that kind goes first, the other second, then the
    fallbacks (reason ``controller:<kind>``, or ``controller:split:<kind>`` when ``split``: the controller sends
    a share of the class to each pool and this request drew ``<kind>``; ``controller:probe:speculative`` for a
    probe). ``candidates``: the controller's pools by kind (``RoutingRules.candidates``); without them, the pools
    of each kind among route.preferred / route.saturated.
    ``visitor``: the controller drew the pool away from home by load (its share, not a probe, a force, the guard
    or the safe state); such a draw goes home instead while that pool is full for visitors
    (``full_for_visitors``: as busy as its own classes take before they spill; reason ``controller:<kind>:full``):
    otherwise a share of open chat drawn onto a busy speculative pool would push the JSON and code at home there
    onto the standard pool, the two classes swapping places to everyone's loss.
    The in-flight saturation rule (``should_spill``: over the limit, and the saturated pool less loaded) still
    applies on top while the controller picks ``route.preferred``: it reacts at once, the controller only once per
    round. When the controller picks ``route.saturated`` that pool is not checked (the limit is defined for the
    preferred pool only). ``speeds``: the class's time per output token on each pool, from its controller's last
    round (``should_spill`` weighs the pools' loads by them).

    A class with ``route.pin`` never gets a pool of the other kind in its plan (skipped: ``pinned to <kind>``).

    ``why``: the controller's reason for the draw when it is not the load (``guard``, ``stale``): it shows in the
    reason (``controller:guard:<kind>``).

    ``forced``: an on-call class route (``route_state`` is the forced kind): the controller's candidate of that
    kind, else the first pool of that kind among the route's pools (preferred, saturated, fallback), goes first,
    the others keep their order after it (reason ``forced:<kind>``); no saturation spill.
    """
    if route_state is None:
        candidates = None
    elif candidates is None:
        candidates = controller_candidates(route, pools)
    if forced and route_state is not None:
        return _forced_plan(route, model, pools, route_state, candidates)
    preferred = pools.get(route.preferred)
    decided = "preferred"
    order: list[str] = [route.preferred]
    if candidates is not None and route_state is not None and route_state in candidates:
        first = candidates[route_state]
        # the other candidate is the next attempt only where the route names it (a balancing class whose other
        # pool came from "any pool of the model" takes a share there, but "fallback: []" still means no retry)
        named = {route.preferred, route.saturated, *route.fallback}
        order = [first] + [n for n in candidates.values() if n != first and n in named]
        decided = "probe" if probe else why if why in ("guard", "stale") else "split" if split else "controller"
        if visitor and first != route.preferred and full_for_visitors(pools.get(first)):
            order = [route.preferred] + ([first] if first in named else [])
            decided = "full"
    if (
        (candidates is None or order[0] == route.preferred)
        and route.saturated is not None
        and preferred is not None
        and should_spill(route, preferred, pools.get(route.saturated), speeds)
    ):
        order = [route.saturated, route.preferred]
        decided = "saturated"
    order.extend(route.fallback)
    return _plan(route, model, pools, order, decided, route_state)


def route_reason(decided: str, kind: str | None, displaced: tuple[str, str] | None = None) -> str:
    """The one route reason of a plan (the ``x-specgate-route`` header, the access log's ``route_reason``, the
    ``specgate_route_decisions_total`` label and explain's ``plan.reason``): what put the first pool first.

    ``decided``: what ordered the pools (``preferred``, ``saturated``, ``forced``, or the class controller's
    ``controller`` / ``split`` / ``probe`` / ``guard`` / ``stale`` / ``full``), ``kind`` the pool kind it picked.
    ``displaced``: (the pool it put first, why that pool was left out) when another pool goes first: then what
    decided is that pool's absence, ``<pool> drained`` (an on-call drain) or ``<pool> unavailable`` (no routable
    endpoint, the model not served, ...; explain's ``skipped`` says which)."""
    if displaced is not None:
        pool, why = displaced
        return f"{pool} drained" if why == "drained" else f"{pool} unavailable"
    if decided in ("preferred", "saturated") or kind is None:
        return decided
    if decided == "forced":
        return f"forced:{kind}"
    if decided == "controller":
        return f"controller:{kind}"
    if decided == "full":
        return f"controller:{kind}:full"
    return f"controller:{decided}:{kind}"  # split, probe, guard, stale


def _forced_plan(
    route: Route, model: str, pools: Mapping[str, PoolView], kind: str, candidates: Mapping[str, str] | None
) -> Plan:
    names = [route.preferred] + ([route.saturated] if route.saturated is not None else []) + list(route.fallback)
    order = list(dict.fromkeys(names))
    first = None if candidates is None else candidates.get(kind)
    if first is None:
        first = next((n for n in order if (v := pools.get(n)) is not None and v.kind == kind), None)
    if first is not None:
        if first in order:
            order.remove(first)
        order.insert(0, first)
    return _plan(route, model, pools, order, "forced", kind)


def _plan(
    route: Route, model: str, pools: Mapping[str, PoolView], order: list[str], decided: str, kind: str | None
) -> Plan:
    chosen: list[str] = []
    other_model: list[str] = []  # fallback pools that serve route.fallback_model instead: tried last
    skipped: list[tuple[str, str]] = []
    alt = route.fallback_model if route.fallback_model != model else None
    for name in order:
        if name in chosen or name in other_model:
            continue
        view = pools.get(name)
        if view is None:
            skipped.append((name, "unknown pool"))
            continue
        if route.pin is not None and view.kind != route.pin:
            skipped.append((name, f"pinned to {route.pin}"))
            continue
        serves = model in view.models
        if not serves and not (alt in view.models and name in route.fallback):  # nor route.fallback_model
            skipped.append((name, "model not served"))
        elif view.routable_endpoints == 0:
            skipped.append((name, "drained" if view.drained else "no routable endpoint"))
        else:
            (chosen if serves else other_model).append(name)
    final = chosen + other_model
    displaced = None
    if final and final[0] != order[0]:
        displaced = (order[0], next((why for name, why in skipped if name == order[0]), "unavailable"))
    reason = route_reason(decided, kind, displaced)
    models = tuple((name, alt) for name in other_model if alt is not None)
    return Plan(tuple(final), reason, tuple(skipped), models, route.ttft_deadline_s)
