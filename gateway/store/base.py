"""The ``Store`` protocol: claims on Idempotency-Keys with owner tokens and leases, and the stored responses.

One record per scoped key (the caller scopes keys by tenant before they get here). Its life:

1. ``claim(key, fingerprint, lease_ms)``: atomically creates a *running* record owned by a fresh token
   (``Claimed``), unless a record exists: then ``Running`` (someone holds it: 409, or wait) or ``Completed`` (replay
   its response). Both carry the existing record's request fingerprint, so a different body under the same key can
   be answered 422.
2. While the request runs, the owner ``extend``\\ s the lease (a long stream outlives one lease); a gateway that
   dies stops extending, the lease runs out and the key can be claimed again: it never blocks a key forever.
3. ``complete(key, token, response, ttl_ms)`` stores the final response, only while ``token`` still owns the
   record (compare-and-set): a late finisher whose lease ran out and whose key was claimed again cannot overwrite
   the newer claim. ``release(key, token)`` drops the claim instead (nothing was generated: the client may retry).

Every record has a TTL (the lease while running, ``ttl_ms`` once completed). A store that cannot be reached raises
``StoreUnavailable``; the caller applies its policy (refuse keyed requests with 503 by default).

Besides the claims, a store keeps small values with a TTL (``remember`` / ``recall``): where a Responses API response
lives (response id → pool and endpoint), so that every replica sends its follow-ups to the one server holding it;
``forget`` drops one (``DELETE /v1/responses/{id}``).
Their keys never collide with claims (the callers prefix them differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class StoreUnavailable(Exception):
    """The store cannot be reached or answered an error: the caller decides (fail closed by default)."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """This caller now owns the key."""

    token: str


@dataclass(frozen=True, slots=True)
class Running:
    """Another request holds the key and has not finished."""

    fingerprint: str


@dataclass(frozen=True, slots=True)
class Completed:
    """The key's request finished; ``response`` is what was stored (an opaque blob for the store)."""

    fingerprint: str
    response: bytes
    oversize: bool = False  # the stored response was larger than the reader's cap: left in the store, not read


ClaimResult = Claimed | Running | Completed


class Store(Protocol):
    """Atomic per-key claims. Implementations: ``MemoryStore`` (one process), ``RedisStore`` (shared)."""

    name: str  # "memory" | "redis"

    async def claim(
        self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0, owner: str = ""
    ) -> ClaimResult:
        """``max_bytes`` (> 0): a completed record's response larger than this is not read back (a record the
        gateway did not write; ``Completed.oversize``). ``owner``: whose record a new claim is (the tenant, or the
        API key's scope), for the per-owner caps; "" is no one in particular."""
        ...

    async def extend(self, key: str, token: str, *, lease_ms: int) -> bool:
        """Renew a running claim's lease; False when ``token`` no longer owns the key."""
        ...

    async def complete(self, key: str, token: str, response: bytes, *, ttl_ms: int) -> bool:
        """Store the final response if ``token`` still owns the running record; False otherwise."""
        ...

    async def release(self, key: str, token: str) -> bool:
        """Delete the running record if ``token`` owns it; False otherwise."""
        ...

    async def get(self, key: str) -> Running | Completed | None:
        """The record as it is now (waiting for a running request to finish polls this)."""
        ...

    async def remember(self, key: str, value: bytes, *, ttl_ms: int, owner: str = "") -> None:
        """Keep ``value`` under ``key`` for ``ttl_ms`` (a newer value replaces it), counted to ``owner``."""
        ...

    async def recall(self, key: str) -> bytes | None:
        """The value kept under ``key``; None when there is none or it expired."""
        ...

    async def forget(self, key: str) -> bool:
        """Drop the value kept under ``key``; False when there was none (or it had expired)."""
        ...

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` when the store cannot serve."""
        ...

    async def close(self) -> None: ...
