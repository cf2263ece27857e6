"""gateway.routing.ownership and the controller's side of it: the speculative pool goes to the classes that gain most
there; an outranked class takes nothing onto it and hands back what it has, and two classes never swap places."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.schema import ControllerConfig, PoolKind
from gateway.routing.controller import Controller
from gateway.routing.estimate import Observation
from gateway.routing.ownership import MARGIN, Standing, outranked
from tests.unit.test_controller_balance import BASE


def standing(name: str, rate: float | None, share: float, home: PoolKind = "speculative", **kw: Any) -> Standing:
    return Standing(name, kw.get("pool", "spec"), rate, share, home, kw.get("deciding", True))


def test_a_class_is_outranked_while_a_clearly_better_speculative_home_class_is_partly_off_the_pool() -> None:
    json_ = standing("json", 0.75, 0.75)
    chat = standing("chat", 0.3, 0.2, home="standard")
    assert outranked([json_, chat]) == {"chat": "json"}
    assert outranked([standing("json", 0.75, 1.0), chat]) == {}  # wholly on it: the others may follow
    assert outranked([standing("json", 0.75, 0.97), chat]) == {}  # a balance step off it is not pushed off
    assert outranked([standing("json", 0.75, 0.9), chat]) == {}  # a tenth off is not more than a tenth
    # close rates are not ordered (one noisy window must not reorder classes)
    assert outranked([standing("code", 0.75 - MARGIN / 2, 0.5), standing("json", 0.75, 0.5)]) == {}


def test_only_classes_that_decide_by_load_and_share_the_pool_outrank() -> None:
    chat = standing("chat", 0.3, 0.2, home="standard")
    assert outranked([standing("json", 0.75, 0.5, deciding=False), chat]) == {}  # guard, force, too few samples
    assert outranked([standing("json", 0.75, 0.5, pool="other"), chat]) == {}
    assert outranked([standing("mid", 0.6, 0.0, home="standard"), chat]) == {}  # a standard-home class at home
    assert outranked([standing("json", None, 0.5), chat]) == {}
    assert outranked([standing("json", 0.75, 0.5), standing("chat", None, 0.2)]) == {}


def test_the_best_of_several_is_named() -> None:
    got = outranked([standing("code", 0.6, 0.5), standing("json", 0.8, 0.85), standing("chat", 0.3, 0.1)])
    assert got == {"chat": "json", "code": "json"}


def ob(spec: float, std: float, by: str | None = None) -> Observation:
    return Observation(50, spec, std, 0.0, 1.0, None, None, False, by)


def test_an_outranked_class_hands_back_its_share_whatever_its_own_costs_say() -> None:
    c = Controller("chat", ControllerConfig.model_validate(BASE), initial="standard", home="standard")
    c.observe(0.0, ob(1.0, 3.0))
    assert c.share == 0.25
    c.observe(11.0, ob(1.0, 3.0, by="json"))  # still far cheaper there for chat, but json waits off the pool
    assert c.share == 0.0
    snap = c.snapshot()
    assert snap.last_reason == "load_recovered"
    c.observe(22.0, ob(1.0, 3.0, by="json"))
    assert (c.share, c.snapshot().holding) == (0.0, "order")  # and takes nothing back while outranked
    c.observe(33.0, ob(1.0, 3.0))
    assert c.share > 0.0  # json is back on the pool: chat may follow again


def test_an_outranked_speculative_home_class_makes_room_too() -> None:
    c = Controller("code", ControllerConfig.model_validate(BASE), home="speculative")
    c.observe(0.0, ob(1.0, 1.0, by="json"))
    assert c.share == 0.75


@settings(max_examples=60, deadline=None)
@given(
    home=st.sampled_from(["speculative", "standard"]),
    rounds=st.lists(st.tuples(st.floats(0.1, 10.0), st.floats(0.1, 10.0), st.booleans()), min_size=1, max_size=40),
)
def test_an_outranked_class_never_gains_share_and_shares_stay_in_bounds(
    home: PoolKind, rounds: list[tuple[float, float, bool]]
) -> None:
    c = Controller("x", ControllerConfig.model_validate(BASE), initial=home, home=home)
    for i, (spec, std, by) in enumerate(rounds):
        before = c.share
        c.observe(i * 11.0, ob(spec, std, "json" if by else None))
        assert 0.0 <= c.share <= 1.0
        if by:
            assert c.share <= before
