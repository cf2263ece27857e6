"""Which store a process uses (``build_store``), and whether it can be reached right now (``StoreHealth``).

``StoreHealth`` wraps the store and is itself a ``Store``: the runtime hands the wrapper to the request path, so
every failure there (``StoreUnavailable`` from any operation) is counted and marks the store degraded at once,
without waiting for the next ping. A background loop pings on an interval and is the only thing that marks it
healthy again: Redis coming back is noticed within one interval with no operator action ("recovers by itself").

A degraded store does not make the gateway unready: requests without an Idempotency-Key never touch it. Its
state is reported in ``/ready`` and in the metrics ``specgate_store_up{store}`` (1/0) and
``specgate_store_errors_total{store,op}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.periodic import run_every
from gateway.store.base import ClaimResult, Completed, Running, Store, StoreUnavailable
from gateway.store.memory import DEFAULT_MAX_BYTES, DEFAULT_MAX_OWNER_RECORDS, MemoryStore
from gateway.store.redis import DEFAULT_PREFIX, RedisStore, redact_url

logger = logging.getLogger("specgate.store")

T = TypeVar("T")


def build_store(
    redis_url: str | None,
    *,
    prefix: str = DEFAULT_PREFIX,
    socket_timeout_s: float = 0.5,
    memory_bytes: int = DEFAULT_MAX_BYTES,
    owner_records: int = DEFAULT_MAX_OWNER_RECORDS,
    owner_bytes: int = 0,
) -> Store:
    """``RedisStore`` when a URL is configured (shared by the replicas), else ``MemoryStore`` (this process only).

    Nothing connects here: an unreachable Redis at start-up leaves the gateway serving, with the store reported
    degraded until it answers.
    """
    if not redis_url:
        return MemoryStore(max_bytes=memory_bytes, max_owner_records=owner_records, max_owner_bytes=owner_bytes)
    logger.info("idempotency store: redis at %s", redact_url(redis_url))
    return RedisStore.from_url(
        redis_url, socket_timeout_s=socket_timeout_s, prefix=prefix, max_owner_records=owner_records
    )


class StoreHealth:
    """A ``Store`` that delegates to ``store`` and tracks whether it answers; ``run()`` is its ping loop."""

    def __init__(
        self,
        store: Store,
        registry: CollectorRegistry | None = None,
        *,
        interval_s: float = 1.0,
        ping_timeout_s: float = 2.0,
    ) -> None:
        if interval_s <= 0 or ping_timeout_s <= 0:
            raise ValueError("interval_s and ping_timeout_s must be > 0")
        self.store = store
        self.name = store.name
        self.interval_s = interval_s
        self._ping_timeout_s = ping_timeout_s
        # Optimistic until the first ping (which ``run()`` sends at once): a request that comes first finds out
        # for itself, and its failure flips this immediately.
        self.healthy = True
        self.last_error: str | None = None
        self.since = time.time()  # wall-clock time of the last change of ``healthy``
        self.pings = 0
        r = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.registry = r
        # With several workers each has its own connection: the merged gauge is the worst worker's view.
        self._up = Gauge(
            "specgate_store_up",
            "1 when the idempotency store answers (memory: always), 0 while it cannot be reached.",
            ["store"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self._errors = Counter(
            "specgate_store_errors_total",
            "Failed idempotency store operations (ping included), by operation.",
            ["store", "op"],
            registry=r,
        )
        self._up.labels(self.name).set(1)

    # -- state ---------------------------------------------------------------------------------------------------

    def mark_failed(self, op: str, error: str) -> None:
        """Count a failure and mark the store degraded (from the request path or the ping loop)."""
        self._errors.labels(self.name, op).inc()
        self.last_error = error
        if self.healthy:
            self.healthy = False
            self.since = time.time()
            self._up.labels(self.name).set(0)
            logger.warning("idempotency store %s is unavailable: %s", self.name, error)

    def _mark_ok(self) -> None:
        if not self.healthy:
            down_for = time.time() - self.since
            self.healthy = True
            self.since = time.time()
            self._up.labels(self.name).set(1)
            logger.warning("idempotency store %s is reachable again (was down %.1fs)", self.name, down_for)

    def status(self) -> dict[str, object]:
        """The store's state for ``/ready``: name, healthy, last_error (the latest failure, kept after recovery)."""
        return {"name": self.name, "healthy": self.healthy, "last_error": self.last_error, "since": self.since}

    async def check(self) -> bool:
        """Ping once, update the state; True when the store answered."""
        self.pings += 1
        try:
            async with asyncio.timeout(self._ping_timeout_s):
                await self.store.ping()
        except StoreUnavailable as exc:
            self.mark_failed("ping", str(exc))
            return False
        except TimeoutError:
            self.mark_failed("ping", f"{self.name} ping timed out after {self._ping_timeout_s}s")
            return False
        self._mark_ok()
        return True

    async def run(self) -> None:
        await run_every(self.check, lambda: self.interval_s, what="idempotency store health check", log=logger)

    # -- the Store protocol, delegated -----------------------------------------------------------------------

    async def _call(self, op: str, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except StoreUnavailable as exc:
            self.mark_failed(op, str(exc))
            raise

    async def claim(
        self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0, owner: str = ""
    ) -> ClaimResult:
        return await self._call(
            "claim", self.store.claim(key, fingerprint, lease_ms=lease_ms, max_bytes=max_bytes, owner=owner)
        )

    async def extend(self, key: str, token: str, *, lease_ms: int) -> bool:
        return await self._call("extend", self.store.extend(key, token, lease_ms=lease_ms))

    async def complete(self, key: str, token: str, response: bytes, *, ttl_ms: int) -> bool:
        return await self._call("complete", self.store.complete(key, token, response, ttl_ms=ttl_ms))

    async def release(self, key: str, token: str) -> bool:
        return await self._call("release", self.store.release(key, token))

    async def get(self, key: str) -> Running | Completed | None:
        return await self._call("get", self.store.get(key))

    async def remember(self, key: str, value: bytes, *, ttl_ms: int, owner: str = "") -> None:
        await self._call("remember", self.store.remember(key, value, ttl_ms=ttl_ms, owner=owner))

    async def recall(self, key: str) -> bytes | None:
        return await self._call("recall", self.store.recall(key))

    async def forget(self, key: str) -> bool:
        return await self._call("forget", self.store.forget(key))

    async def ping(self) -> None:
        await self._call("ping", self.store.ping())

    async def close(self) -> None:
        await self.store.close()
