"""The gateway on a real socket in front of fake vLLM servers: routing, streaming, errors, disconnects."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, SPEC_ONLY_MODEL, ServerThread, closed_port_url, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

CODE_REQ: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0.1,
    "messages": [{"role": "user", "content": "write a python function that adds two numbers"}],
}
CHAT_REQ: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}


def posts(server: FakeUpstreamServer) -> list[dict[str, Any]]:
    """What the upstream received, health checks left out."""
    return [r for r in server.state.requests if r["method"] == "POST"]


def sse_events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


@pytest.fixture
def two_pools(fake: Fake, gateway: Gateway) -> tuple[ServerThread, FakeUpstreamServer, FakeUpstreamServer]:
    spec, std = fake("spec"), fake("std")
    return gateway(rules_for([spec.url], [std.url])), spec, std


def test_classes_reach_their_pools_with_the_decision_visible(two_pools: Any) -> None:
    gw, spec, _std = two_pools
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ, headers={"X-Request-Id": "req-42"})
    assert r.status_code == 200, r.text
    assert r.json()["system_fingerprint"] == "fake-spec"
    assert r.headers["x-specgate-class"] == "precise"
    assert r.headers["x-specgate-pool"] == "spec"
    assert r.headers["x-specgate-task-type"] == "code"
    assert r.headers["x-request-id"] == "req-42"
    assert r.headers["x-specgate-attempts"] == "1"
    assert posts(spec)[-1]["headers"]["x-request-id"] == "req-42"

    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT_REQ)  # no temperature = 1.0 → standard
    assert r.status_code == 200
    assert r.json()["system_fingerprint"] == "fake-std"
    assert r.headers["x-specgate-class"] == "default"
    assert len(r.headers["x-request-id"]) == 32


def test_unknown_fields_pass_through_untouched(two_pools: Any) -> None:
    gw, _, std = two_pools
    body = {**CHAT_REQ, "top_k": 40, "min_p": 0.05, "structured_outputs": {"regex": "[a-z]+"}, "priority": -3}
    r = httpx.post(gw.url + "/v1/chat/completions", content=orjson.dumps(body))
    assert r.status_code == 200
    assert posts(std)[-1]["body"] == body


def test_completions_endpoint(two_pools: Any) -> None:
    gw, _, _ = two_pools
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "def add(", "temperature": 0})
    assert r.status_code == 200
    assert r.json()["object"] == "text_completion"
    assert r.headers["x-specgate-pool"] == "spec"


def test_first_chunk_arrives_before_the_upstream_finishes(fake: Fake, gateway: Gateway) -> None:
    std = fake("std", token_delay_s=0.15, tokens=12)
    gw = gateway(rules_for([std.url], [std.url.replace("127.0.0.1", "localhost")]))
    t0 = time.perf_counter()
    arrivals: list[float] = []
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT_REQ, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.perf_counter() - t0)
    total = arrivals[-1]
    assert total > 12 * 0.15 * 0.9
    # The role chunk and the first token come long before the end, and tokens trickle in one by one.
    assert arrivals[1] < total / 3
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:13])]
    assert sum(1 for g in gaps if g > 0.05) >= 8


def test_stream_passes_events_and_usage_chunk_through(two_pools: Any) -> None:
    gw, _, _ = two_pools
    body = {**CHAT_REQ, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 5}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body)
    events = sse_events(r.content)
    assert events[-1] == b"data: [DONE]"
    usage_chunk = orjson.loads(events[-2][6:])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 5


def test_client_disconnect_cancels_the_upstream(fake: Fake, gateway: Gateway) -> None:
    std = fake("std", token_delay_s=0.1, tokens=200)
    gw = gateway(rules_for([std.url], [std.url.replace("127.0.0.1", "localhost")]))
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT_REQ, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data:"):
                seen += 1
            if seen == 3:
                break
    deadline = time.monotonic() + 2.0
    while std.state.stats()["aborted"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert std.state.stats()["aborted"] == 1
    assert std.state.stats()["completed"] == 0


def test_client_disconnect_before_the_first_token_cancels_the_upstream(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url.replace("127.0.0.1", "localhost")]))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            gw.url + "/v1/chat/completions",
            json=CHAT_REQ,
            headers={"X-Fake-Behavior": "first_token_delay=30"},
            timeout=httpx.Timeout(5, read=0.5),
        )
    deadline = time.monotonic() + 2.0
    while std.state.stats()["in_flight"] > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert std.state.stats()["in_flight"] == 0


def test_stream_broken_mid_way_ends_with_error_event(two_pools: Any) -> None:
    gw, _, _ = two_pools
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={**CHAT_REQ, "stream": True},
        headers={"X-Fake-Behavior": "break_after=3"},
    )
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == b"data: [DONE]"
    err = orjson.loads(events[-2][6:])["error"]
    assert err["code"] == "stream_interrupted"
    assert err["message"]
    assert r.headers["x-specgate-attempts"] == "1"  # committed: never re-sent


def test_upstream_error_event_is_relayed_then_done(two_pools: Any) -> None:
    gw, _, _ = two_pools
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json={**CHAT_REQ, "stream": True},
        headers={"X-Fake-Behavior": "error_event_after=2"},
    )
    events = sse_events(r.content)
    assert events[-1] == b"data: [DONE]"
    assert b'"error"' in events[-2]


def test_connect_failure_falls_back_before_commit(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([closed_port_url()], [std.url]), health_interval_s=60)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CODE_REQ, "stream": True})
    assert r.status_code == 200
    assert r.headers["x-specgate-pool"] == "std"
    assert sse_events(r.content)[-1] == b"data: [DONE]"


def test_retryable_status_falls_back(fake: Fake, gateway: Gateway) -> None:
    spec, std = fake("spec"), fake("std")
    gw = gateway(rules_for([spec.url], [std.url]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ, headers={"X-Fake-Behavior": "status=503"})
    # Both pools answer 503 to this header: every attempt is listed in the 503 the client gets.
    assert r.status_code == 503
    assert r.headers["retry-after"]
    err = r.json()["error"]
    # Each pool and its status, never the endpoint or what the pool said (the log line has those).
    assert "spec: HTTP 503" in err["message"]
    assert "std: HTTP 503" in err["message"]
    assert "spec-0" not in err["message"]
    assert "std-0" not in err["message"]
    assert err["message"].endswith(f"(request id {r.headers['x-request-id']})")
    assert r.headers["x-specgate-attempts"] == "2"


def test_upstream_client_error_is_relayed_with_string_code(two_pools: Any) -> None:
    gw, _, _ = two_pools
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT_REQ, headers={"X-Fake-Behavior": "status=400"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "400"
    assert set(err) == {"message", "type", "param", "code"}


def test_all_pools_down_gives_503_with_retry_after(gateway: Gateway) -> None:
    gw = gateway(rules_for([closed_port_url()], [closed_port_url()]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT_REQ)
    assert r.status_code == 503
    assert int(r.headers["retry-after"]) > 0
    assert r.json()["error"]["type"] == "service_unavailable"
    ready = httpx.get(gw.url + "/ready")
    assert ready.status_code == 503


@pytest.mark.parametrize(
    ("content", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (b"", 400, "invalid_json", None),
        (orjson.dumps({**CHAT_REQ, "temperature": "hot"}), 400, "invalid_value", "temperature"),
        (orjson.dumps({**CHAT_REQ, "model": "gpt-nope"}), 404, "model_not_found", "model"),
        (orjson.dumps({"messages": CHAT_REQ["messages"]}), 400, "invalid_value", "model"),
    ],
)
def test_bad_requests_get_envelopes(two_pools: Any, content: bytes, status: int, code: str, param: str | None) -> None:
    gw, spec, std = two_pools
    r = httpx.post(gw.url + "/v1/chat/completions", content=content)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code
    assert err["param"] == param
    assert err["message"]
    assert posts(spec) == []
    assert posts(std) == []  # never sent anywhere


def test_body_over_the_limit_is_413_even_without_content_length(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url.replace("127.0.0.1", "localhost")]), max_body_bytes=4096)
    big = orjson.dumps({**CHAT_REQ, "messages": [{"role": "user", "content": "x" * 10000}]})
    r = httpx.post(gw.url + "/v1/chat/completions", content=big)
    assert r.status_code == 413

    def chunks() -> Any:
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = httpx.post(gw.url + "/v1/chat/completions", content=chunks())  # chunked: no Content-Length
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method(two_pools: Any) -> None:
    gw, _, _ = two_pools
    r = httpx.post(gw.url + "/v1/assistants", json={})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_route"
    r = httpx.get(gw.url + "/v1/chat/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(gw.url + "/sleep")  # vLLM dev routes are never forwarded
    assert r.status_code == 404


def test_models_health_ready_metrics(two_pools: Any) -> None:
    gw, _, _ = two_pools
    models = httpx.get(gw.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, SPEC_ONLY_MODEL]
    assert httpx.get(gw.url + "/health").status_code == 200
    ready = httpx.get(gw.url + "/ready").json()
    assert (ready["ready"], ready["reason"], ready["store"]["healthy"]) == (True, "ok", True)
    httpx.post(gw.url + "/v1/chat/completions", json=CHAT_REQ)
    text = httpx.get(gw.url + "/metrics").text
    assert 'specgate_requests_total{class="default",outcome="ok",pool="std"} 1.0' in text
    assert "specgate_gateway_overhead_seconds_bucket" in text
    assert 'specgate_endpoint_healthy{endpoint="spec-0",pool="spec"} 1.0' in text


def test_model_served_only_by_one_pool_goes_there(two_pools: Any) -> None:
    gw, _, _ = two_pools
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT_REQ, "model": SPEC_ONLY_MODEL})
    assert r.status_code == 200
    assert r.headers["x-specgate-pool"] == "spec"  # the class prefers std, which lacks the model


def test_client_api_keys(fake: Fake, gateway: Gateway) -> None:
    spec, std = fake("spec", api_key="pool-secret"), fake("std")
    rules = rules_for([spec.url], [std.url])
    rules["pools"][0]["api_key_env"] = "SPECGATE_TEST_SPEC_KEY"
    import os

    os.environ["SPECGATE_TEST_SPEC_KEY"] = "pool-secret"
    try:
        gw = gateway(rules, api_keys="client-a,client-b")
    finally:
        del os.environ["SPECGATE_TEST_SPEC_KEY"]
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ, headers={"Authorization": "Bearer client-b"})
    assert r.status_code == 200, r.text
    assert posts(spec)[-1]["headers"]["authorization"] == "Bearer pool-secret"
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT_REQ, headers={"Authorization": "Bearer client-a"})
    assert r.status_code == 200
    assert "authorization" not in posts(std)[-1]["headers"]
    assert httpx.get(gw.url + "/v1/models").status_code == 401


def test_embeddings(fake: Fake, gateway: Gateway) -> None:
    emb = fake("emb", embeddings=True, models=["e5"])
    std = fake("std")
    rules = rules_for([std.url], [std.url.replace("127.0.0.1", "localhost")])
    gw = gateway(rules)
    r = httpx.post(gw.url + "/v1/embeddings", json={"model": "e5", "input": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_route"

    rules["pools"].append({"name": "emb", "kind": "standard", "models": ["e5"], "endpoints": [{"url": emb.url}]})
    rules["embeddings_pool"] = "emb"
    gw2 = gateway(rules)
    r = httpx.post(gw2.url + "/v1/embeddings", json={"model": "e5", "input": "hi"})
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["object"] == "embedding"
    r = httpx.post(gw2.url + "/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"
