"""The leader lease: one gateway replica of a cluster holds it, renews it, hands it over on shutdown.

A Redis key set with ``NX PX`` to a random owner token. The holder renews it every ``ttl/4``; anyone else tries to
take it as often. Renewal and release are compare-and-set scripts (only the owner's token extends or deletes it),
so a replica that was paused past its lease can never extend or delete its successor's. A holder that cannot
renew (Redis unreachable, partitioned) stops acting as leader once ``ttl`` has passed since its last successful
renewal, which is when another replica may have taken over: at most one replica believes it leads at any time,
up to clock drift within one ``ttl``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from redis import asyncio as aioredis
from redis.exceptions import RedisError

logger = logging.getLogger("specgate.cluster")

# KEYS[1] = lease; ARGV = token, ttl_ms. 1 when the caller holds it (renewed), else 0.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# KEYS[1] = lease; ARGV = token. 1 when the caller held it (deleted), else 0.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaderLease:
    """One replica's side of the lease. ``tick`` is called every ``ttl/4`` (by ``ClusterNode``); ``held`` says
    whether this replica may act as leader now."""

    def __init__(
        self,
        client: aioredis.Redis,
        key: str,
        token: str,
        *,
        ttl_s: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self.key = key
        self.token = token
        self._ttl_s = ttl_s
        self._clock = clock
        self._renew: Any = client.register_script(_RENEW)
        self._release: Any = client.register_script(_RELEASE)
        self._valid_until = 0.0  # our clock: the lease is ours until then, as far as we can know
        self.holder: str | None = None  # the token of the holder, as last read (None: unknown or nobody)
        self.acquired = 0  # how many times this replica became leader

    @property
    def held(self) -> bool:
        return self._clock() < self._valid_until

    async def tick(self) -> bool:
        """Renew the lease if held, else try to take it; returns ``held`` after. Redis errors are not raised: the
        lease lapses on its own (a partitioned leader stops leading when its last renewal is ``ttl`` old)."""
        ttl_ms = max(1, round(self._ttl_s() * 1000))
        started = self._clock()
        try:
            if self.held:
                ok = bool(await self._renew(keys=[self.key], args=[self.token, ttl_ms]))
                if not ok:
                    logger.warning("leader lease %s lost to another replica", self.key)
            else:
                ok = bool(await self._client.set(self.key, self.token, nx=True, px=ttl_ms))
                if ok:
                    self.acquired += 1
                    logger.info("this replica is now the cluster leader (lease %s)", self.key)
            if ok:
                self.holder = self.token
                # Valid from when we asked, not from when Redis answered: a slow reply shortens it, never extends.
                self._valid_until = started + ttl_ms / 1000.0
            else:
                self._valid_until = 0.0
                raw = await self._client.get(self.key)
                self.holder = raw.decode() if isinstance(raw, bytes) else raw
        except (RedisError, OSError) as exc:
            if self.held:
                logger.warning("leader lease renewal failed (%s); leading until it lapses", type(exc).__name__)
            self.holder = self.token if self.held else None
        return self.held

    async def release(self) -> None:
        """Hand the lease over now (shutdown): another replica takes it at its next tick, not after ``ttl``."""
        was = self.held
        self._valid_until = 0.0
        if not was:
            return
        try:
            await self._release(keys=[self.key], args=[self.token])
            logger.info("leader lease %s released", self.key)
        except (RedisError, OSError) as exc:
            logger.warning("leader lease release failed (%s); it lapses on its own", type(exc).__name__)
