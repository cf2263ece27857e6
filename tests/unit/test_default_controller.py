"""The built-in default controller: a YAML without a ``defaults.controller`` key gives every unpinned class that has
pools of both kinds ``balancing_controller()`` (``safe_state: home``: its static route while measurements are
missing); ``defaults: {controller: null}`` opts out; a YAML with one kind of pool gets none and no error."""

from __future__ import annotations

import random
from typing import Any

import pytest
import yaml

from gateway.config.controller import ControllerConfig, balancing_controller
from gateway.config.loader import RulesError, load_rules_text
from gateway.config.schema import RoutingRules
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.routing_state import RoutingState
from tests.unit.test_routing_both_ways import SPEC, STD

STD2 = {"name": "std2", "kind": "standard", "models": ["m"], "endpoints": [{"url": "http://std2:8000"}]}
OMIT: Any = object()  # no defaults.controller key at all
CLASSES = [
    {"name": "json", "when": {"temperature": {"lte": 0.5}}, "route": {"preferred": "spec", "fallback": ["std"]}},
    {"name": "pinned", "when": {"temperature": {"lte": 0.7}}, "route": {"preferred": "std", "pin": "standard"}},
    {"name": "chat", "route": {"preferred": "std", "fallback": ["spec"]}},
]


def yaml_text(
    *, defaults_ctl: Any = OMIT, pools: list[dict[str, Any]] | None = None, classes: list[dict[str, Any]] | None = None
) -> str:
    doc: dict[str, Any] = {"version": 1}
    if defaults_ctl is not OMIT:
        doc["defaults"] = {"controller": defaults_ctl}
    doc["pools"] = [SPEC, STD] if pools is None else pools
    doc["classes"] = CLASSES if classes is None else classes
    return yaml.safe_dump(doc, sort_keys=False)


def load(**kw: Any) -> RoutingRules:
    """Through the loader, so the cross-field checks (gateway.config.checks) run too."""
    return load_rules_text(yaml_text(**kw))


def controllers(r: RoutingRules) -> dict[str, ControllerConfig | None]:
    return {cls.name: r.controller_of(cls) for cls in r.classes}


def state(r: RoutingRules) -> RoutingState:
    return RoutingState(lambda: r, GatewayMetrics().registry, clock=lambda: 0.0)


def stale(pool: str) -> PoolLoadView:
    return PoolLoadView(pool, 1, 0, None, None, None, None, None, None)


def test_balancing_controller_is_the_estimate_alone_with_home_as_safe_state() -> None:
    cfg = balancing_controller()
    assert (cfg.acceptance_weight, cfg.safe_state, cfg.balance_margin) == (0.0, "home", 1.05)
    assert cfg == ControllerConfig(acceptance_weight=0, safe_state="home", balance_margin=1.05)
    assert balancing_controller() is not balancing_controller()  # a fresh one each time: no shared mutable default


def test_without_a_defaults_controller_key_every_unpinned_two_kind_class_gets_the_balancing_controller() -> None:
    for text in (yaml_text(), yaml_text().replace("version: 1\n", "version: 1\ndefaults: {temperature: 1.0}\n")):
        r = load_rules_text(text)
        assert "controller" not in r.defaults.model_fields_set
        assert r.defaults.controller == balancing_controller()
        ctl = controllers(r)
        assert ctl["json"] == balancing_controller()
        assert ctl["chat"] == balancing_controller()
        rs = state(r)
        assert rs.state_of("json") == "speculative"  # each at its home
        assert rs.state_of("chat") == "standard"
        snap = rs.snapshot()
        assert (snap["chat"]["speculative_pool"], snap["chat"]["standard_pool"]) == ("spec", "std")
        assert (snap["json"]["speculative_pool"], snap["json"]["standard_pool"]) == ("spec", "std")


def test_a_class_block_still_beats_the_built_in_default() -> None:
    own = {"window_s": 5, "safe_state": "standard"}
    classes = [CLASSES[0], CLASSES[1], {**CLASSES[2], "controller": own}]
    ctl = controllers(load(classes=classes))
    assert ctl["chat"] == ControllerConfig(**own)
    assert ctl["json"] == balancing_controller()


def test_defaults_controller_null_gives_no_class_a_controller() -> None:
    r = load(defaults_ctl=None)
    assert r.defaults.controller is None
    assert controllers(r) == {"json": None, "pinned": None, "chat": None}
    rs = state(r)
    assert [rs.state_of(c) for c in ("json", "pinned", "chat")] == [None, None, None]
    assert rs.choose("chat", random.Random(1)) is None
    assert rs.snapshot() == {}


