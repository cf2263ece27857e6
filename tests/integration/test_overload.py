"""Overload through real sockets (uvicorn, the fake upstream): a full connection pool is back-pressure (503 overloaded
with Retry-After, the endpoint stays healthy, the next request is served at once), and a client that stops reading
is cut off with its upstream request cancelled, its connection slot and in-flight count released."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, poll, rules_for, static_routes

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.9}


def one_pool_rules(url: str, **pool: Any) -> dict[str, Any]:
    """Everything to the standard pool, one endpoint, no fallback (no controller: it would add the spec pool)."""
    rules = static_routes(rules_for([url], [url]))
    rules["pools"][1].update(pool)
    rules["classes"] = [{"name": "default", "route": {"preferred": "std"}}]
    return rules


def metric(gw: ServerThread, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def wait_for(check: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    return poll(check, timeout_s)


def test_a_full_connection_pool_is_back_pressure_not_an_unhealthy_endpoint(fake: Fake, gateway: Gateway) -> None:
    std = fake("std", tokens=20, token_delay_s=0.1)
    timeouts = {"connect_s": 0.5, "first_byte_s": 0.5, "total_s": 30}
    rules = one_pool_rules(std.url, max_connections=1, timeouts=timeouts, max_num_seqs=4)
    gw = gateway(rules, health_interval_s=600)
    holder: dict[str, Any] = {}

    def long_stream() -> None:
        holder["r"] = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)

    t = threading.Thread(target=long_stream)
    t.start()
    assert wait_for(lambda: std.state.stats()["in_flight"] == 1)
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)  # no free connection within 0.5 s
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "overloaded"
    assert "no free connection" in err["message"]
    t.join()
    assert holder["r"].status_code == 200
    # Not marked down, not counted toward ejection: the next request is served at once (no health round between).
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200
    assert metric(gw, "specgate_upstream_attempts_total", pool="std", result="pool_full") == 1
    assert metric(gw, "specgate_shed_total", pool="std", reason="busy") == 1
    assert metric(gw, "specgate_endpoint_ejections_total") == 0
    assert metric(gw, "specgate_endpoint_healthy", pool="std") == 1
    assert metric(gw, "specgate_in_flight_requests", pool="std") == 0
    # The admission bound (1 endpoint x (4 + 2 waiting)) is exported after a scrape round.
    assert wait_for(lambda: metric(gw, "specgate_admission_limit", pool="std") == 6)


def stalled_request(gw: ServerThread, body: dict[str, Any], headers: str = "") -> socket.socket:
    """A streaming request from a client with a tiny receive buffer that never reads its response. The gateway's
    side of the connection gets a small send buffer too (accepted sockets inherit it from the listening one), so a
    few hundred KiB fill the way to the client instead of the megabytes loopback's autotuning allows."""
    gw._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gw.port))
    payload = orjson.dumps(body)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n{headers}\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def test_a_client_that_stops_reading_is_cut_off_and_its_slot_released(fake: Fake, gateway: Gateway) -> None:
    std = fake("std", tokens=5)
    rules = one_pool_rules(std.url, max_connections=1)
    rules["overload"] = {"client_send_timeout_s": 0.5}
    gw = gateway(rules)
    # A token a millisecond for up to 20 s: the buffers to the client fill within a second or two.
    sock = stalled_request(gw, {**CHAT, "stream": True}, "x-fake-behavior: tokens=20000,token_delay=0.001\r\n")
    try:
        assert wait_for(lambda: metric(gw, "specgate_client_stalled_total", pool="std") == 1, 60)
        assert wait_for(lambda: metric(gw, "specgate_in_flight_requests", pool="std") == 0)
        assert wait_for(lambda: std.state.stats()["aborted"] == 1)  # the generation was cancelled upstream
        assert std.state.stats()["completed"] == 0
        assert metric(gw, "specgate_requests_total", outcome="client_stalled") == 1
        # The only connection of the pool is free again: another client is served.
        r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30)
        assert r.status_code == 200
        assert r.text.endswith("data: [DONE]\n\n")
        # The stalled client's connection was closed by the gateway.
        sock.settimeout(10)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def test_a_stalled_keyed_request_runs_to_its_end_and_is_replayed(fake: Fake, gateway: Gateway) -> None:
    std = fake("std", tokens=5)
    rules = one_pool_rules(std.url)
    rules["overload"] = {"client_send_timeout_s": 0.5}
    gw = gateway(rules)
    body = {**CHAT, "stream": True}
    behavior = "tokens=4000,token_delay=0.001"
    sock = stalled_request(gw, body, f"x-fake-behavior: {behavior}\r\nidempotency-key: stall-1\r\n")
    try:
        assert wait_for(lambda: metric(gw, "specgate_client_stalled_total", pool="std") == 1, 60)
        assert wait_for(lambda: std.state.stats()["completed"] == 1, 60)  # generated to its end, not cancelled
        assert wait_for(lambda: metric(gw, "specgate_in_flight_requests", pool="std") == 0)
    finally:
        sock.close()
    r = httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"idempotency-key": "stall-1", "x-fake-behavior": behavior},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")
    assert std.state.stats()["started"] == 1  # the retry was a replay of the stored answer
