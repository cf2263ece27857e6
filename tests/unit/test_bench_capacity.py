"""gateway.bench.capacity_judge: how ``bench capacity`` decides that a fleet sustains a rate, where it steps next,
and how two fleets' sustainable rates compare."""

from __future__ import annotations

import math
import random

import pytest

from gateway.bench.capacity_judge import (
    Comparison,
    Rules,
    Step,
    backlog_trend,
    bracket,
    compare,
    next_fraction,
    slope,
    verdict,
)


def _step(mean: float, rise: float, answered: int = 400, failed: int = 0) -> Step:
    return Step(1.0, 10.0, 80.0, mean, rise, answered, failed)


def test_slope_is_the_least_squares_line() -> None:
    assert slope([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx(2.0)
    assert slope([(0.0, 4.0)]) == 0.0
    assert slope([(1.0, 4.0), (1.0, 9.0)]) == 0.0  # no spread in time: no slope


def test_a_noisy_flat_backlog_is_flat_and_a_growing_one_grows() -> None:
    rng = random.Random(3)
    flat = [(t * 0.5, 60 + rng.gauss(0, 8)) for t in range(80)]  # 40 s of samples around 60 turns
    mean, rise = backlog_trend(flat)
    assert mean == pytest.approx(60, abs=3)
    ok, why = verdict(_step(mean, rise), servers=4)
    assert ok, why
    # 5% over a capacity of 10 turns/s for 80 simulated seconds: 40 turns more at the end than at the start
    growing = [(t * 0.5, 60 + t * 0.5 + rng.gauss(0, 8)) for t in range(80)]
    mean, rise = backlog_trend(growing)
    assert rise == pytest.approx(40, abs=12)
    ok, why = verdict(_step(mean, rise), servers=4)
    assert not ok
    assert "grew" in why


def test_a_falling_backlog_is_sustained() -> None:
    # after an overloaded step, a rate below capacity drains what it left
    ok, _ = verdict(_step(mean=120, rise=-90), servers=4)
    assert ok


def test_a_small_backlog_needs_a_few_turns_per_server_to_count_as_growth() -> None:
    assert verdict(_step(mean=4, rise=6), servers=4)[0]  # under 2 turns per server
    assert not verdict(_step(mean=4, rise=9), servers=4)[0]


def test_shedding_is_not_sustaining_even_with_a_flat_backlog() -> None:
    ok, why = verdict(_step(mean=40, rise=0, answered=400, failed=20), servers=4)
    assert not ok
    assert "failed" in why
    assert verdict(_step(mean=40, rise=0, answered=400, failed=4), servers=4)[0]  # 1%: within
    assert not verdict(_step(mean=40, rise=0, answered=400, failed=4), servers=4, rules=Rules(max_failed=0.005))[0]


def test_the_ladder_climbs_then_bisects_down_to_the_resolution() -> None:
    history: list[tuple[float, bool]] = []
    capacity = 1.02  # a fleet that sustains up to 102%
    seen = []
    while (f := next_fraction(history, 0.9, 0.2, 0.05)) is not None:
        seen.append(f)
        history.append((f, f <= capacity))
    assert seen == [0.9, 1.1, 1.0, 1.05]
    assert bracket(history) == (1.0, 1.05)


def test_the_ladder_descends_when_the_first_step_fails() -> None:
    history = [(0.9, False)]
    assert next_fraction(history, 0.9, 0.2, 0.05) == pytest.approx(0.7)
    history.append((0.7, False))
    assert next_fraction(history, 0.9, 0.2, 0.05) == pytest.approx(0.5)
    history.append((0.5, True))
    assert next_fraction(history, 0.9, 0.2, 0.05) == pytest.approx(0.6)
    assert next_fraction([(0.1, False)], 0.1, 0.2, 0.05) is None  # nothing lower left to try


def test_a_noisy_verdict_above_a_failure_does_not_widen_the_bracket() -> None:
    # sustained at 1.2 after failing at 1.1: the bracket is below the lowest failure
    assert bracket([(0.9, True), (1.1, False), (1.2, True)]) == (0.9, 1.1)
    assert bracket([(0.9, True)]) == (0.9, None)
    assert bracket([]) == (None, None)


def test_two_fleets_compare_by_their_brackets() -> None:
    c = compare((0.95, 1.0), (1.0, 1.05))
    assert c.value == pytest.approx(0.95)
    assert c.lo == pytest.approx(0.95 / 1.05)
    assert c.hi == pytest.approx(1.0)
    assert c.reading() == "met"  # at least 0.9 whatever the truth inside the brackets
    assert compare((0.7, 0.75), (1.0, 1.05)).reading() == "missed"
    assert compare((0.85, 0.95), (1.0, 1.05)).reading() == "undecided"
    never_failed = compare((1.3, None), (1.0, 1.05))
    assert never_failed.hi == math.inf
    assert never_failed.reading() == "met"
    assert math.isnan(compare((None, 0.5), (1.0, 1.1)).value)
    assert Comparison(math.nan, math.nan, math.nan).reading() == "unknown"


def test_throughput_counts_the_answered_turns_that_did_not_fail() -> None:
    s = Step(1.2, 12.0, 80.0, 100.0, 50.0, 880, 80)
    assert s.throughput == pytest.approx(10.0)
    assert s.failed_share == pytest.approx(80 / 880)
