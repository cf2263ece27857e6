"""Header hygiene: RFC 9110 §7.6.1 hop-by-hop headers, credentials, request ids."""

from __future__ import annotations

import pytest

from gateway.proxy.headers import HOP_BY_HOP, client_response_headers, request_id, upstream_request_headers


def test_hop_by_hop_and_connection_named_headers_are_dropped() -> None:
    client = [
        ("Host", "gw.example"),
        ("Connection", "keep-alive, X-Custom-Hop"),
        ("Keep-Alive", "timeout=5"),
        ("X-Custom-Hop", "secret"),
        ("TE", "trailers"),
        ("Transfer-Encoding", "chunked"),
        ("Upgrade", "h2c"),
        ("Proxy-Authorization", "Basic abc"),
        ("Content-Length", "123"),
        ("X-Sim-Task", "code"),
        ("Accept", "application/json"),
        ("Connection", "traceparent"),
        ("traceparent", "00-abc-def-01"),
    ]
    out = upstream_request_headers(client, request_id="rid-1", api_key=None)
    for name in [*HOP_BY_HOP, "host", "content-length", "x-custom-hop", "traceparent"]:
        assert name not in out, name
    assert out["x-sim-task"] == "code"
    assert out["accept"] == "application/json"
    assert out["x-request-id"] == "rid-1"


def test_client_authorization_is_replaced_by_pool_key() -> None:
    out = upstream_request_headers([("Authorization", "Bearer client-key")], request_id="r", api_key="pool-key")
    assert out["authorization"] == "Bearer pool-key"


def test_client_authorization_is_dropped_without_pool_key() -> None:
    out = upstream_request_headers([("authorization", "Bearer client-key")], request_id="r", api_key=None)
    assert "authorization" not in out
    assert "client-key" not in str(out)


def test_client_request_id_is_replaced_by_the_chosen_one() -> None:
    out = upstream_request_headers([("X-Request-Id", "from-client")], request_id="chosen", api_key=None)
    assert out["x-request-id"] == "chosen"


@pytest.mark.parametrize(
    ("incoming", "kept"),
    [
        ("abc-123", True),
        ("req_01:xyz.9", True),
        ("", False),
        (None, False),
        ("bad id with spaces", False),
        ("x" * 129, False),
        ("inject\r\nx: y", False),
    ],
)
def test_request_id_kept_only_when_sane(incoming: str | None, kept: bool) -> None:
    rid = request_id(incoming)
    assert (rid == incoming) is kept
    assert 1 <= len(rid) <= 128


def test_new_request_ids_are_version_4_uuids_from_either_source() -> None:
    """From the runtime's generator (the request path) or from the system's randomness: 32 hex digits with the
    version and variant bits of a random UUID, as ``uuid.uuid4().hex``, and none repeated."""
    import random
    import uuid

    draw = random.Random(7).getrandbits
    ids = [request_id(None, draw) for _ in range(500)] + [request_id(None) for _ in range(500)]
    assert len(set(ids)) == len(ids)
    for rid in ids:
        u = uuid.UUID(hex=rid)
        assert (u.version, u.variant, u.hex) == (4, uuid.RFC_4122, rid)
    assert request_id("client-id", draw) == "client-id"


def test_response_headers_drop_hop_by_hop_and_framing() -> None:
    upstream = [
        ("Content-Type", "application/json"),
        ("Content-Length", "10"),
        ("Connection", "close, X-Internal"),
        ("X-Internal", "1"),
        ("Transfer-Encoding", "chunked"),
        ("Server", "uvicorn"),
        ("Date", "Mon"),
        ("X-Specgate-Pool", "forged"),
        ("X-Request-Id", "upstream-id"),
        ("X-Vllm-Thing", "kept"),
    ]
    out = dict(client_response_headers([(k.encode(), v.encode()) for k, v in upstream]))
    assert out == {b"content-type": b"application/json", b"x-vllm-thing": b"kept"}


def test_response_header_values_are_never_decoded() -> None:
    out = client_response_headers([(b"X-Odd", b"caf\xe9"), (b"Content-Type", b"application/json")])
    assert (b"x-odd", b"caf\xe9") in out
