"""Hostile clients against a real uvicorn gateway: request-head limits enforced as the bytes arrive, before auth.

Each attack is reproduced as a client would send it (raw sockets), at sizes scaled down so the tests stay fast;
the limits are the defaults (64 KiB of head, 100 header fields) unless a test says otherwise.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from gateway.bench.attacks import health_latencies, huge_header, many_headers, start_flood
from gateway.bench.load import percentile
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

CHAT = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


def posts(server: FakeUpstreamServer) -> list[dict[str, Any]]:
    return [r for r in server.state.requests if r["method"] == "POST"]


def read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Read one whole HTTP/1.1 response (content-length framed), leaving what follows it on the socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)  # byte by byte: a pipelined second response stays unread
        if not chunk:
            break
        data += chunk
    lines = data.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    length = int(headers["content-length"])
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            break
        body += chunk
    return status, headers, body


def send_head_attack(port: int, head: bytes, piece: int = 65536) -> tuple[int, dict[str, str], bytes, int]:
    """Send ``head`` (a request head, maybe never ending) as fast as the server reads it; stop when it answers.

    Returns the answer and how many bytes the server took before answering."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(10)
        with contextlib.suppress(OSError):  # the server answers and half-closes mid-send: broken pipe or reset
            while sent < len(head):
                sent += sock.send(head[sent : sent + piece])
        status, headers, body = read_response(sock)
    return status, headers, body, sent


def metric(gw: ServerThread, name: str) -> float:
    text = httpx.get(
        gw.url + "/metrics", headers={"authorization": "Bearer good-key"}
    ).text  # keys set: /metrics needs one
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
def gw_auth(fake: Fake, gateway: Gateway) -> tuple[ServerThread, FakeUpstreamServer]:
    std = fake("std")
    return gateway(rules_for([std.url], [std.url]), api_keys="good-key"), std


def test_one_huge_header_without_credentials_is_431_after_the_limit(gw_auth: Any) -> None:
    gw, std = gw_auth
    # A header that has not ended (the client is still sending): answered without waiting for its end.
    status, headers, body, _ = send_head_attack(gw.port, huge_header(8 * 2**20)[: 2**20])
    assert status == 431
    assert headers["content-type"] == "application/json"
    err = orjson.loads(body)["error"]
    assert err["code"] == "request_header_fields_too_large"
    assert err["type"] == "invalid_request_error"
    assert "65536" in err["message"]
    # The whole of it: drained (up to a bound), dropped; the client may see 431 or the connection reset.
    with contextlib.suppress(OSError, IndexError):
        assert send_head_attack(gw.port, huge_header(8 * 2**20))[0] == 431
    assert posts(std) == []
    assert metric(gw, 'specgate_limit_refusals_total{limit="header_bytes"}') == 2
    assert posts(std) == []


def test_too_many_headers_with_a_valid_key_are_431_and_never_forwarded(gw_auth: Any) -> None:
    gw, std = gw_auth
    status, _, body, _ = send_head_attack(gw.port, many_headers(3000, "good-key", CHAT))
    assert status == 431
    assert orjson.loads(body)["error"]["code"] in ("too_many_headers", "request_header_fields_too_large")
    status, _, body, _ = send_head_attack(gw.port, many_headers(150, "good-key", CHAT))  # within the bytes limit
    assert status == 431
    assert orjson.loads(body)["error"]["code"] == "too_many_headers"
    assert posts(std) == []
    # Just under both limits: forwarded as usual.
    status, _, body, _ = send_head_attack(gw.port, many_headers(90, "good-key", CHAT))
    assert status == 200, body
    assert len(posts(std)) == 1


def test_a_head_at_the_limit_then_a_big_body_is_not_mistaken_for_a_long_head(fake: Fake, gateway: Gateway) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), max_header_bytes=4096)
    pad = b"x" * 3800
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "y" * 200_000}]})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-pad: %s\r\ncontent-length: %d\r\n\r\n" % (
        pad,
        len(body),
    )
    assert len(head) < 4096
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(head + body)  # one write: the head's end and much body arrive in the same read
        status, _, answer = read_response(sock)
    assert status == 200, answer
    # Keep-alive: a second request on the same connection has its head counted from zero.
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        small = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-pad: %s\r\ncontent-length: %d\r\n\r\n%s" % (
            pad,
            len(CHAT),
            CHAT,
        )
        sock.sendall(small + small)  # pipelined
        assert read_response(sock)[0] == 200
        assert read_response(sock)[0] == 200


def test_a_malformed_request_gets_the_envelope(gw_auth: Any) -> None:
    gw, _ = gw_auth
    status, _headers, body, _ = send_head_attack(gw.port, b"POST /v1/chat/completions HTTP/1.1\r\nbad header\r\n\r\n")
    assert status == 400
    assert orjson.loads(body)["error"]["code"] == "invalid_http_request"


def test_bystanders_stay_fast_while_huge_headers_arrive(gw_auth: Any) -> None:
    """The issue's 32 MiB header froze the loop for seconds (quadratic joins in the parser: /health p99 3.6 s);
    here 3 attackers, in their own process, send 8 MiB headers in a loop while a bystander's /health p99 stays
    under 50 ms. On a machine too busy for that even without an attack, the bound is 3x the p99 measured just
    before (the frozen loop was 100x)."""
    gw, _ = gw_auth
    quiet = percentile(health_latencies(gw.url, 1.5), 0.99)
    attack = start_flood(gw.port, 8 * 2**20, clients=3, seconds=4)
    try:
        time.sleep(0.5)
        lat = health_latencies(gw.url, 2.5)
        out, _ = attack.communicate(timeout=60)
    finally:
        attack.kill()
    statuses = orjson.loads(out)["statuses"]
    assert "431" in statuses, statuses
    assert set(statuses) <= {"431", "0"}, statuses  # 0: reset while still sending, after the drain bound
    p99 = percentile(lat, 0.99)
    bound = max(0.05, 3 * quiet)
    assert p99 < bound, f"/health p99 {p99 * 1000:.1f} ms during the attack, {quiet * 1000:.1f} ms before"
