"""Per-tenant requests-per-minute and tokens-per-minute limits: GCRA (the generic cell rate algorithm), in memory
or in Redis.

Each limit is a bucket that holds ``limit`` units and refills continuously at ``limit`` per minute. GCRA keeps
one number per bucket, its theoretical arrival time ``tat``: a request of cost ``n`` moves it to
``max(tat, now) + n * 60 s / limit`` and is admitted when that lands at most 60 s ahead of now. So a tenant may
spend its whole minute at once and then one unit every ``60 s / limit``: over any 60 s window it gets at most
about twice its limit, and over long spans exactly its limit per minute.

The requests bucket and the tokens bucket are checked together and charged only when both admit (an atomic Lua
script in Redis, with the server's clock, so every replica and worker shares one exact count). The tokens charged
at admission are an estimate (prompt estimate + the output it may generate); ``adjust`` corrects the bucket by
the difference once the answer's usage is known.

In Redis the two keys of a tenant share a hash tag (``specgate:rl:{tenant}:r`` / ``:t``) so the script runs on one
Cluster slot; each expires when its bucket is full again.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.store.base import StoreUnavailable
from gateway.store.redis import connection_pool

WINDOW_S = 60.0
LimitKind = Literal["requests", "tokens"]


@dataclass(frozen=True, slots=True)
class BucketView:
    """What the ``x-ratelimit-*`` headers say of one bucket after the decision."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    refused_by: LimitKind | None  # the first bucket that refused
    retry_after_s: float  # when the refused request would be admitted (0 when allowed)
    requests: BucketView | None
    tokens: BucketView | None
    never: bool = False  # the request costs more than the whole bucket: no wait admits it


def _view(limit: int, ahead_s: float) -> BucketView:
    """A bucket whose ``tat`` is ``ahead_s`` in the future."""
    interval = WINDOW_S / limit
    ahead = max(0.0, ahead_s)
    return BucketView(limit, max(0, min(limit, math.floor((WINDOW_S - ahead) / interval + 1e-9))), ahead)


def verdict(
    rpm: int | None, tpm: int | None, cost: int, req: tuple[float, float] | None, tok: tuple[float, float] | None
) -> Verdict:
    """The decision from each bucket's (tat - now, new tat - now) in seconds."""
    refused: LimitKind | None = None
    retry = 0.0
    never = tpm is not None and cost * WINDOW_S / tpm > WINDOW_S
    for kind, got in (("requests", req), ("tokens", tok)):
        if got is not None and got[1] > WINDOW_S + 1e-9:
            refused = refused or kind  # type: ignore[assignment]
            retry = max(retry, got[1] - WINDOW_S)
    allowed = refused is None and not never
    if never:
        refused = "tokens"

    def view(limit: int | None, got: tuple[float, float] | None) -> BucketView | None:
        if limit is None or got is None:
            return None
        return _view(limit, got[1] if allowed else got[0])

    return Verdict(allowed, refused, retry, view(rpm, req), view(tpm, tok), never)


class RateLimiter(Protocol):
    name: str

    async def acquire(self, tenant: str, rpm: int | None, tpm: int | None, cost: int) -> Verdict: ...

    async def adjust(self, tenant: str, tpm: int, delta: int) -> None: ...

    async def close(self) -> None: ...


class MemoryRateLimiter:
    """This process's buckets (no Redis): exact for one process, each worker or replica counts alone."""

    name = "memory"

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._tat: dict[tuple[str, str], float] = {}  # one entry per limited tenant and bucket: bounded by config

    def _look(self, key: tuple[str, str], limit: int | None, cost: int, now: float) -> tuple[float, float] | None:
        if limit is None:
            return None
        tat = max(self._tat.get(key, now), now)
        return tat - now, tat - now + cost * WINDOW_S / limit

    async def acquire(self, tenant: str, rpm: int | None, tpm: int | None, cost: int) -> Verdict:
        now = self._clock()
        req = self._look((tenant, "r"), rpm, 1, now)
        tok = self._look((tenant, "t"), tpm, cost, now)
        v = verdict(rpm, tpm, cost, req, tok)
        if v.allowed:
            if req is not None:
                self._tat[(tenant, "r")] = now + req[1]
            if tok is not None:
                self._tat[(tenant, "t")] = now + tok[1]
        return v

    async def adjust(self, tenant: str, tpm: int, delta: int) -> None:
        now = self._clock()
        key = (tenant, "t")
        tat = self._tat.get(key)
        if tat is not None:
            self._tat[key] = max(now, tat + delta * WINDOW_S / tpm)

    async def close(self) -> None:
        return None


