"""Misbehaving pools against a real uvicorn gateway: the response head, body, decoded size and one SSE event are
bounded as the bytes arrive; past a limit the client gets 502 before the commit point, or the in-band error event
after it, and the gateway's memory stays bounded (Python allocations traced; without the limits each of these
would hold the whole response).

Also the client-side rows that need a pool: JSON nested deeper than the gateway re-serialises, and the headers a
pool is sent.
"""

from __future__ import annotations

import asyncio
import gzip
import re
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for
from tests.integration.test_review_findings import (
    RawRequest,
    RawUpstream,
    http_chunk,
    sse_chunk,
)

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]
Raw = Callable[..., RawUpstream]
Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter

CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}
CAP = 4 * 2**20  # max_response_bytes of the pools in these tests
EVENT_CAP = 256 * 1024


def capped(url: str, **pool: Any) -> dict[str, Any]:
    """Both pools on one misbehaving upstream (no healthy fallback rescues the request), with small caps."""
    rules = rules_for([url], [url])
    for p in rules["pools"]:
        p.update({"max_response_bytes": CAP, "max_event_bytes": EVENT_CAP, **pool})
    return rules


@pytest.fixture
def hostile() -> Iterator[Raw]:
    """Start a hand-written upstream (``RawUpstream``) with a handler; all are stopped after the test."""
    started: list[RawUpstream] = []

    def start(handler: Any) -> RawUpstream:
        server = RawUpstream(handler)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def traced() -> Iterator[Callable[[], int]]:
    """The peak of Python allocations from here on, in bytes (what a buffered or inflated body would show)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def endless_header(req: RawRequest, reader: Reader, writer: Writer) -> bool:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-endless: ")
    piece = b"a" * 65536
    for _ in range(256):  # 16 MiB, never ending the line
        writer.write(piece)
        await writer.drain()
    return False


# ~40 KB inflating to 40 MiB; built once at import, before any allocation is traced
BOMB = gzip.compress(b'{"x":"' + b"a" * (40 * 2**20) + b'"}', compresslevel=9)


async def gzip_bomb(req: RawRequest, reader: Reader, writer: Writer) -> bool:
    body = BOMB
    assert len(body) < 100_000
    ctype = b"text/event-stream" if b'"stream":true' in req.body.replace(b" ", b"") else b"application/json"
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-encoding: gzip\r\ncontent-length: %d\r\n\r\n%s"
        % (ctype, len(body), body)
    )
    await writer.drain()
    return True


async def huge_body(req: RawRequest, reader: Reader, writer: Writer) -> bool:
    size = 40 * 2**20
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size)
    piece = b"a" * 65536
    for _ in range(size // len(piece)):
        writer.write(piece)
        await writer.drain()
    return True


async def endless_event_after_one(req: RawRequest, reader: Reader, writer: Writer) -> bool:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    writer.write(http_chunk(sse_chunk("first ")))
    writer.write(http_chunk(b'data: {"choices":[{"delta":{"content":"'))
    piece = b"a" * 65536
    for _ in range(128):  # 8 MiB without the event's end
        writer.write(http_chunk(piece))
        await writer.drain()
    return False


def test_an_endless_upstream_header_fails_the_attempt_at_the_head_cap(
    hostile: Raw, gateway: Gateway, traced: Any
) -> None:
    up = hostile(endless_header)
    gw = gateway(capped(up.url))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "upstream_error"
    assert err["code"] == "upstream_response_too_large"
    assert "head is larger than 65536 bytes" in err["message"]
    assert len(up.requests) == 1  # not retried on the other pool
    assert traced() < 8 * 2**20  # the 16 MiB line was never held


@pytest.mark.parametrize("stream", [False, True])
def test_a_gzip_bomb_is_cut_at_the_decoded_cap(hostile: Raw, gateway: Gateway, traced: Any, stream: bool) -> None:
    up = hostile(gzip_bomb)
    gw = gateway(capped(up.url))
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=30)
    assert r.status_code == 502, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "upstream_response_too_large"
    # Whichever limit the inflating bytes reach first: the decoded size, the buffered body, or one SSE event.
    assert re.search(r"decodes to more than|body is larger than|event exceeds", err["message"]), err
    assert len(up.requests) == 1
    assert traced() < 3 * CAP  # 40 MiB inflated whole before; now at most the cap (+ what the test reads)


def test_a_non_streaming_body_past_max_response_bytes_is_502(hostile: Raw, gateway: Gateway, traced: Any) -> None:
    up = hostile(huge_body)
    gw = gateway(capped(up.url))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 502, r.text[:300]
    assert f"larger than {CAP} bytes" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "upstream_response_too_large"
    assert traced() < 3 * CAP


def test_one_sse_event_past_max_event_bytes_ends_the_stream_with_an_error_event(
    hostile: Raw, gateway: Gateway, traced: Any
) -> None:
    up = hostile(endless_event_after_one)
    gw = gateway(capped(up.url))
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        body = r.read()
    events = [e for e in body.split(b"\n\n") if e]
    assert b"first" in events[0]
    error = orjson.loads(events[-2][len(b"data: ") :])["error"]
    assert f"exceeds {EVENT_CAP} bytes" in error["message"]
    assert events[-1] == b"data: [DONE]"
    assert traced() < 4 * 2**20


def deep_body(levels: int, **fields: Any) -> bytes:
    """A chat request with a field nested ``levels`` deep (built as bytes: orjson cannot write it)."""
    head = orjson.dumps({**CHAT, **fields})[:-1]
    return head + b',"x":' + b"[" * levels + b'"x"' + b"]" * levels + b"}"


@pytest.mark.parametrize(
    ("extra_headers", "body"),
    [
        ({"Idempotency-Key": "deep-1"}, deep_body(300)),  # the fingerprint re-serialises the body
        ({}, deep_body(300, temperature=0.1, stream=True, response_format={"type": "json_object"})),
        ({}, deep_body(1000)),
    ],
    ids=["idempotency-key", "stream-to-speculative", "1000-levels"],
)
def test_json_deeper_than_the_gateway_reserialises_is_400_invalid_json(
    fake: Fake, gateway: Gateway, extra_headers: dict[str, str], body: bytes
) -> None:
    spec, std = fake("spec"), fake("std")
    gw = gateway(rules_for([spec.url], [std.url]))
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers=extra_headers)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["code"] == "invalid_json"
    assert "deeper than 128 levels" in err["message"]
    assert [q for q in spec.state.requests + std.state.requests if q["method"] == "POST"] == []
    ok = deep_body(100)
    r = httpx.post(gw.url + "/v1/chat/completions", content=ok, headers={"Idempotency-Key": "ok-1"})
    assert r.status_code == 200


def test_a_client_cannot_pick_the_data_parallel_rank_and_the_pool_sees_x_forwarded_for(
    fake: Fake, gateway: Gateway
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]))
    headers = {"X-data-parallel-rank": "3", "X-Specgate-Pool": "forged"}
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 200
    sent = [q for q in std.state.requests if q["method"] == "POST"][-1]["headers"]
    assert "x-data-parallel-rank" not in sent
    assert "x-specgate-pool" not in sent
    assert sent["x-forwarded-for"] == "127.0.0.1"
