"""The warm home through the real gateway, one endpoint per pool, class controllers on: a conversation whose class
changes between turns (a tool call at temperature 0, then chat at 0.8) stays on the pool it started on while its
prefix is warm there; a new conversation of the second class goes to its class's home."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from gateway.admin.explain import explain
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def _rules(spec: str, std: str) -> dict[str, Any]:
    rules = rules_for([spec], [std])
    # every class gets a controller; no probes: each request here goes where its class and warmth send it
    rules["defaults"]["controller"] = {"probe_share": 0}
    rules["classes"] = [
        {"name": "tools", "when": {"temperature": {"lte": 0.1}}, "route": {"preferred": "spec", "fallback": ["std"]}},
        {"name": "chat", "route": {"preferred": "std", "fallback": ["spec"]}},
    ]
    return rules


def system_prompt(i: int) -> str:
    return f"You are agent {i}. Use the tools for every lookup and cite the ledger line you read. " * 30


def test_a_conversation_that_changes_class_stays_on_its_warm_pool(fake: Fake, gateway: Gateway) -> None:
    spec, std = fake("spec"), fake("std")
    gw = gateway(_rules(spec.url, std.url))
    rt = gw.app.state.runtime  # type: ignore[attr-defined]
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt(1)},
            {"role": "user", "content": "What does line 12 of the ledger say?"},
        ]
        r = client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        assert (r.headers["x-specgate-class"], r.headers["x-specgate-pool"]) == ("tools", "spec")
        assert r.headers["x-specgate-route"] == "controller:speculative"
        where = []
        for turn in range(3):  # chat turns at 0.8: the class's home is std, the conversation is warm on spec
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or "ok"})
            messages.append({"role": "user", "content": f"Explain that in plain words, part {turn}."})
            body = {"model": MODEL, "messages": messages, "tools": TOOLS, "temperature": 0.8}
            if turn == 0:  # explain says why before the request goes
                d = explain(rt, "/v1/chat/completions", body, {})
                assert d["warm_home"]["verdict"] == "won", d["warm_home"]
                assert d["warm_home"]["pool"] == "spec"
                assert d["warm_home"]["warmth"]["spec"] >= 512
                assert d["warm_home"]["warmth"]["std"] == 0
                assert d["plan"]["reason"] == "warm:speculative"
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-specgate-class"] == "chat"
            where.append((r.headers["x-specgate-pool"], r.headers["x-specgate-route"]))
        assert where == [("spec", "warm:speculative")] * 3, where

        # a new conversation of the chat class goes to its class home, whatever is warm where
        fresh = [
            {"role": "system", "content": system_prompt(1)},
            {"role": "user", "content": "What does line 12 of the ledger say?"},
        ]
        r = client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": fresh, "tools": TOOLS, "temperature": 0.8}
        )
        assert r.status_code == 200, r.text
        assert (r.headers["x-specgate-class"], r.headers["x-specgate-pool"]) == ("chat", "std")
        assert r.headers["x-specgate-route"].startswith("controller:")
        metrics = client.get("/metrics").text
    assert 'specgate_route_decisions_total{class="chat",route="warm:speculative"} 3.0' in metrics
