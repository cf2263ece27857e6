"""gateway.routing.controller_rules and ownership: the decision as named rules in one order, and the visitor limit
that follows the home classes carrying traffic."""

from __future__ import annotations

import random
from typing import Any

from gateway.config.schema import ControllerConfig, RoutingRules
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.controller import Controller
from gateway.routing.controller_rules import RULES, Guard, Situation, evaluate
from gateway.routing.estimate import Observation
from gateway.routing.ownership import visitor_limit
from gateway.routing.plan import PoolView, plan_route
from gateway.routing.routing_state import RoutingState
from tests.unit.test_controller_balance import BASE
from tests.unit.test_routing_state import POOLS, view


def ob(spec: float, std: float, samples: int = 50, **kw: Any) -> Observation:
    return Observation(samples=samples, spec_cost_s=spec, std_cost_s=std, spec_queue=0.0, spec_batch=1.0, **kw)


def test_the_rules_run_in_one_visible_order() -> None:
    assert tuple(r.__name__ for r in RULES) == (
        "forced",
        "safe_state",
        "min_samples",
        "guard",
        "balance",
        "limits",
        "order",
        "settled",
        "step",
        "min_hold",
        "cap",
        "take_step",
    )


def test_the_rule_that_decided_is_named_in_the_snapshot_and_the_transition() -> None:
    c = Controller("json", ControllerConfig.model_validate({**BASE, "min_hold_s": 25.0}), share=1.0, now=0.0)
    c.observe(10.0, ob(1.0, 1.0, samples=1))
    assert (c.snapshot().rule, c.snapshot().holding) == ("min_samples", "min_samples")
    c.observe(20.0, ob(1.0, 1.0))
    assert (c.snapshot().rule, c.snapshot().holding) == ("settled", None)  # equal costs at home: stays home
    c.observe(21.0, ob(5.0, 1.0))  # the speculative pool is far dearer, but the state changed 21 s ago
    assert (c.snapshot().rule, c.snapshot().holding) == ("min_hold", "hold")
    t = c.observe(30.0, ob(5.0, 1.0))  # a share steps off it
    assert t is not None
    assert (t.rule, t.reason, c.share) == ("take_step", "load", 0.75)
    c.observe(35.0, ob(5.0, 1.0))
    assert (c.snapshot().rule, c.snapshot().holding) == ("step", "step")  # one step per window_s
    c.observe(40.0, ob(5.0, 1.0, outranked_by="code"))
    assert c.snapshot().rule == "take_step"  # a yield is a full step
    c.observe(50.0, ob(5.0, 1.0, stale=True))
    assert c.snapshot().rule == "safe_state"
    forced = c.force("speculative", 60.0, ttl_s=30.0)
    assert forced is not None
    assert forced.rule == "on_call"
    c.observe(70.0, ob(5.0, 1.0))
    assert (c.snapshot().rule, c.snapshot().holding) == ("forced", "forced")


def test_a_rule_passes_adjusts_or_decides_and_only_the_decider_ends_the_evaluation() -> None:
    cfg = ControllerConfig.model_validate(BASE)
    s = Situation(now=30.0, obs=ob(1.0, 5.0), config=cfg, home="standard", share=0.0, since=0.0, guard=Guard())
    verdict, guard = evaluate(s)
    assert (verdict.rule, verdict.outcome, verdict.share, verdict.reason) == ("take_step", "decide", 0.25, "load")
    assert guard.window_start == 30.0  # the guard counted its first window on the way
    # the home is an input like the costs: the same costs read from a speculative home settle
    home, _ = evaluate(Situation(now=30.0, obs=ob(1.0, 5.0), config=cfg, home="speculative", share=1.0, since=0.0,
                                 guard=Guard()))  # fmt: skip
    assert (home.rule, home.outcome, home.share) == ("settled", "decide", None)


# -- the visitor limit ---------------------------------------------------------------------------------------


def _rules() -> RoutingRules:
    ctl = {"window_s": 1, "min_samples": 1000, "min_hold_s": 0, "share_step": 0.25, "probe_share": 0}

    def spec_home(name: str, t: float, limit: int) -> dict[str, Any]:
        return {
            "name": name,
            "when": {"temperature": {"lte": t}},
            "route": {"preferred": "spec", "saturated": "std", "saturation": {"max_inflight_per_endpoint": limit}},
        }

    return RoutingRules.model_validate(
        {
            "defaults": {"controller": ctl},
            "pools": POOLS,
            "classes": [
                spec_home("json", 0.1, 8),
                spec_home("mid", 0.6, 2),  # the strictest limit in the YAML, but nobody sends it this window
                {"name": "chat", "route": {"preferred": "std", "fallback": ["spec"]}},
            ],
        }
    )


def test_the_visitor_limit_is_the_lowest_of_the_home_classes_that_carry_traffic() -> None:
    r = _rules()
    assert visitor_limit(r, "spec") == 2  # every home class counted
    assert visitor_limit(r, "spec", lambda name: name != "mid") == 8  # "mid" carried nothing
    assert visitor_limit(r, "spec", lambda name: False) is None  # no home traffic to protect
    assert visitor_limit(r, "std") is None  # no class at home on std spills


def test_visitors_stop_at_the_limit_of_the_classes_carrying_traffic_not_the_strictest_in_the_yaml() -> None:
    rng = random.Random(3)
    rs = RoutingState(_rules, GatewayMetrics().registry, clock=lambda: 0.0)
    rs._classes["chat"].controller._share = 1.0  # chat's share drawn onto the speculative pool by load
    spec_busy = {"spec": PoolView("spec", "speculative", frozenset({"m"}), 1, 4), "std": PoolView("std", "standard",
                 frozenset({"m"}), 1, 0)}  # fmt: skip
    route = _rules().classes[2].route

    def chat_plan() -> str:
        choice = rs.choose("chat", rng, temperature=0.9)
        assert choice is not None
        assert choice.why == "spill"
        return plan_route(
            route, "m", spec_busy, pick=choice.pick, by_kind=dict(choice.pools), visitor_limit=choice.visitor_limit
        ).reason

    # before any round counted the traffic, the strictest limit holds (2 a server): 4 in flight is full
    assert chat_plan() == "controller:speculative:full"
    for _ in range(5):
        rs.choose("json", rng, temperature=0.0)
    rs.on_scrape_round(0.5, {"spec": view("spec"), "std": view("std")})
    # json carried traffic in the window, "mid" none: visitors stop at json's 8, so chat takes the room there
    assert chat_plan() == "controller:speculative"
    # once json's window is empty too, nothing at home there needs protecting
    rs.on_scrape_round(2.0, {"spec": view("spec"), "std": view("std")})
    assert rs._classes["chat"].visitor_limit is None
