"""``MemoryStore``: the shared store contract, its bounded memory, and ``StoreHealth`` / ``build_store`` / settings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from gateway.config.settings import Settings, SettingsError
from gateway.proxy.idempotency import store_owner, tenant_scope
from gateway.store.base import Claimed, ClaimResult, Completed, Running, StoreUnavailable
from gateway.store.health import StoreHealth, build_store
from gateway.store.memory import MemoryStore
from gateway.store.redis import RedisStore, redact_url
from tests.store_contract import LEASE_MS, OWNER_CAP, TTL_MS, OwnerCapContract, StoreContract


class TestMemoryStoreContract(StoreContract):
    @pytest.fixture
    async def store(self) -> AsyncIterator[MemoryStore]:
        s = MemoryStore()
        yield s
        await s.close()


class TestMemoryStoreOwnerCaps(OwnerCapContract):
    @pytest.fixture
    async def capped(self) -> AsyncIterator[MemoryStore]:
        s = MemoryStore(max_owner_records=OWNER_CAP)
        yield s
        await s.close()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _claim(store: MemoryStore, key: str, lease_ms: int = LEASE_MS) -> str:
    res = await store.claim(key, "fp", lease_ms=lease_ms)
    assert isinstance(res, Claimed)
    return res.token


async def test_expired_records_are_pruned_on_writes() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    for i in range(50):
        await _claim(store, f"k{i}", lease_ms=1_000)
    assert len(store) == 50
    clock.now += 2
    await _claim(store, "fresh")
    assert len(store) == 1


async def test_an_extended_lease_is_not_pruned_by_its_old_expiry() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    token = await _claim(store, "k", lease_ms=1_000)
    assert await store.extend("k", token, lease_ms=10_000)
    clock.now += 2
    await _claim(store, "other")  # a write: prunes what expired by now
    assert await store.get("k") == Running("fp")


async def test_full_store_drops_the_oldest_completed_first() -> None:
    clock = FakeClock()
    store = MemoryStore(max_records=4, clock=clock)
    running = await _claim(store, "running-first")  # oldest claim, but running: never dropped
    for key in ("done-1", "done-2", "done-3"):
        token = await _claim(store, key)
        assert await store.complete(key, token, key.encode(), ttl_ms=TTL_MS)
    res = await store.claim("new", "fp", lease_ms=LEASE_MS)
    assert isinstance(res, Claimed)
    assert len(store) <= 4
    assert await store.get("done-1") is None
    assert await store.get("done-3") == Completed("fp", b"done-3")
    assert await store.get("running-first") == Running("fp")
    assert await store.complete("running-first", running, b"ok", ttl_ms=TTL_MS)


async def test_full_store_of_running_claims_fails_closed() -> None:
    store = MemoryStore(max_records=3)
    for i in range(3):
        await _claim(store, f"k{i}")
    with pytest.raises(StoreUnavailable, match="memory store full"):
        await store.claim("one-too-many", "fp", lease_ms=LEASE_MS)
    # An existing key is still answered: no room is needed for that.
    assert await store.claim("k0", "fp", lease_ms=LEASE_MS) == Running("fp")


async def test_expiry_on_the_injected_clock_needs_no_sleep() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    token = await _claim(store, "k", lease_ms=100)
    clock.now += 0.1  # exactly at the expiry: gone
    assert await store.get("k") is None
    assert await store.complete("k", token, b"late", ttl_ms=TTL_MS) is False


def test_max_records_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_records"):
        MemoryStore(max_records=0)


# -- StoreHealth ----------------------------------------------------------------------------------------------


class FlakyStore(MemoryStore):
    """A memory store whose every operation fails while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreUnavailable("flaky store is down")

    async def claim(
        self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0, owner: str = ""
    ) -> ClaimResult:
        self._check()
        return await super().claim(key, fingerprint, lease_ms=lease_ms, max_bytes=max_bytes, owner=owner)

    async def ping(self) -> None:
        self._check()


def _up(registry: CollectorRegistry, store: str) -> float | None:
    return registry.get_sample_value("specgate_store_up", {"store": store})


def _errors(registry: CollectorRegistry, store: str, op: str) -> float:
    return registry.get_sample_value("specgate_store_errors_total", {"store": store, "op": op}) or 0.0


async def test_store_health_memory_is_up() -> None:
    registry = CollectorRegistry()
    health = StoreHealth(MemoryStore(), registry)
    assert await health.check() is True
    assert health.status() == {"name": "memory", "healthy": True, "last_error": None, "since": health.since}
    assert _up(registry, "memory") == 1.0
    assert isinstance(await health.claim("k", "fp", lease_ms=LEASE_MS), Claimed)


