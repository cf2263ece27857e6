"""A stored Idempotency-Key response read back from a store is validated, never trusted (``StoredResponse.decode``),
and the in-memory store honours the caller's read cap as Redis does."""

from __future__ import annotations

import orjson
import pytest

from gateway.proxy.stored_response import StoredResponse
from gateway.store.base import Completed
from gateway.store.memory import MemoryStore


def _blob(head: object, body: bytes = b"{}") -> bytes:
    raw = orjson.dumps(head)
    return b"SGI1" + len(raw).to_bytes(4, "big") + raw + body


def test_what_the_gateway_writes_reads_back() -> None:
    stored = StoredResponse(410, ((b"content-type", b"application/json"), (b"x-request-id", b"r-1")), b'{"a":1}')
    assert StoredResponse.decode(stored.encode(), max_bytes=1024) == stored


@pytest.mark.parametrize(
    ("blob", "why"),
    [
        (_blob({"status": 200}), "headers"),
        (_blob({"status": 1000, "headers": []}), "status"),
        (_blob({"status": 199, "headers": []}), "status"),
        (_blob({"status": True, "headers": []}), "status"),
        (_blob({"status": 200, "headers": [["set-cookie", "a=b"]]}), "not one the gateway stores"),
        (_blob({"status": 200, "headers": [["location", "http://x/"]]}), "not one the gateway stores"),
        (_blob({"status": 200, "headers": [["x-request-id", "a"], ["x-request-id", "b"]]}), "repeated"),
        (_blob({"status": 200, "headers": [["content-type", "a\nb"]]}), "value"),
        (_blob({"status": 200, "headers": [["content-type"]]}), "pair"),
        (_blob([200]), "object"),
        (b"SGI1" + (10**6).to_bytes(4, "big") + b"{}", "head of"),
        (b"junk", "magic"),
        (_blob({"status": 200, "headers": []}, b"x" * 2048), "larger than 1024"),
    ],
)
def test_anything_else_is_refused_with_a_reason(blob: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        StoredResponse.decode(blob, max_bytes=1024)


async def test_the_memory_store_does_not_hand_back_a_record_over_the_cap() -> None:
    store = MemoryStore()
    got = await store.claim("k", "fp", lease_ms=10_000)
    assert not isinstance(got, Completed)
    assert await store.complete("k", got.token, b"x" * 100, ttl_ms=10_000)  # type: ignore[union-attr]
    assert await store.claim("k", "fp", lease_ms=1, max_bytes=99) == Completed("fp", b"", oversize=True)
    assert await store.claim("k", "fp", lease_ms=1, max_bytes=100) == Completed("fp", b"x" * 100)
