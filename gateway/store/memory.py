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

Per owner (who created a record: the tenant, or the API key's scope without tenants; ``owner=""`` is no one in
particular and has no cap of its own), so that one owner's records never push out another's:

- an owner holds at most ``max_owner_records`` claims and, separately, as many remembered values; past that its
  *own* oldest completed claim (oldest value) goes first. An owner whose claims are all running gets
  ``StoreUnavailable`` for one more, like the full store;
- an owner's stored responses stay within ``max_owner_bytes`` (0, the default: a quarter of ``max_bytes``):
  completing drops that owner's oldest completed records first (one response larger than the share is still kept,
  alone, within ``max_bytes``);
- when the whole store is at ``max_records`` or ``max_bytes``, the records dropped are those of the owner holding
  the most (records, or bytes) at each step, its oldest completed first.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.store.base import Claimed, ClaimResult, Completed, Running, StoreUnavailable

DEFAULT_MAX_RECORDS = 100_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_OWNER_RECORDS = 10_000


@dataclass(slots=True)
class _Owner:
    """One owner's share: its claims in creation/completion order, their response bytes, its remembered values."""

    # OrderedDicts: the oldest is found in O(1) however many were deleted before it (a plain dict's iteration would
    # step over the holes its deletions left at the front, once per eviction).
    keys: OrderedDict[str, None] = field(default_factory=OrderedDict)
    bytes: int = 0
    values: OrderedDict[str, None] = field(default_factory=OrderedDict)


