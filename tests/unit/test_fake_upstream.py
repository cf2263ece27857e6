"""The fake vLLM upstream, over a real socket (uvicorn in a thread) with aiohttp, the gateway's own client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.testing.fake_upstream import (
    Behavior,
    FakeConfig,
    FakeUpstreamServer,
    parse_behavior,
    spec_decode_metrics,
)

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}]}

StartFake = Callable[..., FakeUpstreamServer]


@pytest.fixture
def start_fake() -> Iterator[StartFake]:
    servers: list[FakeUpstreamServer] = []

    def start(**overrides: Any) -> FakeUpstreamServer:
        server = FakeUpstreamServer(FakeConfig(**overrides)).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeUpstreamServer]:
    """One shared server (starting and stopping uvicorn costs ~0.2 s): tests compare stats as deltas."""
    with FakeUpstreamServer(FakeConfig(name="a")) as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        yield s


def _events(raw: bytes) -> list[bytes]:
    """Split an SSE body into event payloads, checking the framing is exactly ``data: <x>\\n\\n``."""
    assert raw.endswith(b"\n\n")
    parts = raw[:-2].split(b"\n\n")
    assert all(p.startswith(b"data: ") for p in parts), parts
    return [p[len(b"data: ") :] for p in parts]


async def _stats(session: aiohttp.ClientSession, fake: FakeUpstreamServer) -> dict[str, int]:
    async with session.get(f"{fake.url}/_fake/stats") as r:
        stats: dict[str, int] = await r.json()
        return stats


async def _poll_stats(
    session: aiohttp.ClientSession, fake: FakeUpstreamServer, done: Callable[[dict[str, int]], bool]
) -> dict[str, int]:
    """Stats once ``done(stats)`` holds, or after 1 s (the caller's assertion then fails)."""
    stats = await _stats(session, fake)
    for _ in range(100):
        if done(stats):
            break
        await asyncio.sleep(0.01)
        stats = await _stats(session, fake)
    return stats


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] if k != "in_flight" else v for k, v in after.items()}


