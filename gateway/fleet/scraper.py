"""The scrape loop: every endpoint's ``GET /metrics``, concurrently, on the YAML's interval.

A lifespan task (``Scraper.run``). Each round reads the pools and the ``scrape`` block afresh (a reload takes
effect at the next round; an endpoint that is gone is forgotten, a new one starts stale), fetches every endpoint's
``/metrics`` at once with the configured timeout on its own small aiohttp session (never the proxy's connection pools),
parses the exposition in a worker thread (``asyncio.to_thread``: a vLLM exposition is 50-100 KB of text), updates
the ``EndpointLoad`` and exports the pool gauges. A bug in one endpoint's scrape or in one round is logged and the
loop goes on.

``/health`` is fetched by the health checker alone (``gateway.fleet.health``), which owns the rotation and
``specgate_endpoint_healthy``; ``EndpointLoad.health_ok`` copies its last result.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping

import aiohttp

from gateway.config.schema import Scrape
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.prefix_index import TOKENS_PER_CHUNK
from gateway.fleet.vllm_exposition import MetricsFormatError, parse_vllm_metrics_bytes
from gateway.fleet.vllm_metrics import EndpointLoad, PoolLoad, PoolLoadView
from gateway.observability.metrics import GatewayMetrics
from gateway.periodic import run_every

logger = logging.getLogger("specgate.scrape")

MAX_BODY_BYTES = 8 << 20  # a vLLM exposition is ~100 KB; anything this large is not one


def _timeout(cfg: Scrape) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=cfg.timeout_s)


class _ScrapeFailure(Exception):
    def __init__(self, result: str, message: str) -> None:
        super().__init__(message)
        self.result = result


class Scraper:
    """Scrapes the pools that ``pools()`` returns, with the settings that ``config()`` returns (called each round)."""

    def __init__(
        self,
        pools: Callable[[], Iterable[PoolState]],
        config: Callable[[], Scrape],
        metrics: GatewayMetrics | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_round: Callable[[float, Mapping[str, PoolLoadView]], object] | None = None,
    ) -> None:
        self._pools = pools
        self._on_round = on_round  # called after each round with (now, views): the route-state controllers
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self.loads: dict[str, PoolLoad] = {}
        self.rounds = 0
        # A cluster follower's pool views, as the leader scraped them (``adopt``); None: this process's own.
        self.adopted: dict[str, PoolLoadView] | None = None
        self._exported: set[tuple[str, str]] = set()  # (pool, endpoint) label sets in the metrics

    # -- reading ---------------------------------------------------------------------------------------------

    def views(self, now: float | None = None) -> dict[str, PoolLoadView]:
        """Every pool's load now, the scraped numbers moved by the gateway's in-flight counts since the scrape (a
        cluster follower: the leader's views)."""
        if self.adopted is not None:
            return dict(self.adopted)
        t = self._clock() if now is None else now
        in_flight = {p.name: {e.id: e.in_flight for e in p.endpoints} for p in self._pools()}
        return {name: load.view(t, in_flight.get(name)) for name, load in self.loads.items()}

    # -- the loop --------------------------------------------------------------------------------------------

    async def run(self) -> None:
        await run_every(self.scrape_all, lambda: self._config().interval_s, what="scrape round", log=logger)

    def adopt(self, views: Mapping[str, PoolLoadView] | None) -> None:
        """Route on another replica's scrape (a cluster follower), or on this process's own again (None)."""
        self.adopted = None if views is None else dict(views)
        if views is not None:
            self._export()

    async def scrape_all(self) -> None:
        """One round: every endpoint at once; then the pool metrics."""
        self.adopted = None
        cfg = self._config()
        pools = list(self._pools())
        targets = self._sync(pools, cfg)
        session = self._get_session()
        results = await asyncio.gather(
            *(self._scrape(session, ep, load, cfg) for ep, load in targets), return_exceptions=True
        )
        for (ep, _), res in zip(targets, results, strict=True):
            if isinstance(res, BaseException) and not isinstance(res, asyncio.CancelledError):
                logger.error("scrape of %s/%s failed with a bug", ep.pool, ep.id, exc_info=res)
        self.rounds += 1
        self._export()
        if self._on_round is not None:
            now = self._clock()
            self._on_round(now, self.views(now))

    def _sync(self, pools: list[PoolState], cfg: Scrape) -> list[tuple[EndpointState, EndpointLoad]]:
        """Match the loads to the current pools and endpoints (after a reload), and apply the settings."""
        loads: dict[str, PoolLoad] = {}
        targets: list[tuple[EndpointState, EndpointLoad]] = []
        for pool in pools:
            old = self.loads.get(pool.name)
            new = PoolLoad(pool.name)
            for ep in pool.endpoints:
                load = old.endpoints.get(ep.id) if old is not None else None
                if load is None or load.url != ep.url:
                    load = EndpointLoad(pool.name, ep.id, ep.url)
                load.stale_after_s = cfg.stale_after
                load.window_s = cfg.window_s
                new.endpoints[ep.id] = load
                targets.append((ep, load))
            loads[pool.name] = new
        self.loads = loads
        return targets

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=2), auto_decompress=True
            )
        return self._session

    async def _scrape(self, session: aiohttp.ClientSession, ep: EndpointState, load: EndpointLoad, cfg: Scrape) -> None:
        metrics = await self._fetch_metrics(session, ep, cfg)
        load.health_ok = ep.healthy  # the health checker's last result: /health is fetched once per interval, there
        if isinstance(metrics, _ScrapeFailure):
            if not load.failed:
                logger.warning("scrape of %s/%s failed: %s (its data is stale)", ep.pool, ep.id, metrics)
            load.record_failure(metrics.result, str(metrics))
            result = metrics.result
        else:
            body, at, in_flight = metrics
            try:
                sample = await asyncio.to_thread(parse_vllm_metrics_bytes, body, cfg.metric_names)
            except MetricsFormatError as exc:
                if not load.failed:
                    logger.warning("scrape of %s/%s: %s (its data is stale)", ep.pool, ep.id, exc)
                load.record_failure("malformed", str(exc))
                result = "malformed"
            else:
                was_failed = load.failed
                ep.note_queue(sample.waiting, at + cfg.stale_after)
                prev = load.sample
                if load.record(sample, at, in_flight):
                    logger.info("counters of %s/%s went down: restart assumed, new baseline", ep.pool, ep.id)
                    ep.prefixes.clear()  # a restarted server's prefix cache is empty
                elif prev is not None and prev.prefix_hits is not None and sample.prefix_hits is not None:
                    ep.prefixes.observe_hits(sample.prefix_hits - prev.prefix_hits)
                if sample.cache_tokens is not None:
                    ep.prefixes.set_capacity(sample.cache_tokens // TOKENS_PER_CHUNK)
                if was_failed:
                    logger.info("scrape of %s/%s works again", ep.pool, ep.id)
                result = "ok"
        if self._metrics is not None:
            self._metrics.scrapes.labels(ep.pool, result).inc()

    async def _fetch_metrics(
        self, session: aiohttp.ClientSession, ep: EndpointState, cfg: Scrape
    ) -> tuple[bytes, float, int] | _ScrapeFailure:
        """The body, the time it arrived and the in-flight count then; or why not."""
        try:
            async with session.get(ep.url + "/metrics", timeout=_timeout(cfg), allow_redirects=False) as resp:
                if resp.status != 200:
                    return _ScrapeFailure("bad_status", f"/metrics returned {resp.status}")
                if (resp.content_length or 0) > MAX_BODY_BYTES:
                    return _ScrapeFailure("malformed", f"/metrics body too large ({resp.content_length} bytes)")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.content.iter_chunked(1 << 16):
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        return _ScrapeFailure("malformed", f"/metrics body over {MAX_BODY_BYTES} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            return _ScrapeFailure("timeout", f"/metrics timed out after {cfg.timeout_s}s")
        except (aiohttp.ClientError, OSError) as exc:
            return _ScrapeFailure("error", f"/metrics failed: {type(exc).__name__}: {exc}".rstrip(": "))
        return b"".join(chunks), self._clock(), ep.in_flight

    def _export(self) -> None:
        m = self._metrics
        if m is None:
            return
        now = self._clock()
        current = {(name, ep_id) for name, load in self.loads.items() for ep_id in load.endpoints}
        for pool, ep_id in self._exported - current:  # gone after a reload: its series go too
            for per_endpoint in (m.endpoint_scrape_stale, m.prefix_measured_hit_ratio, m.prefix_index_chunks):
                per_endpoint.remove(pool, ep_id)
        for pool in {p for p, _ in self._exported} - set(self.loads):
            for gauge in (m.pool_acceptance, m.pool_queue_depth, m.pool_batch_size):
                gauge.remove(pool)
        self._exported = current
        states = {(p.name, e.id): e for p in self._pools() for e in p.endpoints}
        for name, view in self.views(now).items():
            acc = view.acceptance
            m.pool_acceptance.labels(name).set(math.nan if acc is None else acc.rate)
            m.pool_queue_depth.labels(name).set(math.nan if view.waiting is None else view.waiting)
            m.pool_batch_size.labels(name).set(math.nan if view.running is None else view.running)
            for ep_id, load in self.loads[name].endpoints.items():
                m.endpoint_scrape_stale.labels(name, ep_id).set(1 if load.stale(now) else 0)
                d = load.deltas(now)
                ratio = None if d is None else d.prefix_hit_ratio
                m.prefix_measured_hit_ratio.labels(name, ep_id).set(math.nan if ratio is None else ratio)
                state = states.get((name, ep_id))
                if state is not None:
                    m.prefix_index_chunks.labels(name, ep_id).set(len(state.prefixes))

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