@dataclass(slots=True)
class _Record:
    token: str
    fingerprint: str
    expires_at: float  # the store's clock (monotonic seconds)
    response: bytes | None = None  # None while running
    owner: str = ""

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
        max_owner_records: int = DEFAULT_MAX_OWNER_RECORDS,
        max_owner_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_records < 1:
            raise ValueError(f"max_records must be >= 1, got {max_records}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if max_owner_records < 1:
            raise ValueError(f"max_owner_records must be >= 1, got {max_owner_records}")
        if max_owner_bytes < 0:
            raise ValueError(f"max_owner_bytes must be >= 0 (0: a quarter of max_bytes), got {max_owner_bytes}")
        self._max = max_records
        self._owner_max = max_owner_records
        self._owner_max_bytes = max_owner_bytes or max(1, max_bytes // 4)
        self._owners: dict[str, _Owner] = {}  # only owners holding something: an emptied one is removed
        self._max_bytes = max_bytes
        self._bytes = 0  # the stored responses' sizes, together
        self._clock = clock
        # Insertion order = order of the last write that created or completed the record (complete moves it to
        # the end), so the first completed record found walking the dict is the oldest completion.
        self._records: dict[str, _Record] = {}
        self._expiries: list[tuple[float, str]] = []  # (expires_at, key) min-heap; may hold stale entries
        # remember/recall: (expires_at, value, owner) in write order; at most max_records.
        self._values: dict[str, tuple[float, bytes, str]] = {}

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

    def owner_usage(self, owner: str) -> tuple[int, int, int]:
        """What ``owner`` holds now: (claims, their response bytes, remembered values)."""
        o = self._owners.get(owner)
        return (0, 0, 0) if o is None else (len(o.keys), o.bytes, len(o.values))

    def _owner(self, owner: str) -> _Owner:
        o = self._owners.get(owner)
        if o is None:
            o = self._owners[owner] = _Owner()
        return o

    def _tidy(self, owner: str, o: _Owner) -> None:
        if not o.keys and not o.values:
            del self._owners[owner]

    def _drop(self, key: str) -> None:
        rec = self._records.pop(key)
        o = self._owners[rec.owner]
        del o.keys[key]
        if rec.response is not None:
            self._bytes -= len(rec.response)
            o.bytes -= len(rec.response)
        self._tidy(rec.owner, o)

    def _drop_value(self, key: str) -> None:
        owner = self._values.pop(key)[2]
        o = self._owners[owner]
        del o.values[key]
        self._tidy(owner, o)

    def _oldest_done(self, o: _Owner) -> str | None:
        """The owner's oldest completed record (its keys are in creation/completion order)."""
        records = self._records
        return next((k for k in o.keys if records[k].done), None)

    def _evict_largest(self, over: Callable[[], bool], size: Callable[[_Owner], int]) -> None:
        """While ``over()``: drop the oldest completed record of the owner with the largest ``size``."""
        heap = [(-size(o), name) for name, o in self._owners.items() if size(o) > 0]
        heapq.heapify(heap)
        while heap and over():
            _, name = heapq.heappop(heap)
            o = self._owners[name]
            victim = self._oldest_done(o)
            if victim is None:  # only running claims left: this owner cannot give more
                continue
            self._drop(victim)
            if name in self._owners and size(o) > 0:
                heapq.heappush(heap, (-size(o), name))

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

    def _make_room(self, now: float, owner: str) -> None:
        self._prune(now)
        if owner:
            o = self._owners.get(owner)
            if o is not None and len(o.keys) >= self._owner_max:
                # Drop 1% more than needed, so that an owner at its cap does not walk its records on every claim.
                excess = len(o.keys) - self._owner_max + 1 + self._owner_max // 100
                records = self._records
                for k in list(itertools.islice((k for k in o.keys if records[k].done), excess)):
                    self._drop(k)
                if len(o.keys) >= self._owner_max:
                    raise StoreUnavailable(
                        f"memory store: this owner holds {len(o.keys)} running claims "
                        f"(max_owner_records={self._owner_max})"
                    )
        if len(self._records) < self._max:
            return
        floor = self._max - 1 - self._max // 100  # 1% below the cap, as above
        self._evict_largest(lambda: len(self._records) > floor, lambda o: len(o.keys))
        if len(self._records) >= self._max:
            raise StoreUnavailable(f"memory store full: {len(self._records)} running claims (max_records={self._max})")

    # -- the Store protocol -------------------------------------------------------------------------------------

    def _make_bytes(self, size: int, now: float, owner: str) -> None:
        """Drop the owner's own oldest completed records until ``size`` more bytes fit its share, then those of the
        owners holding the most bytes until they fit ``max_bytes``."""
        o = self._owners[owner]
        if owner and o.bytes + size > self._owner_max_bytes:
            self._prune(now)
            while o.bytes > 0 and o.bytes + size > self._owner_max_bytes:
                victim = self._oldest_done(o)
                if victim is None:
                    break
                self._drop(victim)
        if self._bytes + size <= self._max_bytes:
            return
        self._prune(now)
        self._evict_largest(lambda: self._bytes + size > self._max_bytes, lambda o: o.bytes)

    async def claim(
        self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0, owner: str = ""
    ) -> ClaimResult:
        now = self._clock()
        rec = self._live(key, now)
        if rec is not None:
            if rec.response is not None:
                if 0 < max_bytes < len(rec.response):
                    return Completed(rec.fingerprint, b"", oversize=True)
                return Completed(rec.fingerprint, rec.response)
            return Running(rec.fingerprint)
        self._make_room(now, owner)
        token = secrets.token_hex(16)
        rec = _Record(token=token, fingerprint=fingerprint, expires_at=0.0, owner=owner)
        self._records[key] = rec
        self._owner(owner).keys[key] = None
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
        self._make_bytes(len(response), now, rec.owner)
        rec.response = bytes(response)
        self._bytes += len(response)
        o = self._owners[rec.owner]
        o.bytes += len(response)
        del self._records[key]  # re-insert at the end: completion order drives eviction
        self._records[key] = rec
        o.keys.move_to_end(key)
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

    async def remember(self, key: str, value: bytes, *, ttl_ms: int, owner: str = "") -> None:
        now = self._clock()
        values = self._values
        if key in values:
            self._drop_value(key)
        # The oldest writes come first: drop the expired ones at the front.
        for k in list(itertools.islice(values, 64)):
            if values[k][0] > now:
                break
            self._drop_value(k)
        o = self._owners.get(owner)
        if owner and o is not None and len(o.values) >= self._owner_max:  # the owner's own oldest goes first
            for k in list(itertools.islice(o.values, len(o.values) - self._owner_max + 1)):
                self._drop_value(k)
        if len(values) >= self._max:  # then the oldest of the owners holding the most values, 1% below the cap
            floor = self._max - 1 - self._max // 100
            heap = [(-len(o.values), name) for name, o in self._owners.items() if o.values]
            heapq.heapify(heap)
            while heap and len(values) > floor:
                _, name = heapq.heappop(heap)
                o = self._owners[name]
                self._drop_value(next(iter(o.values)))
                if o.values:
                    heapq.heappush(heap, (-len(o.values), name))
        values[key] = (now + ttl_ms / 1000, bytes(value), owner)
        self._owner(owner).values[key] = None

    async def recall(self, key: str) -> bytes | None:
        got = self._values.get(key)
        if got is None:
            return None
        if got[0] <= self._clock():
            self._drop_value(key)
            return None
        return got[1]

    async def forget(self, key: str) -> bool:
        got = self._values.get(key)
        if got is None:
            return False
        self._drop_value(key)
        return got[0] > self._clock()

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._records.clear()
        self._bytes = 0
        self._expiries.clear()
        self._values.clear()
        self._owners.clear()
