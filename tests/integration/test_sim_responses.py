"""The simulator's Responses API on the wire, as vLLM 0.33 serves it (its ``ResponsesResponse`` fields, the typed
event order, the store behind ``VLLM_ENABLE_RESPONSES_API_STORE``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.sim.app import SimOptions
from gateway.sim.faults import Faults
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths

pytestmark = pytest.mark.integration

MODEL = "m"
# vLLM 0.33's ResponsesResponse, serialised (``metrics`` is left out while None).
FIELDS = {
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object", "output",
    "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p", "background", "max_output_tokens",
    "max_tool_calls", "previous_response_id", "prompt", "prompt_cache_options", "prompt_cache_key",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "status", "text", "top_logprobs",
    "truncation", "usage", "user", "presence_penalty", "frequency_penalty", "kv_transfer_params",
    "ec_transfer_params", "input_messages", "output_messages",
}  # fmt: skip


def start(**kw: Any) -> SimServer:
    opts: dict[str, Any] = {"model": MODEL, "port": 0, "time_scale": 0.002, "output_lengths": OutputLengths(20, 0)}
    return SimServer(SimOptions(**{**opts, **kw})).start()


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    stored, plain = start(enable_responses_store=True), start()
    yield stored, plain
    stored.stop()
    plain.stop()


def typed(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        if block:
            head, data = block.split(b"\n", 1)
            assert head.startswith(b"event: ")
            assert data.startswith(b"data: ")
            out.append((head[7:].decode(), orjson.loads(data[6:])))
    return out


def test_whole_response_shape(sims: tuple[SimServer, SimServer]) -> None:
    stored, _ = sims
    r = httpx.post(f"{stored.url}/v1/responses", json={"model": MODEL, "input": "hi", "instructions": "be brief"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == FIELDS
    assert body["id"].startswith("resp_")
    assert body["object"] == "response"
    assert body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "message"
    assert item["role"] == "assistant"
    assert item["status"] == "completed"
    assert item["content"][0]["type"] == "output_text"
    assert item["content"][0]["text"]
    usage = body["usage"]
    assert usage["output_tokens"] == 20
    assert usage["total_tokens"] == usage["input_tokens"] + 20
    assert "metrics" not in body  # vLLM puts no per-request spec-decode metrics in Responses answers


def test_stream_event_order_and_sequence(sims: tuple[SimServer, SimServer]) -> None:
    stored, _ = sims
    r = httpx.post(f"{stored.url}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    events = typed(r.content)
    kinds = [k for k, _ in events]
    assert all(data["type"] == k for k, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert b"[DONE]" not in r.content
    text = "".join(d["delta"] for k, d in events if k == "response.output_text.delta")
    assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == text


def test_max_output_tokens_makes_it_incomplete(sims: tuple[SimServer, SimServer]) -> None:
    stored, _ = sims
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 5, "stream": True}
    kind, data = typed(httpx.post(f"{stored.url}/v1/responses", json=body).content)[-1]
    assert kind == "response.incomplete"
    assert data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_store_previous_retrieve_cancel(sims: tuple[SimServer, SimServer]) -> None:
    stored, _ = sims
    with httpx.Client(base_url=stored.url) as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
        second = c.post("/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": first["id"]})
        assert second.status_code == 200
        assert second.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]  # the conversation grew
        assert c.get(f"/v1/responses/{first['id']}").json() == first
        refused = c.post(f"/v1/responses/{first['id']}/cancel")
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "Cannot cancel a synchronous response."
        stored.update_faults(Faults(slow_chunk_s=0.5).to_json())  # a background generation still running
        try:
            bg = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "background": True})
            assert bg.json()["status"] == "queued"
            assert c.post(f"/v1/responses/{bg.json()['id']}/cancel").json()["status"] == "cancelled"
            assert c.get(f"/v1/responses/{bg.json()['id']}").json()["status"] == "cancelled"
        finally:
            stored.update_faults(Faults().to_json())
        missing = c.get("/v1/responses/resp_nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["param"] == "response_id"


def test_without_the_store(sims: tuple[SimServer, SimServer]) -> None:
    _, plain = sims
    with httpx.Client(base_url=plain.url) as c:
        first = c.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
        assert first["status"] == "completed"  # store: true is ignored silently
        assert c.get(f"/v1/responses/{first['id']}").status_code == 404
        prev = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": first["id"]})
        assert prev.status_code == 404
        bg = c.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True})
        assert bg.status_code == 400
        assert bg.json()["error"]["param"] == "background"


def test_failed_generation_drops_the_stream(sims: tuple[SimServer, SimServer]) -> None:
    _, plain = sims
    plain.update_faults(Faults(error_after=2).to_json())
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(f"{plain.url}/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    finally:
        plain.update_faults(Faults().to_json())
