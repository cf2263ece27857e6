"""The trust boundary toward the pools, against a real gateway: which client headers reach vLLM, how
X-Forwarded-For is built (socket peer, ``--trusted-proxies``), and what a pool's unrelayable answer becomes (an
upstream that answers 101, status 600 or 4,500 header fields gets the client a 502, and the next request is served).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, Served, ServerThread, rules_for

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
HOSTILE = {
    "Cookie": "session=secret",
    "X-Api-Key": "sk-client",
    "X-Forwarded-Host": "evil.example",
    "X-Vllm-Foo": "bar",
    "X-Forwarded-For": "6.6.6.6",
    "Forwarded": "for=6.6.6.6",
    "X-Real-IP": "6.6.6.6",
    "Authorization": "Bearer client-key",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "X-Sim-Task": "code",
}


def _sent(fake: FakeUpstreamServer) -> dict[str, str]:
    posts = [q for q in fake.state.requests if q["method"] == "POST"]
    assert posts, "the request never reached the pool"
    headers: dict[str, str] = posts[-1]["headers"]
    return headers


def _assert_hostile_dropped(sent: dict[str, str]) -> None:
    for name in ("cookie", "x-api-key", "x-forwarded-host", "x-vllm-foo", "forwarded", "x-real-ip"):
        assert name not in sent, name
    assert sent.get("authorization") != "Bearer client-key"
    assert sent["traceparent"] == HOSTILE["traceparent"]
    assert sent["x-sim-task"] == "code"  # the simulator's control header still passes


def test_only_allow_listed_headers_reach_the_pool_and_x_forwarded_for_is_the_peer(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread]
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=HOSTILE)
    assert r.status_code == 200, r.text
    sent = _sent(std)
    _assert_hostile_dropped(sent)
    assert sent["x-forwarded-for"] == "127.0.0.1"  # the client's 6.6.6.6 is not believed
    assert sent["x-request-id"] == r.headers["x-request-id"]


def test_a_trusted_proxy_keeps_the_client_x_forwarded_for_and_the_peer_is_appended_once(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread]
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), trusted_proxies="127.0.0.1/32")
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=HOSTILE)
    assert r.status_code == 200, r.text
    sent = _sent(std)
    _assert_hostile_dropped(sent)
    assert sent["x-forwarded-for"] == "6.6.6.6, 127.0.0.1"


def test_specgate_serve_takes_the_peer_from_the_socket_not_from_a_loopback_client_x_forwarded_for(
    fake: Callable[..., FakeUpstreamServer], served: Callable[..., Served]
) -> None:
    """uvicorn's own proxy-headers handling trusts 127.0.0.1 by default and would make 6.6.6.6 the peer."""
    std = fake("std")
    gw = served(rules_for([std.url], [std.url]))
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"X-Forwarded-For": "6.6.6.6"})
    assert r.status_code == 200, r.text
    assert _sent(std)["x-forwarded-for"] == "127.0.0.1"


# --- a raw upstream that answers what no HTTP framework would -----------------------------------------------------

COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-raw",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
)


def _answer(mode: str) -> bytes:
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    if mode == "101":
        return b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    if mode == "600":
        return b"HTTP/1.1 600 Weird\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    if mode == "headers":
        many = b"".join(b"x-h%d: v\r\n" % i for i in range(4500))
        return b"HTTP/1.1 200 OK\r\n" + many + b"content-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    return ok % (len(COMPLETION), COMPLETION)


class RawUpstream:
    """An asyncio server in a thread: GETs (health checks) answer 200; each POST answers as ``mode`` says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.posts = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                await reader.readexactly(length)
                if head.startswith(b"GET"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                else:
                    self.posts += 1
                    writer.write(_answer(self.mode))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def start(self) -> RawUpstream:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def raw_upstream() -> Iterator[RawUpstream]:
    server = RawUpstream().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("mode", ["101", "600", "headers"])
def test_an_unrelayable_upstream_answer_is_a_502_and_the_gateway_serves_the_next_request(
    raw_upstream: RawUpstream, gateway: Callable[..., ServerThread], mode: str
) -> None:
    gw = gateway(rules_for([raw_upstream.url], [raw_upstream.url]))
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        raw_upstream.mode = mode
        before = raw_upstream.posts
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        expected = "upstream_response_too_large" if mode == "headers" else "upstream_invalid_response"
        assert err["code"] == expected
        assert raw_upstream.posts == before + 1  # not retried on another endpoint or pool
        for stream in (False, True):  # a stream's attempt fails the same way, before anything is committed
            r = client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert r.status_code == 502, r.text
        raw_upstream.mode = "ok"
        after = client.post("/v1/chat/completions", json=CHAT)
        assert after.status_code == 200, after.text
        assert after.json()["choices"][0]["message"]["content"] == "ok"
    metrics = httpx.get(gw.url + "/metrics").text
    if mode == "headers":
        assert 'specgate_limit_refusals_total{limit="response_header_count"}' in metrics
