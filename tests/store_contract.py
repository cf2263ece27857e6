"""The contract every ``Store`` keeps, written once and run against each implementation.

A test module subclasses ``StoreContract`` and provides a ``store`` fixture (a fresh, empty store); pytest then
runs every test below against it (``tests/unit/test_store_memory.py``, ``tests/integration/test_store_redis.py``).
The idempotency guard relies on exactly these behaviours, whichever store a deployment configures.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from gateway.store.base import Claimed, Completed, Running, Store, StoreUnavailable

LEASE_MS = 30_000
TTL_MS = 60_000

BODIES = {
    "non-utf8": b'\xff\xfe\x00\x80data: {"x": 1}\r\n\r\n\xc3\x28\x00',
    "empty": b"",
    "1mb": os.urandom(1024 * 1024),
}


async def _claimed(store: Store, key: str, fingerprint: str = "fp-1", *, lease_ms: int = LEASE_MS) -> str:
    res = await store.claim(key, fingerprint, lease_ms=lease_ms)
    assert isinstance(res, Claimed), res
    return res.token


class StoreContract:
    async def test_first_claim_owns_the_key(self, store: Store) -> None:
        res = await store.claim("k", "fp-1", lease_ms=LEASE_MS)
        assert isinstance(res, Claimed)
        assert len(res.token) == 32
        assert await store.get("k") == Running("fp-1")

    async def test_missing_key_is_none(self, store: Store) -> None:
        assert await store.get("nothing-here") is None

    async def test_second_claim_sees_the_first_fingerprint(self, store: Store) -> None:
        await _claimed(store, "k", "fp-1")
        assert await store.claim("k", "fp-2", lease_ms=LEASE_MS) == Running("fp-1")

    async def test_tokens_differ_between_claims(self, store: Store) -> None:
        a = await _claimed(store, "a")
        b = await _claimed(store, "b")
        assert a != b

    @pytest.mark.parametrize("body", list(BODIES.values()), ids=list(BODIES))
    async def test_completed_response_replays_exact_bytes(self, store: Store, body: bytes) -> None:
        token = await _claimed(store, "k", "fp-1")
        assert await store.complete("k", token, body, ttl_ms=TTL_MS) is True
        assert await store.get("k") == Completed("fp-1", body)
        again = await store.claim("k", "fp-other", lease_ms=LEASE_MS)
        assert isinstance(again, Completed)
        assert again.fingerprint == "fp-1"
        assert again.response == body

    async def test_wrong_token_changes_nothing(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1", lease_ms=2_000)
        wrong = "0" * 32
        assert await store.complete("k", wrong, b"forged", ttl_ms=TTL_MS) is False
        assert await store.release("k", wrong) is False
        assert await store.extend("k", wrong, lease_ms=LEASE_MS) is False
        assert await store.get("k") == Running("fp-1")
        # The owner still owns it.
        assert await store.complete("k", token, b"real", ttl_ms=TTL_MS) is True
        assert await store.get("k") == Completed("fp-1", b"real")

    async def test_operations_on_a_missing_key_are_refused(self, store: Store) -> None:
        assert await store.complete("none", "t" * 32, b"x", ttl_ms=TTL_MS) is False
        assert await store.extend("none", "t" * 32, lease_ms=LEASE_MS) is False
        assert await store.release("none", "t" * 32) is False
        assert await store.get("none") is None

    async def test_release_makes_the_key_claimable(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1")
        assert await store.release("k", token) is True
        assert await store.get("k") is None
        assert isinstance(await store.claim("k", "fp-2", lease_ms=LEASE_MS), Claimed)
        assert await store.release("k", token) is False  # the old token owns nothing any more

    async def test_completed_record_cannot_be_released_or_extended(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1")
        assert await store.complete("k", token, b"answer", ttl_ms=TTL_MS) is True
        assert await store.release("k", token) is False
        assert await store.extend("k", token, lease_ms=LEASE_MS) is False
        assert await store.get("k") == Completed("fp-1", b"answer")

    async def test_repeated_complete_by_the_owner_is_a_noop(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1")
        assert await store.complete("k", token, b"first", ttl_ms=TTL_MS) is True
        assert await store.complete("k", token, b"second", ttl_ms=TTL_MS) is True  # a retried call
        assert await store.get("k") == Completed("fp-1", b"first")

    async def test_lease_expiry_frees_the_key_and_the_late_finisher_loses(self, store: Store) -> None:
        old = await _claimed(store, "k", "fp-1", lease_ms=200)
        await asyncio.sleep(0.3)
        assert await store.get("k") is None
        new = await _claimed(store, "k", "fp-2", lease_ms=LEASE_MS)
        assert new != old
        assert await store.complete("k", old, b"late", ttl_ms=TTL_MS) is False
        assert await store.extend("k", old, lease_ms=LEASE_MS) is False
        assert await store.release("k", old) is False
        assert await store.get("k") == Running("fp-2")
        assert await store.complete("k", new, b"fresh", ttl_ms=TTL_MS) is True
        assert await store.get("k") == Completed("fp-2", b"fresh")

    async def test_extend_keeps_the_claim_alive(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1", lease_ms=300)
        await asyncio.sleep(0.15)
        assert await store.extend("k", token, lease_ms=1_000) is True
        await asyncio.sleep(0.3)  # past the first lease, inside the renewed one
        assert await store.claim("k", "fp-2", lease_ms=LEASE_MS) == Running("fp-1")

    async def test_completed_record_expires_after_its_ttl(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1", lease_ms=LEASE_MS)
        assert await store.complete("k", token, b"answer", ttl_ms=200) is True
        assert await store.get("k") == Completed("fp-1", b"answer")
        await asyncio.sleep(0.3)
        assert await store.get("k") is None
        assert isinstance(await store.claim("k", "fp-2", lease_ms=LEASE_MS), Claimed)

    async def test_completion_ttl_replaces_the_lease(self, store: Store) -> None:
        token = await _claimed(store, "k", "fp-1", lease_ms=200)
        assert await store.complete("k", token, b"answer", ttl_ms=5_000) is True
        await asyncio.sleep(0.3)  # past the lease: the completed record lives on its own TTL
        assert await store.get("k") == Completed("fp-1", b"answer")

    async def test_concurrent_claims_have_exactly_one_winner(self, store: Store) -> None:
        results = await asyncio.gather(*(store.claim("k", f"fp-{i}", lease_ms=LEASE_MS) for i in range(20)))
        winners = [i for i, r in enumerate(results) if isinstance(r, Claimed)]
        assert len(winners) == 1
        others = [r for r in results if not isinstance(r, Claimed)]
        assert others == [Running(f"fp-{winners[0]}")] * 19

    async def test_keys_are_independent(self, store: Store) -> None:
        a = await _claimed(store, "a", "fp-a")
        await _claimed(store, "b", "fp-b")
        assert await store.complete("a", a, b"A", ttl_ms=TTL_MS) is True
        assert await store.get("a") == Completed("fp-a", b"A")
        assert await store.get("b") == Running("fp-b")

    async def test_ping_answers(self, store: Store) -> None:
        await store.ping()

    # -- remember / recall (where a Responses API response lives) ---------------------------------------------------

    async def test_remember_and_recall(self, store: Store) -> None:
        assert await store.recall("resp:a") is None
        await store.remember("resp:a", b'{"pool": "p"}', ttl_ms=TTL_MS)
        assert await store.recall("resp:a") == b'{"pool": "p"}'
        await store.remember("resp:a", b"newer", ttl_ms=TTL_MS)
        assert await store.recall("resp:a") == b"newer"
        assert await store.recall("resp:b") is None

    async def test_forget_drops_a_remembered_value(self, store: Store) -> None:
        await store.remember("resp:f", b"v", ttl_ms=TTL_MS)
        await store.remember("resp:g", b"w", ttl_ms=TTL_MS)
        assert await store.forget("resp:f") is True
        assert await store.recall("resp:f") is None
        assert await store.forget("resp:f") is False  # gone: a second forget finds nothing
        assert await store.forget("resp:never") is False
        assert await store.recall("resp:g") == b"w"  # the others stay

    async def test_remembered_values_are_binary_safe(self, store: Store) -> None:
        await store.remember("resp:k", BODIES["non-utf8"], ttl_ms=TTL_MS)
        assert await store.recall("resp:k") == BODIES["non-utf8"]
        assert isinstance(await store.claim("idem:k", "fp", lease_ms=LEASE_MS), Claimed)  # callers prefix apart
        assert await store.recall("resp:k") == BODIES["non-utf8"]

    async def test_remembered_value_expires(self, store: Store) -> None:
        await store.remember("short", b"v", ttl_ms=150)
        assert await store.recall("short") == b"v"
        await asyncio.sleep(0.3)
        assert await store.recall("short") is None


OWNER_CAP = 3  # the ``capped`` fixture's max_owner_records


class OwnerCapContract:
    """Per-owner caps: a subclass provides ``capped``, a fresh store with ``max_owner_records=OWNER_CAP`` (and a
    global cap well above it)."""

    async def _done(self, store: Store, key: str, owner: str, body: bytes = b"r") -> None:
        res = await store.claim(key, "fp", lease_ms=LEASE_MS, owner=owner)
        assert isinstance(res, Claimed), res
        assert await store.complete(key, res.token, body, ttl_ms=TTL_MS) is True

    async def test_an_owner_past_its_cap_drops_only_its_own_oldest(self, capped: Store) -> None:
        for i in range(OWNER_CAP):
            await self._done(capped, f"b{i}", "owner-b")
        for i in range(4 * OWNER_CAP):
            await self._done(capped, f"a{i}", "owner-a")
        for i in range(OWNER_CAP):  # B keeps everything
            assert await capped.get(f"b{i}") == Completed("fp", b"r")
        kept = [i for i in range(4 * OWNER_CAP) if await capped.get(f"a{i}") is not None]
        assert len(kept) <= OWNER_CAP
        assert 4 * OWNER_CAP - 1 in kept  # the newest stays, the oldest went
        assert 0 not in kept

    async def test_an_owner_full_of_running_claims_is_refused_others_are_not(self, capped: Store) -> None:
        for i in range(OWNER_CAP):
            assert isinstance(await capped.claim(f"a{i}", "fp", lease_ms=LEASE_MS, owner="owner-a"), Claimed)
        with pytest.raises(StoreUnavailable):
            await capped.claim("a-more", "fp", lease_ms=LEASE_MS, owner="owner-a")
        for i in range(OWNER_CAP):  # nothing running was dropped
            assert await capped.get(f"a{i}") == Running("fp")
        assert isinstance(await capped.claim("b0", "fp", lease_ms=LEASE_MS, owner="owner-b"), Claimed)

    async def test_a_running_claim_is_passed_over_for_the_oldest_completed(self, capped: Store) -> None:
        assert isinstance(await capped.claim("a0", "fp", lease_ms=LEASE_MS, owner="owner-a"), Claimed)
        for i in range(1, OWNER_CAP):
            await self._done(capped, f"a{i}", "owner-a")
        for i in range(OWNER_CAP, OWNER_CAP + 2):
            await self._done(capped, f"a{i}", "owner-a")
        assert await capped.get("a0") == Running("fp")  # the oldest, still running: kept
        assert await capped.get("a1") is None
        assert await capped.get("a2") is None
        assert await capped.get(f"a{OWNER_CAP + 1}") == Completed("fp", b"r")

    async def test_a_freed_claim_makes_room_again(self, capped: Store) -> None:
        tokens = []
        for i in range(OWNER_CAP):
            res = await capped.claim(f"a{i}", "fp", lease_ms=LEASE_MS, owner="owner-a")
            assert isinstance(res, Claimed)
            tokens.append(res.token)
        assert await capped.release("a0", tokens[0]) is True
        assert isinstance(await capped.claim("a-more", "fp", lease_ms=LEASE_MS, owner="owner-a"), Claimed)

    async def test_remembered_values_are_capped_per_owner(self, capped: Store) -> None:
        for i in range(OWNER_CAP):
            await capped.remember(f"resp:b{i}", b"B", ttl_ms=TTL_MS, owner="owner-b")
        for i in range(4 * OWNER_CAP):
            await capped.remember(f"resp:a{i}", b"A", ttl_ms=TTL_MS, owner="owner-a")
        for i in range(OWNER_CAP):
            assert await capped.recall(f"resp:b{i}") == b"B"
        kept = [i for i in range(4 * OWNER_CAP) if await capped.recall(f"resp:a{i}") is not None]
        assert kept == list(range(3 * OWNER_CAP, 4 * OWNER_CAP))  # the owner's newest, in full

    async def test_records_without_an_owner_are_not_capped_per_owner(self, capped: Store) -> None:
        for i in range(4 * OWNER_CAP):
            await self._done(capped, f"n{i}", "")
            await capped.remember(f"resp:n{i}", b"N", ttl_ms=TTL_MS)
        for i in range(4 * OWNER_CAP):
            assert await capped.get(f"n{i}") == Completed("fp", b"r")
            assert await capped.recall(f"resp:n{i}") == b"N"
