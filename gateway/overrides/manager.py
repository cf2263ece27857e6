"""On-call overrides: pool and endpoint weights, drains and forced class routes, each with a TTL and a reason, in
force on every replica that shares the store (``gateway.overrides.store``), and audited there.

The model (``Override``, ``gateway.overrides.override``) and its JSON form are the admin API's (README, "Runtime
overrides (on-call)"). One override per kind and target is active: a newer one replaces the older one. Precedence of
an endpoint's effective weight: a drain of its pool makes it 0; else its ``endpoint_weight`` override; else its pool's
``pool_weight`` override; else the YAML weight (``EndpointState.configured_weight``). Weight 0 takes no new
requests; those in flight finish. A ``class_route`` override forces the class's first pool kind: a controlled
class's controller is forced for the TTL, a class without one is routed to the first pool of that kind among its
route's pools (``RoutingState.set_forced``).

``OverrideManager`` is the runtime component: it holds the stored overrides, applies the active ones to the live
config (``apply``, also after a config swap), makes the changes the admin routes ask for, and runs as a lifespan
task (``run``): re-read on every change notification and every ``reread_s``, expire every ``tick_s``, and write
queued audit records to the store. An override expires by itself at ``expires_at`` on every replica; the store's
compare-and-delete lets exactly one replica write the expiry's audit record. The store unreachable: traffic keeps
flowing on the last known overrides, audit records wait in a bounded queue, and admin changes answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from gateway.config.schema import PoolKind, RoutingRules
from gateway.errors import OverrideStoreUnavailable
from gateway.fleet.pools import PoolState
from gateway.overrides.audit import AuditLog, AuditRecord
from gateway.overrides.override import KINDS, Override, effective_weight, unknown_target
from gateway.overrides.store import MAX_OVERRIDE_BYTES, OverrideStore
from gateway.periodic import raise_if_cancelled
from gateway.routing.routing_state import RoutingState
from gateway.store.base import StoreUnavailable

logger = logging.getLogger("specgate.overrides")

MAX_PENDING_AUDIT = 10_000


class OverrideManager:
    """The overrides of this replica, kept in step with the store; see the module docstring."""

    def __init__(
        self,
        store: OverrideStore,
        *,
        pools: Callable[[], Mapping[str, PoolState]],
        rules: Callable[[], RoutingRules],
        routing: RoutingState,
        registry: CollectorRegistry,
        local_audit: AuditLog | None = None,
        on_rejected: Callable[[str], object] = lambda kind: None,
        clock: Callable[[], float] = time.time,
        tick_s: float = 0.5,
        reread_s: float = 5.0,
    ) -> None:
        self.store = store
        self._pools = pools
        self._rules = rules
        self._routing = routing
        self._local = local_audit  # this process's recent records and the JSON log line
        self._on_rejected = on_rejected  # an override read back that failed its checks ("override")
        self._clock = clock
        self.tick_s = tick_s
        self.reread_s = reread_s
        self._stored: dict[str, Override] = {}  # by key, as last read or written (expired ones until deleted)
        self._pending: deque[AuditRecord] = deque(maxlen=MAX_PENDING_AUDIT)
        self._flushing = asyncio.Lock()  # one writer at a time: a record is written once
        self._gen = 0  # bumped by every local write: a read that overlapped one is repeated
        self._applied_to: object = None  # the pools mapping the overrides were last applied to
        self._dirty = True
        self._wake = asyncio.Event()
        self.last_sync: float | None = None  # epoch time of the last successful read
        self.last_error: str | None = None
        self.active_gauge = Gauge(
            "specgate_overrides_active",
            "On-call overrides in force on this replica, by kind.",
            ["kind"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.changes = Counter(
            "specgate_admin_changes_total",
            "Changes made through the admin API (set, replaced or removed overrides), by action.",
            ["action"],
            registry=registry,
        )
        for kind in KINDS:
            self.active_gauge.labels(kind).set(0)

    # -- state -----------------------------------------------------------------------------------------------

    def active(self, now: float | None = None) -> list[Override]:
        """The overrides in force, oldest first."""
        at = self._clock() if now is None else now
        return sorted((o for o in self._stored.values() if not o.expired(at)), key=lambda o: o.created_at)

    def status(self) -> dict[str, Any]:
        return {
            "store": self.store.name,
            "last_sync": self.last_sync,
            "last_error": self.last_error,
            "pending_audit": len(self._pending),
        }

    def apply(self) -> list[Override]:
        """Set every endpoint's effective weight and the forced class routes from the active overrides, on the
        live config as it is now (call it right after a config swap). Returns the active overrides whose pool,
        endpoint or class the config does not have (not applied)."""
        now = self._clock()
        pools, rules = self._pools(), self._rules()
        active: dict[str, Override] = {}
        unknown: list[Override] = []
        for o in self.active(now):
            if unknown_target(o, pools, rules):
                unknown.append(o)
            else:
                active[o.key] = o
        for pool in pools.values():
            for ep in pool.endpoints:
                ep.weight = effective_weight(pool.name, ep.id, ep.configured_weight, active)
        forced: dict[str, tuple[PoolKind, float | None]] = {}
        for o in active.values():
            if o.kind == "class_route" and o.class_name is not None and o.value in ("speculative", "standard"):
                kind: PoolKind = "speculative" if o.value == "speculative" else "standard"
                forced[o.class_name] = (kind, None if o.expires_at is None else o.expires_at - now)
        self._routing.set_forced(forced)
        for k in KINDS:
            self.active_gauge.labels(k).set(sum(1 for o in active.values() if o.kind == k))
        self._applied_to = pools
        return unknown

    # -- reading and expiring ----------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read every override from the store and apply them (raises ``StoreUnavailable``)."""
        for _ in range(5):
            gen = self._gen
            payloads = await self.store.list_overrides()
            if gen == self._gen:
                break
        stored: dict[str, Override] = {}
        for raw in payloads:
            try:
                if raw is None:
                    raise ValueError(f"malformed, or larger than {MAX_OVERRIDE_BYTES} bytes (not read)")
                o = Override.from_bytes(raw)
            except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
                self._on_rejected("override")
                logger.warning("ignoring an unreadable override in the store: %s", exc)
                continue
            stored[o.key] = o
        self._stored = stored
        self._ok()
        self.apply()

    async def expire(self, now: float | None = None) -> list[Override]:
        """Drop the overrides whose time is over; those this replica deleted from the store are audited (and
        returned): exactly one replica wins each."""
        at = self._clock() if now is None else now
        over = [o for o in self._stored.values() if o.expired(at)]
        if not over:
            return []
        for o in over:
            del self._stored[o.key]
        self.apply()
        won: list[Override] = []
        for o in over:
            if await self.store.delete(o.key, o.id) is not None:
                won.append(o)
                detail = {"override": o.as_dict()}
                reason = f"ttl over (set by {o.actor}: {o.reason})"
                self.record(AuditRecord.now("system", "expire", o.target, reason, detail))
        if won:
            await self._notify()
        return won

    # -- changes (the admin routes) ----------------------------------------------------------------------------

    async def put(self, o: Override) -> tuple[Override, Override | None]:
        """Store ``o`` (replacing the override of the same kind and target), apply it, audit it, tell the other
        replicas. Returns it and the one it replaced, if any. Raises ``OverrideStoreUnavailable``."""
        self._gen += 1
        try:
            raw = await self.store.put(o.key, o.id, o.to_bytes())
        except StoreUnavailable as exc:
            raise self._unavailable(exc) from exc
        old = None
        if raw is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError, orjson.JSONDecodeError):
                old = Override.from_bytes(raw)
        self._stored[o.key] = o
        self.apply()
        detail: dict[str, Any] = {"override": o.as_dict(), "replaced": None if old is None else old.as_dict()}
        self.record(AuditRecord.now(o.actor, o.kind, o.target, o.reason, detail))
        self.changes.labels(o.kind).inc()
        await self._notify()
        await self._flush_quietly()
        return o, old

    async def remove(
        self, match: Callable[[Override], bool], *, actor: str, reason: str, action: str
    ) -> list[Override]:
        """Remove every active override that ``match``es (read fresh from the store first); the ones removed."""
        try:
            await self.refresh()
            now = self._clock()
            removed: list[Override] = []
            self._gen += 1
            for o in [o for o in self._stored.values() if not o.expired(now) and match(o)]:
                if await self.store.delete(o.key, o.id) is not None:
                    removed.append(o)
                self._stored.pop(o.key, None)
        except StoreUnavailable as exc:
            raise self._unavailable(exc) from exc
        self.apply()
        for o in removed:
            self.record(AuditRecord.now(actor, action, o.target, reason, {"override": o.as_dict()}))
            self.changes.labels(action).inc()
        if removed:
            await self._notify()
        await self._flush_quietly()
        return removed

    async def find(self, override_id: str) -> Override | None:
        """The active override with this id, read fresh from the store."""
        try:
            await self.refresh()
        except StoreUnavailable as exc:
            raise self._unavailable(exc) from exc
        now = self._clock()
        return next((o for o in self._stored.values() if o.id == override_id and not o.expired(now)), None)

    async def drop(self, overrides: Iterable[Override], *, actor: str, reason: str) -> list[Override]:
        """Remove these overrides (e.g. their pool or class left the config: ``apply`` returned them)."""
        ids = {o.id for o in overrides}
        if not ids:
            return []
        return await self.remove(lambda o: o.id in ids, actor=actor, reason=reason, action="drop")

    # -- the audit log -------------------------------------------------------------------------------------------

    def record(self, rec: AuditRecord) -> None:
        """Audit one change (synchronous: the controller calls it): logged now, written to the store soon."""
        if self._local is not None:
            self._local.append(rec)
        self._pending.append(rec)
        self._wake.set()

    async def flush_audit(self) -> None:
        """Write the queued audit records to the store, oldest first (raises ``StoreUnavailable``)."""
        async with self._flushing:
            while self._pending:
                rec = self._pending[0]
                await self.store.append_audit(rec.at, orjson.dumps(rec.as_dict(), option=orjson.OPT_NON_STR_KEYS))
                if self._pending and self._pending[0] is rec:
                    self._pending.popleft()

    async def audit(self, limit: int, since: float | None = None) -> tuple[list[AuditRecord], int, int]:
        """The newest ``limit`` records after ``since``, the records kept, and the records ever written."""
        try:
            await self.flush_audit()
            raws = await self.store.audit(limit, since)
            size, total = await self.store.audit_counts()
        except StoreUnavailable as exc:
            raise self._unavailable(exc) from exc
        out: list[AuditRecord] = []
        for raw in raws:
            with contextlib.suppress(ValueError, KeyError, TypeError, orjson.JSONDecodeError):
                d = orjson.loads(raw)
                out.append(AuditRecord(d["at"], d["actor"], d["action"], d["target"], d["reason"], d["detail"]))
        return out, size, total

    # -- the lifespan task -----------------------------------------------------------------------------------

    async def run(self) -> None:
        listener = asyncio.create_task(self._listen(), name="specgate-overrides-listen")
        next_read = 0.0
        try:
            while True:
                raise_if_cancelled()
                now = time.monotonic()
                try:
                    if self._dirty or now >= next_read:
                        self._dirty = False
                        next_read = now + self.reread_s
                        await self.refresh()
                    await self.expire()
                    await self.flush_audit()
                except StoreUnavailable as exc:
                    self._failed(str(exc))
                    next_read = min(next_read, now + 1.0)
                except Exception:  # a bug here must not stop the overrides for good
                    logger.exception("override sync failed")
                if self._pools() is not self._applied_to:  # the config was swapped without apply()
                    self.apply()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.tick_s):
                        await self._wake.wait()
                self._wake.clear()
        finally:
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener

    async def _listen(self) -> None:
        async for _ in self.store.changes():
            self._dirty = True
            self._wake.set()

    async def close(self) -> None:
        await self._flush_quietly()
        await self.store.close()

    # -- helpers ---------------------------------------------------------------------------------------------

    async def _notify(self) -> None:
        try:
            await self.store.notify()
        except StoreUnavailable as exc:  # the others re-read within reread_s anyway
            self._failed(str(exc))

    async def _flush_quietly(self) -> None:
        try:
            await self.flush_audit()
        except StoreUnavailable as exc:
            self._failed(str(exc))

    def _ok(self) -> None:
        if self.last_error is not None:
            logger.warning("override store %s is reachable again", self.store.name)
        self.last_error = None
        self.last_sync = self._clock()

    def _failed(self, error: str) -> None:
        if self.last_error is None:
            logger.warning("override store %s unavailable, last known overrides kept: %s", self.store.name, error)
        self.last_error = error

    def _unavailable(self, exc: StoreUnavailable) -> OverrideStoreUnavailable:
        self._failed(str(exc))
        return OverrideStoreUnavailable(f"the override store cannot be reached; nothing was changed ({exc})")
