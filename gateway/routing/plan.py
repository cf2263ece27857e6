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
from gateway.routing.ownership import full_for_visitors, should_spill
from gateway.routing.warm_home import WarmHome, warm_home

# The route reason of a Responses API follow-up: it goes only to the endpoint holding its conversation.
STICKY = "sticky"

# Skip reasons that no client retry can change (only a config change or an operator can).
PERMANENT_SKIPS = frozenset({"unknown pool", "model not served", "drained"})


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class PoolView:
    """What the decision needs to know about one pool right now."""

    name: str
    kind: str
    models: frozenset[str]
    routable_endpoints: int
    in_flight: int
    drained: bool = False  # every endpoint has weight 0


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
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
    warm: WarmHome | None = None  # the warm-home decision (None: not weighed: no controller, or no warmth given)

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


def pools_by_kind(route: Route, pools: Mapping[str, PoolView]) -> dict[str, str] | None:
    """The class's controller pools by kind (``{"speculative": name, "standard": name}``) among
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
    pick: str | None = None,
    split: bool = False,
    forced: bool = False,
    by_kind: Mapping[str, str] | None = None,
    probe: bool = False,
    speeds: Mapping[str, float] | None = None,
    visitor_limit: int | None = None,
    why: str | None = None,
    warmth: Mapping[str, int] | None = None,
    warm_eligible: bool = False,
    away_limit: int | None = None,
) -> Plan:
    """Order the pools for one request of a class, by the class's route and the pools' state.

    ``pick`` is the pool kind the class controller picked for this request (``"speculative"`` / ``"standard"``;
    None: no controller): the controller's pool of that kind goes first, the other second, then the fallbacks
    (reason ``controller:<kind>``, or ``controller:split:<kind>`` when ``split``: the controller sends a share of
    the class to each pool and this request drew ``<kind>``; ``controller:probe:speculative`` for a probe).
    ``by_kind``: the controller's pools by kind (``RoutingRules.controller_pools``); without them, the pools of
    each kind among route.preferred / route.saturated.
    ``visitor_limit``: the controller drew the pool away from home by load (its share, not a probe, a force, the
    guard or the safe state), and that pool takes visitors up to this many requests in flight per endpoint
    (``ownership.visitor_limit``; None: not a visitor, or no limit); past it the draw goes home instead (reason
    ``controller:<kind>:full``): otherwise a share of open chat drawn onto a busy speculative pool would push the
    JSON and code at home there onto the standard pool, the two classes swapping places to everyone's loss.
    The in-flight saturation rule (``ownership.should_spill``: over the limit, and the saturated pool less
    loaded) still applies on top while the controller picks ``route.preferred``: it reacts at once, the controller
    only once per round. When the controller picks ``route.saturated`` that pool is not checked (the limit is
    defined for the preferred pool only). ``speeds``: the class's time per output token on each pool, from its
    controller's last round (``should_spill`` weighs the pools' loads by them).

    A class with ``route.pin`` never gets a pool of the other kind in its plan (skipped: ``pinned to <kind>``).

    ``why``: the controller's reason for the draw when it is not the load (``guard``, ``stale``): it shows in the
    reason (``controller:guard:<kind>``).

    ``forced``: an on-call class route (``pick`` is the forced kind): the controller's pool of that kind, else the
    first pool of that kind among the route's pools (preferred, saturated, fallback), goes first, the others keep
    their order after it (reason ``forced:<kind>``); no saturation spill.

    ``warmth``: pool → the longest counted warm prefix of this prompt there (tokens; computed by the fleet, None:
    not weighed). When the controller drew a pool by load (or holds the class at its safe state while its
    measurements are stale) and the request continues a conversation
    (``warm_eligible``), the other controller pool goes first while its prefix is longer there, it is not full for
    visitors (``away_limit``: the visitor limit of the class's pool away from home) and, at home, not spilling
    (``gateway.routing.warm_home``; reason ``warm:<kind>``). The decision is kept in ``Plan.warm``.
    """
    if pick is None:
        by_kind = None
    elif by_kind is None:
        by_kind = pools_by_kind(route, pools)
    if forced and pick is not None:
        return _forced_plan(route, model, pools, pick, by_kind)
    preferred = pools.get(route.preferred)
    decided = "preferred"
    order: list[str] = [route.preferred]
    warm: WarmHome | None = None
    if by_kind is not None and pick is not None and pick in by_kind:
        first = by_kind[pick]
        # the other pool is the next attempt only where the route names it (a balancing class whose other pool
        # came from "any pool of the model" takes a share there, but "fallback: []" still means no retry)
        named = {route.preferred, route.saturated, *route.fallback}
        order = [first] + [n for n in by_kind.values() if n != first and n in named]
        decided = "probe" if probe else why if why in ("guard", "stale") else "split" if split else "controller"
        if first != route.preferred and full_for_visitors(pools.get(first), visitor_limit):
            order = [route.preferred] + ([first] if first in named else [])
            decided = "full"
        if warmth is not None:
            other = next((n for n in by_kind.values() if n != first), None)
            if other is not None:
                warm = warm_home(
                    route,
                    first,
                    other,
                    warmth,
                    pools,
                    eligible=warm_eligible and decided in ("controller", "split", "stale"),
                    away_limit=away_limit,
                    speeds=speeds,
                )
                if warm.won:
                    order = [other] + ([first] if first in named else [])
                    decided, pick = "warm", next(k for k, n in by_kind.items() if n == other)
    if (
        (by_kind is None or order[0] == route.preferred)
        and route.saturated is not None
        and preferred is not None
        and should_spill(route, preferred, pools.get(route.saturated), speeds)
    ):
        order = [route.saturated, route.preferred]
        decided = "saturated"
    order.extend(route.fallback)
    return _plan(route, model, pools, order, decided, pick, warm)


# The route reason of each way a pool kind goes first, ``{}`` its kind; the controller's other ways are
# ``controller:<way>:<kind>``.
_REASONS = {"forced": "forced:{}", "controller": "controller:{}", "full": "controller:{}:full", "warm": "warm:{}"}


def route_reason(decided: str, kind: str | None, displaced: tuple[str, str] | None = None) -> str:
    """The one route reason of a plan (the ``x-specgate-route`` header, the access log's ``route_reason``, the
    ``specgate_route_decisions_total`` label and explain's ``plan.reason``): what put the first pool first.

    ``decided``: what ordered the pools (``preferred``, ``saturated``, ``forced``, or the class controller's
    ``controller`` / ``split`` / ``probe`` / ``guard`` / ``stale`` / ``full``, or ``warm``: the conversation's warm
    home, ``gateway.routing.warm_home``), ``kind`` the pool kind it picked.
    ``displaced``: (the pool it put first, why that pool was left out) when another pool goes first: then what
    decided is that pool's absence, ``<pool> drained`` (an on-call drain) or ``<pool> unavailable`` (no routable
    endpoint, the model not served, ...; explain's ``skipped`` says which)."""
    if displaced is not None:
        pool, why = displaced
        return f"{pool} drained" if why == "drained" else f"{pool} unavailable"
    if decided in ("preferred", "saturated") or kind is None:
        return decided
    template = _REASONS.get(decided)
    return template.format(kind) if template is not None else f"controller:{decided}:{kind}"  # split, probe, ...


def _forced_plan(
    route: Route, model: str, pools: Mapping[str, PoolView], kind: str, by_kind: Mapping[str, str] | None
) -> Plan:
    names = [route.preferred] + ([route.saturated] if route.saturated is not None else []) + list(route.fallback)
    order = list(dict.fromkeys(names))
    first = None if by_kind is None else by_kind.get(kind)
    if first is None:
        first = next((n for n in order if (v := pools.get(n)) is not None and v.kind == kind), None)
    if first is not None:
        if first in order:
            order.remove(first)
        order.insert(0, first)
    return _plan(route, model, pools, order, "forced", kind)


def _plan(
    route: Route,
    model: str,
    pools: Mapping[str, PoolView],
    order: list[str],
    decided: str,
    kind: str | None,
    warm: WarmHome | None = None,
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
    return Plan(tuple(final), reason, tuple(skipped), models, route.ttft_deadline_s, warm)
