"""Slow and greedy clients against a real uvicorn gateway: the head and body deadlines (408), the keep-alive idle
time, the connection caps (503), all before authentication; and a large legal body that must not hold up others.

The deadlines are set short in each test; the assertions on time are generous bounds (a slow shared machine): they
catch a connection that is never closed, not a timer that is a little late.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from gateway.bench.attacks import huge_header
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for
from tests.integration.test_limits_client import metric, posts, read_response, send_head_attack

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
KEY = "good-key"


def request(body: bytes = CHAT, *, key: str | None = KEY, length: int | None = None) -> bytes:
    auth = b"authorization: Bearer %s\r\n" % key.encode() if key else b""
    n = len(body) if length is None else length
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return head + auth + b"content-length: %d\r\n\r\n" % n + body


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """Read until the server closes the connection; what it sent, or None when still open after ``seconds``."""
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], 0.1)
        if ready:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk
    return None


def trickle(sock: socket.socket, pieces: list[bytes], every_s: float = 0.05) -> bytes | None:
    """Send ``pieces`` one at a time, ``every_s`` apart, until the server answers; then all it sent until it closed
    (None: it never answered)."""
    for piece in pieces:
        with contextlib.suppress(OSError):  # the server answered and half-closed: our sends may fail
            sock.send(piece)
        ready, _, _ = select.select([sock], [], [], every_s)
        if ready:
            return closed_within(sock, 10)
    return None


def error_of(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), orjson.loads(body)["error"]


def test_a_trickling_head_gets_408_at_its_deadline_before_authentication(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), api_keys=KEY, header_timeout_s=1.0)
    head = request(key=None)
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        started = time.monotonic()
        answer = trickle(sock, [bytes([b]) for b in head[:-4]])  # a byte every 50 ms, never the head's blank line
        elapsed = time.monotonic() - started
    assert answer is not None
    status, err = error_of(answer)
    assert status == 408
    assert err["code"] == "request_timeout"
    assert err["type"] == "invalid_request_error"
    assert 0.5 <= elapsed < 8  # the 1 s deadline, counted from the first byte; generous for a slow machine
    assert posts(std) == []
    assert metric(gw, 'specgate_limit_refusals_total{limit="head_timeout"}') == 1


def test_blank_lines_before_a_request_count_as_its_head(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), header_timeout_s=1.0, keep_alive_s=60)
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        started = time.monotonic()
        answer = trickle(sock, [b"\r\n"] * 400)  # CRLF every 50 ms: none of them resets a timer
        elapsed = time.monotonic() - started
    assert answer == b""  # closed at the head's deadline; no request began, so no answer (a stray 408 could be
    assert elapsed < 10  # read by the client as the answer to its next request)
    assert metric(gw, 'specgate_limit_refusals_total{limit="head_timeout"}') == 1


def test_idle_connections_are_closed_after_keep_alive_new_or_after_a_response(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), keep_alive_s=0.5)
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:  # never sends anything
        assert closed_within(sock, 10) == b""  # closed silently: no request, nothing to answer
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(request())
        assert read_response(sock)[0] == 200
        assert closed_within(sock, 10) == b""  # then idle: closed


def test_a_stalled_body_gets_408_and_the_app_sees_the_client_gone(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), api_keys=KEY, body_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        started = time.monotonic()
        sock.sendall(request(b"{", length=100))  # 1 of 100 bytes, then nothing
        answer = closed_within(sock, 10)
        elapsed = time.monotonic() - started
    assert answer is not None
    status, err = error_of(answer)
    assert status == 408
    assert err["code"] == "request_timeout"
    assert 0.5 <= elapsed < 8
    assert posts(std) == []
    assert metric(gw, 'specgate_limit_refusals_total{limit="body_timeout"}') == 1
    # Unauthenticated: answered 401 at once (the key is checked before the body is read); the connection, still
    # owed 99 bytes, is closed at the body's deadline all the same.
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(request(b"{", key=None, length=100))
        answer = closed_within(sock, 10)
    assert answer is not None
    assert answer.startswith(b"HTTP/1.1 401")


def test_a_large_body_may_take_longer_at_the_minimum_rate(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), body_timeout_s=0.5, body_min_rate=1024)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 6000}]})
    # ~6 KB at ~4 KB/s: 1.5 s, past body_timeout_s but within its size at 1 KiB/s (about 6 s).
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(request(body[:100], length=len(body)))
        for i in range(100, len(body), 400):
            time.sleep(0.1)
            sock.sendall(body[i : i + 400])
        status, _, answer = read_response(sock, timeout=20)
    assert status == 200, answer


def open_connection(port: int) -> socket.socket:
    """A keep-alive connection that the gateway has accepted and answered once."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(request())
    status, _, body = read_response(sock)
    assert status == 200, body
    return sock