async def test_request_path_failure_degrades_at_once_and_the_ping_loop_recovers() -> None:
    registry = CollectorRegistry()
    inner = FlakyStore()
    inner.name = "flaky"
    health = StoreHealth(inner, registry, interval_s=0.02)
    inner.down = True
    with pytest.raises(StoreUnavailable):
        await health.claim("k", "fp", lease_ms=LEASE_MS)
    assert not health.healthy
    assert health.last_error == "flaky store is down"
    assert _up(registry, "flaky") == 0.0
    assert _errors(registry, "flaky", "claim") == 1.0

    task = asyncio.create_task(health.run())
    try:
        await asyncio.sleep(0.1)
        assert not health.healthy
        assert _errors(registry, "flaky", "ping") >= 2
        inner.down = False
        for _ in range(100):
            if health.healthy:
                break
            await asyncio.sleep(0.01)
        assert health.healthy
        assert _up(registry, "flaky") == 1.0
        assert health.last_error == "flaky store is down"  # the latest failure stays visible after recovery
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_store_health_ping_timeout_counts_as_a_failure() -> None:
    class Hanging(MemoryStore):
        async def ping(self) -> None:
            await asyncio.sleep(10)

    health = StoreHealth(Hanging(), CollectorRegistry(), ping_timeout_s=0.05)
    assert await health.check() is False
    assert health.last_error is not None
    assert "timed out" in health.last_error


# -- build_store, settings, redaction -------------------------------------------------------------------------


async def test_build_store_picks_memory_without_url_and_redis_with_one() -> None:
    assert isinstance(build_store(None), MemoryStore)
    assert isinstance(build_store(""), MemoryStore)
    store = build_store("redis://:secret@127.0.0.1:1/0")  # nothing connects yet
    assert isinstance(store, RedisStore)
    await store.close()


def test_redact_url_hides_the_password() -> None:
    assert redact_url("redis://:s3cret@host:6380/2") == "redis://:***@host:6380/2"
    assert redact_url("rediss://user:s3cret@host/0") == "rediss://user:***@host/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_settings_redis_url_from_env_and_kept_out_of_repr() -> None:
    env = {"SPECGATE_RULES": "rules.yaml", "SPECGATE_REDIS_URL": "redis://:s3cret@redis:6379/0"}
    s = Settings.from_env(env)
    assert s.redis_url == "redis://:s3cret@redis:6379/0"
    assert "s3cret" not in repr(s)
    assert Settings.from_env(s.to_env()).redis_url == s.redis_url
    assert Settings.from_env({"SPECGATE_RULES": "rules.yaml"}).redis_url is None
    assert "SPECGATE_REDIS_URL" not in Settings.from_env({"SPECGATE_RULES": "rules.yaml"}).to_env()


def test_settings_reject_a_non_redis_url() -> None:
    with pytest.raises(SettingsError, match="redis_url"):
        Settings.from_env({"SPECGATE_RULES": "r.yaml", "SPECGATE_REDIS_URL": "http://redis:6379"})


async def test_remembered_values_are_capped_oldest_first() -> None:
    clock = FakeClock()
    store = MemoryStore(max_records=3, clock=clock)
    for i in range(5):
        await store.remember(f"k{i}", b"v", ttl_ms=60_000)
    assert [await store.recall(f"k{i}") for i in range(5)] == [None, None, b"v", b"v", b"v"]
    clock.now += 61
    await store.remember("fresh", b"v", ttl_ms=60_000)
    assert len(store._values) == 1  # the expired ones went on the write, without waiting to be read


# -- per-owner accounting ------------------------------------------------------------------------------------------


async def _done(store: MemoryStore, key: str, owner: str, body: bytes = b"r") -> None:
    res = await store.claim(key, "fp", lease_ms=LEASE_MS, owner=owner)
    assert isinstance(res, Claimed)
    assert await store.complete(key, res.token, body, ttl_ms=TTL_MS) is True


async def test_the_full_store_drops_the_largest_owners_records_first() -> None:
    store = MemoryStore(max_records=200, max_owner_records=150)
    for i in range(20):
        await _done(store, f"b{i}", "owner-b")  # the oldest records, of the small owner
    for i in range(150):
        await _done(store, f"a{i}", "owner-a")
    for i in range(30):
        await _done(store, f"c{i}", "owner-c")  # the store reaches its cap here
    await _done(store, "b-new", "owner-b")
    assert len(store) <= 200
    assert store.owner_usage("owner-b")[0] == 21  # B lost nothing although its records were the oldest
    assert store.owner_usage("owner-c")[0] == 30
    assert store.owner_usage("owner-a")[0] < 150
    assert await store.get("a0") is None  # A's own oldest went
    assert await store.get("a149") is not None


