"""The time a request adds to a pool's running requests (gateway.routing.estimate.BatchSlope, ``impact_s``): what
the controllers compare is the request's own expected time plus that, so a class is not moved onto a pool whose
steps lengthen steeply with its batch only because its own requests would be a little faster there."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.routing.estimate import BatchSlope, PoolSpeeds, estimate
from gateway.routing.route_state import RoutingState
from tests.unit.test_routing_both_ways import CTL, rules, state, view  # the same two-pool rules


def test_the_slope_is_measured_against_the_lowest_batch_seen() -> None:
    s = BatchSlope()
    assert s.add(1.0, 0.010) is None  # the floor: nothing to compare yet
    assert s.add(1.3, 0.011) is None  # near the floor: refreshes its TPOT
    assert s.floor == (1.0, 0.011)
    assert s.add(5.0, 0.019) == pytest.approx((0.019 - 0.011) / 4)
    assert s.add(0.0, 0.009) == pytest.approx(0.002)  # a new, lower floor keeps the last slope ...
    assert s.add(4.0, 0.017) == pytest.approx(0.002)  # ... until a batch a full request above it
    assert s.add(6.0, 0.005) == 0.0  # faster at a larger batch (the traffic changed): no impact, never negative
    assert s.add(math.nan, 0.02) == 0.0  # unusable pairs change nothing
    assert s.add(3.0, -1.0) == 0.0


@given(st.lists(st.tuples(st.floats(0, 64), st.floats(1e-4, 1.0)), max_size=40))
def test_the_slope_stays_within_what_the_tpot_allows(pairs: list[tuple[float, float]]) -> None:
    s = BatchSlope()
    for batch, tpot in pairs:
        slope = s.add(batch, tpot)
        if slope is not None:
            assert slope >= 0.0
            assert slope * max(batch, 1.0) <= max(t for _, t in pairs) + 1e-12


def test_a_fall_in_acceptance_is_not_taken_for_a_batch_slope() -> None:
    speeds = PoolSpeeds()
    speeds.round({"spec": view("spec", running=1, tpot=0.005, rate=0.75)})  # 4 tokens a step: a 20 ms step
    speeds.round({"spec": view("spec", running=8, tpot=0.010, rate=0.25)})  # 2 tokens a step: still 20 ms
    assert speeds.slope("spec") == 0.0  # the TPOT doubled with the traffic's acceptance, not with the batch
    speeds.round({"spec": view("spec", running=9, tpot=0.015, rate=0.25)})  # a 30 ms step at batch 9
    assert speeds.slope("spec") == pytest.approx(0.010 / 8 / 2)  # per added sequence, per token of 2 a step
    assert speeds.slope("std") is None


def test_the_impact_is_the_running_requests_remaining_tokens_times_the_slope() -> None:
    v = view("spec", running=8, tpot=0.04)
    e = estimate(v, "speculative", 0.04, output_tokens=200, slope_s=0.001)
    assert e is not None
    assert e.impact_s == pytest.approx(8 * 100 * 0.001)
    assert e.cost_s == pytest.approx(e.expected_s + 0.8)
    half = estimate(v, "speculative", 0.04, output_tokens=200, slope_s=0.001, impact_weight=0.5)
    assert half is not None
    assert half.impact_s == pytest.approx(0.4)
    for off in (
        estimate(v, "speculative", 0.04, output_tokens=200),  # slope unknown
        estimate(v, "speculative", 0.04, output_tokens=200, slope_s=0.001, impact_weight=0.0),
    ):
        assert off is not None
        assert (off.impact_s, off.cost_s) == (0.0, off.expected_s)


def _rounds(rs: RoutingState, rounds: list[dict[str, object]], rng: random.Random) -> None:
    for i, views in enumerate(rounds):
        rs.choose("chat", rng)
        rs.on_scrape_round(1.0 + i, views)  # type: ignore[arg-type]


def _steep_spec_rounds() -> list[dict[str, object]]:
    """At a batch of 8 the speculative pool decodes the class a third faster than the standard one (15 against
    20 ms a token), but its TPOT was 6 ms at batch 1 (1.3 ms more per added request); the standard one's went from
    16 to 20 ms (0.6 ms). The pools' acceptance is not reported: the class's TPOT is the pool's."""
    low = {"spec": view("spec", running=1, tpot=0.006), "std": view("std", running=1, tpot=0.016)}
    busy = {"spec": view("spec", running=8, tpot=0.015), "std": view("std", running=8, tpot=0.020)}
    return [low, busy, busy, busy, busy]


def test_a_standard_home_class_goes_no_further_onto_a_steep_pool_that_is_only_a_little_faster_for_it() -> None:
    rs, _ = state(rules(defaults_ctl=CTL))
    _rounds(rs, _steep_spec_rounds(), random.Random(3))
    snap = rs.snapshot()["chat"]
    spec, std = snap["estimates"]["spec"], snap["estimates"]["std"]
    assert spec["impact_s"] > std["impact_s"] > 0
    assert std["expected_s"] > spec["expected_s"] * CTL_EXIT  # on its own times it would move ...
    assert spec["cost_s"] * CTL_EXIT > std["cost_s"]  # ... but not on its costs
    assert snap["share"] == 0.5  # the one step it took while the speculative pool was idle (and much faster)


def test_load_impact_zero_compares_the_own_times_only() -> None:
    rs, _ = state(rules(defaults_ctl={**CTL, "load_impact": 0}))
    _rounds(rs, _steep_spec_rounds(), random.Random(3))
    snap = rs.snapshot()["chat"]
    assert snap["estimates"]["spec"]["impact_s"] == 0.0
    assert snap["share"] == 1.0  # all of it onto the speculative pool, by its own faster time there


def test_with_equal_costs_a_class_stays_home() -> None:
    rs, _ = state(rules(defaults_ctl=CTL))
    flat = {"spec": view("spec", running=1, tpot=0.02), "std": view("std", running=1, tpot=0.02)}
    same = {"spec": view("spec", running=5, tpot=0.03), "std": view("std", running=5, tpot=0.03)}
    _rounds(rs, [flat, same, same, same], random.Random(4))
    assert rs.state_of("chat") == "standard"
    assert rs.state_of("json") == "speculative"


CTL_EXIT = 1.25  # ControllerConfig.exit_margin's default (CTL leaves it out)