def refused(port: int) -> tuple[int, dict[str, Any], dict[str, str]]:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(request())
        status, headers, body = read_response(sock)
    return status, orjson.loads(body)["error"], headers


def wait_accepted(port: int, seconds: float = 10) -> socket.socket:
    """A new connection, once the gateway has noticed that an old one closed (connection_lost is asynchronous)."""
    deadline = time.monotonic() + seconds
    while True:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request())
        status, _, _ = read_response(sock)
        if status == 200:
            return sock
        sock.close()
        assert time.monotonic() < deadline, "a closed connection was never released"
        time.sleep(0.05)


def test_the_per_client_cap_refuses_with_503_and_a_closed_connection_frees_its_place(
    fake: Fake, gateway: Gateway
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), api_keys=KEY, max_connections_per_client=3, keep_alive_s=60)
    held = [open_connection(gw.port) for _ in range(3)]
    try:
        status, err, headers = refused(gw.port)
        assert status == 503
        assert err["code"] == "too_many_connections"
        assert err["type"] == "service_unavailable"
        assert headers["retry-after"] == "1"
        held.pop().close()
        held.append(wait_accepted(gw.port))
        assert refused(gw.port)[0] == 503
    finally:
        for s in held:
            s.close()
    # Every way a connection ends gives its place back: refused heads (431), timeouts, plain closes.
    for _ in range(4):
        with contextlib.suppress(OSError, IndexError):
            send_head_attack(gw.port, huge_header(2**20))
    held = [wait_accepted(gw.port) for _ in range(3)]
    for s in held:
        s.close()
    assert metric(gw, 'specgate_limit_refusals_total{limit="connections_per_client"}') >= 2


def test_the_total_cap(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), max_connections=2, max_connections_per_client=0, keep_alive_s=60)
    held = [open_connection(gw.port) for _ in range(2)]
    try:
        status, err, _ = refused(gw.port)
        assert status == 503
        assert "in total" in err["message"]
    finally:
        for s in held:
            s.close()
    wait_accepted(gw.port).close()


def test_a_large_body_of_tiny_messages_lets_a_concurrent_health_check_through(fake: Fake, gateway: Gateway) -> None:
    """7.9 MB of 230k messages (under the 8 MiB limit). The bound is generous: the test and the upstream share the
    gateway's process here (its GIL too); the number for the record comes from a gateway of its own (docs/limits.md)."""
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]))
    big = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}] * 230_000})
    assert 7_500_000 < len(big) < 8 * 2**20
    results: dict[str, Any] = {}

    def post() -> None:
        r = httpx.post(gw.url + "/v1/chat/completions", content=big, timeout=60)
        results["status"] = r.status_code

    worker = threading.Thread(target=post)
    worker.start()
    health: list[float] = []
    with httpx.Client(timeout=30) as client:
        while worker.is_alive():
            t0 = time.perf_counter()
            assert client.get(gw.url + "/health").status_code == 200
            health.append(time.perf_counter() - t0)
    worker.join()
    assert results["status"] == 200
    assert health
    assert max(health) < 10
