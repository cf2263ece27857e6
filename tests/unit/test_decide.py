"""The routing decision (pure) and the endpoint pick."""

from __future__ import annotations

import random
from collections import Counter

from gateway.config.pool import Pool
from gateway.config.schema import Route
from gateway.fleet.pools import PoolState
from gateway.routing.plan import PoolView, plan_route


def view(name: str, *, routable: int = 1, in_flight: int = 0, models: tuple[str, ...] = ("m",)) -> PoolView:
    return PoolView(name, "standard", frozenset(models), routable, in_flight)


def route(**kw: object) -> Route:
    return Route.model_validate({"preferred": "spec", **kw})


def test_preferred_then_fallbacks() -> None:
    plan = plan_route(route(fallback=["std"]), "m", {"spec": view("spec"), "std": view("std")})
    assert plan.pools == ("spec", "std")
    assert plan.reason == "preferred"


def test_saturated_pool_goes_first_when_preferred_is_saturated() -> None:
    r = route(saturated="std", fallback=["std"], saturation={"max_inflight_per_endpoint": 4})
    calm = plan_route(r, "m", {"spec": view("spec", routable=2, in_flight=7), "std": view("std")})
    busy = plan_route(r, "m", {"spec": view("spec", routable=2, in_flight=8), "std": view("std")})
    assert calm.pools == ("spec", "std")
    assert busy.pools == ("std", "spec")
    assert busy.reason == "saturated"


def test_pools_without_the_model_or_endpoints_are_skipped() -> None:
    r = route(fallback=["std", "other"])
    pools = {"spec": view("spec", routable=0), "std": view("std", models=("x",)), "other": view("other")}
    plan = plan_route(r, "m", pools)
    assert plan.pools == ("other",)
    assert plan.reason == "spec unavailable"
    assert dict(plan.skipped) == {"spec": "no routable endpoint", "std": "model not served"}


def test_empty_plan() -> None:
    plan = plan_route(route(), "m", {"spec": view("spec", routable=0)})
    assert plan.empty


def _pool(weights: list[float]) -> PoolState:
    spec = Pool.model_validate(
        {
            "name": "p",
            "kind": "standard",
            "models": ["m"],
            "endpoints": [{"url": f"http://h{i}:8000", "weight": w} for i, w in enumerate(weights)],
        }
    )
    return PoolState.from_spec(spec)


def test_pick_respects_weights_and_drain() -> None:
    pool = _pool([3.0, 1.0, 0.0])
    rng = random.Random(1)
    counts = Counter(pool.pick(rng).id for _ in range(4000))  # type: ignore[union-attr]
    assert "h2:8000" not in counts  # weight 0 = drained
    assert counts["h0:8000"] > 2 * counts["h1:8000"]


def test_pick_prefers_least_in_flight() -> None:
    pool = _pool([1.0, 1.0])
    pool.endpoints[0].in_flight = 50
    rng = random.Random(2)
    counts = Counter(pool.pick(rng).id for _ in range(1000))  # type: ignore[union-attr]
    assert counts["h1:8000"] > 700


def test_pick_skips_unhealthy_and_excluded() -> None:
    pool = _pool([1.0, 1.0, 1.0])
    pool.endpoints[0].healthy = False
    rng = random.Random(3)
    for _ in range(100):
        ep = pool.pick(rng, exclude={"h1:8000"})
        assert ep is not None
        assert ep.id == "h2:8000"
    pool.endpoints[2].weight = 0
    assert pool.pick(rng, exclude={"h1:8000"}) is None


# -- with a controller state -----------------------------------------------------------------------------------


def kview(name: str, kind: str, *, routable: int = 1, in_flight: int = 0) -> PoolView:
    return PoolView(name, kind, frozenset({"m"}), routable, in_flight)


CONTROLLED = {
    "spec": kview("spec", "speculative"),
    "std": kview("std", "standard"),
    "other": kview("other", "standard"),
}


def test_controller_state_puts_the_candidate_of_its_kind_first() -> None:
    r = route(saturated="std", fallback=["other"])
    spec = plan_route(r, "m", CONTROLLED, pick="speculative")
    std = plan_route(r, "m", CONTROLLED, pick="standard")
    assert (spec.pools, spec.reason) == (("spec", "std", "other"), "controller:speculative")
    assert (std.pools, std.reason) == (("std", "spec", "other"), "controller:standard")


def test_controller_candidates_by_kind_not_by_position() -> None:
    r = Route.model_validate({"preferred": "std", "saturated": "spec"})  # home is the standard pool
    assert plan_route(r, "m", CONTROLLED, pick="speculative").pools == ("spec", "std")
    assert plan_route(r, "m", CONTROLLED, pick="standard").pools == ("std", "spec")


def test_no_controller_state_is_todays_plan() -> None:
    r = route(saturated="std", fallback=["other"])
    assert plan_route(r, "m", CONTROLLED, pick=None) == plan_route(r, "m", CONTROLLED)


def test_saturation_still_applies_when_the_controller_picks_the_preferred_pool() -> None:
    r = route(saturated="std", saturation={"max_inflight_per_endpoint": 2})
    busy = {**CONTROLLED, "spec": kview("spec", "speculative", in_flight=2)}
    plan = plan_route(r, "m", busy, pick="speculative")
    assert (plan.pools, plan.reason) == (("std", "spec"), "saturated")
    # on the saturated pool already: nothing to spill
    assert plan_route(r, "m", busy, pick="standard").reason == "controller:standard"


def test_controller_state_skips_an_unavailable_candidate() -> None:
    r = route(saturated="std")
    pools = {**CONTROLLED, "spec": kview("spec", "speculative", routable=0)}
    plan = plan_route(r, "m", pools, pick="speculative")
    assert plan.pools == ("std",)
    assert plan.skipped == (("spec", "no routable endpoint"),)


def test_controller_state_without_two_kinds_falls_back_to_the_route() -> None:
    r = Route.model_validate({"preferred": "std", "saturated": "other"})  # both standard: the loader refuses this
    plan = plan_route(r, "m", CONTROLLED, pick="speculative")
    assert (plan.pools, plan.reason) == (("std",), "preferred")


def test_no_spill_onto_a_pool_that_is_busier_still() -> None:
    r = route(saturated="std", saturation={"max_inflight_per_endpoint": 4})
    # spec over its limit (8 per endpoint) but std holds 10 per endpoint: stay
    busier = plan_route(r, "m", {"spec": view("spec", routable=1, in_flight=8), "std": view("std", in_flight=10)})
    assert (busier.pools[0], busier.reason) == ("spec", "preferred")
    lighter = plan_route(r, "m", {"spec": view("spec", routable=1, in_flight=8), "std": view("std", in_flight=3)})
    assert (lighter.pools[0], lighter.reason) == ("std", "saturated")
    # a saturated pool without a routable endpoint takes nothing
    gone = plan_route(r, "m", {"spec": view("spec", in_flight=8), "std": view("std", routable=0)})
    assert gone.pools[0] == "spec"
