"""``MemoryStore``: the idempotency store of a single gateway process (the default without ``--redis-url``).

It must behave exactly like ``RedisStore`` (same claims, same owner-token compare-and-set, same expiry), so that
the idempotency guard is tested once and runs the same with either. Atomicity comes from the event loop: every
method does its check and its write with no ``await`` in between, so no lock is needed.

Memory stays bounded without a background task:

- an expired record is treated as absent the moment it is read, and removed then;
- every write pops the records whose expiry has passed, from a min-heap of expiry times (an entry whose record
  was extended, completed or replaced since is stale and skipped), so the cost is O(log n) per expiry;
- values kept with ``remember`` live in a dict of their own, in write order: every write drops the expired ones at
  its front and, above ``max_records``, the oldest;
- above ``max_records`` the oldest completed records are dropped first (a dropped completion only costs a replay:
  the client's retry runs again). Running claims are never dropped to make room, since that could let a duplicate
  run; with the store full of running claims a new claim raises ``StoreUnavailable`` (the caller fails closed);
- the stored responses together stay within ``max_bytes``: completing a record drops the oldest completed ones
  until the new one fits. One response larger than ``max_bytes`` is never kept: ``complete`` raises
  ``StoreUnavailable`` (the caller keeps its own, smaller per-record cap well below, ``gateway.proxy.idempotency``).
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.store.base import Claimed, ClaimResult, Completed, Running, StoreUnavailable

DEFAULT_MAX_RECORDS = 100_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass(slots=True)
class _Record:
    token: str
    fingerprint: str
    expires_at: float  # the store's clock (monotonic seconds)
    response: bytes | None = None  # None while running

    @property
    def done(self) -> bool:
        return self.response is not None


class MemoryStore:
    """Claims and stored responses in a dict, with TTLs on the monotonic clock; see the module docstring."""

    name = "memory"

    def __init__(
        self,
        *,
        max_records: int = DEFAULT_MAX_RECORDS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self._max = max_records
        self._max_bytes = max_bytes
        self._bytes = 0  # the stored responses' sizes, together
        self._clock = clock
        # Insertion order = order of the last write that created or completed the record (complete moves it to
        # the end), so the first completed record found walking the dict is the oldest completion.
        self._records: dict[str, _Record] = {}
        self._expiries: list[tuple[float, str]] = []  # (expires_at, key) min-heap; may hold stale entries
        # remember/recall: (expires_at, value) in write order; at most max_records, the oldest write goes first.
        self._values: dict[str, tuple[float, bytes]] = {}

    def __len__(self) -> int:
        return len(self._records)

    @property
    def stored_bytes(self) -> int:
        """The bytes of the completed responses held now."""
        return self._bytes

    # -- internals (all synchronous: the atomicity of every public method relies on it) -----------------------

    def _live(self, key: str, now: float) -> _Record | None:
        rec = self._records.get(key)
        if rec is not None and rec.expires_at <= now:
            self._drop(key)
            return None
        return rec

    def _drop(self, key: str) -> None:
        rec = self._records.pop(key)
        if rec.response is not None:
            self._bytes -= len(rec.response)

    def _set_expiry(self, key: str, rec: _Record, expires_at: float) -> None:
        rec.expires_at = expires_at
        heapq.heappush(self._expiries, (expires_at, key))

    def _prune(self, now: float) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            rec = self._records.get(key)
            if rec is not None and rec.expires_at <= now:
                self._drop(key)
        # Stale entries of long-lived records can pile up only as far as the number of writes; rebuild the heap
        # when they clearly dominate, so it stays proportional to the live records.
        if len(heap) > 4 * len(self._records) + 1024:
            self._expiries = [(r.expires_at, k) for k, r in self._records.items()]
            heapq.heapify(self._expiries)

    def _make_room(self, now: float) -> None:
        self._prune(now)
        if len(self._records) < self._max:
            return
        # Drop 1% more than needed, so that a store at its cap does not walk the dict on every claim.
        excess = len(self._records) - self._max + 1 + self._max // 100
        victims = list(itertools.islice((k for k, r in self._records.items() if r.done), excess))
        for k in victims:
            self._drop(k)
        if len(self._records) >= self._max:
            raise StoreUnavailable(f"memory store full: {len(self._records)} running claims (max_records={self._max})")

    # -- the Store protocol -------------------------------------------------------------------------------------

    def _make_bytes(self, size: int, now: float) -> None:
        """Drop the oldest completed records until ``size`` more bytes fit in ``max_bytes``."""
        if self._bytes + size <= self._max_bytes:
            return
        self._prune(now)
        victims: list[str] = []
        freed = 0
        for k, r in self._records.items():
            if self._bytes - freed + size <= self._max_bytes:
                break
            if r.response is not None:
                victims.append(k)
                freed += len(r.response)
        for k in victims:
            self._drop(k)

    async def claim(self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0) -> ClaimResult:
        now = self._clock()
        rec = self._live(key, now)
        if rec is not None:
            if rec.response is not None:
                if 0 < max_bytes < len(rec.response):
                    return Completed(rec.fingerprint, b"", oversize=True)
                return Completed(rec.fingerprint, rec.response)
            return Running(rec.fingerprint)
        self._make_room(now)
        token = secrets.token_hex(16)
        rec = _Record(token=token, fingerprint=fingerprint, expires_at=0.0)
        self._records[key] = rec
        self._set_expiry(key, rec, now + lease_ms / 1000)
        return Claimed(token)

    async def extend(self, key: str, token: str, *, lease_ms: int) -> bool:
        now = self._clock()
        rec = self._live(key, now)
        if rec is None or rec.token != token or rec.done:
            return False
        self._set_expiry(key, rec, now + lease_ms / 1000)
        self._prune(now)
        return True

    async def complete(self, key: str, token: str, response: bytes, *, ttl_ms: int) -> bool:
        now = self._clock()
        rec = self._live(key, now)
        if rec is None or rec.token != token:
            return False
        if rec.done:  # the owner completing again (a retried call): a no-op, like RedisStore
            return True
        if len(response) > self._max_bytes:
            raise StoreUnavailable(f"a response of {len(response)} bytes exceeds the store's {self._max_bytes} bytes")
        self._make_bytes(len(response), now)
        rec.response = bytes(response)
        self._bytes += len(response)
        del self._records[key]  # re-insert at the end: completion order drives eviction
        self._records[key] = rec
        self._set_expiry(key, rec, now + ttl_ms / 1000)
        self._prune(now)
        return True

    async def release(self, key: str, token: str) -> bool:
        now = self._clock()
        rec = self._live(key, now)
        if rec is None or rec.token != token or rec.done:
            return False
        self._drop(key)
        self._prune(now)
        return True

    async def get(self, key: str) -> Running | Completed | None:
        rec = self._live(key, self._clock())
        if rec is None:
            return None
        if rec.response is not None:
            return Completed(rec.fingerprint, rec.response)
        return Running(rec.fingerprint)

    async def remember(self, key: str, value: bytes, *, ttl_ms: int) -> None:
        now = self._clock()
        values = self._values
        values.pop(key, None)
        # The oldest writes come first: drop the expired ones at the front, then the oldest beyond the cap.
        for k in list(itertools.islice(values, 64)):
            if values[k][0] > now and len(values) < self._max:
                break
            del values[k]
        values[key] = (now + ttl_ms / 1000, bytes(value))

    async def recall(self, key: str) -> bytes | None:
        got = self._values.get(key)
        if got is None:
            return None
        if got[0] <= self._clock():
            del self._values[key]
            return None
        return got[1]

    async def forget(self, key: str) -> bool:
        got = self._values.pop(key, None)
        return got is not None and got[0] > self._clock()

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._records.clear()
        self._bytes = 0
        self._expiries.clear()
        self._values.clear()
