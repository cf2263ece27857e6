"""Active health checks: every endpoint's ``GET /health``, concurrently, on an interval.

An endpoint that fails a check leaves the rotation; one that passes comes back (also after a passive
failure marked it down). An ejected endpoint (``gateway.routing.attempts``) comes back only with the first passing check
once its ejection time is over. The checks use their own small connection pool, so that a pool whose connections
are all busy with long generations is not declared dead for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp

from gateway.fleet.pools import EndpointState, PoolState
from gateway.observability.metrics import GatewayMetrics
from gateway.periodic import run_every

logger = logging.getLogger("specgate.health")


class HealthChecker:
    """Checks every endpoint's ``GET /health`` on an interval (``run``), concurrently, on its own small
    connection pool; a failed check takes the endpoint out of rotation, a passed one brings it back (and ends an
    ejection that is over). ``rounds`` counts finished rounds (``/ready`` waits for the first)."""

    def __init__(
        self,
        pools: Callable[[], Iterable[PoolState]],
        metrics: GatewayMetrics,
        *,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self._pools = pools
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.rounds = 0

    async def _probe(self, session: aiohttp.ClientSession, ep: EndpointState) -> None:
        error: str | None = None
        try:
            async with session.get(ep.url + "/health", allow_redirects=False) as resp:
                await resp.read()
                if resp.status != 200:
                    error = f"/health returned {resp.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = f"/health failed: {type(exc).__name__}: {exc}".rstrip(": ")
        healthy = error is None
        if healthy != ep.healthy:
            logger.warning(
                "endpoint %s/%s is now %s%s",
                ep.pool,
                ep.id,
                "healthy" if healthy else "unhealthy",
                f" ({error})" if error else "",
            )
        if ep.set_health(healthy, error, now=time.monotonic()):
            logger.warning("endpoint %s/%s is back from its ejection (health check passed)", ep.pool, ep.id)
            self._metrics.endpoint_ejected.labels(ep.pool, ep.id).set(0)
        self._metrics.endpoint_up.labels(ep.pool, ep.id).set(1 if healthy else 0)
        self._metrics.health_checks.labels(ep.pool, "ok" if healthy else "fail").inc()

    async def check_all(self) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=32, force_close=True)
            )
        session = self._session
        pools = list(self._pools())
        eps = [ep for pool in pools for ep in pool.endpoints]
        await asyncio.gather(*(self._probe(session, ep) for ep in eps))
        self._unstrand(pools)
        self.rounds += 1

    def _unstrand(self, pools: list[PoolState]) -> None:
        """End the ejection of healthy endpoints early when a model has no routable endpoint left: ejection only
        checks "never the last one" when it happens, and the others may have failed their checks since."""
        for pool in pools:
            for model in pool.models:
                if any(e.routable for p in pools if model in p.models for e in p.endpoints):
                    continue
                for p in pools:
                    if model not in p.models:
                        continue
                    for ep in p.endpoints:
                        if ep.ejected and ep.healthy and ep.weight > 0:
                            ep.ejected = False
                            logger.warning(
                                "endpoint %s/%s is back early from its ejection: no other endpoint serves %s",
                                ep.pool,
                                ep.id,
                                model,
                            )
                            self._metrics.endpoint_ejected.labels(ep.pool, ep.id).set(0)

    async def run(self) -> None:
        await run_every(self.check_all, lambda: self._interval_s, what="health check round", log=logger)

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
