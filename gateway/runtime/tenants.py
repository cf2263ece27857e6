"""Tenants at run time: who a client key belongs to, the tenant's limits at admission, its requests per pool for
fair share, and its metrics. Exists only with a tenants file (``Runtime.tenancy``); without one the request path
does none of this.

A request's ``Ticket`` is taken at admission (``Tenancy.admit``: concurrency, then the requests and tokens
buckets) and finished exactly once when its answer ends (``Ticket.finish``): the concurrency slot is given back and
the tokens bucket corrected by the answer's usage.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.config.tenants import NO_TENANT, PRIORITY_BOUND, Tenant, TenantsFile
from gateway.errors import BadRequest, RateLimited, Unauthorized
from gateway.observability.recent_counts import RecentCounts
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.routing.fairshare import PoolTenants, TenantWeight, admit_at_bound, hold_back, share_of
from gateway.runtime.waiting_room import WaitingRoom
from gateway.store.base import StoreUnavailable
from gateway.store.ratelimit import BucketView, MemoryRateLimiter, RateLimiter, Verdict

logger = logging.getLogger("specgate")

PRIORITY_HEADER = "x-specgate-priority"
# A waiter looks again this often even when no request of this process left the pool: slots freed by another replica
# (shared counts), a bound raised by a reload or an endpoint back, a better band that now lets it in.
_RECHECK_S = 0.25
Load = Callable[[], tuple[int, int | None]]  # a pool's requests in flight against its admission bound
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d{1,12})')


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``20ms``, ``1s``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    head = f"{hours}h{minutes}m" if hours else f"{minutes}m"
    return f"{head}{round(rest, 3):g}s"


def usage_tokens(data: bytes) -> int | None:
    """The last ``usage.total_tokens`` in a body or an event (chat, completions, Responses), if any."""
    found = _TOTAL_TOKENS.findall(data)
    return int(found[-1]) if found else None


def rate_headers(requests: BucketView | None, tokens: BucketView | None) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, view in (("requests", requests), ("tokens", tokens)):
        if view is not None:
            out += [
                (f"x-ratelimit-limit-{kind}", str(view.limit)),
                (f"x-ratelimit-remaining-{kind}", str(view.remaining)),
                (f"x-ratelimit-reset-{kind}", format_reset(view.reset_s)),
            ]
    return out


@dataclass(slots=True)
class TenantState:
    """One tenant in this process: its configuration (None: keys without a tenant) and requests in flight."""

    name: str
    spec: Tenant | None
    max_concurrent: int | None  # this process's part of the tenant's bound (split over the workers)
    in_flight: int = 0
    shed: int = 0  # since start, in this process (for /admin/state and the console)
    limited: int = 0
    # Shed and limited in the last few minutes, in this process (the console's panel).
    recent: RecentCounts = field(default_factory=lambda: RecentCounts(("shed", "limited")))


class Ticket:
    """One admitted request of a tenant: its priority, its reservation, the pools it is counted in."""

    __slots__ = ("_done", "_pools", "headers", "priority", "reserved", "tenancy", "tenant", "usage")

    def __init__(
        self, tenancy: Tenancy, tenant: TenantState, priority: int, reserved: int, headers: list[tuple[str, str]]
    ) -> None:
        self.tenancy = tenancy
        self.tenant = tenant
        self.priority = priority
        self.reserved = reserved  # tokens charged at admission (0 without a tokens limit)
        self.headers = headers  # the x-ratelimit-* headers of the answer
        self.usage: int | None = None  # the answer's total tokens, when it said
        self._pools: list[str] = []
        self._done = False

    @property
    def name(self) -> str:
        return self.tenant.name

    @property
    def wants_usage(self) -> bool:
        return self.reserved > 0

    def enter(self, pool: str) -> None:
        counts = self.tenancy.pool_counts.setdefault(pool, {})
        counts[self.tenant.name] = counts.get(self.tenant.name, 0) + 1
        self._pools.append(pool)

    def leave(self, pool: str) -> None:
        counts = self.tenancy.pool_counts.get(pool)
        if counts is not None and pool in self._pools:
            self._pools.remove(pool)
            left = counts.get(self.tenant.name, 0) - 1
            if left > 0:
                counts[self.tenant.name] = left
            else:
                counts.pop(self.tenant.name, None)
            self.tenancy.pump(pool)

    async def admission(self, pool: str, load: Load, can_wait: bool) -> bool:
        """Admission control with tenants: below the bound admitted (unless held back from the last free slots), at
        it admitted by fair share and priority (``gateway.routing.fairshare``); otherwise, where the request has no
        other pool to go to (``can_wait``), it waits in the pool's waiting room (``gateway.runtime.waiting_room``)
        up to ``waiting.wait_s``. False: shed."""
        tenancy = self.tenancy
        in_flight, bound = load()
        if bound is None:
            return True
        room = tenancy.rooms.get(pool)
        if room is not None and room.waiters:
            tenancy.pump(pool, load)  # slots freed where no request of this process left: the waiters' first
        taken = in_flight + (room.granted if room is not None else 0)
        if taken < bound and not self.holds_back(pool, taken, bound):
            return True
        if self.admit_at_bound(pool, taken, bound):
            return True
        wait_s = tenancy.waiting_s
        if not can_wait or wait_s <= 0:
            return False
        if room is None:
            room = tenancy.rooms[pool] = WaitingRoom()
        room.load = load
        counts = tenancy.pool_counts.get(pool, {})
        weight = tenancy.weights.get(self.name, TenantWeight(1.0, 0)).weight  # its tenant removed by a reload: 1
        waiter = room.join(self.name, self.priority, weight, counts, tenancy.room_size)
        if waiter is None:
            return False

        def look_again() -> bool:  # no slot handed to it yet: freed elsewhere, or a better band lets it in now?
            tenancy.pump(pool, load)
            if waiter.future.done():
                return False
            in_flight, bound = load()
            return bound is None or self.admit_at_bound(pool, in_flight + room.granted, bound)

        admitted = False
        try:
            admitted = await room.wait(waiter, wait_s, _RECHECK_S, look_again)
            return admitted
        finally:
            if room.done(waiter) and not admitted:
                tenancy.pump(pool)  # granted, then cancelled before entering: the slot goes to the next waiter

    def admit_at_bound(self, pool: str, in_flight: int, bound: int | None) -> bool:
        """The pool is at its admission bound: is this request admitted anyway (``gateway.routing.fairshare``)?"""
        if bound is None:
            return False
        counts = self.tenancy.pool_counts.get(pool, {})
        return admit_at_bound(
            self.tenant.name, PoolTenants(counts, self.tenancy.weights, bound, in_flight), self.priority
        )

    def holds_back(self, pool: str, in_flight: int, bound: int | None) -> bool:
        """Below the bound: this request leaves the last free slots to the other tenants
        (``gateway.routing.fairshare.hold_back``)."""
        counts = self.tenancy.pool_counts.get(pool)
        if bound is None or not counts:
            return False
        tenancy = self.tenancy
        return hold_back(
            self.tenant.name,
            PoolTenants(counts, tenancy.weights, bound, in_flight),
            priority=self.priority,
            best=tenancy.best,
        )

    def observe(self, data: bytes) -> None:
        """A body or event of the answer: keep the usage it reports (tenants with a tokens limit only)."""
        got = usage_tokens(data)
        if got is not None:
            self.usage = got

    def finish(self, outcome: str, reached_pool: bool) -> None:
        """The answer ended (once): the slot back, the tokens bucket corrected, the metrics."""
        if self._done:
            return
        self._done = True
        for pool in list(self._pools):
            self.leave(pool)
        self.tenancy.release(self, outcome, reached_pool)


class Tenancy:
    """The tenants of this process (see the module docstring)."""

    def __init__(
        self,
        spec: TenantsFile,
        plain_keys: frozenset[str],
        metrics: TenantMetrics,
        limiter: RateLimiter,
        workers: int = 1,
    ) -> None:
        self.metrics = metrics
        self.limiter = limiter
        self._fallback = MemoryRateLimiter()  # while Redis fails: each process counts alone
        self._split = max(1, workers)
        self._by_digest: dict[bytes, TenantState] = {}
        self.tenants: dict[str, TenantState] = {NO_TENANT: TenantState(NO_TENANT, None, None)}
        self.weights: dict[str, TenantWeight] = {}
        # The requests of each tenant in flight per pool, in this process (fair share at the admission bound).
        self.pool_counts: dict[str, dict[str, int]] = {}
        # Each full pool's waiters (created at the first wait), and how long and how many may wait.
        self.rooms: dict[str, WaitingRoom] = {}
        self.best = 0  # the best priority configured (the fast lane)
        self.waiting_s = 0.0
        self.room_size = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.update(spec, plain_keys)

    def update(self, spec: TenantsFile, plain_keys: frozenset[str]) -> None:
        """Put a tenants file in force (at start, and when the file changes): keys, priorities, weights, limits and
        the waiting room's settings, swapped at once. A tenant that stays keeps its requests in flight and its
        counts; the requests of a removed one finish under it (its keys get 401 from now on); a new one starts
        at zero. The requests and tokens buckets are by tenant name, so they carry over too."""
        old = self.tenants
        tenants: dict[str, TenantState] = {}
        by_digest: dict[bytes, TenantState] = {}
        weights = {NO_TENANT: TenantWeight(1.0, 0)}
        for t in spec.tenants:
            limit = None if t.limits.max_concurrent is None else math.ceil(t.limits.max_concurrent / self._split)
            state = old.get(t.name)
            if state is None or state.spec is None:
                state = TenantState(t.name, t, limit)
                self.metrics.in_flight.labels(t.name).set(0)  # every label present from the start
            state.spec, state.max_concurrent = t, limit
            tenants[t.name] = state
            weights[t.name] = TenantWeight(t.weight, t.priority)
            for key in t.keys:
                by_digest[hashlib.sha256(key.encode()).digest()] = state
        anonymous = tenants[NO_TENANT] = old[NO_TENANT]
        self.metrics.in_flight.labels(NO_TENANT).inc(0)
        for key in plain_keys:
            by_digest.setdefault(hashlib.sha256(key.encode()).digest(), anonymous)
        self.tenants, self._by_digest, self.weights = tenants, by_digest, weights
        self.best = min(w.priority for w in weights.values())
        self.waiting_s = float(spec.waiting.wait_s)
        self.room_size = spec.waiting.max_waiting_per_pool

    def pump(self, pool: str, load: Load | None = None) -> None:
        """Slots of ``pool`` may have freed: hand them to its best waiters (``WaitingRoom.refill``)."""
        room = self.rooms.get(pool)
        if room is not None and room.waiters:
            room.refill(self.pool_counts.get(pool, {}), self.weights, self.best, load)

    def describe(self, bounds: Mapping[str, int | None]) -> list[dict[str, Any]]:
        """Each tenant now, for ``/admin/state`` and the console: its settings, its requests in flight and, in each
        pool it has requests in, how many against its fair share of the pool's bound (``bounds``), and its requests
        waiting in each pool's waiting room."""
        out = []
        waiting: dict[str, dict[str, int]] = {}
        for pool, room in self.rooms.items():
            for waiter in room.waiters:
                mine = waiting.setdefault(waiter.tenant, {})
                mine[pool] = mine.get(pool, 0) + 1
        for name, state in self.tenants.items():
            w = self.weights[name]
            pools = {}
            for pool, counts in self.pool_counts.items():
                if counts.get(name):
                    bound = bounds.get(pool)
                    share = None if bound is None else share_of(name, counts, self.weights, bound)
                    pools[pool] = {"in_flight": counts[name], "share": share, "bound": bound}
            spec = state.spec
            out.append(
                {
                    "name": name,
                    "priority": w.priority,
                    "weight": w.weight,
                    "in_flight": state.in_flight,
                    "shed": state.shed,
                    "limited": state.limited,
                    "recent": {"window_s": state.recent.window_s, **state.recent.totals()},
                    "limits": None if spec is None else spec.limits.model_dump(),
                    "pools": pools,
                    "waiting": waiting.get(name, {}),
                }
            )
        return out

    @property
    def key_digests(self) -> frozenset[bytes]:
        return frozenset(self._by_digest)

    def identify(self, authorization: str | None) -> TenantState:
        if not authorization or not authorization[:7].lower() == "bearer ":
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        state = self._by_digest.get(hashlib.sha256(authorization[7:].strip().encode()).digest())
        if state is None:
            raise Unauthorized("invalid API key")
        return state

    def priority_of(self, tenant: TenantState, header: str | None) -> int:
        spec = tenant.spec
        default = spec.priority if spec is not None else 0
        if header is None:
            return default
        if spec is None or not spec.allow_priority_header:
            raise BadRequest(
                f"{PRIORITY_HEADER} is not allowed for this key (tenant setting allow_priority_header)",
                code="priority_header_not_allowed",
            )
        try:
            value = int(header.strip())
        except ValueError:
            value = PRIORITY_BOUND + 1
        if abs(value) > PRIORITY_BOUND:
            raise BadRequest(
                f"{PRIORITY_HEADER} must be an integer in -{PRIORITY_BOUND}..{PRIORITY_BOUND}", code="invalid_priority"
            )
        return value

    def reservation(self, tenant: TenantState, prompt_tokens: int, max_tokens: float, n: int) -> int:
        """Tokens reserved at admission: the prompt's estimate plus what the answer may generate."""
        spec = tenant.spec
        if spec is None or spec.limits.tokens_per_minute is None:
            return 0
        out = spec.limits.reserve_output_tokens if math.isinf(max_tokens) else max(0, int(max_tokens))
        return max(1, prompt_tokens + out * max(1, n))

    async def admit(self, tenant: TenantState, priority: int, cost: int) -> Ticket:
        """Take a slot and charge the buckets, or raise ``RateLimited`` with the headers OpenAI sends."""
        spec = tenant.spec
        headers: list[tuple[str, str]] = []
        if spec is not None:
            if tenant.max_concurrent is not None and tenant.in_flight >= tenant.max_concurrent:
                tenant.limited += 1
                tenant.recent.add("limited")
                self.metrics.limited.labels(tenant.name, "concurrent").inc()
                self.metrics.requests.labels(tenant.name, "limited").inc()
                raise RateLimited(
                    f"tenant {tenant.name!r} has {tenant.in_flight} requests in flight, its limit here "
                    f"(max_concurrent): retry when one has ended",
                    limit="concurrent",
                    headers={"retry-after": "1", "retry-after-ms": "1000"},
                )
            if spec.limited:
                lim = spec.limits
                got = await self._acquire(tenant.name, lim.requests_per_minute, lim.tokens_per_minute, cost)
                headers = rate_headers(got.requests, got.tokens)
                if not got.allowed:
                    kind = got.refused_by or "requests"
                    tenant.limited += 1
                    tenant.recent.add("limited")
                    self.metrics.limited.labels(tenant.name, kind).inc()
                    self.metrics.requests.labels(tenant.name, "limited").inc()
                    raise _limited(tenant.name, kind, got, cost, headers)
        tenant.in_flight += 1
        self.metrics.in_flight.labels(tenant.name).inc()
        reserved = cost if spec is not None and spec.limits.tokens_per_minute is not None else 0
        return Ticket(self, tenant, priority, reserved, headers)

    async def _acquire(self, name: str, rpm: int | None, tpm: int | None, cost: int) -> Verdict:
        try:
            return await self.limiter.acquire(name, rpm, tpm, cost)
        except StoreUnavailable as exc:
            logger.warning("rate limits counted in this process only: %s", exc)
            return await self._fallback.acquire(name, rpm, tpm, cost)

    def release(self, ticket: Ticket, outcome: str, reached_pool: bool) -> None:
        tenant = ticket.tenant
        tenant.in_flight -= 1
        m = self.metrics
        m.in_flight.labels(tenant.name).dec()
        m.requests.labels(tenant.name, outcome).inc()
        if outcome == "overloaded":
            tenant.shed += 1
            tenant.recent.add("shed")
            m.shed.labels(tenant.name).inc()
        if ticket.reserved <= 0 or tenant.spec is None:
            return
        used = ticket.usage if ticket.usage is not None else (ticket.reserved if reached_pool else 0)
        m.tokens.labels(tenant.name).inc(used)
        tpm = tenant.spec.limits.tokens_per_minute
        if used != ticket.reserved and tpm is not None:
            task = asyncio.get_running_loop().create_task(self._adjust(tenant.name, tpm, used - ticket.reserved))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _adjust(self, name: str, tpm: int, delta: int) -> None:
        try:
            await self.limiter.adjust(name, tpm, delta)
        except StoreUnavailable as exc:
            logger.warning("tokens usage not corrected: %s", exc)
            await self._fallback.adjust(name, tpm, delta)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.limiter.close()


def _limited(name: str, kind: str, got: Verdict, cost: int, headers: list[tuple[str, str]]) -> RateLimited:
    extra = dict(headers)
    if got.never:
        message = (
            f"request too large for tenant {name!r}: it needs {cost} tokens (prompt estimate + max output), more "
            "than its tokens per minute; lower max_tokens or the prompt"
        )
        return RateLimited(message, limit="tokens", headers=extra)
    wait = max(0.001, got.retry_after_s)
    extra["retry-after"] = str(max(1, math.ceil(wait)))
    extra["retry-after-ms"] = str(max(1, math.ceil(wait * 1000)))
    per = "requests" if kind == "requests" else "tokens"
    message = f"rate limit of tenant {name!r} reached: {per} per minute; retry in {format_reset(wait)}"
    return RateLimited(message, limit=kind, headers=extra)
