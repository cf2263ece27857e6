"""Where on-call overrides and the audit log live: ``OverrideStore``, in memory (one process) or in Redis (every
replica, surviving restarts of all gateways).

The store knows nothing of what an override means: each is an opaque payload under a *target key* (one active
override per kind and target, so a ``put`` replaces the older one) and carries its id, so that ``delete`` is a
compare-and-delete: it removes the override only while the key still holds that id, and says whether THIS call
removed it. Every replica notices an expiry at about the same time; only the one whose delete won writes the
expiry's audit record.

The audit log is capped (``audit_capacity`` records, oldest dropped first) and ordered by each record's time.

Change notification: after a change the writer calls ``notify``; ``changes()`` yields once when it starts (the
caller reads everything) and once per notification from any replica. Memory: an in-process notification to every
``changes()`` of the same store. Redis: a pub/sub channel (the caller also re-reads periodically: a notification
sent while a replica was reconnecting is lost).

Redis encoding (``prefix`` default ``specgate:``):

- ``<prefix>overrides``: a hash, field = target key, value = ``<id>\\n<payload>``;
- ``<prefix>audit``: a sorted set, score = the record's epoch time, member = ``<n>:<payload>`` (``n`` from the
  counter ``<prefix>audit:total``, so equal records stay distinct); trimmed to the capacity on every append;
- ``<prefix>overrides:changed``: the pub/sub channel.

Any Redis or socket error becomes ``StoreUnavailable`` (the URL, which may hold a password, is never in it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.periodic import raise_if_cancelled
from gateway.store.base import StoreUnavailable
from gateway.store.redis import connection_pool

logger = logging.getLogger("specgate.store")

DEFAULT_PREFIX = "specgate:"
AUDIT_CAPACITY = 10_000
# Read back from Redis, at most (what the admin API writes is far smaller: one override of bounded fields each, one
# per kind and target).
MAX_OVERRIDE_BYTES = 16 * 1024
MAX_OVERRIDES = 10_000
RESUBSCRIBE_S = 1.0


class OverrideStore(Protocol):
    """Overrides by target key, the capped audit log, and change notification; see the module docstring."""

    name: str  # "memory" | "redis"
    audit_capacity: int

    async def put(self, key: str, override_id: str, payload: bytes) -> bytes | None:
        """Store the override under ``key``, replacing any other; returns the payload it replaced."""
        ...

    async def delete(self, key: str, override_id: str) -> bytes | None:
        """Remove the override under ``key`` if it is still ``override_id``; the payload THIS call removed."""
        ...

    async def list_overrides(self) -> list[bytes | None]:
        """Every stored override's payload (expired ones too, until someone deletes them), at most
        ``MAX_OVERRIDES``; None in place of one larger than ``MAX_OVERRIDE_BYTES`` (not read) or malformed."""
        ...

    async def append_audit(self, at: float, payload: bytes) -> None: ...

    async def audit(self, limit: int, since: float | None = None) -> list[bytes]:
        """The newest ``limit`` audit payloads (with time > ``since`` when given), oldest first."""
        ...

    async def audit_counts(self) -> tuple[int, int]:
        """(records kept, records ever appended)."""
        ...

    async def notify(self) -> None:
        """Tell every replica (this one included) that the overrides changed."""
        ...

    def changes(self) -> AsyncIterator[None]:
        """Yields once at (re)subscription and once per notification; runs until cancelled."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


