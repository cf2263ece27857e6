"""The warm home: a continuing conversation goes first to the other controller pool of its class while its prompt
prefix is longer there, unless that pool is full for visitors or spilling; pinned, forced, probed and cold requests
keep the class's plan."""

from __future__ import annotations

import random
from typing import Any

from gateway.config.affinity import PrefixAffinity
from gateway.config.schema import Route, RoutingRules
from gateway.fleet.pools import PoolState
from gateway.fleet.prefix_index import CHUNK_CHARS, chain_hashes
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.decision import decide
from gateway.routing.plan import PoolView, plan_route
from gateway.routing.prompt_key import continues
from gateway.routing.routing_state import RoutingState
from gateway.routing.warm_home import warm_home
from tests.unit.test_routing_both_ways import SPEC, STD

BY_KIND = {"speculative": "spec", "standard": "std"}


def views(spec_in_flight: int = 0, std_in_flight: int = 0) -> dict[str, PoolView]:
    return {
        "spec": PoolView("spec", "speculative", frozenset({"m"}), 2, spec_in_flight),
        "std": PoolView("std", "standard", frozenset({"m"}), 2, std_in_flight),
    }


CHAT = Route.model_validate({"preferred": "std", "fallback": ["spec"]})
TOOLS = Route.model_validate({"preferred": "spec", "saturated": "std", "saturation": {"max_inflight_per_endpoint": 8}})


def test_warm_on_the_other_pool_goes_there_first() -> None:
    p = plan_route(
        CHAT, "m", views(), pick="standard", by_kind=BY_KIND, warmth={"spec": 2048, "std": 0}, warm_eligible=True
    )
    assert (p.pools, p.reason) == (("spec", "std"), "warm:speculative")
    assert p.warm is not None
    assert p.warm.verdict == "won"
    assert p.warm.pool == "spec"


def test_cold_or_not_longer_keeps_the_draw() -> None:
    cold = plan_route(CHAT, "m", views(), pick="standard", by_kind=BY_KIND, warmth={}, warm_eligible=True)
    assert (cold.pools, cold.reason) == (("std", "spec"), "controller:standard")
    assert cold.warm is not None
    assert cold.warm.verdict == "cold"
    equal = plan_route(
        CHAT, "m", views(), pick="standard", by_kind=BY_KIND, warmth={"spec": 512, "std": 512}, warm_eligible=True
    )
    assert equal.reason == "controller:standard"
    assert equal.warm is not None
    assert equal.warm.verdict == "not_longer"


def test_a_new_conversation_goes_by_its_class() -> None:
    p = plan_route(CHAT, "m", views(), pick="standard", by_kind=BY_KIND, warmth={"spec": 2048}, warm_eligible=False)
    assert p.reason == "controller:standard"
    assert p.warm is not None
    assert p.warm.verdict == "not_eligible"


def test_a_warm_pool_full_for_visitors_sends_the_request_to_its_class_home() -> None:
    # std is the class's home; spec (away) holds 16 in flight on 2 endpoints = its visitor limit of 8
    p = plan_route(
        CHAT,
        "m",
        views(spec_in_flight=16),
        pick="standard",
        by_kind=BY_KIND,
        warmth={"spec": 2048},
        warm_eligible=True,
        away_limit=8,
    )
    assert (p.pools, p.reason) == (("std", "spec"), "controller:standard")
    assert p.warm is not None
    assert p.warm.verdict == "full"
    below = plan_route(
        CHAT,
        "m",
        views(spec_in_flight=15),
        pick="standard",
        by_kind=BY_KIND,
        warmth={"spec": 2048},
        warm_eligible=True,
        away_limit=8,
    )
    assert below.reason == "warm:speculative"


def test_a_saturated_warm_home_spills_as_any_request_at_home() -> None:
    # the class's home spec is warm, the controller drew std (a spill share); spec is over its limit, std idle
    hot = plan_route(
        TOOLS,
        "m",
        views(spec_in_flight=16),
        pick="standard",
        split=True,
        by_kind=BY_KIND,
        warmth={"spec": 4096},
        warm_eligible=True,
    )
    assert (hot.pools[0], hot.reason) == ("std", "controller:split:standard")
    assert hot.warm is not None
    assert hot.warm.verdict == "saturated"
    room = plan_route(
        TOOLS,
        "m",
        views(spec_in_flight=4),
        pick="standard",
        split=True,
        by_kind=BY_KIND,
        warmth={"spec": 4096},
        warm_eligible=True,
    )
    assert (room.pools, room.reason) == (("spec", "std"), "warm:speculative")


