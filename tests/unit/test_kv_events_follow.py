"""The KV event follower's pure part: what a batch of vLLM's KV cache events does to an endpoint's prefix index
(resets, restarts, gaps, the live block count as a bound) and how malformed batches are refused."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.fleet.kv_events import MAX_EVENTS, CacheTracker, apply_to, decode
from gateway.fleet.pools import EndpointState
from gateway.fleet.prefix_index import PrefixIndex


def stored(*hashes: int, size: int = 16) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None, "token_ids": [],
            "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None}  # fmt: skip


def removed(*hashes: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def endpoint(chunks: int = 100) -> EndpointState:
    ep = EndpointState("e0", "http://127.0.0.1:1", "std", 1.0)
    ep.prefixes = PrefixIndex(capacity_chunks=1000)
    ep.prefixes.record(list(range(1, chunks + 1)))
    return ep


def test_from_sequence_zero_the_live_count_bounds_the_index() -> None:
    ep, t = endpoint(100), CacheTracker()
    assert apply_to(ep, t, 0, [stored(*range(10))]) is None
    assert t.known
    assert t.live_chunks == 10
    assert len(ep.prefixes) == 10  # the server holds 10 blocks: at most 10 of the gateway's chunks are warm
    assert ep.prefixes.match(list(range(1, 101))) == 10  # the prompt's start stays (eviction eats from the end)
    apply_to(ep, t, 1, [removed(0, 1, 2), stored(20, 21)])
    assert t.live_chunks == 9


def test_joining_a_running_server_leaves_the_count_unknown_until_a_clear() -> None:
    ep, t = endpoint(100), CacheTracker()
    apply_to(ep, t, 57, [stored(1, 2)])
    assert not t.known
    assert t.live_chunks is None
    assert len(ep.prefixes) == 100  # nothing known: the index is left alone
    assert apply_to(ep, t, 58, [CLEARED, stored(5)]) == "clear"
    assert len(ep.prefixes) == 0
    assert t.known
    assert t.live_chunks == 1


def test_a_gap_makes_the_count_unknown_and_lifts_the_bound() -> None:
    ep, t = endpoint(50), CacheTracker()
    apply_to(ep, t, 0, [stored(*range(40))])
    assert ep.prefixes.capacity == 40
    apply_to(ep, t, 5, [stored(99)])  # batches 1-4 were lost
    assert t.live_chunks is None
    assert ep.prefixes.capacity == 1000


def test_a_restart_empties_the_index() -> None:
    ep, t = endpoint(30), CacheTracker()
    apply_to(ep, t, 0, [stored(*range(30))])
    apply_to(ep, t, 1, [stored(30)])
    assert len(ep.prefixes) == 30
    assert apply_to(ep, t, 0, [stored(7)]) == "clear"  # the publisher counts from 0 again: a new server process
    assert len(ep.prefixes) == 0
    assert t.known
    assert t.live_chunks == 1


def test_block_size_scales_the_bound() -> None:
    ep, t = endpoint(100), CacheTracker()
    apply_to(ep, t, 0, [stored(*range(10), size=32)])
    assert t.live_chunks == 20  # 10 blocks of 32 tokens = 20 chunks of 16


def test_a_malformed_batch_changes_nothing() -> None:
    ep, t = endpoint(20), CacheTracker()
    apply_to(ep, t, 0, [stored(1, 2, 3)])
    for bad in ([CLEARED, {"type": "BlockStored", "block_hashes": "x"}], [CLEARED, 5], [{"no": "type"}],
                [stored(1, size=0)]):  # fmt: skip
        with pytest.raises(ValueError, match=r"event|block"):
            apply_to(ep, t, 1, bad)
        assert t.live_chunks == 3
        assert len(ep.prefixes) == 3
        assert t.last_seq == 0


def test_decode_takes_vllms_batch_and_refuses_others() -> None:
    payload = msgspec.msgpack.encode([1.5, [stored(1), CLEARED], 0])
    assert decode(payload) == [stored(1), CLEARED]
    for bad in (b"\xc1", msgspec.msgpack.encode({"a": 1}), msgspec.msgpack.encode([1.0])):
        with pytest.raises(ValueError, match=r"msgpack|batch"):
            decode(bad)
    with pytest.raises(ValueError, match="events"):
        decode(msgspec.msgpack.encode([1.0, [CLEARED] * (MAX_EVENTS + 1), 0]))


def test_the_bound_is_lifted_when_no_longer_known() -> None:
    idx = PrefixIndex(capacity_chunks=100)
    idx.bound_live(5)
    idx.record(list(range(50)))
    assert len(idx) == 5
    idx.bound_live(None)
    idx.record(list(range(100, 150)))
    assert len(idx) == 55
