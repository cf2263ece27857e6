"""Keyed requests (Idempotency-Key) against a real uvicorn gateway: large answers are not kept whole, and clients
cannot leave any number of generations running by hanging up."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, poll, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}


def posts(server: FakeUpstreamServer) -> list[dict[str, Any]]:
    return [r for r in server.state.requests if r["method"] == "POST"]


def metric(gw: ServerThread, name: str) -> float:
    for line in httpx.get(gw.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    return poll(cond, timeout_s)


def test_an_answer_too_large_to_keep_leaves_the_key_used_and_its_replay_says_so(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url], idempotency={"max_response_bytes": 2048}))
    headers = {"Idempotency-Key": "big-1", "X-Fake-Behavior": "tokens=2000"}
    first = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert first.status_code == 200
    assert len(first.content) > 2048  # the client got its whole answer once
    again = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert again.status_code == 410
    assert again.headers["idempotent-replayed"] == "true"
    err = again.json()["error"]
    assert err["code"] == "idempotency_response_not_stored"
    assert "not generated again" in err["message"]
    assert len(posts(std)) == 1  # never a second generation
    assert metric(gw, 'specgate_idempotency_total{result="too_large"}') == 1
    small = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "small-1"})
    replay = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "small-1"})
    assert replay.status_code == 200
    assert replay.content == small.content


def start_and_hang_up(gw: ServerThread, key: str, token: str) -> None:
    """A keyed stream: read its first bytes, then close the connection."""
    headers = {"Idempotency-Key": key, "Authorization": f"Bearer {token}", "X-Fake-Behavior": "tokens=60"}
    with (
        httpx.Client(timeout=10) as client,
        client.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers) as r,
    ):
        assert r.status_code == 200
        next(r.iter_raw())


def test_detached_keyed_generations_are_capped_per_client_and_in_total(fake: Fake, gateway: Gateway) -> None:
    std = fake("std", token_delay_s=0.05)  # 60 tokens: 3 s each
    gw = gateway(rules_for([std.url], [std.url]), max_detached=2, max_detached_per_client=1)
    start_and_hang_up(gw, "a-1", "client-a")  # detached (a: 1, total 1)
    start_and_hang_up(gw, "a-2", "client-a")  # past a's cap: cancelled
    start_and_hang_up(gw, "b-1", "client-b")  # detached (total 2)
    start_and_hang_up(gw, "c-1", "client-c")  # past the total: cancelled
    name = 'specgate_limit_refusals_total{limit="detached"}'
    assert wait_until(lambda: metric(gw, name) == 2), metric(gw, name)
    assert wait_until(lambda: std.state.aborted == 2), std.state.aborted  # the two cut were cancelled upstream
    runtime: Any = gw.app.state.runtime  # type: ignore[attr-defined]
    assert runtime.detached.running == 2
    # The detached two run to their end, are stored, and free the budget.
    assert wait_until(lambda: runtime.detached.running == 0, timeout_s=15)
    assert std.state.completed >= 2
    replay = httpx.post(
        gw.url + "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"Idempotency-Key": "a-1", "Authorization": "Bearer client-a", "X-Fake-Behavior": "tokens=60"},
    )
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content.rstrip().endswith(b"data: [DONE]")
