"""The simulator over HTTP: real uvicorn on free ports, a small time scale, httpx and the OpenAI SDK as clients."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.app import SimOptions
from gateway.sim.faults import Faults
from gateway.sim.metrics import BASE_NAMES, SPEC_NAMES
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
SHORT = OutputLengths(median=40, sigma=0)

pytestmark = pytest.mark.integration


def start(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {"port": 0, "time_scale": 0.01, "output_lengths": SHORT, "seed": 1}
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture(scope="module")
def spec() -> Iterator[SimServer]:
    server = start(speculative_config=SPEC, per_request_spec_decode_metrics="summary", fixed_acceptance=0.8)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def std() -> Iterator[SimServer]:
    server = start(enable_request_id_headers=True, served_model_names=(MODEL, "alias"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow() -> Iterator[SimServer]:
    """Real time (about 15 ms a step), one request in the queue at most: for queue-full and disconnects."""
    server = start(time_scale=1.0, max_num_queued_reqs=1, output_lengths=OutputLengths(median=2000, sigma=0))
    yield server
    server.stop()


@pytest.fixture
def faulty(spec: SimServer) -> Iterator[SimServer]:
    yield spec
    spec.update_faults(Faults().to_json())


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5) as c:
        yield c


def events(raw: bytes) -> list[Any]:
    """SSE payloads, checking the framing is exactly ``data: <x>\\n\\n`` and the stream ends with [DONE]."""
    assert raw.endswith(b"data: [DONE]\n\n")
    parts = raw[:-2].split(b"\n\n")
    assert all(p.startswith(b"data: ") for p in parts), parts
    return [orjson.loads(p[6:]) for p in parts[:-1]]


def stats(c: httpx.Client, server: SimServer) -> dict[str, Any]:
    body: dict[str, Any] = c.get(f"{server.url}/sim/stats").json()
    return body


def poll(check: Callable[[], bool], timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# --------------------------------------------------------------------------------------------------------------
# Wire format


def test_chat_whole_and_stream_agree(spec: SimServer, client: httpx.Client) -> None:
    r = client.post(f"{spec.url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "whole-1"})
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "chatcmpl-whole-1"
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 40
    sd = body["metrics"]["speculative_decoding"]
    assert sd["num_spec_tokens"] == 4
    assert sum(sd["acceptance_histogram"]) == sd["num_spec_steps"] > 0
    assert client.post(f"{spec.url}/v1/chat/completions", json=CHAT).json()["choices"][0] == choice  # deterministic
    other = client.post(f"{spec.url}/v1/chat/completions", json={**CHAT, "seed": 7}).json()
    assert other["choices"][0]["message"]["content"] != choice["message"]["content"]

    payload = {**CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = client.post(f"{spec.url}/v1/chat/completions", json=payload)
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.content)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = [c["choices"][0] for c in chunks[1:-1]]
    assert "".join(t["delta"]["content"] for t in tokens) == choice["message"]["content"]
    assert tokens[-1]["finish_reason"] == "stop"
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    steps = [b - a for a, b in itertools.pairwise(counts)]
    assert max(steps) > 1  # bursts: one chunk carries every token of one engine step
    assert max(steps) <= 5  # K + 1
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"] == {
        "prompt_tokens": body["usage"]["prompt_tokens"],
        "total_tokens": final["usage"]["total_tokens"],
        "completion_tokens": 40,
    }
    assert final["metrics"]["speculative_decoding"]["num_spec_tokens"] == 4


def test_completions_on_a_standard_server(std: SimServer, client: httpx.Client) -> None:
    body = {"model": "alias", "prompt": "Once upon a time", "max_tokens": 12}
    whole = client.post(f"{std.url}/v1/completions", json=body).json()
    assert whole["object"] == "text_completion"
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12
    assert whole["metrics"] is None
    stream = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(client.post(f"{std.url}/v1/completions", json=stream).content)
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == list(range(1, 13))  # one token a step
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == whole["choices"][0]["text"]
    assert "metrics" not in chunks[-1]
    n2 = client.post(f"{std.url}/v1/chat/completions", json={**CHAT, "n": 2, "max_tokens": 5}).json()
    assert [c["index"] for c in n2["choices"]] == [0, 1]
    assert n2["usage"]["completion_tokens"] == 10


def test_models_version_health(std: SimServer, client: httpx.Client) -> None:
    models = client.get(f"{std.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"]
    assert models["data"][0]["max_model_len"] == 8192
    assert client.get(f"{std.url}/version").json() == {"version": "0.33.0"}
    for path in ("/health", "/ping"):
        r = client.get(f"{std.url}{path}")
        assert (r.status_code, r.content) == (200, b"")
    shown = client.get(f"{std.url}/sim/options").json()
    assert shown["served_model_names"] == [MODEL, "alias"]
    assert shown["acceptance"]["task_factors"]["lookup"]["chat"] > 0


def test_errors(std: SimServer, client: httpx.Client) -> None:
    r = client.post(f"{std.url}/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": f"The model `nope` does not exist. Valid aliases: {MODEL}, alias.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    r = client.post(f"{std.url}/v1/chat/completions", content=b"{nope")
    assert (r.status_code, r.json()["error"]["type"], r.json()["error"]["code"]) == (400, "BadRequestError", 400)


def test_api_key(client: httpx.Client) -> None:
    server = start(api_keys=("sekret",))
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.get(f"{server.url}/v1/models", headers=headers)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"})
        assert client.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get(f"{server.url}/health").status_code == 200  # only /v1 is protected
        assert client.get(f"{server.url}/metrics").status_code == 200
    finally:
        server.stop()


def test_request_ids_and_generation_counts(std: SimServer, client: httpx.Client) -> None:
    url = f"{std.url}/v1/chat/completions"
    r = client.post(url, json={**CHAT, "max_tokens": 2}, headers={"X-Request-Id": "twice"})
    assert r.headers["x-request-id"] == "twice"
    assert r.json()["id"] == "chatcmpl-twice"
    client.post(url, json={**CHAT, "max_tokens": 2}, headers={"X-Request-Id": "twice"})
    client.post(url, json={**CHAT, "max_tokens": 2}, headers={"X-Request-Id": "once"})
    assert len(client.post(url, json={**CHAT, "max_tokens": 2}).headers["x-request-id"]) == 32
    generations = stats(client, std)["generations"]
    assert (generations["twice"], generations["once"]) == (2, 1)


def test_metrics_exposition(spec: SimServer, client: httpx.Client) -> None:
    client.post(f"{spec.url}/v1/chat/completions", json=CHAT)
    text = client.get(f"{spec.url}/metrics").text
    samples = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    for name in (*BASE_NAMES, *SPEC_NAMES):
        assert any(s == name or s.startswith(f"{name}_") for s in samples), name
    assert not any("acceptance_rate" in s for s in samples)
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    assert f"vllm:num_requests_running{labels} 0.0" in text


def test_openai_sdk(spec: SimServer) -> None:
    client = openai.OpenAI(base_url=f"{spec.url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 40
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == completion.choices[0].message.content
    )
    assert chunks[-1].usage is not None
    text = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert text.choices[0].finish_reason == "length"


# --------------------------------------------------------------------------------------------------------------
# Load: queue full, disconnects


def test_queue_full_and_disconnect_aborts(slow: SimServer, client: httpx.Client) -> None:
    payload = {**CHAT, "stream": True}
    with client.stream("POST", f"{slow.url}/v1/chat/completions", json=payload) as first:
        next(first.iter_bytes())  # the first chunk: the request is running
        assert stats(client, slow)["running"] == 1
        r = client.post(f"{slow.url}/v1/chat/completions", json=CHAT)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "Service Unavailable"
        assert r.json()["error"]["code"] == 503
    # The client left: the generation is aborted long before its natural end (2,000 tokens at ~15 ms a step is
    # 30 s); the bound is generous because a loaded machine can be slow to notice the closed socket.
    assert poll(lambda: stats(client, slow)["running"] == 0, timeout_s=15.0)
    assert stats(client, slow)["requests"]["aborted"] == 1
    metrics = client.get(f"{slow.url}/metrics").text
    assert f'vllm:request_success_total{{engine="0",finished_reason="abort",model_name="{MODEL}"}} 1.0' in metrics
    assert 'vllm:admission_rejections_total{model_name="' in metrics


# --------------------------------------------------------------------------------------------------------------
# Faults


def put_faults(c: httpx.Client, server: SimServer, **fields: Any) -> dict[str, Any]:
    r = c.put(f"{server.url}/sim/faults", json=fields)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_fault_api(faulty: SimServer, client: httpx.Client) -> None:
    assert put_faults(client, faulty, error_rate=0.5)["error_rate"] == 0.5
    assert client.get(f"{faulty.url}/sim/faults").json()["error_rate"] == 0.5
    r = client.put(f"{faulty.url}/sim/faults", json={"eror_rate": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (400, 400)
    assert client.post(f"{faulty.url}/sim/faults/reset").json() == Faults().to_json()


def test_fault_error_rate(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, error_rate=1.0, error_status=503)
    r = client.post(f"{faulty.url}/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == 503


def test_fault_hang(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, hang_s=0.3)
    t0 = time.monotonic()
    assert client.post(f"{faulty.url}/v1/chat/completions", json={**CHAT, "max_tokens": 1}).status_code == 200
    assert time.monotonic() - t0 >= 0.3
    put_faults(client, faulty, hang=True)
    with pytest.raises(httpx.ReadTimeout):
        client.post(f"{faulty.url}/v1/chat/completions", json=CHAT, timeout=0.3)


def test_fault_cut(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, cut_after=2)
    received = b""
    url = f"{faulty.url}/v1/chat/completions"
    with pytest.raises(httpx.RemoteProtocolError), client.stream("POST", url, json={**CHAT, "stream": True}) as r:  # noqa: PT012
        for piece in r.iter_bytes():
            received += piece
    assert received.count(b'"delta":{"content":') == 2
    assert b"[DONE]" not in received
    with pytest.raises(httpx.RemoteProtocolError):
        client.post(f"{faulty.url}/v1/chat/completions", json=CHAT)
    assert stats(client, faulty)["faults"]["cuts"] >= 2


def test_fault_error_event_mid_stream(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, error_after=2)
    raw = client.post(f"{faulty.url}/v1/chat/completions", json={**CHAT, "stream": True}).content
    chunks = events(raw)
    assert sum("choices" in c and bool(c["choices"]) and "content" in c["choices"][0]["delta"] for c in chunks) == 3
    assert chunks[-1]["error"]["code"] == 500
    assert b'data: {"error": {"message": ' in raw  # json.dumps, as vLLM renders it
    r = client.post(f"{faulty.url}/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["error"]["type"]) == (500, "InternalServerError")


def test_fault_slow_chunks(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, slow_chunk_s=0.02)
    t0 = time.monotonic()
    r = client.post(f"{faulty.url}/v1/completions", json={"prompt": "x", "max_tokens": 10, "stream": True})
    assert len(events(r.content)) >= 3
    assert time.monotonic() - t0 >= 0.02 * 3


def test_fault_refuse_connections_and_recover(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, refuse_connections=True, refuse_for_s=0.4)
    with pytest.raises(httpx.ConnectError):
        client.get(f"{faulty.url}/health")
    assert poll(lambda: _reachable(faulty), timeout_s=3.0)
    assert client.get(f"{faulty.url}/sim/faults").json()["refuse_connections"] is False
    faulty.update_faults({"refuse_connections": True})  # in process: no timer, cleared explicitly
    assert not _reachable(faulty)
    faulty.update_faults({"refuse_connections": False})
    assert client.post(f"{faulty.url}/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 200


def _reachable(server: SimServer) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=1).status_code == 200
    except httpx.ConnectError:
        return False


def test_fault_metrics_and_health(faulty: SimServer, client: httpx.Client) -> None:
    put_faults(client, faulty, metrics="malformed", health_status=503)
    assert client.get(f"{faulty.url}/health").status_code == 503
    with pytest.raises(ValueError):  # noqa: PT011 - prometheus_client's parser raises a bare ValueError
        list(text_string_to_metric_families(client.get(f"{faulty.url}/metrics").text))
    put_faults(client, faulty, metrics="missing")
    assert client.get(f"{faulty.url}/metrics").status_code == 404
    client.post(f"{faulty.url}/sim/faults/reset")
    assert client.get(f"{faulty.url}/health").status_code == 200
