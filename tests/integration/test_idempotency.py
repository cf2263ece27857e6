"""Idempotency-Key end to end: real uvicorn, fake vLLM servers, the OpenAI SDK, two gateways on one redis-server."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, RedisServer, ServerThread, closed_port_url, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}


def posts(server: FakeUpstreamServer) -> int:
    return sum(1 for r in server.state.requests if r["method"] == "POST")


def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def one_pool(fake: Fake, gateway: Gateway, **fake_kw: Any) -> tuple[ServerThread, FakeUpstreamServer]:
    std = fake("std", **fake_kw)
    return gateway(rules_for([std.url], [std.url])), std


def test_replay_over_sockets_streaming_and_not(fake: Fake, gateway: Gateway) -> None:
    gw, std = one_pool(fake, gateway)
    url = gw.url + "/v1/chat/completions"
    first = httpx.post(url, json=CHAT, headers={"Idempotency-Key": "n-1"})
    again = httpx.post(url, json=CHAT, headers={"Idempotency-Key": "n-1"})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", url, json=body, headers={"Idempotency-Key": "s-1"}) as r:
        transcript = r.read()
    replay = httpx.post(url, json=body, headers={"Idempotency-Key": "s-1"})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["content-type"].startswith("text/event-stream")
    assert replay.content == transcript
    assert transcript.endswith(b"data: [DONE]\n\n")
    assert posts(std) == 2


def test_keyed_stream_outlives_a_client_disconnect_and_the_retry_gets_the_whole_answer(
    fake: Fake, gateway: Gateway
) -> None:
    gw, std = one_pool(fake, gateway, token_delay_s=0.03, tokens=30)
    url = gw.url + "/v1/chat/completions"
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", url, json=body, headers={"Idempotency-Key": "dc-1"}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break  # the client goes away mid-stream
    wait_for(lambda: std.state.stats()["completed"] == 1)
    assert std.state.stats()["aborted"] == 0
    retry = None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # 409 until the gateway has stored the answer
        retry = httpx.post(url, json=body, headers={"Idempotency-Key": "dc-1"})
        if retry.status_code != 409:
            break
        time.sleep(0.05)
    assert retry is not None
    assert retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content.endswith(b"data: [DONE]\n\n")
    assert b"tok30 " in retry.content
    assert b'"error"' not in retry.content
    assert posts(std) == 1

    # Without a key a disconnect still cancels the generation at once.
    with httpx.stream("POST", url, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    wait_for(lambda: std.state.stats()["aborted"] == 1)


def test_openai_sdk_sends_the_key_and_retries_409_into_a_replay(fake: Fake, gateway: Gateway) -> None:
    gw, std = one_pool(fake, gateway)
    key = str(uuid.uuid4())
    sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=5)
    headers = {"Idempotency-Key": key, "X-Fake-Behavior": "first_token_delay=1.0"}
    results: dict[str, Any] = {}

    def first() -> None:
        results["first"] = sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], extra_headers=headers)

    t = threading.Thread(target=first)
    t.start()
    wait_for(lambda: posts(std) == 1)  # the first one runs upstream
    # Same key while the first runs: 409, which the SDK retries (honouring Retry-After) until it is a replay.
    raw = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT["messages"], extra_headers={"Idempotency-Key": key}
    )
    t.join(10)
    assert raw.headers["idempotent-replayed"] == "true"
    assert raw.retries_taken >= 1
    assert raw.parse().id == results["first"].id
    assert posts(std) == 1

    with pytest.raises(openai.UnprocessableEntityError) as err:
        sdk.chat.completions.create(model=MODEL, messages=CHAT["messages"], n=2, extra_headers={"Idempotency-Key": key})
    assert err.value.code == "idempotency_key_mismatch"


def test_redis_unreachable_refuses_keyed_requests_or_proceeds_when_configured(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    dead_redis = closed_port_url().replace("http://", "redis://")
    refuse = gateway(rules_for([std.url], [std.url]), redis_url=dead_redis)
    r = httpx.post(refuse.url + "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "r-1"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "idempotency_store_unavailable"
    assert int(r.headers["retry-after"]) > 0
    assert httpx.post(refuse.url + "/v1/chat/completions", json=CHAT).status_code == 200
    proceed = gateway(
        rules_for([std.url], [std.url], idempotency={"store_unavailable": "proceed"}), redis_url=dead_redis
    )
    r = httpx.post(proceed.url + "/v1/chat/completions", json=CHAT, headers={"Idempotency-Key": "r-1"})
    assert r.status_code == 200
    assert posts(std) == 2


def test_two_gateways_sharing_redis_generate_a_keyed_request_once(
    fake: Fake, gateway: Gateway, redis_server: RedisServer
) -> None:
    std = fake("std", first_token_delay_s=0.5)
    rules = rules_for([std.url], [std.url])
    gws = [gateway(rules, redis_url=redis_server.url), gateway(rules, redis_url=redis_server.url)]
    body = {**CHAT, "stream": True}

    def send(i: int) -> httpx.Response:
        url = gws[i % 2].url + "/v1/chat/completions"
        return httpx.post(url, json=body, headers={"Idempotency-Key": "race-1"}, timeout=10)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    generated = [a for a in answers if a.status_code == 200 and "idempotent-replayed" not in a.headers]
    assert len(generated) == 1
    assert all(
        a.status_code == 409 or a.headers.get("idempotent-replayed") == "true" for a in answers if a not in generated
    )
    assert posts(std) == 1
    for gw in gws:  # once it completed, both replicas replay the same transcript
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"Idempotency-Key": "race-1"})
        assert r.headers["idempotent-replayed"] == "true"
        assert r.content == generated[0].content
    assert posts(std) == 1