def test_a_homogeneous_yaml_validates_and_its_classes_have_no_controller() -> None:
    classes = [
        {"name": "json", "when": {"temperature": {"lte": 0.5}}, "route": {"preferred": "std", "fallback": ["std2"]}},
        {"name": "chat", "route": {"preferred": "std2"}},
    ]
    r = load(pools=[STD, STD2], classes=classes)  # no RulesError: nothing to balance, nothing to complain about
    assert all(r.controller_pools(cls) is None for cls in r.classes)
    rs = state(r)
    assert rs.state_of("json") is None
    assert rs.state_of("chat") is None
    assert rs.choose("chat", random.Random(1)) is None
    assert rs.snapshot() == {}
    assert rs.on_scrape_round(1.0, {"std": stale("std"), "std2": stale("std2")}) == []


def test_a_homogeneous_yaml_with_an_explicit_defaults_controller_is_still_an_error() -> None:
    classes = [{"name": "chat", "route": {"preferred": "std"}}]
    with pytest.raises(RulesError) as info:
        load(defaults_ctl={}, pools=[STD, STD2], classes=classes)
    assert any("a class with a controller needs a pool of the other kind" in str(i) for i in info.value.issues)


def test_with_missing_or_stale_measurements_the_implicit_controller_keeps_each_class_at_home() -> None:
    rs = state(load())
    rng = random.Random(1)
    for now, views in ((1.0, {}), (2.0, {"spec": stale("spec"), "std": stale("std")})):
        rs.choose("json", rng)
        rs.choose("chat", rng)
        assert rs.on_scrape_round(now, views) == []  # no transition: safe_state home is where they are
        assert rs.state_of("json") == "speculative"
        assert rs.state_of("chat") == "standard"
    for name, kind in (("json", "speculative"), ("chat", "standard")):
        picks = {c.pick for c in (rs.choose(name, rng) for _ in range(200)) if c is not None}
        assert picks == {kind}
    json_choice, chat_choice = rs.choose("json", rng), rs.choose("chat", rng)
    assert json_choice is not None
    assert chat_choice is not None
    assert (json_choice.why, chat_choice.why) == ("home", "home")


def test_a_class_that_spilled_goes_back_home_when_the_measurements_go_stale() -> None:
    rs = state(load())
    rng = random.Random(1)
    busy = {
        "spec": PoolLoadView("spec", 1, 1, 4.0, 20.0, None, None, 0.01, None),
        "std": PoolLoadView("std", 1, 1, 1.0, 0.0, None, None, 0.01, None),
    }
    for _ in range(30):  # min_samples 20 of the built-in controller
        rs.choose("json", rng)
    (spill,) = rs.on_scrape_round(100.0, busy)
    assert (spill.class_name, spill.to_state, spill.reason) == ("json", "split", "load")
    (back,) = rs.on_scrape_round(200.0, {})
    assert (back.from_state, back.to_state, back.reason) == ("split", "speculative", "stale")
    choice = rs.choose("json", rng)
    assert choice is not None
    assert (choice.pick, choice.why) == ("speculative", "stale")


def test_an_explicit_safe_state_standard_block_still_goes_to_standard_when_stale() -> None:
    classes = [{**CLASSES[0], "controller": {"safe_state": "standard"}}, CLASSES[1], CLASSES[2]]
    rs = state(load(classes=classes))
    assert rs.state_of("json") == "speculative"
    transitions = rs.on_scrape_round(1.0, {})
    assert [(t.class_name, t.from_state, t.to_state, t.reason) for t in transitions] == [
        ("json", "speculative", "standard", "stale")
    ]
    assert rs.state_of("json") == "standard"
    choice = rs.choose("json", random.Random(1))
    assert choice is not None
    assert (choice.pick, choice.why) == ("standard", "stale")
    assert rs.state_of("chat") == "standard"  # the implicit one next to it stays home


def test_an_explicit_defaults_controller_with_safe_state_home_keeps_a_speculative_home() -> None:
    rs = state(load(defaults_ctl={"safe_state": "home"}))
    assert rs.on_scrape_round(1.0, {}) == []
    assert (rs.state_of("json"), rs.state_of("chat")) == ("speculative", "standard")


def test_a_pinned_class_gets_no_controller_under_the_built_in_default() -> None:
    r = load()
    assert controllers(r)["pinned"] is None
    rs = state(r)
    assert rs.state_of("pinned") is None
    assert rs.choose("pinned", random.Random(1)) is None
    assert "pinned" not in rs.snapshot()
