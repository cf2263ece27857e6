"""gateway.bench.capacity_judge: how ``bench capacity`` measures a fleet's ceiling, decides that a hold sustained its
rate, and compares two fleets."""

from __future__ import annotations

import math
import random

import pytest

from gateway.bench.capacity_judge import (
    Comparison,
    Rules,
    Step,
    backlog_trend,
    compare,
    rate_and_error,
    slope,
    verdict,
)


def _step(mean: float, rise: float, answered: int = 400, failed: int = 0) -> Step:
    return Step(0.9, 9.0, 80.0, mean, rise, answered, failed)


def test_slope_is_the_least_squares_line() -> None:
    assert slope([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx(2.0)
    assert slope([(0.0, 4.0)]) == 0.0
    assert slope([(1.0, 4.0), (1.0, 9.0)]) == 0.0  # no spread in time: no slope


def test_a_noisy_flat_backlog_is_flat_and_a_growing_one_grows() -> None:
    rng = random.Random(3)
    flat = [(t * 0.5, 60 + rng.gauss(0, 8)) for t in range(240)]  # 120 s of samples around 60 turns
    mean, rise = backlog_trend(flat)
    assert mean == pytest.approx(60, abs=3)
    ok, why = verdict(_step(mean, rise), servers=4)
    assert ok, why
    # conversations piling up: 60 turns more at the end of the window than at its start
    growing = [(t * 0.5, 60 + t / 4 + rng.gauss(0, 8)) for t in range(240)]
    mean, rise = backlog_trend(growing)
    assert rise == pytest.approx(60, abs=6)
    ok, why = verdict(_step(mean, rise), servers=4)
    assert not ok
    assert "grew" in why


def test_a_falling_backlog_is_sustained() -> None:
    assert verdict(_step(mean=120, rise=-90), servers=4)[0]


def test_a_small_backlog_needs_a_few_turns_per_server_to_count_as_growth() -> None:
    assert verdict(_step(mean=4, rise=15), servers=4)[0]  # under 4 turns per server
    assert not verdict(_step(mean=4, rise=17), servers=4)[0]
    assert verdict(_step(mean=36, rise=14), servers=4)[0]  # within half the mean


def test_shedding_is_not_sustaining_even_with_a_flat_backlog() -> None:
    ok, why = verdict(_step(mean=40, rise=0, answered=400, failed=20), servers=4)
    assert not ok
    assert "failed" in why
    assert verdict(_step(mean=40, rise=0, answered=400, failed=4), servers=4)[0]  # 1%: within
    assert not verdict(_step(mean=40, rise=0, answered=400, failed=4), servers=4, rules=Rules(max_failed=0.005))[0]


def test_a_rate_comes_with_the_spread_of_its_sub_windows() -> None:
    steady = [i * 0.1 for i in range(600)]  # 10 per second for 60 s
    rate, se = rate_and_error(steady, 0.0, 60.0)
    assert rate == pytest.approx(10.0)
    assert se == pytest.approx(0.0, abs=1e-9)
    # the first half at 5 per second, the second at 15: the same mean, a wide error
    uneven = [i * 0.2 for i in range(150)] + [30 + i / 15 for i in range(450)]
    rate, se = rate_and_error(uneven, 0.0, 60.0)
    assert rate == pytest.approx(10.0, rel=0.01)
    assert se > 1.5
    outside = [-1.0, 60.0, 61.0]  # before the window, at its end (excluded), after it
    assert rate_and_error([*steady, *outside], 0.0, 60.0)[0] == pytest.approx(10.0)
    assert math.isnan(rate_and_error(steady, 5.0, 5.0)[0])


def test_throughput_counts_the_answered_turns_that_did_not_fail() -> None:
    s = Step(1.4, 14.0, 80.0, 100.0, 50.0, 880, 80)
    assert s.throughput == pytest.approx(10.0)
    assert s.failed_share == pytest.approx(80 / 880)


def test_two_fleets_compare_by_their_ceilings_with_an_interval() -> None:
    def ceiling(rate: float, se: float) -> Step:
        return Step(1.4, 14.0, 100.0, 200.0, 80.0, round(rate * 100), 0, se)

    c = compare(ceiling(9.5, 0.1), ceiling(10.0, 0.1))
    assert c.value == pytest.approx(0.95)
    half = 1.96 * 0.95 * math.sqrt((0.1 / 9.5) ** 2 + (0.1 / 10.0) ** 2)
    assert (c.lo, c.hi) == (pytest.approx(0.95 - half), pytest.approx(0.95 + half))
    assert c.reading() == "met"
    assert compare(ceiling(7.0, 0.1), ceiling(10.0, 0.1)).reading() == "missed"
    assert compare(ceiling(9.0, 0.3), ceiling(10.0, 0.3)).reading() == "undecided"
    assert compare(ceiling(9.5, math.nan), ceiling(10.0, math.nan)).lo == pytest.approx(0.95)  # no error known
    assert compare(ceiling(0.0, 0.0), ceiling(10.0, 0.1)).reading() == "unknown"
    assert Comparison(math.nan, math.nan, math.nan).reading() == "unknown"


def test_a_ceiling_counts_only_where_the_fleet_was_saturated() -> None:
    from gateway.bench.capacity_judge import saturated

    assert saturated(_step(mean=70, rise=20), slots=64)
    assert not saturated(_step(mean=22, rise=20), slots=64)  # the conversations had not built up yet


def test_sustainable_rates_compare_within_their_holds_and_ceilings() -> None:
    from gateway.bench.capacity_judge import sustained_bounds

    b = sustained_bounds(mine_hold=6.5, mine_ceiling=7.2, peer_hold=5.1, peer_ceiling=6.4)
    assert b.value == pytest.approx(6.5 / 5.1)
    assert (b.lo, b.hi) == (pytest.approx(6.5 / 6.4), pytest.approx(7.2 / 5.1))
    assert b.reading() == "met"
    assert sustained_bounds(4.0, 4.4, 6.0, 6.6).reading() == "missed"  # 4.4 / 6.0 < 0.9
    assert sustained_bounds(5.4, 6.0, 6.0, 6.6).reading() == "undecided"
    assert math.isnan(sustained_bounds(5.0, 6.0, 0.0, 6.0).value)
