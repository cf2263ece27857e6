"""RoutingState: a class's prior acceptance follows the temperatures its requests carry, and a class too sparse to
reach ``min_samples`` in one window gathers them over several."""

from __future__ import annotations

import random
from typing import Any

import pytest

from gateway.config.schema import RoutingRules
from gateway.fleet.vllm_metrics import Acceptance, PoolLoadView
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.estimate import per_token_acceptance, prior_rate, rate_from_per_token
from gateway.routing.routing_state import RoutingState
from tests.unit.test_routing_both_ways import SPEC, STD

CTL = {"window_s": 1, "min_samples": 5, "min_hold_s": 0, "share_step": 0.5, "probe_share": 0}


def rules(**ctl: Any) -> RoutingRules:
    return RoutingRules.model_validate(
        {
            "defaults": {"controller": {**CTL, **ctl}},
            "pools": [SPEC, STD],
            "classes": [{"name": "chat", "route": {"preferred": "std"}}],  # the catch-all: no temperature band
        }
    )


def view(pool: str, *, running: float = 1, tpot: float = 0.02, rate: float | None = None) -> PoolLoadView:
    acc = None if rate is None else Acceptance(rate, 1 + 4 * rate, (), 100.0)
    return PoolLoadView(pool, 1, 1, running, 0, None, acc, tpot, None)


def state(r: RoutingRules) -> RoutingState:
    return RoutingState(lambda: r, GatewayMetrics().registry, clock=lambda: 0.0)


VIEWS = {"spec": view("spec", tpot=0.01, rate=0.6), "std": view("std", tpot=0.02)}


def spec_estimate(rs: RoutingState) -> dict[str, Any]:
    est: dict[str, Any] = rs.snapshot()["chat"]["estimates"]["spec"]
    return est


def test_before_any_request_the_prior_is_the_temperature_bands() -> None:
    rs = state(rules())
    rs.on_scrape_round(1.0, VIEWS)
    est = spec_estimate(rs)
    assert est["acceptance_source"] == "prior"
    assert est["acceptance"] == pytest.approx(prior_rate(None, 1.0, 4))  # the catch-all stands for T 1.0


def test_the_prior_follows_the_temperatures_the_class_actually_receives() -> None:
    rs = state(rules())
    rng = random.Random(1)
    for _ in range(200):
        rs.choose("chat", rng, temperature=0.8)
    rs.on_scrape_round(1.0, VIEWS)
    est = spec_estimate(rs)
    assert est["acceptance_source"] == "prior"
    assert est["acceptance"] == pytest.approx(rate_from_per_token(per_token_acceptance(0.8), 4), rel=1e-6)
    assert est["acceptance"] > prior_rate(None, 1.0, 4)  # temperature-0.8 chat accepts more than T 1.0 traffic
    # the faster class speed on the speculative pool follows: fewer draft tokens wasted than the band assumed
    band = state(rules())
    band.on_scrape_round(1.0, VIEWS)
    assert est["class_tpot_s"] < spec_estimate(band)["class_tpot_s"]


def test_a_change_in_the_temperatures_moves_the_prior_within_tens_of_requests() -> None:
    rs = state(rules())
    rng = random.Random(1)
    for _ in range(100):
        rs.choose("chat", rng, temperature=0.2)
    for _ in range(100):
        rs.choose("chat", rng, temperature=1.0)
    rs.on_scrape_round(1.0, VIEWS)
    expected = rate_from_per_token(per_token_acceptance(1.0), 4)
    assert spec_estimate(rs)["acceptance"] == pytest.approx(expected, rel=0.01)


def test_explain_does_not_move_the_prior() -> None:
    rs = state(rules())
    rng = random.Random(1)
    for _ in range(50):
        rs.choose("chat", rng, count=False, temperature=0.0)
    rs.on_scrape_round(1.0, VIEWS)
    assert spec_estimate(rs)["acceptance"] == pytest.approx(prior_rate(None, 1.0, 4))


def test_a_prior_set_in_the_yaml_wins_over_the_requests_temperatures() -> None:
    rs = state(rules(prior_acceptance=0.3))
    rng = random.Random(1)
    for _ in range(50):
        rs.choose("chat", rng, temperature=0.0)
    rs.on_scrape_round(1.0, VIEWS)
    assert spec_estimate(rs)["acceptance"] == pytest.approx(0.3)


def test_a_measured_acceptance_wins_over_the_prior() -> None:
    r = rules()
    m = GatewayMetrics()
    rs = RoutingState(lambda: r, m.registry, clock=lambda: 0.0)
    rng = random.Random(1)
    rs.on_scrape_round(0.5, VIEWS)
    for _ in range(20):
        rs.choose("chat", rng, temperature=0.0)
    m.class_draft_tokens.labels("chat").inc(400)
    m.class_accepted_tokens.labels("chat").inc(80)
    rs.on_scrape_round(1.0, VIEWS)
    est = spec_estimate(rs)
    assert (est["acceptance"], est["acceptance_source"]) == (pytest.approx(0.2), "measured")


# -- sparse classes ----------------------------------------------------------------------------------------------

FASTER_THERE = {"spec": view("spec", tpot=0.005, rate=0.6), "std": view("std", running=6, tpot=0.03)}


def test_a_sparse_class_gathers_min_samples_over_several_windows() -> None:
    """Two requests per one-second window never reach min_samples 5 in one window; the third round has six
    since the share last changed, so the class moves then, and waits for five more before the next step."""
    rs = state(rules())
    rng = random.Random(3)
    shares = []
    for t in range(1, 9):
        rs.choose("chat", rng, temperature=1.0)
        rs.choose("chat", rng, temperature=1.0)
        rs.on_scrape_round(float(t), FASTER_THERE)
        shares.append(rs.snapshot()["chat"]["share"])
    assert shares[:2] == [0.0, 0.0]  # 2, then 4 requests: not yet
    assert shares[2] == 0.5  # 6 requests since the start: the first step
    assert shares[3:5] == [0.5, 0.5]  # 2, 4 since that step
    assert shares[5] == 1.0  # 6 since the step: the next one


def test_a_class_without_requests_never_moves() -> None:
    rs = state(rules())
    for t in range(1, 20):
        rs.on_scrape_round(float(t), FASTER_THERE)
    snap = rs.snapshot()["chat"]
    assert (snap["share"], snap["holding"]) == (0.0, "min_samples")


def test_a_choice_carries_the_class_speeds_of_the_last_round_for_the_saturation_spill() -> None:
    rs = state(rules())
    assert rs.choose("chat", random.Random(1)).speeds is None  # type: ignore[union-attr]  # nothing measured yet
    rs.on_scrape_round(1.0, VIEWS)
    choice = rs.choose("chat", random.Random(1))
    assert choice is not None
    assert choice.speeds is not None
    speeds = dict(choice.speeds)
    est = rs.snapshot()["chat"]["estimates"]
    assert speeds == {"spec": est["spec"]["class_tpot_s"], "std": est["std"]["class_tpot_s"]}
