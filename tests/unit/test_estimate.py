"""gateway.routing.estimate: a class's expected completion time on a pool, and the acceptance prior."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config.schema import Range
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.routing.estimate import (
    band_temperature,
    estimate,
    per_token_acceptance,
    prior_rate,
    rate_from_per_token,
    tokens_per_step,
)


def view(running: float | None = 8, waiting: float | None = 4, fresh: int = 2) -> PoolLoadView:
    return PoolLoadView("p", 2, fresh, running, waiting, None, None, 0.02, None)


def test_the_estimate_adds_queue_first_step_and_the_class_decode() -> None:
    e = estimate(view(), "standard", 0.02, output_tokens=100)
    assert e is not None
    # per endpoint 4 running, 2 waiting: 2 x (256 x 0.02) / 4 of queue
    assert (e.queue_s, e.first_token_s, e.decode_s) == pytest.approx((2.56, 0.02, 2.0))
    assert e.expected_s == pytest.approx(4.58)
    assert e.acceptance is None
    assert e.acceptance_source == "none"


def test_the_speculative_tpot_is_rescaled_from_the_pools_acceptance_to_the_classs() -> None:
    e = estimate(view(), "speculative", 0.02, output_tokens=100, k=4, class_rate=0.25, pool_rate=0.75)
    assert e is not None
    assert e.class_tpot_s == pytest.approx(0.02 * 4 / 2)
    unknown_pool = estimate(view(), "speculative", 0.02, output_tokens=100, k=4, class_rate=0.25)
    assert unknown_pool is not None
    assert unknown_pool.class_tpot_s == 0.02


def test_stale_or_unusable_is_unknown_never_zero() -> None:
    assert estimate(view(fresh=0), "standard", 0.02) is None
    assert estimate(view(running=None), "standard", 0.02) is None
    assert estimate(view(), "standard", float("nan")) is None


def test_the_prior_follows_the_published_temperature_curve() -> None:
    assert per_token_acceptance(0.0) == 0.81
    assert per_token_acceptance(0.8) == pytest.approx(0.52)
    assert per_token_acceptance(0.6) == pytest.approx((0.71 + 0.52) / 2)
    assert per_token_acceptance(5.0) == 0.1
    # vLLM's rate: E[accepted] / K under the truncated geometric; a = 0.5, K = 5 is about 0.19
    assert rate_from_per_token(0.5, 5) == pytest.approx(0.19375)
    assert band_temperature(Range(lte=0.5), 1.0) == 0.25
    assert band_temperature(Range(gt=0.7), 1.0) == pytest.approx(0.85)
    assert band_temperature(None, 1.0) == 1.0
    assert prior_rate(Range(lte=0.5), 1.0, 4) > prior_rate(None, 1.0, 4)


@given(a=st.floats(0, 0.999), k=st.integers(1, 8))
def test_rates_and_tokens_per_step_are_bounded(a: float, k: int) -> None:
    r = rate_from_per_token(a, k)
    assert 0.0 <= r <= 1.0
    assert 1.0 <= tokens_per_step(r, k) <= 1.0 + k
