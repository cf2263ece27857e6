"""gateway.routing.controller with ``balance_margin``: leaving home takes ``exit_margin``, but a share already away
from home moves on toward whichever pool is cheaper by more than the balance margin, both ways, so it settles near
where the two pools' costs meet instead of anywhere inside the hysteresis band."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.schema import ControllerConfig, PoolKind
from gateway.routing.controller import Controller
from gateway.routing.estimate import Observation
from tests.unit.test_controller_symmetric import BASE as SYMMETRIC

BASE: dict[str, Any] = {**SYMMETRIC, "balance_margin": 1.05}
HOME_SHARE = {"speculative": 1.0, "standard": 0.0}


def cfg(**kw: Any) -> ControllerConfig:
    return ControllerConfig.model_validate({**BASE, **kw})


def ob(home: PoolKind, ratio: float) -> Observation:
    """Costs where home's is ``ratio`` x the other pool's."""
    spec, std = (ratio, 1.0) if home == "speculative" else (1.0, ratio)
    return Observation(50, spec, std, 0.0, 1.0, None, None, False)


def run(c: Controller, obs: list[Observation], *, t0: float = 0.0, dt: float = 11.0) -> list[float]:
    shares = []
    for i, o in enumerate(obs):
        c.observe(t0 + i * dt, o)
        shares.append(c.share)
    return shares


@pytest.mark.parametrize("home", ["speculative", "standard"])
def test_at_home_the_exit_margin_still_holds_the_class(home: PoolKind) -> None:
    c = Controller("x", cfg(), initial=home, home=home)
    assert run(c, [ob(home, 1.2)] * 5) == [HOME_SHARE[home]] * 5  # 20% dearer at home: not enough to leave


@pytest.mark.parametrize("home", ["speculative", "standard"])
def test_once_away_a_share_follows_a_small_difference_in_both_directions(home: PoolKind) -> None:
    c = Controller("x", cfg(), initial=home, home=home)
    away = 1 if home == "standard" else -1
    first = run(c, [ob(home, 2.0)])  # clearly dearer at home: one step away
    assert first == [HOME_SHARE[home] + away * 0.25]
    # home still 10% dearer: inside the old band (0.9-1.25) nothing moved; now the share keeps going
    assert run(c, [ob(home, 1.1)], t0=11.0) == [HOME_SHARE[home] + away * 0.5]
    # home now 10% cheaper (above enter_margin 0.9): the share comes back, half a step (a reversal)
    assert run(c, [ob(home, 1 / 1.1)], t0=22.0) == [HOME_SHARE[home] + away * 0.375]
    # within the balance margin: it stays
    assert run(c, [ob(home, 1.02), ob(home, 0.98)], t0=33.0) == [HOME_SHARE[home] + away * 0.375] * 2


def test_a_class_wholly_away_comes_back_on_a_small_difference() -> None:
    c = Controller("chat", cfg(), initial="standard", home="standard")
    assert run(c, [ob("standard", 2.0)] * 4) == [0.25, 0.5, 0.75, 1.0]
    assert run(c, [ob("standard", 0.93)], t0=100.0) == [0.875]  # a reversal; enter_margin alone would hold 1.0


def test_whole_class_moves_keep_the_full_band() -> None:
    c = Controller("chat", cfg(share_step=1.0), initial="standard", home="standard")
    assert run(c, [ob("standard", 2.0)]) == [1.0]
    # moving back as a whole on a 7% difference would flap: it takes enter_margin
    assert run(c, [ob("standard", 0.93)] * 3, t0=11.0) == [1.0] * 3
    assert run(c, [ob("standard", 0.85)], t0=50.0) == [0.0]


def test_without_a_balance_margin_the_band_holds_a_split_share() -> None:
    c = Controller("chat", cfg(balance_margin=None), initial="standard", home="standard")
    assert run(c, [ob("standard", 2.0)]) == [0.25]
    assert run(c, [ob("standard", 1.1), ob("standard", 0.95)], t0=11.0) == [0.25, 0.25]


@pytest.mark.parametrize("bad", [0.99, 1.25, 2.0])
def test_the_balance_margin_lies_between_one_and_the_exit_margin(bad: float) -> None:
    with pytest.raises(pydantic.ValidationError):
        cfg(balance_margin=bad)


@settings(max_examples=60, deadline=None)
@given(
    home=st.sampled_from(["speculative", "standard"]),
    balance=st.floats(1.0, 1.2),
    costs=st.lists(st.tuples(st.floats(0.1, 10.0), st.floats(0.1, 10.0)), min_size=1, max_size=40),
)
def test_a_share_never_steps_toward_the_dearer_pool(
    home: PoolKind, balance: float, costs: list[tuple[float, float]]
) -> None:
    c = Controller("x", cfg(balance_margin=balance), initial=home, home=home)
    for i, (spec, std) in enumerate(costs):
        before = c.share
        c.observe(i * 11.0, Observation(50, spec, std, 0.0, 1.0, None, None, False))
        assert 0.0 <= c.share <= 1.0
        if c.share > before:
            assert spec < std  # more onto the speculative pool only when it is the cheaper one
        if c.share < before:
            assert std < spec