# KEYS[1] = requests tat, KEYS[2] = tokens tat (microseconds of the server's clock); ARGV = rpm, tpm, cost
# (0 = no such limit). Returns {allowed, req_ahead, req_new_ahead, tok_ahead, tok_new_ahead} in microseconds.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = 60000000
local function look(key, limit, n)
  if limit <= 0 then return {0, 0} end
  local tat = tonumber(redis.call('GET', key) or '0') or 0
  if tat < now then tat = now end
  return {tat - now, tat - now + n * window / limit}
end
local r = look(KEYS[1], tonumber(ARGV[1]), 1)
local k = look(KEYS[2], tonumber(ARGV[2]), tonumber(ARGV[3]))
local ok = 1
if r[2] > window or k[2] > window then ok = 0 end
if ok == 1 then
  if tonumber(ARGV[1]) > 0 then
    redis.call('SET', KEYS[1], string.format('%d', now + r[2]), 'PX', math.floor(r[2] / 1000) + 1)
  end
  if tonumber(ARGV[2]) > 0 then
    redis.call('SET', KEYS[2], string.format('%d', now + k[2]), 'PX', math.floor(k[2] / 1000) + 1)
  end
end
return {ok, math.floor(r[1]), math.floor(r[2]), math.floor(k[1]), math.floor(k[2])}
"""

# KEYS[1] = tokens tat; ARGV = tpm, delta tokens (may be negative).
_ADJUST = """
local tat = tonumber(redis.call('GET', KEYS[1]) or '')
if not tat then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local new = tat + tonumber(ARGV[2]) * 60000000 / tonumber(ARGV[1])
if new <= now then redis.call('DEL', KEYS[1]) return 1 end
redis.call('SET', KEYS[1], string.format('%d', new), 'PX', math.floor((new - now) / 1000) + 1)
return 1
"""


def redis_keys(tenant: str) -> list[str]:
    return [f"specgate:rl:{{{tenant}}}:r", f"specgate:rl:{{{tenant}}}:t"]


class RedisRateLimiter:
    """The buckets in Redis, shared by every replica and worker (exact: one atomic script per admission)."""

    name = "redis"

    def __init__(self, client: aioredis.Redis, where: str = "redis") -> None:
        self._client = client
        self._where = where
        self._acquire = client.register_script(_ACQUIRE)
        self._adjust = client.register_script(_ADJUST)

    @classmethod
    def from_url(cls, url: str, *, socket_timeout_s: float = 0.5) -> RedisRateLimiter:
        pool, where = connection_pool(
            url,
            max_connections=64,
            socket_timeout_s=socket_timeout_s,
            health_check_interval_s=10,
            client_name="specgate-limits",
        )
        return cls(aioredis.Redis(connection_pool=pool), where)

    async def acquire(self, tenant: str, rpm: int | None, tpm: int | None, cost: int) -> Verdict:
        try:
            raw = await self._acquire(keys=redis_keys(tenant), args=[rpm or 0, tpm or 0, max(0, cost)])
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis rate limit failed ({self._where}): {type(exc).__name__}") from exc
        if not isinstance(raw, list) or len(raw) != 5:
            raise StoreUnavailable(f"redis rate limit returned an unexpected reply: {str(raw)[:100]!r}")
        us = [int(x) / 1e6 for x in raw[1:]]
        req = (us[0], us[1]) if rpm is not None else None
        tok = (us[2], us[3]) if tpm is not None else None
        return verdict(rpm, tpm, cost, req, tok)

    async def adjust(self, tenant: str, tpm: int, delta: int) -> None:
        try:
            await self._adjust(keys=redis_keys(tenant)[1:], args=[tpm, delta])
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis rate limit failed ({self._where}): {type(exc).__name__}") from exc

    async def close(self) -> None:
        try:
            await self._client.aclose()
            await self._client.connection_pool.aclose()
        except (RedisError, OSError):  # closing a dead connection: nothing left to do
            pass
