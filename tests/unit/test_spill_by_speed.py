"""The in-flight saturation spill weighs each pool's requests by the class's time per token there: a class is not
spilled onto a pool with fewer requests where it decodes so much slower that it would finish later."""

from __future__ import annotations

from gateway.config.schema import Route
from gateway.routing.ownership import should_spill
from gateway.routing.plan import PoolView, plan_route

ROUTE = Route.model_validate(
    {"preferred": "spec", "saturated": "std", "fallback": ["std"], "saturation": {"max_inflight_per_endpoint": 4}}
)


def pools(spec_in_flight: int, std_in_flight: int) -> dict[str, PoolView]:
    return {
        "spec": PoolView("spec", "speculative", frozenset({"m"}), 1, spec_in_flight),
        "std": PoolView("std", "standard", frozenset({"m"}), 1, std_in_flight),
    }


def test_without_speeds_fewer_requests_is_less_loaded() -> None:
    p = pools(6, 2)
    assert should_spill(ROUTE, p["spec"], p["std"])
    assert not should_spill(ROUTE, pools(3, 0)["spec"], pools(3, 0)["std"])  # under the limit: never


def test_a_pool_three_times_slower_for_the_class_is_not_less_loaded_with_half_the_requests() -> None:
    p = pools(6, 3)
    speeds = {"spec": 0.005, "std": 0.015}
    assert not should_spill(ROUTE, p["spec"], p["std"], speeds)  # (3+1) x 15 ms > (6+1) x 5 ms
    assert should_spill(ROUTE, p["spec"], p["std"])  # by request counts alone it would spill
    idle = pools(6, 0)
    assert should_spill(ROUTE, idle["spec"], idle["std"], speeds)  # 1 x 15 ms < 7 x 5 ms: an idle pool still wins


def test_unknown_or_unusable_speeds_fall_back_to_request_counts() -> None:
    p = pools(6, 2)
    for speeds in ({}, {"spec": 0.005}, {"spec": 0.0, "std": 0.01}):
        assert should_spill(ROUTE, p["spec"], p["std"], speeds)


def test_the_plan_follows_the_speed_weighted_spill() -> None:
    p = pools(6, 3)
    slow_std = plan_route(ROUTE, "m", p, speeds={"spec": 0.005, "std": 0.015})
    assert (slow_std.pools[0], slow_std.reason) == ("spec", "preferred")
    similar = plan_route(ROUTE, "m", p, speeds={"spec": 0.01, "std": 0.011})
    assert (similar.pools[0], similar.reason) == ("std", "saturated")
