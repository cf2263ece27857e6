"""Review findings on the core proxy (forward/upstream/headers/app), against a real uvicorn gateway.

Most upstreams here are the fake vLLM server; where a finding needs bytes the fake cannot produce (headers
before the first token, a gzip'd body, a non-SSE 200 to a stream, a late chunked terminator, odd header
bytes), ``RawUpstream`` writes the HTTP/1.1 response by hand on a real socket.

Tests marked ``xfail(strict=True)`` demonstrate a defect; the others pin behaviour checked during review.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, poll, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

CODE_REQ: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0.1,
    "messages": [{"role": "user", "content": "write a python function that adds two numbers"}],
}
CHAT_REQ: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}

COMPLETION = {
    "id": "chatcmpl-raw",
    "object": "chat.completion",
    "created": 1,
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from raw"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
}


def sse_chunk(content: str) -> bytes:
    obj = {
        "id": "chatcmpl-raw",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# --------------------------------------------------------------------------------------------------------------
# A hand-written HTTP/1.1 upstream


@dataclass
class RawRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    conn: int  # which TCP connection carried it


Handler = Callable[[RawRequest, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class RawUpstream:
    """An asyncio server in a thread. ``GET /health`` answers 200; every other request goes to ``handler``,
    which writes the whole response itself and returns whether the connection stays open."""

    handler: Handler
    requests: list[RawRequest] = field(default_factory=list)
    connections: int = 0  # TCP connections that carried at least one non-health request
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, sock=self._sock), self._loop
        ).result(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = 0
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if path in ("/health", "/metrics"):  # the gateway's own probes, not client traffic
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                if conn == 0:
                    self.connections += 1
                    conn = self.connections
                self.requests.append(RawRequest(method, path, headers, body, conn))
                if not await self.handler(self.requests[-1], reader, writer):
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()

    def stop(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for w in list(self._writers):
                w.close()  # a handler waiting on its reader sees EOF and returns
            pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if pending:
                await asyncio.wait(pending, timeout=2)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._sock.close()


@pytest.fixture
def raw() -> Iterator[Callable[[Handler], RawUpstream]]:
    started: list[RawUpstream] = []

    def start(handler: Handler) -> RawUpstream:
        server = RawUpstream(handler)
        started.append(server)
        return server

    yield start
    for s in started:
        s.stop()


def with_timeouts(rules: dict[str, Any], **timeouts: float) -> dict[str, Any]:
    for pool in rules["pools"]:
        pool["timeouts"] = {**pool["timeouts"], **timeouts}
    return rules


def runtime_of(gw: ServerThread) -> Any:
    app: Any = gw._server.config.app
    return app.state.runtime


def metric(gw: ServerThread, pattern: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith("#") and re.search(pattern, line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(cond: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    return poll(cond, timeout_s)


def in_flight_is_zero(gw: ServerThread) -> bool:
    rt = runtime_of(gw)
    eps = [e for p in rt.live.pools.values() for e in p.endpoints]
    return all(e.in_flight == 0 for e in eps) and metric(gw, r"^specgate_in_flight_requests\{") == 0


# --------------------------------------------------------------------------------------------------------------
# Handlers for RawUpstream


async def sse_headers_then_wait(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """What vLLM does for a stream while the request waits in its queue: 200 + SSE headers at once (Starlette's
    StreamingResponse sends them before the first chunk), then nothing until the first token."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    await writer.drain()
    await reader.read()  # until the gateway goes away
    return False


