"""Routing both ways (gateway.routing.routing_state, plan, decision): every class with a controller compares its own
expected completion time on its two candidate pools; standard-home classes spill onto the speculative pool; probes;
pins; ``defaults.controller``."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.config.loader import RulesError, load_rules_text
from gateway.config.schema import Route, RoutingRules
from gateway.fleet.vllm_metrics import Acceptance, PoolLoadView
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.plan import PoolView, plan_route
from gateway.routing.routing_state import ProbeChange, RoutingState

SPEC = {
    "name": "spec",
    "kind": "speculative",
    "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
    "models": ["m"],
    "endpoints": [{"url": "http://spec:8000"}],
}
STD = {"name": "std", "kind": "standard", "models": ["m"], "endpoints": [{"url": "http://std:8000"}]}
CTL = {"window_s": 1, "min_samples": 1, "min_hold_s": 0, "share_step": 0.5, "acceptance_weight": 0}


OMIT: Any = object()  # defaults.controller left out: the built-in balancing controller


def rules(*, defaults_ctl: dict[str, Any] | None = OMIT, chat: dict[str, Any] | None = None) -> RoutingRules:
    defaults: dict[str, Any] = {} if defaults_ctl is OMIT else {"controller": defaults_ctl}
    return RoutingRules.model_validate(
        {
            "defaults": defaults,
            "pools": [SPEC, STD],
            "classes": [
                {"name": "json", "when": {"temperature": {"lte": 0.5}}, "route": {"preferred": "spec"}},
                {"name": "chat", **(chat or {"route": {"preferred": "std"}})},
            ],
        }
    )


def view(
    pool: str, *, running: float = 1, waiting: float = 0, tpot: float | None = 0.02, rate: float | None = None
) -> PoolLoadView:
    acc = None if rate is None else Acceptance(rate, 1 + 4 * rate, (), 100.0)
    return PoolLoadView(pool, 1, 1, running, waiting, None, acc, tpot, None)


def state(r: RoutingRules, **kw: Any) -> tuple[RoutingState, GatewayMetrics]:
    m = GatewayMetrics()
    return RoutingState(lambda: r, m.registry, clock=lambda: 0.0, **kw), m


# -- defaults.controller and candidates -----------------------------------------------------------------------


def test_defaults_controller_gives_every_unpinned_class_a_controller_at_its_home() -> None:
    rs, _ = state(rules(defaults_ctl=CTL))
    assert rs.state_of("json") == "speculative"
    assert rs.state_of("chat") == "standard"
    snap = rs.snapshot()["chat"]
    assert (snap["home"], snap["speculative_pool"], snap["standard_pool"]) == ("standard", "spec", "std")
    # with defaults.controller: null a class without a block keeps its static route
    assert state(rules(defaults_ctl=None))[0].state_of("chat") is None


def test_a_pinned_class_gets_no_controller_and_its_plans_stay_on_its_pin() -> None:
    pinned = {"route": {"preferred": "std", "fallback": [], "pin": "standard"}}
    r = rules(defaults_ctl=CTL, chat=pinned)
    rs, _ = state(r)
    assert rs.state_of("chat") is None
    pools = {
        "spec": PoolView("spec", "speculative", frozenset({"m"}), 1, 0),
        "std": PoolView("std", "standard", frozenset({"m"}), 0, 0),
    }
    plan = plan_route(r.classes[1].route, "m", pools, pick="speculative", forced=True)
    assert plan.pools == ()  # its pool is down: nothing, rather than the other kind


def test_the_loader_checks_pins_and_candidates() -> None:
    base = """
pools:
  - {name: spec, kind: speculative, speculative: {method: eagle3, num_speculative_tokens: 4}, models: [m],
     endpoints: [{url: "http://spec:8000"}]}
  - {name: std, kind: standard, models: [m], endpoints: [{url: "http://std:8000"}]}
classes:
  - name: chat
    when: {temperature: {gt: 0.5}}
    route: {preferred: std, fallback: [spec], pin: standard}
    controller: {}
  - {name: rest, route: {preferred: std}}