class MemoryOverrideStore:
    """One process's overrides and audit log. Atomic by the event loop (no ``await`` inside an operation)."""

    name = "memory"

    def __init__(self, *, audit_capacity: int = AUDIT_CAPACITY) -> None:
        if audit_capacity < 1:
            raise ValueError(f"audit_capacity must be >= 1, got {audit_capacity}")
        self.audit_capacity = audit_capacity
        self._overrides: dict[str, tuple[str, bytes]] = {}
        self._audit: deque[tuple[float, bytes]] = deque(maxlen=audit_capacity)
        self._total = 0
        self._listeners: set[asyncio.Queue[None]] = set()

    async def put(self, key: str, override_id: str, payload: bytes) -> bytes | None:
        old = self._overrides.get(key)
        self._overrides[key] = (override_id, bytes(payload))
        return None if old is None else old[1]

    async def delete(self, key: str, override_id: str) -> bytes | None:
        old = self._overrides.get(key)
        if old is None or old[0] != override_id:
            return None
        del self._overrides[key]
        return old[1]

    async def list_overrides(self) -> list[bytes | None]:
        return [payload for _, payload in self._overrides.values()]

    async def append_audit(self, at: float, payload: bytes) -> None:
        self._audit.append((at, bytes(payload)))
        self._total += 1

    async def audit(self, limit: int, since: float | None = None) -> list[bytes]:
        out: list[tuple[float, bytes]] = []
        if limit <= 0:
            return []
        for at, payload in sorted(self._audit, key=lambda r: r[0], reverse=True):
            if since is not None and at <= since:
                break
            out.append((at, payload))
            if len(out) >= limit:
                break
        return [p for _, p in reversed(out)]

    async def audit_counts(self) -> tuple[int, int]:
        return len(self._audit), self._total

    async def notify(self) -> None:
        for q in self._listeners:
            if q.empty():
                q.put_nowait(None)

    async def changes(self) -> AsyncIterator[None]:
        q: asyncio.Queue[None] = asyncio.Queue(maxsize=1)
        self._listeners.add(q)
        try:
            yield
            while True:
                await q.get()
                yield
        finally:
            self._listeners.discard(q)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._listeners.clear()


