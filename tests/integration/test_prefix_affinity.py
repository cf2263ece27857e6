"""Prefix affinity through the real gateway, in front of two fake vLLM servers per pool: a conversation stays on
the endpoint that holds its prefix while other conversations spread, and a prompt shared by many requests at once
spreads once the warm endpoint's load passes the bound."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from gateway.admin.explain import explain
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]


def system_prompt(i: int) -> str:
    return f"You are assistant number {i}. Follow the house style guide to the letter. " * 40  # ~3,000 characters


def start(fake: Fake, gateway: Gateway) -> ServerThread:
    spec = [fake(f"spec{i}") for i in range(2)]
    std = [fake(f"std{i}") for i in range(2)]
    # Scrapes far apart with a long timeout: on a loaded machine the in-process fakes can be slow to answer /health
    # while sixteen requests are held, and an endpoint marked down would turn these tests' answers into 503s.
    rules = rules_for([s.url for s in spec], [s.url for s in std], scrape={"interval_s": 30, "timeout_s": 10})
    gw = gateway(rules)
    gw.app.state.runtime.rng.seed(7)  # type: ignore[attr-defined]  # the cold picks: the same draws every run
    return gw


def test_a_conversation_sticks_to_its_endpoint_and_others_spread(fake: Fake, gateway: Gateway) -> None:
    gw = start(fake, gateway)
    first: list[str] = []
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for convo in range(10):
            messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(convo)}]
            where: list[str] = []
            for turn in range(4):
                messages.append({"role": "user", "content": f"question {turn} of conversation {convo}"})
                r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
                assert r.status_code == 200, r.text
                assert r.headers["x-specgate-pool"] == "std"
                where.append(r.headers["x-specgate-endpoint"])
                messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            assert len(set(where)) == 1, (convo, where)  # every turn on the endpoint holding the conversation
            first.append(where[0])
            if convo == 0:  # explain shows why the next turn goes there
                messages.append({"role": "user", "content": "and the next question"})
                d = explain(gw.app.state.runtime, "/v1/chat/completions", {"model": MODEL, "messages": messages}, {})  # type: ignore[attr-defined]
                std = d["prefix_affinity"]["pools"]["std"]
                assert (std["pick"], std["why"]) == (where[0], "warm")
                warm = {e["endpoint"]: e["warm_tokens"] for e in std["endpoints"]}
                assert warm[where[0]] > 700
                assert warm[({"std-0", "std-1"} - {where[0]}).pop()] == 0
        assert set(first) == {"std-0", "std-1"}  # new conversations go to either (least loaded, power of two)
        metrics = client.get("/metrics").text
    predicted = {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'specgate_prefix_predicted_hit_tokens_total\{endpoint="([^"]+)",pool="std"\} (\S+)', metrics
        )
    }
    # Turns 2-4 of each conversation were predicted warm: at least the system prompt each time.
    assert sum(predicted.values()) >= 10 * 3 * 700


def test_a_hot_shared_prefix_spreads_once_load_passes_the_bound(fake: Fake, gateway: Gateway) -> None:
    gw = start(fake, gateway)
    shared = system_prompt(99)

    def ask(i: int, hold_s: float) -> str:
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": shared}, {"role": "user", "content": f"q{i}"}],
        }
        headers = {"X-Fake-Behavior": f"first_token_delay={hold_s}"}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.headers["x-specgate-endpoint"]

    # One at a time, the shared prompt's warm endpoint is never busy: every request goes there.
    alone = [ask(i, 0) for i in range(8)]
    assert len(set(alone)) == 1, alone
    # Sixteen at once, each held upstream: the warm endpoint passes the bound (the idlest's load x 1.25 + 4) and the
    # others go to the other endpoint, which warms up in turn.
    with ThreadPoolExecutor(16) as pool:
        together = Counter(pool.map(lambda i: ask(100 + i, 3.0), range(16)))
    assert set(together) == {"std-0", "std-1"}, together
    assert min(together.values()) >= 3, together
