"""One replica's membership in the cluster: the leader lease, the snapshot it publishes or follows, and the
counts it contributes. Only with Redis; without it every replica acts alone (``role`` "local").

Roles:
- ``leader``: holds the lease; scrapes and health-checks every endpoint, runs the class controllers, and after
  every scrape round publishes the fleet snapshot (``gateway.cluster.snapshot``) to a key and a channel.
- ``follower``: another replica leads and its snapshot is fresh (younger than ``stale_after_s``); this replica
  neither scrapes nor checks health, and routes on the snapshot: endpoint health and ejections, pool loads, each
  class's route state and share.
- ``local``: no snapshot fresh enough (the leader died and no one took over yet, Redis is unreachable, or there is
  no Redis): the replica scrapes, checks health and runs its controllers itself, as a single gateway does. It
  says so: ``specgate_cluster_role``, ``specgate_cluster_snapshot_age_seconds``, the ``/ready`` detail, a log line.

Shared counts: every ``contribute_every_s`` each replica writes its own current numbers (in-flight requests per
endpoint; requests, draft and accepted tokens per class, cumulative; the passive ejections it made itself, as time
left) to one field of a hash, and reads every replica's. Absolute values, not deltas: a lost write is corrected by
the next, nothing drifts, and a replica that stops writing drops out when its entry is ``contribution_ttl_s`` old.
Each replica's saturation, admission and busy checks add the others' in-flight counts, each replica takes the
others' ejections for their time left, and the leader's controllers add the others' class counts.

Keys share one hash tag (``specgate:{fleet}:…``) so they live on one Redis Cluster slot.

What is read back is checked (``on_rejected`` counts what is ignored): a snapshot larger than
``snapshot.MAX_SNAPSHOT_BYTES`` is not read past that size, one that is not a JSON object is dropped; a
contribution larger than ``counts.MAX_CONTRIBUTION_BYTES`` or with counts out of range (``parse_contribution``) is
left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import orjson
from prometheus_client import CollectorRegistry, Gauge
from redis import asyncio as aioredis
from redis.exceptions import RedisError

from gateway.cluster.counts import (
    Contribution,
    class_count_sum,
    in_flight_sum,
    longest_ejections,
    parse_contribution,
)
from gateway.cluster.lease import LeaderLease
from gateway.cluster.snapshot import MAX_SNAPSHOT_BYTES
from gateway.periodic import cancel_and_wait, raise_if_cancelled, run_every
from gateway.store.redis import connection_pool

logger = logging.getLogger("specgate.cluster")

Role = Literal["leader", "follower", "local"]
ROLES: tuple[Role, ...] = ("leader", "follower", "local")
DEFAULT_PREFIX = "specgate:{fleet}:"


def replica_id() -> str:
    """A name for this process in the cluster: host, pid and a random tail (a restarted pod is a new replica)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class ClusterNode:
    """The replica's cluster side. ``start`` spawns its loops; the runtime asks ``acting_locally`` before each
    scrape and health round, calls ``publish`` after a round while leading, and gets snapshots via ``on_snapshot``.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        subscriber: aioredis.Redis,
        *,
        replica: str,
        interval_s: Callable[[], float],
        on_snapshot: Callable[[dict[str, Any]], object],
        own_counts: Callable[[], Contribution],
        on_counts: Callable[[], object] = lambda: None,
        on_lead: Callable[[], object] = lambda: None,
        on_rejected: Callable[[str], object] = lambda kind: None,
        registry: CollectorRegistry,
        prefix: str = DEFAULT_PREFIX,
        contribute_every_s: float = 0.25,
        contribution_ttl_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica = replica
        self._client = client
        self._subscriber = subscriber
        self._interval_s = interval_s
        self._on_snapshot = on_snapshot
        self._own_counts = own_counts
        self._on_counts = on_counts  # after each read of the shared counts (the runtime applies them)
        self._on_lead = on_lead  # when this replica takes the lease: scrape and publish at once
        self._on_rejected = on_rejected  # a record read back that failed its checks: "snapshot" | "contribution"
        self._clock = clock
        self.snapshot_key = prefix + "snapshot"
        self.channel = prefix + "snapshot:published"
        self.contrib_key = prefix + "contributions"
        self.contribute_every_s = contribute_every_s
        self.contribution_ttl_s = contribution_ttl_s
        self.lease = LeaderLease(client, prefix + "leader", replica, ttl_s=self.lease_ttl_s, clock=clock)
        self.snapshot: dict[str, Any] | None = None  # the last one applied (from another replica)
        self._snapshot_received = -1.0  # our clock
        self._published_at = -1.0  # our clock: the last snapshot this replica published
        self.seq = 0
        self.snapshots_applied = 0
        self.last_lag_s: float | None = None
        self.others: dict[str, Contribution] = {}  # fresh contributions of the other replicas
        self._counts_read = -1.0  # our clock: the last successful read of the shared counts
        self._role: Role = "local"
        self._tasks: list[asyncio.Task[None]] = []
        self.role_gauge = Gauge(
            "specgate_cluster_role",
            "1 for this replica's cluster role: leader, follower (routes on the leader's snapshot) or local.",
            ["role"],
            registry=registry,
            multiprocess_mode="liveall",
        )
        self.snapshot_age = Gauge(
            "specgate_cluster_snapshot_age_seconds",
            "Age of the fleet snapshot this replica routes on (0 while it leads; NaN when it has none).",
            registry=registry,
            multiprocess_mode="liveall",
        )
        self.replicas = Gauge(
            "specgate_cluster_replicas",
            "Replicas whose shared counts are fresh, this one included.",
            registry=registry,
            multiprocess_mode="liveall",
        )
        self._set_role("local", "starting")

    # -- timing ----------------------------------------------------------------------------------------------

    def lease_ttl_s(self) -> float:
        """1.2 scrape intervals (at least 1 s): with a tick every ttl/4 and a scrape at once by the new leader, a
        dead leader's successor publishes within ~2 intervals."""
        return max(1.0, 1.2 * self._interval_s())

    @property
    def stale_after_s(self) -> float:
        """A snapshot older than this is not routed on: 3 scrape intervals (at least 1.5 s)."""
        return max(1.5, 3.0 * self._interval_s())

    # -- state -----------------------------------------------------------------------------------------------

    @property
    def role(self) -> Role:
        return self._role

    def snapshot_age_s(self) -> float | None:
        if self.lease.held:
            return 0.0 if self._published_at >= 0 else None
        if self._snapshot_received < 0:
            return None
        return max(0.0, self._clock() - self._snapshot_received)

    def acting_locally(self) -> bool:
        """True when this replica must scrape, health-check and run its controllers itself."""
        return self._refresh_role() != "follower"

    def _refresh_role(self) -> Role:
        if self.lease.held:
            role: Role = "leader"
        else:
            age = self.snapshot_age_s()
            role = "follower" if age is not None and age <= self.stale_after_s else "local"
        if role != self._role:
            why = {
                "leader": "holds the leader lease",
                "follower": f"routes on the snapshot of {self.snapshot.get('leader') if self.snapshot else '?'}",
                "local": "no fresh snapshot from a leader: scraping and deciding for itself",
            }[role]
            self._set_role(role, why)
        age = self.snapshot_age_s()
        self.snapshot_age.set(float("nan") if age is None else age)
        return role

    def _set_role(self, role: Role, why: str) -> None:
        if role != self._role and why != "starting":  # the first role it takes is news; "starting" (built) is not
            log = logger.warning if role == "local" else logger.info
            log("cluster role of %s: %s (%s)", self.replica, role, why)
        self._role = role
        for r in ROLES:
            self.role_gauge.labels(r).set(1 if r == role else 0)

    def describe(self) -> dict[str, Any]:
        """For /admin/state and /ready: who leads, how old the snapshot is, each replica's contribution age."""
        now = time.time()
        age = self.snapshot_age_s()
        return {
            "enabled": True,
            "replica": self.replica,
            "role": self._refresh_role(),
            "leader": self.replica if self.lease.held else (self.lease.holder or (self.snapshot or {}).get("leader")),
            "snapshot_age_s": None if age is None else round(age, 3),
            "snapshot_seq": self.seq if self.lease.held else (self.snapshot or {}).get("seq"),
            "stale_after_s": self.stale_after_s,
            "contributions": {r: round(max(0.0, now - c.at), 3) for r, c in sorted(self.others.items())},
        }

    def remote_in_flight(self) -> dict[str, int]:
        """The other replicas' in-flight requests per ``pool/endpoint``."""
        return in_flight_sum(self.others.values())

    def counts_fresh(self) -> bool:
        """The shared counts were read within ``contribution_ttl_s``: the others' in-flight counts are known."""
        return self._counts_read >= 0 and self._clock() - self._counts_read <= self.contribution_ttl_s

    def remote_ejections(self) -> dict[str, float]:
        """The other replicas' own ejections per ``pool/endpoint``: the longest time left."""
        return longest_ejections(self.others.values())

    def remote_class_counts(self) -> dict[str, tuple[float, float, float]]:
        """The other replicas' cumulative (requests, draft tokens, accepted tokens) per class."""
        return class_count_sum(self.others.values())

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> None:
        lease = run_every(_quiet(self._lease_tick), lambda: self.lease_ttl_s() / 4, what="cluster lease", log=logger)
        counts = run_every(_quiet(self.contribute), lambda: self.contribute_every_s, what="cluster counts", log=logger)
        self._tasks = [
            asyncio.create_task(lease, name="cluster-lease"),
            asyncio.create_task(self._follow(), name="cluster-follow"),
            asyncio.create_task(counts, name="cluster-counts"),
        ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []
        # A clean handover (the next replica takes the lease at its next tick), bounded: shutdown never waits on
        # an unreachable Redis for long.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self.lease.release()
                with contextlib.suppress(RedisError, OSError):
                    await self._client.hdel(self.contrib_key, self.replica)
        for c in (self._client, self._subscriber):
            with contextlib.suppress(RedisError, OSError, RuntimeError, TimeoutError):
                async with asyncio.timeout(2.0):
                    await c.aclose()

    async def _lease_tick(self) -> None:
        was = self.lease.held
        if await self.lease.tick() and not was:
            self._on_lead()
        self._refresh_role()

    # -- the snapshot ----------------------------------------------------------------------------------------

    async def publish(self, snapshot: dict[str, Any]) -> bool:
        """Publish a snapshot (the leader, after a scrape round): the key for late joiners, the channel for the
        others now. False when this replica no longer leads or Redis refused."""
        if not self.lease.held:
            return False
        self.seq += 1
        snapshot["seq"] = self.seq
        raw = orjson.dumps(snapshot)
        ttl_ms = max(1, round(self.stale_after_s * 4 * 1000))
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.set(self.snapshot_key, raw, px=ttl_ms)
                pipe.publish(self.channel, raw)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            logger.warning("snapshot not published: %s", exc)
            return False
        self._published_at = self._clock()
        return True

    def _reject(self, kind: str, why: str) -> None:
        self._on_rejected(kind)
        logger.warning("ignoring a cluster %s read from redis: %s", kind, why)

    async def _read_snapshot(self) -> bytes | None:
        """The snapshot key, read to at most one byte past ``MAX_SNAPSHOT_BYTES`` (so a larger one costs no more)."""
        raw = await self._client.getrange(self.snapshot_key, 0, MAX_SNAPSHOT_BYTES)
        if not raw:
            return None
        return raw.encode() if isinstance(raw, str) else bytes(raw)

    def _accept(self, raw: bytes | str | None) -> None:
        if raw is None or self.lease.held:
            return
        if len(raw) > MAX_SNAPSHOT_BYTES:
            self._reject("snapshot", f"larger than {MAX_SNAPSHOT_BYTES} bytes")
            return
        try:
            snap = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._reject("snapshot", "not JSON")
            return
        if not isinstance(snap, dict):
            self._reject("snapshot", "not a JSON object")
            return
        if snap.get("leader") == self.replica:
            return
        old = self.snapshot
        newer = old is None or snap.get("leader") != old.get("leader") or _int(snap.get("seq")) > _int(old.get("seq"))
        if not newer:
            return
        self.snapshot = snap
        self._snapshot_received = self._clock()
        at = snap.get("at")
        if isinstance(at, int | float):  # publish → apply, by the wall clocks of two hosts (skew included)
            self.last_lag_s = time.time() - at
        self.snapshots_applied += 1
        self._refresh_role()
        self._on_snapshot(snap)

    async def _follow(self) -> None:
        """Subscribe to the channel; read the key at (re)subscription and whenever nothing came for an interval."""
        while True:
            raise_if_cancelled()
            pubsub = self._subscriber.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._accept(await self._read_snapshot())
                while True:
                    raise_if_cancelled()
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self._interval_s())
                    if msg is not None and msg.get("type") == "message":
                        self._accept(msg.get("data"))
                    elif not self.lease.held:
                        age = self.snapshot_age_s()
                        if age is None or age > self._interval_s():
                            self._accept(await self._read_snapshot())
                    self._refresh_role()
            except (RedisError, OSError) as exc:
                logger.debug("cluster subscription: %s; retrying", exc)
                self._refresh_role()
                await asyncio.sleep(min(1.0, self._interval_s()))
            finally:
                with contextlib.suppress(RedisError, OSError, RuntimeError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]

    # -- shared counts ---------------------------------------------------------------------------------------

    async def contribute(self) -> None:
        """Write this replica's counts and read everyone's, in one round trip."""
        own = self._own_counts()
        own.at = time.time()
        raw = own.encode()
        ttl_ms = max(1, round(self.contribution_ttl_s * 5 * 1000))
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.hset(self.contrib_key, self.replica, raw)
                pipe.pexpire(self.contrib_key, ttl_ms)
                pipe.hgetall(self.contrib_key)
                results = await pipe.execute()
        except (RedisError, OSError):
            self.others = {}  # nobody's counts are known: this replica judges on its own, as alone
            self.replicas.set(1)
            self._on_counts()
            raise
        entries: Mapping[bytes | str, bytes | str] = results[2] or {}
        others: dict[str, Contribution] = {}
        stale: list[str] = []
        for key, value in entries.items():
            name = key.decode() if isinstance(key, bytes) else key
            if name == self.replica:
                continue
            c = parse_contribution(value)
            if c is None:
                self._reject("contribution", f"the counts of {name[:80]!r} are malformed, too large or out of range")
                stale.append(name)
                continue
            if own.at - c.at > self.contribution_ttl_s:
                stale.append(name)
                continue
            others[name] = c
        self.others = others
        self._counts_read = self._clock()
        self.replicas.set(len(others) + 1)
        self._on_counts()
        if stale and self.lease.held:  # the leader tidies up after replicas that went away
            with contextlib.suppress(RedisError, OSError):
                await self._client.hdel(self.contrib_key, *stale)


def _quiet(step: Callable[[], Awaitable[object]]) -> Callable[[], Awaitable[None]]:
    """The step, with Redis being unreachable not an error worth a traceback every 250 ms (the role says it)."""

    async def run() -> None:
        try:
            await step()
        except (RedisError, OSError) as exc:
            raise_if_cancelled()  # a cancellation a client library turned into a timeout is still one
            logger.debug("cluster step: %s", exc)

    return run


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


def connect(redis_url: str) -> tuple[aioredis.Redis, aioredis.Redis]:
    """A small command pool and a subscriber connection for one replica's cluster side."""
    pool, _ = connection_pool(
        redis_url, max_connections=4, socket_timeout_s=0.5, health_check_interval_s=10, client_name="specgate-cluster"
    )
    subscriber = aioredis.Redis.from_url(
        redis_url, socket_connect_timeout=0.5, health_check_interval=10, client_name="specgate-cluster-sub"
    )
    return aioredis.Redis(connection_pool=pool), subscriber