async def json_200(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    body = orjson.dumps(COMPLETION)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return True


async def gzip_json_200(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    body = gzip.compress(orjson.dumps(COMPLETION))
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return True


async def json_200_odd_header(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    body = orjson.dumps(COMPLETION)
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"x-upstream-note: caf\xe9\r\n"  # one latin-1 byte: legal obs-text (RFC 9110 5.5), not UTF-8
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return True


async def sse_with_late_terminator(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """A complete stream whose final zero-size chunk comes in its own write, a moment after [DONE] (Starlette's
    StreamingResponse, i.e. vLLM, sends [DONE] and the end of the body as two separate sends)."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for i in range(3):
        writer.write(http_chunk(sse_chunk(f"tok{i} ")))
    writer.write(http_chunk(b"data: [DONE]\n\n"))
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


async def close_delimited_sse(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """HTTP/1.0 style: no Content-Length, no chunking, the body ends when the connection closes."""
    writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    for i in range(3):
        writer.write(sse_chunk(f"tok{i} "))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.write(b"data: [DONE]\n\n")
    await writer.drain()
    return False


async def close_delimited_json(req: RawRequest, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + orjson.dumps(COMPLETION))
    await writer.drain()
    return False


# --------------------------------------------------------------------------------------------------------------
# Findings


def test_stream_without_first_event_falls_back_within_first_byte_deadline(
    raw: Callable[[Handler], RawUpstream], fake: Fake, gateway: Gateway
) -> None:
    stuck, std = raw(sse_headers_then_wait), fake("std")
    gw = gateway(with_timeouts(rules_for([stuck.url], [std.url]), connect_s=0.5, first_byte_s=0.5, total_s=30))
    t0 = time.perf_counter()
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions", json={**CODE_REQ, "stream": True}, timeout=httpx.Timeout(5, read=3)
        )
    except httpx.ReadTimeout:
        pytest.fail("no byte within 3 s although first_byte_s is 0.5 s and another pool is healthy")
    assert r.status_code == 200
    assert r.headers["x-specgate-pool"] == "std"  # nothing was committed: the next pool takes it
    assert time.perf_counter() - t0 < 2.5


def test_non_stream_generation_longer_than_first_byte_deadline_succeeds(fake: Fake, gateway: Gateway) -> None:
    spec, std = fake("spec"), fake("std")
    gw = gateway(with_timeouts(rules_for([spec.url], [std.url]), connect_s=0.3, first_byte_s=0.3, total_s=30))
    # 5 tokens at 0.15 s: the full answer is ready after ~0.6 s, well within total_s.
    r = httpx.post(
        gw.url + "/v1/chat/completions", json=CODE_REQ, headers={"X-Fake-Behavior": "tokens=5,token_delay=0.15"}
    )
    generations = spec.state.stats()["started"] + std.state.stats()["started"]
    assert r.status_code == 200, r.text
    assert generations == 1  # and not one aborted generation per pool


def test_upstream_header_with_obs_text_does_not_break_the_response(
    raw: Callable[[Handler], RawUpstream], fake: Fake, gateway: Gateway
) -> None:
    up = raw(json_200_odd_header)
    gw = gateway(rules_for([up.url], [fake("std").url]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "hello from raw"


def test_non_sse_200_to_a_stream_request_is_not_a_clean_empty_stream(
    raw: Callable[[Handler], RawUpstream], fake: Fake, gateway: Gateway
) -> None:
    up = raw(json_200)
    gw = gateway(rules_for([up.url], [fake("std").url]))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    try:
        chunks = list(client.chat.completions.create(**CODE_REQ, stream=True))
    except openai.APIError:
        return  # an explicit error is fine
    assert chunks, "the SDK got a stream that ended cleanly with no chunk at all"


def test_gzip_upstream_body_reaches_the_client_readable(
    raw: Callable[[Handler], RawUpstream], fake: Fake, gateway: Gateway
) -> None:
    up = raw(gzip_json_200)
    gw = gateway(rules_for([up.url], [fake("std").url]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "hello from raw"


def test_upstream_connection_is_reused_after_a_complete_stream(
    raw: Callable[[Handler], RawUpstream], fake: Fake, gateway: Gateway
) -> None:
    up = raw(sse_with_late_terminator)
    gw = gateway(rules_for([up.url], [fake("std").url]))
    for _ in range(3):
        r = httpx.post(gw.url + "/v1/chat/completions", json={**CODE_REQ, "stream": True})
        assert r.content.endswith(b"data: [DONE]\n\n")
        time.sleep(0.2)  # the terminator has arrived long before the next request
    assert len(up.requests) == 3
    assert up.connections == 1


def test_client_disconnect_during_the_request_body_is_recorded(fake: Fake, gateway: Gateway) -> None:
    gw = gateway(rules_for([fake("spec").url], [fake("std").url]))
    with socket.create_connection(("127.0.0.1", gw.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 5000\r\n\r\n" + b'{"model": "'
        )
        time.sleep(0.1)
    assert wait_until(lambda: metric(gw, r'^specgate_requests_total\{.*outcome="client_disconnect"') >= 1, 2.0)


def test_pool_rejecting_the_gateway_key_is_not_a_client_auth_error(fake: Fake, gateway: Gateway) -> None:
    spec = fake("spec", api_key="pool-secret")  # the YAML forgot api_key_env for this pool
    gw = gateway(rules_for([spec.url], [fake("std").url]), api_keys="client-key")
    r = httpx.post(gw.url + "/v1/chat/completions", json=CODE_REQ, headers={"Authorization": "Bearer client-key"})
    assert r.status_code != 401, "the client's valid key was reported invalid"
    assert r.status_code == 200 or r.status_code >= 500  # fall back to the next pool, or a gateway-side error


# --------------------------------------------------------------------------------------------------------------
# Checked and found correct (pinned so that they stay so)


@pytest.mark.parametrize(
    ("behavior", "stream", "read_s"),
    [
        ("first_token_delay=30", False, 0.3),  # waiting for headers
        ("first_token_delay=30", True, 0.3),
        ("tokens=200,token_delay=0.05", False, 0.3),  # non-stream body still being generated
        ("tokens=200,token_delay=0.05", True, None),  # mid-stream (closed after 3 events)
    ],
)
def test_client_disconnect_cancels_upstream_and_in_flight_returns_to_zero(
    fake: Fake, gateway: Gateway, behavior: str, stream: bool, read_s: float | None
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url.replace("127.0.0.1", "localhost")]))
    body = {**CHAT_REQ, "stream": stream}
    if read_s is not None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                gw.url + "/v1/chat/completions",
                json=body,
                headers={"X-Fake-Behavior": behavior},
                timeout=httpx.Timeout(5, read=read_s),
            )
    else:
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json=body, headers={"X-Fake-Behavior": behavior}
        ) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 3:
                    break
    assert wait_until(lambda: std.state.stats()["in_flight"] == 0, 2.0)
    assert std.state.stats()["completed"] == 0
    assert wait_until(lambda: in_flight_is_zero(gw), 2.0)
    assert wait_until(lambda: metric(gw, r'^specgate_requests_total\{.*outcome="client_disconnect"') == 1, 2.0)


@pytest.mark.parametrize(
    "behavior",
    ["", "status=503", "status=400", "break_after=2", "error_event_after=2", "hang=1", "tokens=3"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_in_flight_returns_to_zero_after_every_upstream_outcome(
    fake: Fake, gateway: Gateway, behavior: str, stream: bool
) -> None:
    spec, std = fake("spec"), fake("std")
    # A non-streaming answer is bounded by total_s only (vLLM sends its headers when generation is done).
    gw = gateway(with_timeouts(rules_for([spec.url], [std.url]), connect_s=0.3, first_byte_s=0.3, total_s=1))
    headers = {"X-Fake-Behavior": behavior} if behavior else {}
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CODE_REQ, "stream": stream}, headers=headers, timeout=10)
    assert r.status_code in (200, 400, 500, 503)
    if stream and r.status_code == 200:
        assert r.content.endswith(b"data: [DONE]\n\n")
    else:
        assert "error" in r.json() or "choices" in r.json()
    assert wait_until(lambda: in_flight_is_zero(gw), 2.0)


@pytest.mark.parametrize("handler", [close_delimited_sse, close_delimited_json])
def test_http10_close_delimited_bodies_are_relayed(
    raw: Callable[[Handler], RawUpstream], fake: Fake, gateway: Gateway, handler: Handler
) -> None:
    up = raw(handler)
    gw = gateway(rules_for([up.url], [fake("std").url]))
    stream = handler is close_delimited_sse
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CODE_REQ, "stream": stream})
    assert r.status_code == 200
    assert r.headers["x-specgate-pool"] == "spec"
    if stream:
        assert r.content.endswith(b"data: [DONE]\n\n")
        assert b'"error"' not in r.content
        assert "content-length" not in r.headers
    else:
        assert r.json()["choices"][0]["message"]["content"] == "hello from raw"
        assert int(r.headers["content-length"]) == len(r.content)
    assert wait_until(lambda: in_flight_is_zero(gw), 2.0)


def test_response_headers_have_no_duplicates_and_no_hop_by_hop(fake: Fake, gateway: Gateway) -> None:
    spec = fake("spec")
    gw = gateway(rules_for([spec.url], [fake("std").url]))
    for stream in (False, True):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json={**CODE_REQ, "stream": stream},
            headers={"Connection": "keep-alive, X-Secret", "X-Secret": "s3cr3t", "Authorization": "Bearer k"},
        )
        names = [k.decode("latin-1").lower() for k, _ in r.headers.raw]
        dupes = {n for n in names if names.count(n) > 1}
        assert not dupes, dupes
        assert ("content-length" in names) is not stream
        assert ("transfer-encoding" in names) is stream
        sent = spec.state.requests[-1]["headers"]
        assert "x-secret" not in sent  # named in Connection: hop-by-hop
        assert "authorization" not in sent  # the client's key never reaches a pool
        assert sent["x-request-id"] == r.headers["x-request-id"]