async def test_non_stream_chat_shape(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    async with session.post(f"{fake.url}/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        assert r.headers["content-type"] == "application/json"
        body = await r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    assert body["system_fingerprint"] == "fake-a"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "".join(f"tok{i} " for i in range(1, 17))
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + 16
    assert "metrics" not in body

    async with session.post(f"{fake.url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}) as r:
        body = await r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 4

    async with session.post(f"{fake.url}/v1/completions", json={"model": MODEL, "prompt": "a b c"}) as r:
        body = await r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"].startswith("tok1 tok2 ")
    assert body["usage"]["prompt_tokens"] == 3


async def test_stream_framing_role_tokens_finish_usage_done(
    fake: FakeUpstreamServer, session: aiohttp.ClientSession
) -> None:
    payload = {**CHAT, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    async with session.post(f"{fake.url}/v1/chat/completions", json=payload) as r:
        assert r.status == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    events = _events(raw)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["chat.completion.chunk"] * 6
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:4]] == ["tok1 ", "tok2 ", "tok3 "]
    assert chunks[4]["choices"][0]["finish_reason"] == "length"
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"]["completion_tokens"] == 3

    # Without include_usage: no usage chunk.
    async with session.post(f"{fake.url}/v1/completions", json={"prompt": "x", "stream": True}) as r:
        events = _events(await r.read())
    assert events[-1] == b"[DONE]"
    last = orjson.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in last


async def test_break_after_breaks_the_body(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    before = await _stats(session, fake)
    headers = {"X-Fake-Behavior": "break_after=3"}
    received = b""
    async with session.post(f"{fake.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError, match="not completed"):  # noqa: PT012
            async for piece in r.content.iter_any():
                received += piece
    assert received.count(b'"content":"tok') == 3
    assert b"[DONE]" not in received

    # Non-stream: the connection closes without any response.
    with pytest.raises(aiohttp.ServerDisconnectedError):
        async with session.post(f"{fake.url}/v1/chat/completions", json=CHAT, headers=headers) as r:
            await r.read()

    # The pool survives: a fresh connection works.
    async with session.post(f"{fake.url}/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    stats = _delta(await _stats(session, fake), before)
    assert stats == {"started": 3, "completed": 1, "aborted": 0, "broken": 2, "in_flight": 0}


async def test_error_event_after(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    headers = {"X-Fake-Behavior": "error_event_after=2"}
    async with session.post(f"{fake.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers) as r:
        assert r.status == 200
        events = _events(await r.read())
    assert events[-1] == b"[DONE]"
    error = orjson.loads(events[-2])
    assert error["error"]["code"] == 500
    assert isinstance(error["error"]["message"], str)
    assert sum(b'"content":"tok' in e for e in events) == 2


async def test_status_injection(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    async with session.post(
        f"{fake.url}/v1/chat/completions", json=CHAT, headers={"X-Fake-Behavior": "status=503"}
    ) as r:
        assert r.status == 503
        body = await r.json()
    assert body["error"]["code"] == 503
    assert body["error"]["type"] == "Service Unavailable"

    async with session.post(
        f"{fake.url}/v1/chat/completions", json=CHAT, headers={"X-Fake-Behavior": "nonsense=1"}
    ) as r:
        assert r.status == 400


async def test_client_disconnect_counts_as_aborted(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    before = await _stats(session, fake)
    headers = {"X-Fake-Behavior": "tokens=1000,token_delay=0.2"}  # would run for 200 s
    r = await session.post(f"{fake.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers)
    await r.content.readuntil(b"\n\n")
    assert (await _stats(session, fake))["in_flight"] == 1
    r.close()  # drop the connection mid-stream
    t0 = time.monotonic()
    stats = _delta(await _poll_stats(session, fake, lambda s: s["aborted"] > before["aborted"]), before)
    assert time.monotonic() - t0 < 1.0
    assert stats == {"started": 1, "completed": 0, "aborted": 1, "broken": 0, "in_flight": 0}


async def test_metrics_follow_in_flight_requests(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    hung = asyncio.create_task(
        session.post(f"{fake.url}/v1/completions", json={"prompt": "x"}, headers={"X-Fake-Behavior": "hang=1"})
    )
    running = asyncio.create_task(
        session.post(
            f"{fake.url}/v1/completions", json={"prompt": "x"}, headers={"X-Fake-Behavior": "tokens=5,token_delay=0.05"}
        )
    )
    await asyncio.sleep(0.15)
    async with session.get(f"{fake.url}/metrics") as r:
        text = await r.text()
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    assert f"vllm:num_requests_waiting{labels} 1.0" in text
    assert f"vllm:num_requests_running{labels} 1.0" in text
    assert "vllm:request_success_total{" in text
    hung.cancel()
    (await running).close()
    assert (await _poll_stats(session, fake, lambda s: s["in_flight"] == 0))["in_flight"] == 0


async def test_unknown_model_and_bad_json(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    async with session.post(f"{fake.url}/v1/chat/completions", json={**CHAT, "model": "x"}) as r:
        assert r.status == 404
        assert await r.json() == {
            "error": {
                "message": "The model `x` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
            }
        }
    async with session.post(f"{fake.url}/v1/chat/completions", data=b"{nope") as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["code"] == 400
    assert body["error"]["type"] == "BadRequestError"


async def test_api_key(start_fake: StartFake, session: aiohttp.ClientSession) -> None:
    fake = start_fake(api_key="sekret")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        async with session.post(f"{fake.url}/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 401
            assert await r.json() == {"error": "Unauthorized"}
    async with session.post(
        f"{fake.url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"}
    ) as r:
        assert r.status == 200
    async with session.get(f"{fake.url}/health") as r:
        assert r.status == 200


async def test_requests_are_recorded(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    async with session.delete(f"{fake.url}/_fake/requests") as r:
        assert r.status == 204
    async with session.post(f"{fake.url}/v1/chat/completions", json=CHAT, headers={"X-Trace": "abc"}):
        pass
    async with session.get(f"{fake.url}/_fake/requests") as r:
        [seen] = await r.json()
    assert seen["method"] == "POST"
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["x-trace"] == "abc"
    assert seen["body"] == CHAT
    async with session.delete(f"{fake.url}/_fake/requests"):
        pass
    async with session.get(f"{fake.url}/_fake/requests") as r:
        assert await r.json() == []


async def test_models_version_health(fake: FakeUpstreamServer, session: aiohttp.ClientSession) -> None:
    async with session.get(f"{fake.url}/v1/models") as r:
        body = await r.json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["id"] == MODEL
    assert model["owned_by"] == "vllm"
    assert model["parent"] is None
    assert model["max_model_len"] == 8192
    async with session.get(f"{fake.url}/version") as r:
        assert await r.json() == {"version": "0.33.0"}
    async with session.get(f"{fake.url}/health") as r:
        assert r.status == 200
        assert await r.read() == b""


async def test_embeddings_and_spec_metrics(start_fake: StartFake, session: aiohttp.ClientSession) -> None:
    plain = start_fake()
    async with session.post(f"{plain.url}/v1/embeddings", json={"input": "x"}) as r:
        assert r.status == 404
        assert (await r.json())["error"]["code"] == 404

    fake = start_fake(embeddings=True, spec_metrics=True)
    async with session.post(f"{fake.url}/v1/embeddings", json={"input": ["a", "b", "a"]}) as r:
        body = await r.json()
    vectors = [d["embedding"] for d in body["data"]]
    assert vectors[0] == vectors[2] != vectors[1]

    async with session.post(f"{fake.url}/v1/chat/completions", json=CHAT) as r:
        body = await r.json()
    assert body["metrics"]["speculative_decoding"] == spec_decode_metrics(16)
    payload = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{fake.url}/v1/chat/completions", json=payload) as r:
        events = _events(await r.read())
    assert orjson.loads(events[-2])["metrics"]["speculative_decoding"]["num_spec_tokens"] == 4


def test_parse_behavior() -> None:
    assert parse_behavior(None) == Behavior()
    assert parse_behavior(" status=503 , token_delay=0.05,hang") == Behavior(status=503, token_delay=0.05, hang=True)
    with pytest.raises(ValueError, match="unknown directive"):
        parse_behavior("break_afterr=3")
    with pytest.raises(ValueError, match="status"):
        parse_behavior("status=200")
    metrics = spec_decode_metrics(16)
    assert metrics["num_spec_steps"] == 5
    assert metrics["mean_acceptance_length"] == pytest.approx(3.0)
