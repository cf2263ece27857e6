"""A share drawn onto a pool away from its class's home goes home at that pool's visitor limit only while home is
the less loaded pool: the pool's own classes would spill there only then, so sending the visitor into a busier home
queue makes room for nobody."""

from __future__ import annotations

from gateway.config.schema import Route
from gateway.routing.ownership import should_spill, visitor_goes_home
from gateway.routing.plan import PoolView, plan_route

CHAT = Route.model_validate({"preferred": "std", "fallback": ["spec"]})
JSON = Route.model_validate(
    {"preferred": "spec", "saturated": "std", "fallback": ["std"], "saturation": {"max_inflight_per_endpoint": 8}}
)
BY_KIND = {"speculative": "spec", "standard": "std"}


def pools(spec_in_flight: int, std_in_flight: int, spec_endpoints: int = 2) -> dict[str, PoolView]:
    return {
        "spec": PoolView("spec", "speculative", frozenset({"m"}), spec_endpoints, spec_in_flight),
        "std": PoolView("std", "standard", frozenset({"m"}), 1, std_in_flight),
    }


def test_below_the_limit_a_visitor_stays_whatever_the_loads() -> None:
    p = pools(15, 0)  # 7.5 a server on spec, under 8; std idle
    assert not visitor_goes_home(p["spec"], p["std"], 8)


def test_at_the_limit_a_visitor_goes_to_a_less_loaded_home() -> None:
    p = pools(16, 3)  # 8 a server on spec (the limit), 3 on std
    assert visitor_goes_home(p["spec"], p["std"], 8)


def test_at_the_limit_a_visitor_stays_off_a_busier_home() -> None:
    p = pools(16, 30)  # the standard server queues: 30 against 8 a server
    assert not visitor_goes_home(p["spec"], p["std"], 8)
    # the home classes there would not spill onto it either: the two rules agree
    assert not should_spill(JSON, p["spec"], p["std"])
    less = pools(16, 5)
    assert visitor_goes_home(less["spec"], less["std"], 8) == should_spill(JSON, less["spec"], less["std"]) is True


def test_the_loads_are_weighed_by_the_visitors_time_per_token() -> None:
    p = pools(16, 9)  # 8 a server on spec, 9 on std: by counts, home is busier
    assert not visitor_goes_home(p["spec"], p["std"], 8)
    slow_on_spec = {"spec": 0.03, "std": 0.015}  # open chat decodes twice as slowly there
    assert visitor_goes_home(p["spec"], p["std"], 8, slow_on_spec)  # (9+1) x 15 ms < (8+1) x 30 ms


def test_no_limit_or_no_routable_home_keeps_the_draw() -> None:
    p = pools(40, 0)
    assert not visitor_goes_home(p["spec"], p["std"], None)
    drained = PoolView("std", "standard", frozenset({"m"}), 0, 0)
    assert not visitor_goes_home(p["spec"], drained, 8)
    assert not visitor_goes_home(None, p["std"], 8)


def test_the_plan_keeps_a_visitor_on_a_full_pool_while_its_home_queues_longer() -> None:
    def plan(std_in_flight: int) -> tuple[tuple[str, ...], str]:
        p = plan_route(
            CHAT, "m", pools(16, std_in_flight), pick="speculative", split=True, by_kind=BY_KIND, visitor_limit=8
        )
        return p.pools, p.reason

    assert plan(2) == (("std", "spec"), "controller:speculative:full")
    assert plan(30) == (("spec", "std"), "controller:split:speculative")