async def test_an_owner_stays_within_its_byte_share_and_the_others_keep_theirs() -> None:
    mib = 1024 * 1024
    store = MemoryStore(max_bytes=64 * mib)  # the default owner share: a quarter, 16 MiB
    await _done(store, "b0", "owner-b", b"b" * (4 * mib))
    for i in range(10):
        await _done(store, f"a{i}", "owner-a", b"a" * (3 * mib))
    assert store.owner_usage("owner-a")[1] <= 16 * mib
    assert store.owner_usage("owner-b")[1] == 4 * mib
    assert await store.get("a9") is not None
    assert await store.get("a0") is None
    big = b"x" * (20 * mib)  # larger than a share: kept, alone
    await _done(store, "a-big", "owner-a", big)
    assert store.owner_usage("owner-a") == (1, 20 * mib, 0)
    assert await store.get("b0") is not None


async def test_the_global_byte_cap_takes_from_the_owner_holding_the_most() -> None:
    mib = 1024 * 1024
    store = MemoryStore(max_bytes=64 * mib, max_owner_bytes=40 * mib)
    await _done(store, "b0", "owner-b", b"b" * (10 * mib))
    for i in range(4):
        await _done(store, f"a{i}", "owner-a", b"a" * (10 * mib))
    await _done(store, "c0", "owner-c", b"c" * (20 * mib))  # 70 MiB wanted: A (the largest) gives
    assert store.stored_bytes <= 64 * mib
    assert await store.get("b0") is not None
    assert await store.get("c0") is not None
    assert await store.get("a0") is None
    assert store.owner_usage("owner-a")[1] == 30 * mib


async def test_owner_bookkeeping_follows_expiry_release_and_forget() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await _done(store, "a0", "owner-a", b"12345")
    res = await store.claim("a1", "fp", lease_ms=LEASE_MS, owner="owner-a")
    assert isinstance(res, Claimed)
    await store.remember("resp:a", b"v", ttl_ms=TTL_MS, owner="owner-a")
    assert store.owner_usage("owner-a") == (2, 5, 1)
    assert await store.release("a1", res.token) is True
    assert await store.forget("resp:a") is True
    assert store.owner_usage("owner-a") == (1, 5, 0)
    clock.now += TTL_MS / 1000 + 1
    assert await store.get("a0") is None
    assert store.owner_usage("owner-a") == (0, 0, 0)
    assert store._owners == {}  # an owner holding nothing is not kept


def test_max_owner_records_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_owner_records"):
        MemoryStore(max_owner_records=0)


async def test_the_full_value_store_drops_the_largest_owners_values_first() -> None:
    store = MemoryStore(max_records=100, max_owner_records=80)
    for i in range(10):
        await store.remember(f"b{i}", b"v", ttl_ms=TTL_MS, owner="owner-b")  # the oldest, of the small owner
    for i in range(80):
        await store.remember(f"a{i}", b"v", ttl_ms=TTL_MS, owner="owner-a")
    for i in range(11):
        await store.remember(f"c{i}", b"v", ttl_ms=TTL_MS, owner="owner-c")
    assert len(store._values) <= 100
    assert store.owner_usage("owner-b")[2] == 10
    assert store.owner_usage("owner-c")[2] == 11
    assert await store.recall("a0") is None
    assert await store.recall("a79") == b"v"


def test_settings_bound_the_per_owner_caps() -> None:
    base = {"SPECGATE_RULES": "r.yaml"}
    s = Settings.from_env(
        {**base, "SPECGATE_IDEMPOTENCY_OWNER_RECORDS": "50", "SPECGATE_IDEMPOTENCY_OWNER_BYTES": str(2 * 1024 * 1024)}
    )
    assert (s.idempotency_owner_records, s.idempotency_owner_bytes) == (50, 2 * 1024 * 1024)
    store = build_store(None, owner_records=s.idempotency_owner_records, owner_bytes=s.idempotency_owner_bytes)
    assert isinstance(store, MemoryStore)
    assert (store._owner_max, store._owner_max_bytes) == (50, 2 * 1024 * 1024)
    with pytest.raises(SettingsError, match="idempotency_owner_records"):
        Settings.from_env({**base, "SPECGATE_IDEMPOTENCY_OWNER_RECORDS": "0"})
    with pytest.raises(SettingsError, match="idempotency_owner_bytes"):
        Settings.from_env({**base, "SPECGATE_IDEMPOTENCY_OWNER_BYTES": str(1024 * 1024 * 1024)})


def test_store_owner_names_the_tenant_or_the_key_and_no_one_for_anonymous() -> None:
    scope = tenant_scope("Bearer k1")
    assert store_owner("acme", scope) == "t:acme"
    assert store_owner(None, scope).startswith("k:")
    assert store_owner(None, scope) != store_owner(None, tenant_scope("Bearer k2"))
    assert "k1" not in store_owner(None, scope)
    assert store_owner(None, tenant_scope(None)) == ""
