"""The one dependency container of a gateway process, built by ``create_app`` and run by its lifespan.

Everything that depends on the routing YAML lives in one immutable ``LiveConfig``; a reload builds a new one
and swaps the reference in a single assignment, so a request sees either the old config or the new one, never
a mix. Endpoint state (health, in-flight counts) is carried over by endpoint id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from gateway.attempts import AttemptPolicy
from gateway.audit import AuditLog, AuditRecord
from gateway.classify import Classifier
from gateway.controller import Transition
from gateway.decide import PoolView
from gateway.errors import GatewayError, Unauthorized
from gateway.health import HealthChecker
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.overrides import Override, OverrideManager
from gateway.periodic import cancel_and_wait
from gateway.pools import PoolState
from gateway.reload import Reloader, ReloadResult, config_digest
from gateway.routing_state import RoutingState
from gateway.rules.loader import load_rules_text
from gateway.rules.schema import RoutingRules
from gateway.scrape import PoolLoad
from gateway.scraper import Scraper
from gateway.settings import Settings
from gateway.store.base import Store, StoreUnavailable
from gateway.store.health import StoreHealth, build_store
from gateway.store.overrides import build_override_store
from gateway.upstream import PoolClient

logger = logging.getLogger("specgate")


@dataclass(frozen=True, slots=True)
class LiveConfig:
    rules: RoutingRules
    source: str
    text: str  # the YAML in force, as read (GET /admin/config)
    digest: str
    loaded_at: float
    classifier: Classifier
    pools: dict[str, PoolState]
    clients: dict[str, PoolClient]
    models: tuple[str, ...]
    model_set: frozenset[str]
    # The last view of each pool (``views``): immutable, handed out again while the pool's numbers are the same.
    _views: dict[str, PoolView] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, rules: RoutingRules, source: str, text: str, previous: LiveConfig | None = None) -> LiveConfig:
        pools = {p.name: PoolState.from_spec(p) for p in rules.pools}
        classifier = Classifier(rules)  # can fail (RE2 set compile): before anything touches the live endpoints
        clients = _clients(rules, previous)
        if previous is not None:
            # An endpoint that still exists keeps its state object: requests in flight on it decrement the same
            # counters after the swap, and what health checks learnt stays.
            old = {(e.pool, e.id, e.url): e for p in previous.pools.values() for e in p.endpoints}
            for pool in pools.values():
                for i, ep in enumerate(pool.endpoints):
                    prev = old.get((ep.pool, ep.id, ep.url))
                    if prev is not None:
                        prev.weight = ep.weight
                        prev.configured_weight = ep.configured_weight
                        pool.endpoints[i] = prev
        models = tuple(dict.fromkeys(m for p in rules.pools for m in p.models))
        return cls(
            rules=rules,
            source=source,
            text=text,
            digest=config_digest(text),
            loaded_at=time.time(),
            classifier=classifier,
            pools=pools,
            clients=clients,
            models=models,
            model_set=frozenset(models),
        )

    @property
    def version(self) -> int:
        return self.rules.version

    def views(self) -> dict[str, PoolView]:
        """Every pool as the decision sees it now (read on every request: endpoint state changes all the time)."""
        last = self._views
        out: dict[str, PoolView] = {}
        for name, p in self.pools.items():
            out[name] = last[name] = _view(p, last.get(name))
        return out

    def healthy_endpoints(self) -> int:
        return sum(p.healthy_count() for p in self.pools.values())


def _view(pool: PoolState, last: PoolView | None) -> PoolView:
    """The pool as the decision sees it now, in one pass over its endpoints; ``last`` again when its numbers are
    the same (a frozen dataclass costs more to build than to compare)."""
    routable = in_flight = 0
    drained = True
    for e in pool.endpoints:
        if e.weight > 0:
            drained = False
            if e.healthy and not e.ejected:  # EndpointState.routable
                routable += 1
                in_flight += e.in_flight
        elif not e.weight <= 0:  # NaN: neither routable nor drained
            drained = False
    if (
        last is not None
        and last.routable_endpoints == routable
        and last.in_flight == in_flight
        and last.drained is drained
    ):
        return last
    return PoolView(pool.name, pool.spec.kind, pool.models, routable, in_flight, drained)


def _clients(rules: RoutingRules, previous: LiveConfig | None) -> dict[str, PoolClient]:
    """One client per pool; a pool whose spec did not change keeps its client (its open connections)."""
    old = previous.clients if previous is not None else {}
    out: dict[str, PoolClient] = {}
    for p in rules.pools:
        client = old.get(p.name)
        out[p.name] = client if client is not None and client.spec == p else PoolClient(p)
    return out


class Runtime:
    def __init__(self, settings: Settings, live: LiveConfig) -> None:
        self.settings = settings
        self.live = live
        self.metrics = GatewayMetrics()
        self.access_log = AccessLog(enabled=settings.log_level in ("debug", "info"))
        self.rng = random.Random()
        self.started_at = int(time.time())
        self.audit = AuditLog()  # routing changes (controller transitions, admin actions), for GET /admin/audit
        keys = settings.client_api_keys()
        self._key_digests = frozenset(hashlib.sha256(k.encode()).digest() for k in keys)
        self.health = HealthChecker(
            lambda: self.live.pools.values(),
            self.metrics,
            interval_s=settings.health_interval_s,
            timeout_s=settings.health_timeout_s,
        )
        # The attempt loop's process-wide part: the retry budget and outlier ejection (gateway.attempts).
        self.attempts = AttemptPolicy(lambda: self.live.rules.defaults, self.metrics)
        # The route state of the classes with a ``controller:`` block, fed after every scrape round.
        self.routing = RoutingState(
            lambda: self.live.rules,
            self.metrics.registry,
            latency_p95=self.metrics.latency_p95,
            on_transition=self._audit_transition,
        )
        self.scraper = Scraper(
            lambda: self.live.pools.values(),
            lambda: self.live.rules.scrape,
            self.metrics,
            on_round=self.routing.on_scrape_round,
        )
        # Idempotency records: Redis when configured, else memory. ``store`` is the health-tracking wrapper, so a
        # failure on the request path marks the store degraded at once; ``store_health`` pings it back to healthy.
        self.store_health = StoreHealth(build_store(settings.redis_url), self.metrics.registry)
        self.store: Store = self.store_health
        # On-call overrides and the audit log, in the same store (Redis: shared by every replica; gateway.overrides).
        self.overrides = OverrideManager(
            build_override_store(settings.redis_url),
            pools=lambda: self.live.pools,
            rules=lambda: self.live.rules,
            routing=self.routing,
            registry=self.metrics.registry,
            local_audit=self.audit,
        )
        self._tasks: list[asyncio.Task[None]] = []
        # Hot reload of the routing YAML: SIGHUP, POST /admin/reload, the file watcher (gateway.reload).
        self.reloader = Reloader(self)

    def _audit_transition(self, t: Transition) -> None:
        detail = {"from": t.from_state, "to": t.to_state, "share": t.share, "detail": t.detail}
        self.overrides.record(
            AuditRecord.now("controller", "controller_transition", f"class/{t.class_name}", t.reason, detail)
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> Runtime:
        """Load and validate the routing YAML; raises ``RulesError`` with every problem found."""
        path = Path(settings.rules)
        text = path.read_text()
        rules = load_rules_text(text, source=str(path))
        return cls(settings, LiveConfig.build(rules, str(path), text))

    async def reload(self, trigger: str, actor: str | None = None) -> ReloadResult:
        """Re-read the routing YAML; validated completely before one swap of ``live`` (``gateway.reload``)."""
        return await self.reloader.reload(trigger, actor)

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

    @property
    def ready(self) -> tuple[bool, str]:
        if self.health.rounds == 0:
            return False, "first health check round not finished"
        if self.live.healthy_endpoints() == 0:
            return False, "no healthy endpoint"
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
        self._tasks.append(asyncio.create_task(self.health.run(), name="specgate-health"))
        self._tasks.append(asyncio.create_task(self.scraper.run(), name="specgate-scrape"))
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

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        await self.reloader.stop()
        await self.health.close()
        await self.scraper.close()
        await self.store_health.close()
        await self.overrides.close()
        for client in self.live.clients.values():
            await client.close()