"""
    with pytest.raises(RulesError) as info:
        load_rules_text(base)
    messages = [str(i) for i in info.value.issues]
    assert any("classes[0].controller: a class pinned to standard pools" in m for m in messages)
    assert any(
        'classes[0].route.pin: the class is pinned to standard pools but its route names "spec"' in m for m in messages
    )
    ok = load_rules_text(
        base.replace(", fallback: [spec], pin: standard", ", pin: standard").replace("    controller: {}\n", "")
    )
    assert ok.classes[0].route.pin == "standard"


# -- the expected completion time of the class -----------------------------------------------------------------


def test_the_speculative_estimate_uses_the_class_acceptance_not_the_pools() -> None:
    r = rules(defaults_ctl=CTL)
    rs, m = state(r)
    views = {"spec": view("spec", tpot=0.01, rate=0.75), "std": view("std", tpot=0.02)}
    rs.on_scrape_round(0.5, views)  # the window's base
    # the pool's TPOT was measured at acceptance 0.75 (4 tokens a step); this class drafts at 0.25 (2 a step)
    m.class_draft_tokens.labels("chat").inc(400)
    m.class_accepted_tokens.labels("chat").inc(100)
    rs.choose("chat", random.Random(1))
    rs.on_scrape_round(1.0, views)
    est = rs.snapshot()["chat"]["estimates"]
    assert est["spec"]["class_tpot_s"] == pytest.approx(0.01 * 4 / 2)
    assert (est["spec"]["acceptance"], est["spec"]["acceptance_source"]) == (pytest.approx(0.25), "measured")
    assert est["spec"]["expected_s"] == pytest.approx(0.01 + 256 * 0.02)
    assert est["std"]["expected_s"] == pytest.approx(0.02 + 256 * 0.02)
    # equal expected times: the standard-home class stays home
    assert rs.state_of("chat") == "standard"


def test_a_standard_home_class_spills_onto_an_idle_speculative_pool_that_is_faster_for_it() -> None:
    rs, _ = state(rules(defaults_ctl=CTL))
    rng = random.Random(2)
    fast = {"spec": view("spec", tpot=0.012, rate=0.5), "std": view("std", running=6, tpot=0.03)}
    for t in (1.0, 2.0, 3.0):
        rs.choose("chat", rng)
        rs.on_scrape_round(t, fast)
    snap = rs.snapshot()["chat"]
    assert snap["share"] == 1.0
    assert snap["last_reason"] == "load"
    assert snap["estimates"]["spec"]["acceptance_source"] == "prior"  # T 1.0 (the catch-all): prior of its band
    choice = rs.choose("chat", rng)
    assert choice is not None
    assert (choice.pick, choice.why) == ("speculative", "spill")


def test_the_prior_comes_from_the_temperature_band_unless_the_yaml_sets_one() -> None:
    rs, _ = state(rules(defaults_ctl=CTL))
    json_prior, chat_prior = rs.snapshot()["json"]["prior_acceptance"], rs.snapshot()["chat"]["prior_acceptance"]
    assert json_prior > chat_prior > 0  # T <= 0.5 (middle 0.25) accepts more than T 1.0
    rs2, _ = state(rules(defaults_ctl={**CTL, "prior_acceptance": 0.6}))
    assert rs2.snapshot()["chat"]["prior_acceptance"] == 0.6


# -- probes ------------------------------------------------------------------------------------------------------


def test_probes_are_capped_counted_and_audited() -> None:
    changes: list[ProbeChange] = []
    rs, m = state(rules(defaults_ctl={**CTL, "probe_share": 0.05}), on_probe=changes.append)
    rng = random.Random(3)
    even = {"spec": view("spec", tpot=0.02, rate=0.5), "std": view("std", tpot=0.02)}  # no gain: stays home
    rs.choose("chat", rng)
    rs.on_scrape_round(1.0, even)
    assert rs.state_of("chat") == "standard"
    assert [(c.class_name, c.share) for c in changes] == [("chat", 0.05)]
    picks = Counter(c.why for c in (rs.choose("chat", rng) for _ in range(4000)) if c is not None)
    assert 0 < picks["probe"] < 4000 * 0.05 * 1.5
    assert picks["probe"] + picks["home"] == 4000
    probes = m.registry.get_sample_value("specgate_controller_probes_total", {"class": "chat"})
    assert probes == picks["probe"]
    assert m.registry.get_sample_value("specgate_class_probe_share", {"class": "chat"}) == 0.05
    assert rs.snapshot()["chat"]["probe_share"] == 0.05
    # the class's acceptance is measured: probing stops (audited too)
    m.class_draft_tokens.labels("chat").inc(100)
    m.class_accepted_tokens.labels("chat").inc(30)
    rs.on_scrape_round(2.0, even)
    assert [c.share for c in changes] == [0.05, 0.0]
    assert all(c is not None and c.why != "probe" for c in (rs.choose("chat", rng) for _ in range(500)))


def test_explain_does_not_count_a_probe() -> None:
    rs, m = state(rules(defaults_ctl={**CTL, "probe_share": 0.05}))
    rs.choose("chat", random.Random(0))
    rs.on_scrape_round(1.0, {"spec": view("spec", rate=0.5), "std": view("std")})
    rng = random.Random(4)
    for _ in range(400):
        rs.choose("chat", rng, count=False)
    assert m.registry.get_sample_value("specgate_controller_probes_total", {"class": "chat"}) is None


# -- pins: a property ---------------------------------------------------------------------------------------------

KINDS = ("speculative", "standard")
pool_views = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 2), st.integers(0, 200)), min_size=4, max_size=4
).map(
    lambda ps: {
        f"p{i}": PoolView(f"p{i}", kind, frozenset({"m"}), routable, in_flight)
        for i, (kind, routable, in_flight) in enumerate(ps)
    }
)


@settings(max_examples=300, deadline=None)
@given(
    views=pool_views,
    pin=st.sampled_from(KINDS),
    pick=st.sampled_from((None, *KINDS)),
    forced=st.booleans(),
    split=st.booleans(),
    probe=st.booleans(),
    limit=st.one_of(st.none(), st.integers(1, 50)),
)
def test_a_pinned_class_is_never_planned_off_its_pin(
    views: dict[str, PoolView], pin: str, pick: str | None, forced: bool, split: bool, probe: bool, limit: int | None
) -> None:
    """Whatever the controller, an on-call force, a probe or the saturation rule say, and whatever the route names
    (the loader refuses a mismatched route, the plan does not rely on it)."""
    route = Route.model_validate(
        {
            "preferred": "p0",
            "saturated": "p1",
            "fallback": ["p2", "p3"],
            "pin": pin,
            "saturation": {"max_inflight_per_endpoint": limit},
        }
    )
    candidates = {k: n for n, v in views.items() for k in (v.kind,)}
    plan = plan_route(route, "m", views, pick=pick, forced=forced, split=split, probe=probe, by_kind=candidates)
    assert all(views[name].kind == pin for name in plan.pools)