# KEYS[1] = overrides hash; ARGV = field, id. Returns the stored value when this call deleted it, else false.
_DELETE = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v and string.sub(v, 1, #ARGV[2] + 1) == ARGV[2] .. '\\n' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return v
end
return false
"""

# KEYS[1] = overrides hash; ARGV = field, value. Returns the value it replaced, or false.
_PUT = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return v
"""

# KEYS[1] = overrides hash; ARGV = max bytes of one value, max values. Returns at most that many values, each one
# longer than the cap replaced by false (so it is counted, never sent back).
_LIST = """
local out = {}
local cap = tonumber(ARGV[1])
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do
  if #out >= tonumber(ARGV[2]) then
    break
  end
  if #v > cap then
    out[#out + 1] = 0
  else
    out[#out + 1] = v
  end
end
return out
"""

# KEYS[1] = audit zset, KEYS[2] = total counter; ARGV = time, payload, capacity.
_APPEND = """
local n = redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], ARGV[1], n .. ':' .. ARGV[2])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[3]) + 1))
return n
"""


def _payload(value: Any) -> bytes | None:
    """``<id>\\n<payload>`` → payload."""
    if not value:
        return None
    raw = bytes(value)
    return raw.split(b"\n", 1)[1] if b"\n" in raw else None


class RedisOverrideStore:
    """Overrides and audit shared by every replica; see the module docstring for the keys."""

    name = "redis"

    def __init__(
        self,
        client: aioredis.Redis,
        subscriber: aioredis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        audit_capacity: int = AUDIT_CAPACITY,
        where: str = "redis",
    ) -> None:
        self.audit_capacity = audit_capacity
        self._client = client
        self._subscriber = subscriber  # its own connection: a subscribed connection can do nothing else
        self._where = where
        self._overrides_key = prefix + "overrides"
        self._audit_key = prefix + "audit"
        self._total_key = prefix + "audit:total"
        self._channel = prefix + "overrides:changed"
        self._put = client.register_script(_PUT)
        self._delete = client.register_script(_DELETE)
        self._append = client.register_script(_APPEND)
        self._list = client.register_script(_LIST)

    @classmethod
    def from_url(
        cls, url: str, *, prefix: str = DEFAULT_PREFIX, socket_timeout_s: float = 0.5, max_connections: int = 8
    ) -> RedisOverrideStore:
        """Its own small connection pool on the idempotency store's URL, and one subscriber connection."""
        pool, where = connection_pool(
            url,
            max_connections=max_connections,
            socket_timeout_s=socket_timeout_s,
            health_check_interval_s=10,
            client_name="specgate-overrides",
        )
        subscriber = aioredis.Redis.from_url(
            url, socket_connect_timeout=socket_timeout_s, health_check_interval=10, client_name="specgate-sub"
        )
        return cls(aioredis.Redis(connection_pool=pool), subscriber, prefix=prefix, where=where)

    def _unavailable(self, op: str, exc: BaseException) -> StoreUnavailable:
        detail = str(exc).strip() or "no detail"
        return StoreUnavailable(f"redis {op} failed ({self._where}): {type(exc).__name__}: {detail}")

    async def put(self, key: str, override_id: str, payload: bytes) -> bytes | None:
        value = override_id.encode() + b"\n" + payload
        try:
            old = await self._put(keys=[self._overrides_key], args=[key, value])
        except (RedisError, OSError) as exc:
            raise self._unavailable("put override", exc) from exc
        return _payload(old)

    async def delete(self, key: str, override_id: str) -> bytes | None:
        try:
            old = await self._delete(keys=[self._overrides_key], args=[key, override_id])
        except (RedisError, OSError) as exc:
            raise self._unavailable("delete override", exc) from exc
        return _payload(old)

    async def list_overrides(self) -> list[bytes | None]:
        try:
            values = await self._list(keys=[self._overrides_key], args=[MAX_OVERRIDE_BYTES, MAX_OVERRIDES])
        except (RedisError, OSError) as exc:
            raise self._unavailable("list overrides", exc) from exc
        out: list[bytes | None] = []
        for v in values:  # too large (not sent) or without its id: None, which the caller counts and ignores
            out.append(_payload(v) if isinstance(v, bytes) else None)
        return out

    async def append_audit(self, at: float, payload: bytes) -> None:
        try:
            await self._append(keys=[self._audit_key, self._total_key], args=[at, payload, self.audit_capacity])
        except (RedisError, OSError) as exc:
            raise self._unavailable("append audit", exc) from exc

    async def audit(self, limit: int, since: float | None = None) -> list[bytes]:
        if limit <= 0:
            return []
        low = "-inf" if since is None else f"({since!r}"
        try:
            members = await self._client.zrevrangebyscore(self._audit_key, "+inf", low, start=0, num=limit)
        except (RedisError, OSError) as exc:
            raise self._unavailable("read audit", exc) from exc
        return [m.split(b":", 1)[1] for m in reversed(members) if isinstance(m, bytes)]

    async def audit_counts(self) -> tuple[int, int]:
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zcard(self._audit_key)
                pipe.get(self._total_key)
                size, total = await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._unavailable("count audit", exc) from exc
        return int(size), int(total or 0)

    async def notify(self) -> None:
        try:
            await self._client.publish(self._channel, b"1")
        except (RedisError, OSError) as exc:
            raise self._unavailable("publish", exc) from exc

    async def changes(self) -> AsyncIterator[None]:
        while True:
            raise_if_cancelled()
            pubsub = self._subscriber.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._channel)
                yield  # (re)subscribed: whatever changed meanwhile is read now
                while True:
                    raise_if_cancelled()
                    if await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0) is not None:
                        yield
            except (RedisError, OSError) as exc:
                logger.warning("override change channel lost (%s): %s; resubscribing", self._where, exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]
            await asyncio.sleep(RESUBSCRIBE_S)

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except (RedisError, OSError) as exc:
            raise self._unavailable("ping", exc) from exc

    async def close(self) -> None:
        for client in (self._client, self._subscriber):
            try:
                await client.aclose()
                await client.connection_pool.aclose()
            except (RedisError, OSError):
                pass


def build_override_store(redis_url: str | None, *, prefix: str = DEFAULT_PREFIX) -> OverrideStore:
    """Redis when a URL is configured (the idempotency store's), else memory (this process only)."""
    if not redis_url:
        return MemoryOverrideStore()
    return RedisOverrideStore.from_url(redis_url, prefix=prefix)
