"""The time a request adds to a pool's running requests (gateway.routing.estimate.BatchSlope, ``impact_s``): what
the controllers compare is the request's own expected time plus that, so a class is not moved onto a pool whose
steps lengthen steeply with its batch only because its own requests would be a little faster there."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.observability.metrics import GatewayMetrics
from gateway.routing.batch_slope import BatchSlope, PoolSpeeds
from gateway.routing.estimate import estimate
from gateway.routing.routing_state import RoutingState
from tests.unit.test_routing_both_ways import CTL, rules, state, view  # the same two-pool rules


def test_the_slope_is_fitted_on_step_time_against_batch() -> None:
    s = BatchSlope()
    for batch in (1.0, 2.0, 3.0, 4.0, 5.0):
        assert s.add(batch, 0.020 + 0.003 * batch) is None  # fewer than MIN_WEIGHT rounds: nothing yet
    assert s.add(6.0, 0.038) == pytest.approx(0.003)
    for _ in range(30):  # a steady batch says nothing new: the slope stays
        s.add(8.0, 0.044)
    assert s.slope_s == pytest.approx(0.003, rel=0.2)
    assert s.add(math.nan, 0.02) == s.slope_s  # unusable pairs change nothing
    assert s.add(3.0, -1.0) == s.slope_s


def test_a_batch_that_never_varies_gives_no_slope() -> None:
    s = BatchSlope()
    for _ in range(50):
        s.add(6.0, 0.03)
    assert s.slope_s is None


def test_faster_at_larger_batches_is_no_negative_impact() -> None:
    s = BatchSlope()
    for batch in (1.0, 3.0, 5.0, 7.0, 9.0, 11.0):
        s.add(batch, 0.05 - 0.002 * batch)
    assert s.slope_s == 0.0


@given(st.lists(st.tuples(st.floats(0, 64), st.floats(1e-4, 1.0)), max_size=60))
def test_the_slope_stays_within_what_the_step_time_allows(pairs: list[tuple[float, float]]) -> None:
    s = BatchSlope()
    for batch, step in pairs:
        slope = s.add(batch, step)
        if slope is not None:
            assert slope >= 0.0
            assert slope <= max(t for _, t in pairs) + 1e-12  # at most the mean step over a mean batch >= 1


def test_a_fall_in_acceptance_is_not_taken_for_a_batch_slope() -> None:
    speeds = PoolSpeeds()
    spec = {"spec"}
    for i in range(12):  # the step stays 20 ms while the batch moves: the TPOT moved with the acceptance only
        batch, rate = (1, 0.75) if i % 2 else (8, 0.25)  # 4 tokens a step at 5 ms, 2 tokens a step at 10 ms
        v = view("spec", running=batch, tpot=0.020 / (1 + 4 * rate), rate=rate)
        speeds.round(float(i), {"spec": v}, speculative=spec, window_s=0.5)
    assert speeds.slope("spec") == pytest.approx(0.0, abs=1e-12)
    # a round without drafts keeps the last tokens per step (it is not read as 1 a step)
    speeds.round(20.0, {"spec": view("spec", running=1, tpot=0.010)}, speculative=spec, window_s=0.5)
    assert speeds.slope("spec") == pytest.approx(0.0, abs=1e-12)


def test_the_batch_is_averaged_over_the_tpots_window() -> None:
    speeds = PoolSpeeds()
    for i in range(10):
        running = 10 if i < 5 else 2  # a burst ends: the gauge drops, the window's TPOT still holds the burst
        speeds.round(float(i), {"std": view("std", running=running, tpot=0.02 + 0.001 * running)},
                     speculative=(), window_s=3.0)  # fmt: skip
        assert speeds._batches["std"][0][0] >= i - 3.0
    batches = [b for _, b in speeds._batches["std"]]
    assert batches == [10.0, 2.0, 2.0, 2.0, 2.0][-len(batches) :]


def test_a_pool_not_measured_yet_takes_the_other_pools_slope_scaled_by_the_work_per_sequence() -> None:
    speeds = PoolSpeeds()
    assert speeds.slopes("spec", "std", 4) == (None, None)  # neither measured: no impact on either side
    for i, batch in enumerate((1, 3, 5, 7, 9, 11)):
        speeds.round(float(i), {"spec": view("spec", running=batch, tpot=0.01 + 0.002 * batch, rate=0.5)},
                     speculative={"spec"}, window_s=0.5)  # fmt: skip
    a = speeds.slope("spec")
    assert a is not None
    # the standard pool idles (its batch never varied): a sequence there computes one token a step, not 1 + k
    assert speeds.slopes("spec", "std", 4) == (a, pytest.approx(a / 5))
    only_std = PoolSpeeds()
    for i, batch in enumerate((1, 3, 5, 7, 9, 11)):
        only_std.round(float(i), {"std": view("std", running=batch, tpot=0.02 + 0.001 * batch)},
                       speculative=(), window_s=0.5)  # fmt: skip
    b = only_std.slope("std")
    assert b is not None
    assert only_std.slopes("spec", "std", 4) == (pytest.approx(5 * b), b)


def test_the_impact_is_the_batch_beside_it_times_its_steps_times_the_slope() -> None:
    v = view("std", running=8, tpot=0.04)
    e = estimate(v, "standard", 0.04, output_tokens=200, slope_s=0.001)
    assert e is not None
    assert e.impact_s == pytest.approx(8 * 200 * 0.001)  # 200 steps of one token beside 8 requests
    assert e.cost_s == pytest.approx(e.expected_s + 1.6)
    half = estimate(v, "standard", 0.04, output_tokens=200, slope_s=0.001, impact_weight=0.5)
    assert half is not None
    assert half.impact_s == pytest.approx(0.8)
    spec = estimate(view("spec", running=8, tpot=0.02), "speculative", 0.02, output_tokens=200, k=4,
                    class_rate=0.5, slope_s=0.001)  # fmt: skip
    assert spec is not None
    assert spec.impact_s == pytest.approx(8 * (200 / 3) * 0.001)  # 3 tokens a step: a third of the steps
    for off in (
        estimate(v, "standard", 0.04, output_tokens=200),  # slope unknown
        estimate(v, "standard", 0.04, output_tokens=200, slope_s=0.001, impact_weight=0.0),
    ):
        assert off is not None
        assert (off.impact_s, off.cost_s) == (0.0, off.expected_s)


def _learned(load_impact: float) -> RoutingState:
    """Ten rounds that teach the pools' slopes (no class may move: min_samples out of reach), alternating an idle and
    a busy batch, 100 s apart (each round's window holds its own batch only); then the balancing rules, and three
    busy rounds. Busy: at a batch of 8 the speculative pool decodes the class a third faster than the standard one
    (15 against 20 ms a token), but its step grows 3.9 ms per added request against the standard one's 0.6 ms."""
    ctl = {**CTL, "prior_acceptance": 0.5, "load_impact": load_impact}  # the class accepts as the pool does
    current = [rules(defaults_ctl={**ctl, "min_samples": 10**6})]
    m = GatewayMetrics()
    rs = RoutingState(lambda: current[0], m.registry, clock=lambda: 0.0)
    idle = {"spec": view("spec", running=1, tpot=0.006, rate=0.5), "std": view("std", running=1, tpot=0.016)}
    busy = {"spec": view("spec", running=8, tpot=0.015, rate=0.5), "std": view("std", running=8, tpot=0.020)}
    rng = random.Random(3)
    for i in range(10):
        rs.choose("chat", rng)
        rs.on_scrape_round(100.0 * i, idle if i % 2 == 0 else busy)
    current[0] = rules(defaults_ctl=ctl)
    for j in range(3):
        rs.choose("chat", rng)
        rs.on_scrape_round(2000.0 + 100.0 * j, busy)
    return rs


def test_a_standard_home_class_stays_off_a_steep_pool_that_is_only_a_little_faster_for_it() -> None:
    rs = _learned(1.0)
    snap = rs.snapshot()["chat"]
    spec, std = snap["estimates"]["spec"], snap["estimates"]["std"]
    assert spec["impact_s"] > 2 * std["impact_s"] > 0
    assert std["expected_s"] > spec["expected_s"] * CTL_EXIT  # on its own times it would move ...
    assert spec["cost_s"] * CTL_EXIT > std["cost_s"]  # ... but not on its costs
    assert snap["share"] == 0.0


def test_load_impact_zero_compares_the_own_times_only() -> None:
    snap = _learned(0.0).snapshot()["chat"]
    assert snap["estimates"]["spec"]["impact_s"] == 0.0
    assert snap["share"] == 1.0  # all of it onto the speculative pool, by its own faster time there


def test_with_equal_costs_a_class_stays_home() -> None:
    rs, _ = state(rules(defaults_ctl=CTL))
    rng = random.Random(4)
    for i in range(12):
        batch, tpot = (1, 0.02) if i % 2 == 0 else (5, 0.03)
        views = {"spec": view("spec", running=batch, tpot=tpot), "std": view("std", running=batch, tpot=tpot)}
        rs.choose("chat", rng)
        rs.on_scrape_round(100.0 * i, views)
    assert rs.state_of("chat") == "standard"
    assert rs.state_of("json") == "speculative"


CTL_EXIT = 1.25  # ControllerConfig.exit_margin's default (CTL leaves it out)
