"""The simulator's prefix cache: vLLM's chained block hashes, reference counts and LRU eviction (``prefix_cache``),
the engine skipping cached prefill under a bounded block budget, and the KV events' msgpack shapes."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import random
from typing import Any

import msgspec
import pytest

from gateway.sim import tokens
from gateway.sim.engine import Engine, Generation, GenRequest
from gateway.sim.kv_events import KVEventsConfig, decode_batch, encode_batch
from gateway.sim.metrics import VllmMetrics
from gateway.sim.prefix_cache import (
    NONE_HASH,
    Cleared,
    PrefixCache,
    Removed,
    Stored,
    block_hash,
    chain_hashes,
    external_hash,
)
from gateway.sim.presets import get_preset

BS = 16


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


# --------------------------------------------------------------------------------------------------------------
# Hashing


def test_block_hash_is_vllms_sha256_of_the_pickled_parent_tokens_and_extra_keys() -> None:
    expected_none = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()
    assert expected_none == NONE_HASH
    block = list(range(16))
    first = block_hash(None, block)
    assert first == hashlib.sha256(pickle.dumps((NONE_HASH, tuple(block), None), protocol=5)).digest()
    second = block_hash(first, block)
    assert second != first  # the same tokens after another prefix are another block
    assert external_hash(first) == int.from_bytes(first[-8:], "big")


def test_chain_hashes_name_the_whole_prefix_a_changed_early_block_invalidates_the_rest() -> None:
    a = ids(100, 1)
    ha = chain_hashes(a, BS)
    assert len(ha) == 100 // BS  # full blocks only
    assert chain_hashes(a[:64], BS) == ha[:4]  # a prefix's blocks are the prefix of the blocks
    b = list(a)
    b[20] += 1  # a token of block 1 changes
    hb = chain_hashes(b, BS)
    assert hb[0] == ha[0]
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))
    tail = chain_hashes(a, BS, start_block=3, parent=ha[2])
    assert tail == ha[3:]


# --------------------------------------------------------------------------------------------------------------
# PrefixCache bookkeeping


def test_match_acquire_release_and_lru_order() -> None:
    cache = PrefixCache(BS, record_events=True)
    a, b = ids(64, 1), ids(64, 2)
    ha, hb = chain_hashes(a, BS), chain_hashes(b, BS)
    assert cache.adopt(ha, a, 0, None) == 0  # a's blocks cached, held by a
    assert cache.adopt(hb, b, 0, None) == 0
    assert cache.match(ha, 10) == (4, 0)  # all cached, all held
    assert cache.match(ha, 2) == (2, 0)  # capped
    assert cache.release(ha) == 4
    assert cache.release(hb) == 4
    # a released first: its blocks are the least recently used; of each chain the deepest block goes first
    assert cache.lru_order() == [*reversed(ha), *reversed(hb)]
    assert cache.match(ha, 10) == (4, 4)
    assert cache.acquire(ha[:2]) == 2  # a hit takes its blocks out of free memory
    assert cache.free == 6
    assert cache.evict(3) == 3  # only free cached blocks go, oldest first
    assert cache.lru_order() == list(reversed(hb))[1:]
    assert cache.match(ha, 10) == (2, 0)  # ha[2:] were evicted; the held head stays
    assert cache.match(hb, 10) == (3, 3)  # hb lost its deepest block only
    events = cache.take_events()
    stored = [e for e in events if isinstance(e, Stored)]
    assert [(e.hashes, e.parent, len(e.token_ids)) for e in stored] == [(tuple(ha), None, 64), (tuple(hb), None, 64)]
    removed = [e.hash for e in events if isinstance(e, Removed)]
    assert removed == [ha[3], ha[2], hb[3]]
    assert not cache.clear()  # ha[:2] are held
    cache.release(ha[:2])
    assert cache.clear()
    assert isinstance(cache.take_events()[-1], Cleared)
    assert len(cache) == 0


def test_adopt_shares_a_block_computed_twice_and_stores_runs_with_their_parent() -> None:
    cache = PrefixCache(BS, record_events=True)
    a = ids(64, 3)
    ha = chain_hashes(a, BS)
    cache.adopt(ha[:2], a, 0, None)  # another sequence holds blocks 0-1
    cache.take_events()
    # a second sequence computed all four: blocks 0-1 are shared (its copies freed), 2-3 new
    assert cache.adopt(ha, a, 0, None) == 2
    assert [cache.refs(h) for h in ha] == [2, 2, 1, 1]
    (event,) = cache.take_events()
    assert isinstance(event, Stored)
    assert event.hashes == tuple(ha[2:])
    assert event.parent == ha[1]
    assert event.token_ids == tuple(a[32:64])


def test_memory_stays_bounded_under_random_use() -> None:
    """Whatever the order of adopt/release/evict, the cache never holds more free blocks than it is told fit."""
    rng = random.Random(7)
    cache = PrefixCache(BS)
    prompts = [ids(16 * rng.randint(1, 8), i) for i in range(30)]
    held: list[list[bytes]] = []
    for _ in range(500):
        if held and rng.random() < 0.5:
            cache.release(held.pop(rng.randrange(len(held))))
        else:
            p = rng.choice(prompts)
            h = chain_hashes(p, BS)
            n, _ = cache.match(h, len(h))
            cache.acquire(h[:n])
            cache.adopt(h[n:], p, n, h[n - 1] if n else None)
            held.append(h)
        budget = rng.randint(0, 40)
        cache.evict(budget)
        assert cache.free <= budget
        assert all(cache.refs(h) >= 1 for chain in held for h in chain)


# --------------------------------------------------------------------------------------------------------------
# The engine


def make(kv_tokens: int, **kw: Any) -> Engine:
    preset = get_preset("llama70b-4xh100")
    return Engine(
        preset,
        None,
        VllmMetrics("sim", max_model_len=preset.max_model_len),
        kv_cache_tokens=kv_tokens,
        virtual_clock=True,
        **kw,
    )


def request(name: str, prompt: list[int], out: int = 8) -> GenRequest:
    return GenRequest(
        name,
        len(prompt),
        out,
        0.0,
        prompt_ids=prompt,
        answer_ids=lambda n: tokens.answer_ids(" ".join(["word"] * n), chat=True),
    )


async def run(engine: Engine, *reqs: GenRequest) -> list[Generation]:
    """Each request in turn, to its end."""
    out = []
    for r in reqs:
        g = engine.submit(r)
        await asyncio.wait_for(g.wait(), timeout=30)
        out.append(g)
    return out


async def test_a_repeated_prompt_skips_its_cached_prefill() -> None:
    engine = make(100_000)
    await engine.start()
    try:
        prompt = ids(2000, 1)
        first, second = await run(engine, request("a", prompt), request("b", prompt))
        other = list(prompt)
        other[100] += 1  # block 6 changes: only blocks 0-5 can hit
        (third,) = await run(engine, request("c", other))
    finally:
        await engine.stop()
    assert first.cached_tokens == 0
    assert second.cached_tokens == 1984  # 124 full blocks; the last token is always computed
    assert third.cached_tokens == 6 * BS
    ttft = [g.first_token - g.arrival for g in (first, second)]  # type: ignore[operator]
    assert ttft[1] < 0.2 * ttft[0]
    text = engine.metrics.render().decode()
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim"} 6000.0' in text
    assert f'vllm:prefix_cache_hits_total{{engine="0",model_name="sim"}} {1984 + 96}.0' in text


async def test_the_answer_is_cached_so_the_next_turn_hits_prompt_and_answer() -> None:
    engine = make(100_000)
    await engine.start()
    try:
        prompt = ids(200, 2)
        (turn1,) = await run(engine, request("t1", prompt, out=40))
        answer = tokens.answer_ids(" ".join(["word"] * turn1.tokens), chat=True)
        (turn2,) = await run(engine, request("t2", [*prompt, *answer, *ids(50, 3)]))
    finally:
        await engine.stop()
    assert turn2.cached_tokens == (200 + len(answer)) // BS * BS
    assert turn2.cached_tokens > 200


async def test_no_prefix_caching_gives_no_hits() -> None:
    engine = make(100_000, enable_prefix_caching=False)
    await engine.start()
    try:
        prompt = ids(500, 1)
        gens = await run(engine, request("a", prompt), request("b", prompt))
    finally:
        await engine.stop()
    assert [g.cached_tokens for g in gens] == [0, 0]
    assert engine.cache is None
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="sim"} 0.0' in engine.metrics.render().decode()


async def test_eviction_under_a_small_block_budget_is_lru_and_bounded() -> None:
    """100 blocks: three 640-token prompts (40 blocks each, 41 with the answer) cannot all stay cached."""
    events: list[Any] = []
    engine = make(100 * BS, on_kv_events=events.extend)
    await engine.start()
    try:
        a, b, c = ids(640, 1), ids(640, 2), ids(640, 3)
        await run(engine, request("a", a), request("b", b))
        assert engine.cache is not None
        assert len(engine.cache) <= engine.total_blocks
        await run(engine, request("c", c))  # needs 41 blocks: a's (the oldest) go
        assert len(engine.cache) <= engine.total_blocks
        (b2,) = await run(engine, request("b2", b))
        (a2,) = await run(engine, request("a2", a))
    finally:
        await engine.stop()
    assert b2.cached_tokens == 639 // BS * BS  # b, more recent, survived
    assert a2.cached_tokens < 639 // BS * BS  # a was evicted (deepest blocks first)
    removed = {e.hash for e in events if isinstance(e, Removed)}
    assert set(chain_hashes(a, BS)[-5:]) <= removed
    assert isinstance(events[-1], Cleared)  # the engine stopped


# --------------------------------------------------------------------------------------------------------------
# KV events on the wire


def test_kv_event_batch_is_vllms_msgpack_shape() -> None:
    a = ids(32, 1)
    ha = chain_hashes(a, BS)
    events = [Stored(tuple(ha), None, tuple(a), BS), Removed(ha[1]), Cleared()]
    payload = encode_batch(events, 1234.5)
    raw = msgspec.msgpack.decode(payload)  # untyped: arrays and maps as sent
    assert raw[0] == 1234.5
    assert raw[2] == 0  # data_parallel_rank
    stored, removed, cleared = raw[1]
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx",
    ]  # fmt: skip
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == [external_hash(h) for h in ha]
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == a
    assert (stored["block_size"], stored["medium"], stored["extra_keys"], stored["group_idx"]) == (
        16,
        "GPU",
        [None] * 2,
        0,
    )
    assert removed == {"type": "BlockRemoved", "block_hashes": [external_hash(ha[1])], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}
    batch = decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_kv_events_config_is_validated_like_vllms() -> None:
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5999"}')
    assert cfg.active
    assert cfg.resolved_publisher == "zmq"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').active
    assert not KVEventsConfig.from_json('{"publisher": "zmq"}').active
    for bad in ('{"nope": 1}', '{"publisher": "kafka"}', '{"buffer_steps": 0}', "[1]", "{"):
        with pytest.raises(ValueError, match=r"kv.events.config|kv_events_config"):
            KVEventsConfig.from_json(bad)