def test_forced_probe_guard_and_no_controller_are_unaffected() -> None:
    warmth = {"spec": 4096}
    forced = plan_route(CHAT, "m", views(), pick="standard", forced=True, by_kind=BY_KIND, warmth=warmth)
    assert forced.reason == "forced:standard"
    stale = plan_route(
        CHAT, "m", views(), pick="standard", by_kind=BY_KIND, why="stale", warmth=warmth, warm_eligible=True
    )
    assert stale.reason == "warm:speculative"  # the safe state holds the class, not the conversation
    for why in ("guard",):
        p = plan_route(CHAT, "m", views(), pick="standard", by_kind=BY_KIND, why=why, warmth=warmth, warm_eligible=True)
        assert p.reason == f"controller:{why}:standard"
        assert p.warm is not None
        assert p.warm.verdict == "not_eligible"
    probe = plan_route(
        TOOLS, "m", views(), pick="speculative", by_kind=BY_KIND, probe=True, warmth={"std": 4096}, warm_eligible=True
    )
    assert probe.reason == "controller:probe:speculative"
    plain = plan_route(CHAT, "m", views(), warmth=warmth, warm_eligible=True)
    assert (plain.pools, plain.reason, plain.warm) == (("std", "spec"), "preferred", None)


def test_warm_home_verdicts_directly() -> None:
    v = views()
    assert warm_home(CHAT, "std", "spec", {"spec": 300}, v, eligible=True, away_limit=None).won
    assert not warm_home(CHAT, "std", "spec", {"spec": 300, "std": 900}, v, eligible=True, away_limit=None).won


# -- through the decision: the pools' indexes give the warmth, a pinned class is never moved ------------------


def _rules(pin: str | None = None) -> RoutingRules:
    chat: dict[str, Any] = {"preferred": "std", "fallback": ["spec"]}
    if pin is not None:
        chat["pin"] = pin
    doc = {
        "pools": [SPEC, STD],
        "classes": [
            {
                "name": "tools",
                "when": {"temperature": {"lte": 0.1}},
                "route": {"preferred": "spec", "fallback": ["std"]},
            },
            {"name": "chat", "route": chat},
        ],
    }
    return RoutingRules.model_validate(doc)


class _Live:
    def __init__(self, rules: RoutingRules) -> None:
        from gateway.routing.classify import Classifier

        self.rules = rules
        self.pools = {p.name: PoolState.from_spec(p, PrefixAffinity(min_prefix_tokens=64)) for p in rules.pools}
        self.classifier = Classifier(rules)
        self.model_set = frozenset(m for p in rules.pools for m in p.models)

    def views(self) -> dict[str, PoolView]:
        return {n: PoolView(n, p.spec.kind, p.models, len(p.routable()), p.in_flight) for n, p in self.pools.items()}


def _turn(model: str, temperature: float, answered: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "tell me about the ledger " * 40}]
    if answered:
        messages += [{"role": "assistant", "content": "the ledger is " * 30}, {"role": "user", "content": "and?"}]
    return {"model": model, "temperature": temperature, "messages": messages}


def test_decide_sends_a_warm_conversation_home_and_a_pinned_class_stays() -> None:
    for pin, expect in ((None, "warm:speculative"), ("standard", "preferred")):
        rules = _rules(pin)
        live = _Live(rules)
        model = next(iter(live.model_set))
        rs = RoutingState(lambda r=rules: r, GatewayMetrics().registry, clock=lambda: 0.0)
        first = decide(live, rs, "chat", _turn(model, 0.0, False), None, random.Random(1))
        assert first.traffic_class == "tools"
        assert first.prompt
        for ep in live.pools["spec"].endpoints:  # the first turn went to the speculative pool
            ep.prefixes.record(first.prompt)
        later = decide(live, rs, "chat", _turn(model, 0.8, True), None, random.Random(1))
        assert later.traffic_class == "chat"
        if pin is None:
            assert later.warmth is not None
            assert later.warmth["spec"] > 0
            assert later.warmth["std"] == 0
        assert later.plan.reason == expect, (pin, later.plan)
        assert later.plan.pools[0] == ("spec" if pin is None else "std")
        # the same first message again at temperature 0.8 (a new conversation of the chat class): by its class,
        # although its prefix is warm on the speculative pool
        fresh = decide(live, rs, "chat", _turn(model, 0.8, False), None, random.Random(1))
        assert fresh.plan.pools[0] == "std"
        assert fresh.plan.reason == ("controller:standard" if pin is None else "preferred")


def test_continues() -> None:
    assert not continues("chat", {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]})
    assert continues("chat", {"messages": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "z"}]})
    assert continues("responses", {"input": [{"role": "user", "content": "a"}, {"type": "function_call_output"}]})
    assert not continues("responses", {"input": "hello"})
    assert continues("responses", {"input": "hello", "previous_response_id": "resp_1"})
    assert not continues("completions", {"prompt": "x" * CHUNK_CHARS * 4})
    assert chain_hashes("x" * CHUNK_CHARS * 4)
