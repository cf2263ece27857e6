"""The one dependency container of a gateway process, built by ``create_app`` and run by its lifespan.

Everything that depends on the routing YAML lives in one immutable ``LiveConfig``; a reload builds a new one
and swaps the reference in a single assignment, so a request sees either the old config or the new one, never
a mix. Endpoint state (health, in-flight counts) is carried over by endpoint id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import time
from pathlib import Path
from typing import Any

from gateway.cluster import snapshot as cluster_snapshot
from gateway.cluster.counts import Contribution
from gateway.cluster.node import ClusterNode, connect, replica_id
from gateway.config.loader import load_rules_text
from gateway.config.settings import Settings
from gateway.config.tenants import load_tenants_file
from gateway.errors import GatewayError, Unauthorized
from gateway.fleet.health import HealthChecker
from gateway.fleet.kv_events import KvEventFollower
from gateway.fleet.scraper import Scraper
from gateway.fleet.vllm_metrics import PoolLoad
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.observability.tracing import Tracing
from gateway.overrides.audit import AuditLog, AuditRecord
from gateway.overrides.manager import OverrideManager
from gateway.overrides.override import Override
from gateway.overrides.store import build_override_store
from gateway.periodic import DelayedCalls, cancel_and_wait, run_every
from gateway.routing import overload
from gateway.routing.attempts import AttemptPolicy
from gateway.routing.controller import Transition
from gateway.routing.prompt_hashes import PromptHashes
from gateway.routing.routing_state import ProbeChange, RoutingState
from gateway.runtime.detached import DetachedBudget
from gateway.runtime.live import LiveConfig
from gateway.runtime.parse_pool import ParsePool
from gateway.runtime.reload import Reloader, ReloadResult
from gateway.runtime.tenants import Tenancy
from gateway.runtime.tenants_reload import TenantsReloader
from gateway.runtime.workers import WorkerGroup
from gateway.store.base import Store, StoreUnavailable
from gateway.store.health import StoreHealth, build_store
from gateway.store.ratelimit import MemoryRateLimiter, RateLimiter, RedisRateLimiter

logger = logging.getLogger("specgate")


class Runtime:
    """The one dependency container of a gateway process: everything a request or a background task needs.

    Holds the settings, the config in force (``live``, swapped whole by ``reloader``), the metrics and access log,
    the process-wide attempt policy (retry budget, outlier ejection), the class controllers' ``routing`` state,
    the health checker and scraper that feed it, the idempotency ``store``, the on-call ``overrides`` and their
    ``audit``. Built once by ``create_app`` (``from_settings`` validates the YAML first); ``start`` and ``stop``
    run the background tasks from the app's lifespan. Handlers read ``live`` once per request, so a request sees
    one config from start to end."""

    def __init__(self, settings: Settings, live: LiveConfig) -> None:
        self.settings = settings
        self.live = live
        self.metrics = GatewayMetrics()
        self.access_log = AccessLog(enabled=settings.log_level in ("debug", "info"))
        self.rng = random.Random()
        self.ids = random.Random()  # new request ids (``proxy.headers.request_id``), apart from the routing draws
        # The clients' watches of the serving loop, started a while into a request (``proxy.presence``; the app's
        # lifespan sets it up)
        self.watch_starts: DelayedCalls | None = None
        # OpenTelemetry (--tracing): None when off, and then no request does any tracing work.
        self.tracing: Tracing | None = Tracing() if settings.tracing else None
        self.started_at = int(time.time())
        # Keyed generations left running after their client went away (gateway.runtime.detached).
        self.detached = DetachedBudget(settings.max_detached, settings.max_detached_per_client)
        self.audit = AuditLog()  # routing changes (controller transitions, admin actions), for GET /admin/audit
        self.trusted_proxies = settings.trusted_proxy_networks()  # whose X-Forwarded-For is kept (proxy.headers)
        # Large request bodies are parsed in these processes (gateway.proxy.parse_pool); None: on the event loop.
        self.parse_pool = ParsePool(settings.parse_workers) if settings.parse_workers > 0 else None
        keys = settings.client_api_keys()
        self._key_digests = frozenset(hashlib.sha256(k.encode()).digest() for k in keys)
        # Tenants (--tenants-file): their keys, limits, priority and share weight. None: none of that is done.
        self.tenancy: Tenancy | None = None
        self.tenants_reloader: TenantsReloader | None = None  # the tenants file watched and re-read
        if settings.tenants_file is not None:
            limiter: RateLimiter = (
                RedisRateLimiter.from_url(settings.redis_url) if settings.redis_url else MemoryRateLimiter()
            )
            tenants = load_tenants_file(settings.tenants_file)
            self.tenancy = Tenancy(tenants, keys, TenantMetrics(self.metrics.registry), limiter, settings.workers)
            self._key_digests = self.tenancy.key_digests
            self.tenants_reloader = TenantsReloader(settings.tenants_file, self.tenancy, keys, self._set_keys)
        token = (settings.metrics_token or "").strip()
        self._metrics_digest = hashlib.sha256(token.encode()).digest() if token else None
        every, timeout = settings.health_interval_s, settings.health_timeout_s
        self.health = HealthChecker(lambda: self.live.pools.values(), self.metrics, interval_s=every, timeout_s=timeout)
        # The attempt loop's process-wide part: the retry budget and outlier ejection (gateway.routing.attempts).
        self.attempts = AttemptPolicy(
            lambda: self.live.rules.defaults,
            self.metrics,
            overload_spec=lambda: self.live.rules.overload,
            workers=settings.workers,
        )
        # The route state of the classes with a controller (their block or defaults.controller), fed after every
        # scrape round.
        self.routing = RoutingState(
            lambda: self.live.rules,
            self.metrics.registry,
            latency_p95=self.metrics.latency_p95,
            on_transition=self._audit_transition,
            on_probe=self._audit_probe,
        )
        # The chunk hashes of the latest prompts: a prompt that repeats or extends one hashes only its new part.
        self.prompt_hashes = PromptHashes()
        self.scraper = Scraper(
            lambda: self.live.pools.values(),
            lambda: self.live.rules.scrape,
            self.metrics,
            on_round=self.routing.on_scrape_round,
        )
        # The KV events of the endpoints that name a publisher (every process follows them itself: each has its own
        # prefix indexes).
        self.kv_events = KvEventFollower(lambda: self.live.pools.values(), self.metrics.registry)
        # Idempotency records: Redis when configured, else memory. ``store`` is the health-tracking wrapper, so a
        # failure on the request path marks the store degraded at once; ``store_health`` pings it back to healthy.
        self.store_health = StoreHealth(
            build_store(
                settings.redis_url,
                memory_bytes=settings.idempotency_memory_bytes,
                owner_records=settings.idempotency_owner_records,
                owner_bytes=settings.idempotency_owner_bytes,
            ),
            self.metrics.registry,
        )
        self.store: Store = self.store_health
        # On-call overrides and the audit log, in the same store (Redis: shared by every replica;
        # gateway.overrides.manager).
        self.overrides = OverrideManager(
            build_override_store(settings.redis_url),
            pools=lambda: self.live.pools,
            rules=lambda: self.live.rules,
            routing=self.routing,
            registry=self.metrics.registry,
            local_audit=self.audit,
            on_rejected=lambda kind: self.metrics.store_rejected.labels(kind).inc(),
        )
        # Cluster mode (with Redis): one replica leads (scrapes, checks health, runs the controllers) and publishes
        # a snapshot the others route on; all share their in-flight and class counts (gateway.cluster.node).
        self.cluster: ClusterNode | None = None
        self._scrape_now = asyncio.Event()  # set when this replica becomes the leader: scrape and publish at once
        if settings.redis_url is not None and settings.cluster:
            client, subscriber = connect(settings.redis_url)
            self.cluster = ClusterNode(
                client,
                subscriber,
                replica=replica_id(),
                interval_s=lambda: self.live.rules.scrape.interval_s,
                on_snapshot=self._adopt,
                own_counts=self._own_counts,
                on_counts=self._apply_counts,
                on_lead=self._scrape_now.set,
                on_rejected=lambda kind: self.metrics.store_rejected.labels(kind).inc(),
                registry=self.metrics.registry,
            )
            self.routing.remote_counts = self.cluster.remote_class_counts
            self.attempts.shared_counts = self.cluster.counts_fresh
        self._tasks: list[asyncio.Task[None]] = []
        # The sibling workers of ``--workers N`` (None with one): their config digests (gateway.runtime.workers).
        self.worker_group = WorkerGroup.from_env(settings.workers)
        # Hot reload of the routing YAML: SIGHUP, POST /admin/reload, the file watcher (gateway.runtime.reload).
        self.reloader = Reloader(self, on_result=self._reloaded)

    def _reloaded(self, result: ReloadResult) -> None:
        if self.worker_group is not None:
            self.worker_group.publish(self.live.digest)

    def _export_admission(self) -> None:
        """The admission bounds in force (gauge), every scrape interval, on every replica (leader or not)."""
        gauge = self.metrics.admission_limit
        for name, limit in overload.limits(self.live.pools, self.settings.workers).items():
            if limit is not None:
                gauge.labels(name).set(limit)
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(name)

    def _audit_transition(self, t: Transition) -> None:
        if self.cluster is not None and self.cluster.role == "follower":
            return  # the leader audits the cluster's transitions once (a follower's come from on-call forces)
        detail = {"from": t.from_state, "to": t.to_state, "share": t.share, "detail": t.detail, "rule": t.rule}
        self.overrides.record(
            AuditRecord.now("controller", "controller_transition", f"class/{t.class_name}", t.reason, detail)
        )

    def _audit_probe(self, p: ProbeChange) -> None:
        if self.cluster is not None and self.cluster.role == "follower":
            return  # probes are the leader's (it runs the controllers)
        reason = "probe_started" if p.share > 0 else "probe_stopped"
        detail = {"probe_share": p.share, "detail": p.detail}
        self.overrides.record(
            AuditRecord.now("controller", "controller_probe", f"class/{p.class_name}", reason, detail)
        )

    # -- cluster mode ----------------------------------------------------------------------------------------

    def _acting_locally(self) -> bool:
        return self.cluster is None or self.cluster.acting_locally()

    async def _scrape_round(self) -> None:
        self._export_admission()
        if self.tracing is not None:  # spans exported and dropped (the export process reports its own)
            self.metrics.trace_spans(self.tracing.span_counts())
        if not self._acting_locally():
            return
        await self.scraper.scrape_all()
        node = self.cluster
        if node is not None and node.lease.held:
            now = time.monotonic()
            await node.publish(
                cluster_snapshot.build(
                    leader=node.replica,
                    seq=0,
                    at=time.time(),
                    now=now,
                    config=self.live.digest,
                    pools=self.live.pools.values(),
                    views=self.scraper.views(now),
                    classes=self.routing.snapshot(now),
                )
            )

    async def _health_round(self) -> None:
        if self._acting_locally():
            await self.health.check_all()

    def _adopt(self, snap: dict[str, Any]) -> None:
        """A follower takes the leader's snapshot: endpoint health and ejections, pool loads, class shares."""
        now = time.monotonic()
        pools = list(self.live.pools.values())
        spec = self.live.rules.defaults.outlier_detection
        suspect: list[str] = []
        changed = cluster_snapshot.apply_endpoints(
            snap,
            pools,
            now,
            max_ejection_s=spec.max_ejection_s,
            max_ejection_percent=spec.max_ejection_percent,
            max_fresh_s=self.cluster.stale_after_s if self.cluster is not None else 60.0,
            suspect=suspect,
        )
        if suspect:
            self.metrics.store_rejected.labels("snapshot").inc()
            logger.warning("cluster snapshot out of bounds, cut: %s", "; ".join(suspect[:5]))
        for ep in changed:
            logger.warning("endpoint %s/%s is now %s (cluster leader)", ep.pool, ep.id, "up" if ep.healthy else "down")
        for pool in pools:
            for ep in pool.endpoints:
                self.metrics.endpoint_up.labels(ep.pool, ep.id).set(1 if ep.healthy else 0)
                self.metrics.endpoint_ejected.labels(ep.pool, ep.id).set(1 if ep.ejected else 0)
        self.scraper.adopt(cluster_snapshot.load_views(snap))
        self.routing.adopt(cluster_snapshot.class_shares(snap), cluster_snapshot.class_controllers(snap))

    def _own_counts(self) -> Contribution:
        now = time.monotonic()
        in_flight: dict[str, int] = {}
        ejected: dict[str, float] = {}
        for p in self.live.pools.values():
            for e in p.endpoints:
                if e.in_flight > 0:
                    in_flight[f"{p.name}/{e.id}"] = e.in_flight
                if e.ejected and e.ejected_here and e.ejected_until > now:
                    ejected[f"{p.name}/{e.id}"] = round(e.ejected_until - now, 3)
        return Contribution(0.0, in_flight, self.routing.local_counts(), ejected)

    def _apply_counts(self) -> None:
        """After each read of the shared counts: the others' in-flight requests per endpoint, and their own
        ejections, taken here for the time left (unless that would leave a model without an endpoint)."""
        node = self.cluster
        remote = node.remote_in_flight() if node is not None else {}
        ejections = node.remote_ejections() if node is not None else {}
        now = time.monotonic()
        pools = list(self.live.pools.values())
        spec = self.live.rules.defaults.outlier_detection
        max_s = spec.max_ejection_s
        for p in pools:
            for e in p.endpoints:
                key = f"{p.name}/{e.id}"
                e.remote_in_flight = remote.get(key, 0)
                left = ejections.get(key)
                if left is None or e.ejected or not cluster_snapshot.may_eject(e, p, pools, spec.max_ejection_percent):
                    continue
                e.ejected, e.ejected_here, e.ejected_until = True, False, now + min(left, max_s)
                self.metrics.endpoint_ejected.labels(e.pool, e.id).set(1)
                logger.warning("endpoint %s is ejected for %.1fs (another replica's failures)", key, min(left, max_s))

    @classmethod
    def from_settings(cls, settings: Settings) -> Runtime:
        """Load and validate the routing YAML; raises ``RulesError`` with every problem found."""
        path = Path(settings.rules)
        text = path.read_text()
        rules = load_rules_text(text, source=str(path), stand_ins=settings.stand_in_urls())
        return cls(settings, LiveConfig.build(rules, str(path), text))

    async def reload(self, trigger: str, actor: str | None = None) -> ReloadResult:
        """Re-read the routing YAML; validated completely before one swap of ``live`` (``gateway.runtime.reload``);
        and the tenants file (``gateway.runtime.tenants_reload``)."""
        if self.tenants_reloader is not None:
            self.tenants_reloader.reload(trigger)
        return await self.reloader.reload(trigger, actor)

    def _set_keys(self, digests: frozenset[bytes]) -> None:
        self._key_digests = digests

    async def apply_overrides(self) -> list[Override]:
        """After a config swap: re-apply the active overrides to the new config (synchronously, before the first
        ``await``: no request sees the swapped config without them) and drop (audited, from the store) and return
        those referring to pools, endpoints or classes it no longer has."""
        unknown = self.overrides.apply()
        if unknown:
            reason = f"its target is not in the config {self.live.digest}"
            try:
                await self.overrides.drop(unknown, actor="reload", reason=reason)
            except GatewayError as exc:  # not applied here anyway; the store keeps them until a later drop
                logger.warning("could not drop %d override(s) from the store: %s", len(unknown), exc.message)
        return unknown

    @property
    def loads(self) -> dict[str, PoolLoad]:
        """Scraped load per pool (``PoolLoad.view(now)``, or ``scraper.views()`` with in-flight counts applied)."""
        return self.scraper.loads

    @property
    def auth_enabled(self) -> bool:
        return bool(self._key_digests)

    def authenticate(self, authorization: str | None) -> None:
        if not self._key_digests:
            return
        if not authorization or not authorization[:7].lower() == "bearer ":
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        digest = hashlib.sha256(authorization[7:].strip().encode()).digest()
        if digest not in self._key_digests:
            raise Unauthorized("invalid API key")

    def authenticate_metrics(self, authorization: str | None) -> None:
        """Who may read /metrics (pool and endpoint names, every class's traffic): with a metrics token, only its
        bearer (not a client key: a tenant does not see the others' traffic); without one, as the client API."""
        if self._metrics_digest is None:
            self.authenticate(authorization)
            return
        if not authorization or not authorization[:7].lower() == "bearer ":
            raise Unauthorized(
                "missing metrics token: send 'Authorization: Bearer <token>'", code="invalid_metrics_token"
            )
        digest = hashlib.sha256(authorization[7:].strip().encode()).digest()
        if not hmac.compare_digest(digest, self._metrics_digest):
            raise Unauthorized("invalid metrics token", code="invalid_metrics_token")

    @property
    def ready(self) -> tuple[bool, str]:
        node = self.cluster
        if self.health.rounds == 0 and (node is None or node.snapshots_applied == 0):
            return False, "first health check round not finished"
        if self.live.healthy_endpoints() == 0:
            return False, "no healthy endpoint"
        if node is not None and node.role == "local":
            return True, "ok (cluster: no fresh leader snapshot, scraping and deciding alone)"
        return True, "ok"

    async def start(self) -> None:
        if not self.auth_enabled:
            logger.warning(
                "client authentication is OFF: any client can use this gateway "
                "(set SPECGATE_API_KEYS or --api-keys-file to require keys)"
            )
        rules = self.live.rules
        logger.info(
            "specgate ready to serve: %d pools, %d classes, config %s (%s)",
            len(rules.pools),
            len(rules.classes),
            self.live.source,
            self.live.digest,
        )
        if self.cluster is not None:
            self.cluster.start()
        if self.parse_pool is not None:
            self.parse_pool.start()
        health = run_every(self._health_round, lambda: self.settings.health_interval_s, what="health", log=logger)
        scrape = run_every(
            self._scrape_round,
            lambda: self.live.rules.scrape.interval_s,
            what="scrape",
            log=logger,
            wake=self._scrape_now,
        )
        self._tasks.append(asyncio.create_task(health, name="specgate-health"))
        self._tasks.append(asyncio.create_task(scrape, name="specgate-scrape"))
        self._tasks.append(asyncio.create_task(self.kv_events.run(), name="specgate-kv-events"))
        self._tasks.append(asyncio.create_task(self.access_log.run(), name="specgate-access-log"))
        self._tasks.append(asyncio.create_task(self.store_health.run(), name="specgate-store-health"))
        try:  # overrides in force before the first request (a restart keeps them); else the task retries
            async with asyncio.timeout(2.0):
                await self.overrides.refresh()
                # A restart with a changed config (the usual rollout) drops overrides on pools or classes it no
                # longer has, as a hot reload does: a pool of that name coming back later must not be drained by
                # a forgotten override.
                await self.apply_overrides()
        except (TimeoutError, StoreUnavailable) as exc:
            logger.warning("overrides not loaded at start-up (%s); retrying in the background", exc)
        self._tasks.append(asyncio.create_task(self.overrides.run(), name="specgate-overrides"))
        self.reloader.start()
        if self.tenants_reloader is not None and self.reloader.watch_interval_s > 0:
            watch = self.tenants_reloader.watcher(self.reloader.watch_interval_s).run()
            self._tasks.append(asyncio.create_task(watch, name="specgate-tenants-watch"))
        if self.worker_group is not None:
            self.worker_group.publish(self.live.digest)

    async def stop(self) -> None:
        if self.worker_group is not None:
            self.worker_group.withdraw()
        if self.cluster is not None:
            await self.cluster.stop()  # first: the lease is handed over while this replica still drains
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        await self.reloader.stop()
        await self.health.close()
        await self.scraper.close()
        await self.kv_events.close()
        await self.store_health.close()
        await self.overrides.close()
        if self.tenancy is not None:
            await self.tenancy.close()
        for client in self.live.clients.values():
            await client.close()
        if self.parse_pool is not None:
            await self.parse_pool.close()
        if self.tracing is not None:  # the spans still buffered go out (bounded by the exporter's timeout)
            await asyncio.to_thread(self.tracing.shutdown)
