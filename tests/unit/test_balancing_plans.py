"""Plans of balancing classes: the other kind's pool is a share destination, and a retry target only where the
route names it; a reload that moves a class's home starts it at the new home."""

from __future__ import annotations

import random
from typing import Any

from gateway.config.schema import RoutingRules
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.ownership import visitor_limit
from gateway.routing.plan import PoolView, plan_route
from gateway.routing.routing_state import RoutingState
from tests.unit.test_routing_both_ways import SPEC, STD

VIEWS = {
    "spec": PoolView("spec", "speculative", frozenset({"m"}), 1, 0),
    "std": PoolView("std", "standard", frozenset({"m"}), 1, 0),
}


def rules(route: dict[str, Any]) -> RoutingRules:
    return RoutingRules.model_validate({"pools": [SPEC, STD], "classes": [{"name": "chat", "route": route}]})


def plan(r: RoutingRules, kind: str) -> tuple[str, ...]:
    rs = RoutingState(lambda: r, GatewayMetrics().registry, clock=lambda: 0.0)
    choice = rs.choose("chat", random.Random(1))
    assert choice is not None  # the built-in balancing controller
    cls = r.classes[0]
    return plan_route(cls.route, "m", VIEWS, pick=kind, by_kind=dict(choice.pools)).pools


def test_fallback_none_means_no_retry_on_the_other_pool() -> None:
    r = rules({"preferred": "std", "fallback": []})
    assert plan(r, "standard") == ("std",)  # home: no second attempt the route did not ask for
    assert plan(r, "speculative") == ("spec", "std")  # a share sent away still falls back to its home


def test_a_named_fallback_stays_the_next_attempt() -> None:
    r = rules({"preferred": "std", "fallback": ["spec"]})
    assert plan(r, "standard") == ("std", "spec")


def test_a_reload_that_moves_the_home_starts_the_class_at_its_new_home() -> None:
    current = {"rules": rules({"preferred": "std"})}
    rs = RoutingState(lambda: current["rules"], GatewayMetrics().registry, clock=lambda: 0.0)
    assert rs.state_of("chat") == "standard"
    current["rules"] = rules({"preferred": "spec"})
    rs.set_forced({})  # syncs the controllers with the rules in force (as every round does), no observation
    assert rs.state_of("chat") == "speculative"
    assert rs.snapshot()["chat"]["share"] == 1.0


def test_a_share_drawn_away_goes_home_while_that_pool_is_full_for_its_own_classes() -> None:
    r = RoutingRules.model_validate(
        {
            "pools": [SPEC, STD],
            "classes": [
                {
                    "name": "json",
                    "when": {"temperature": {"lte": 0.1}},
                    "route": {"preferred": "spec", "saturated": "std", "saturation": {"max_inflight_per_endpoint": 8}},
                },
                {"name": "chat", "route": {"preferred": "std", "fallback": ["spec"]}},
            ],
        }
    )
    assert (visitor_limit(r, "spec"), visitor_limit(r, "std")) == (8, None)
    chat = r.classes[1].route
    pools = {"spec": ("spec", "std"), "standard": ("std", "spec")}
    cand = {"speculative": "spec", "standard": "std"}

    def views(spec_in_flight: int) -> dict[str, PoolView]:
        spec = PoolView("spec", "speculative", frozenset({"m"}), 2, spec_in_flight)
        return {"spec": spec, "std": VIEWS["std"]}

    below = plan_route(chat, "m", views(15), pick="speculative", split=True, by_kind=cand, visitor_limit=8)
    assert (below.pools, below.reason) == (pools["spec"], "controller:split:speculative")
    full = plan_route(chat, "m", views(16), pick="speculative", split=True, by_kind=cand, visitor_limit=8)
    assert (full.pools, full.reason) == (pools["standard"], "controller:speculative:full")
    # a draw that is not the class's share by load (an on-call force, the guard, a probe) goes where it was sent
    sent = plan_route(chat, "m", views(16), pick="speculative", by_kind=cand)
    assert sent.pools[0] == "spec"
    # the pool's own classes are not visitors there: their saturation spill decides (std is less loaded here)
    json_ = plan_route(r.classes[0].route, "m", views(15), pick="speculative", by_kind=cand)
    assert json_.pools[0] == "spec"
    spilled = plan_route(r.classes[0].route, "m", views(16), pick="speculative", by_kind=cand)
    assert (spilled.pools[0], spilled.reason) == ("std", "saturated")
