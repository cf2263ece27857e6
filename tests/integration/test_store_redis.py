"""``RedisStore`` on a private redis-server: the shared store contract, two gateways racing, outages and recovery."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from gateway.store.base import Claimed, Completed, Running, StoreUnavailable
from gateway.store.health import StoreHealth
from gateway.store.redis import DEFAULT_PREFIX, RedisStore
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import RedisServer, ServerThread, rules_for
from tests.store_contract import LEASE_MS, OWNER_CAP, TTL_MS, OwnerCapContract, StoreContract

pytestmark = pytest.mark.integration


class TestRedisStoreContract(StoreContract):
    @pytest.fixture
    async def store(self, redis_server: RedisServer) -> AsyncIterator[RedisStore]:
        s = RedisStore.from_url(redis_server.url)
        yield s
        await s.close()


class TestRedisStoreOwnerCaps(OwnerCapContract):
    @pytest.fixture
    async def capped(self, redis_server: RedisServer) -> AsyncIterator[RedisStore]:
        s = RedisStore.from_url(redis_server.url, max_owner_records=OWNER_CAP)
        yield s
        await s.close()


@pytest.fixture
async def stores(redis_server: RedisServer) -> AsyncIterator[Callable[..., RedisStore]]:
    """Independent clients on the same Redis, as two gateway replicas would have."""
    made: list[RedisStore] = []

    def make(**kw: Any) -> RedisStore:
        s = RedisStore.from_url(redis_server.url, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.close()


async def test_two_gateways_racing_for_a_key_have_exactly_one_winner(stores: Callable[..., RedisStore]) -> None:
    a, b = stores(), stores()
    for round_ in range(5):
        key = f"race-{round_}"
        results = await asyncio.gather(*(s.claim(key, f"fp-{i}", lease_ms=LEASE_MS) for i in range(20) for s in (a, b)))
        won = [r for r in results if isinstance(r, Claimed)]
        assert len(won) == 1
        assert all(isinstance(r, Running) for r in results if not isinstance(r, Claimed))
    token = await _claim(a, "shared", "fp-a")
    assert await b.claim("shared", "fp-b", lease_ms=LEASE_MS) == Running("fp-a")
    assert await a.complete("shared", token, b"\x00answer\xff", ttl_ms=TTL_MS)
    assert await b.claim("shared", "fp-b", lease_ms=LEASE_MS) == Completed("fp-a", b"\x00answer\xff")


async def _claim(store: RedisStore, key: str, fp: str = "fp", lease_ms: int = LEASE_MS) -> str:
    res = await store.claim(key, fp, lease_ms=lease_ms)
    assert isinstance(res, Claimed)
    return res.token


async def test_records_are_prefixed_hashes_with_a_ttl(
    redis_server: RedisServer, stores: Callable[..., RedisStore]
) -> None:
    store = stores(prefix="test:")
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        token = await _claim(store, "k", "fp-1", lease_ms=5_000)
        assert await raw.exists(DEFAULT_PREFIX + "k") == 0
        assert await raw.hgetall("test:k") == {b"s": b"running", b"t": token.encode(), b"f": b"fp-1"}
        assert 0 < await raw.pttl("test:k") <= 5_000
        assert await store.complete("k", token, b"body", ttl_ms=60_000)
        assert (await raw.hgetall("test:k"))[b"r"] == b"body"
        assert 5_000 < await raw.pttl("test:k") <= 60_000
    finally:
        await raw.aclose()


async def test_scripts_survive_a_redis_restart(redis_server: RedisServer, stores: Callable[..., RedisStore]) -> None:
    store = stores()
    await _claim(store, "before")
    redis_server.stop()
    redis_server.start()  # empty, and with an empty script cache: EVALSHA gets NOSCRIPT, redis-py reloads
    token = await _claim(store, "after")
    assert await store.complete("after", token, b"ok", ttl_ms=TTL_MS)
    assert await store.get("before") is None


async def test_redis_down_every_operation_fails_fast(
    redis_server: RedisServer, stores: Callable[..., RedisStore]
) -> None:
    store = stores()
    token = await _claim(store, "k")
    redis_server.stop()
    ops = {
        "claim": store.claim("k2", "fp", lease_ms=LEASE_MS),
        "extend": store.extend("k", token, lease_ms=LEASE_MS),
        "complete": store.complete("k", token, b"x", ttl_ms=TTL_MS),
        "release": store.release("k", token),
        "get": store.get("k"),
        "ping": store.ping(),
    }
    for op, aw in ops.items():
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match=f"redis {op} failed") as exc:
            await aw
        assert time.monotonic() - t0 < 2.0, op
        assert str(redis_server.port) in str(exc.value)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers: a hung Redis."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


async def test_a_hung_redis_times_out_quickly(silent_port: int) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{silent_port}/0", socket_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="redis claim failed"):
            await store.claim("k", "fp", lease_ms=LEASE_MS)
        assert time.monotonic() - t0 < 2.0
    finally:
        await store.close()


async def test_password_never_appears_in_errors(redis_server: RedisServer) -> None:
    raw = aioredis.Redis.from_url(redis_server.url)
    await raw.config_set("requirepass", "the-real-one")
    await raw.aclose()
    store = RedisStore.from_url(f"redis://:hunter2-secret@127.0.0.1:{redis_server.port}/0")
    try:
        with pytest.raises(StoreUnavailable) as exc:  # wrong password: AUTH fails
            await store.ping()
        assert "hunter2" not in str(exc.value)
        redis_server.stop()
        with pytest.raises(StoreUnavailable) as exc:  # unreachable
            await store.claim("k", "fp", lease_ms=LEASE_MS)
        assert "hunter2" not in str(exc.value)
    finally:
        await store.close()


async def _until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


async def test_store_health_follows_an_outage_and_recovers_by_itself(
    redis_server: RedisServer, stores: Callable[..., RedisStore]
) -> None:
    registry = CollectorRegistry()
    health = StoreHealth(stores(), registry, interval_s=0.1)

    def up() -> float | None:
        return registry.get_sample_value("specgate_store_up", {"store": "redis"})

    task = asyncio.create_task(health.run())
    try:
        assert await _until(lambda: health.pings > 0, 2)
        assert health.healthy
        assert up() == 1.0
        token = await _claim(health.store, "k")  # type: ignore[arg-type]

        redis_server.stop()
        # A request-path failure degrades it at once, before any ping notices.
        with pytest.raises(StoreUnavailable):
            await health.complete("k", token, b"x", ttl_ms=TTL_MS)
        assert not health.healthy
        assert up() == 0.0
        errors = registry.get_sample_value("specgate_store_errors_total", {"store": "redis", "op": "complete"})
        assert errors == 1.0
        await asyncio.sleep(0.3)
        assert not health.healthy  # the pings keep failing
        assert health.last_error is not None
        assert "redis ping failed" in health.last_error

        redis_server.start()
        assert await _until(lambda: health.healthy, 1.0), health.last_error  # within a few ping intervals
        assert up() == 1.0
        assert isinstance(await health.claim("k", "fp", lease_ms=LEASE_MS), Claimed)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_ready_reports_the_store_without_failing_on_it(
    redis_server: RedisServer,
    fake: Callable[..., FakeUpstreamServer],
    gateway: Callable[..., ServerThread],
) -> None:
    up = fake("up")
    gw = gateway(rules_for([up.url], [up.url]), redis_url=redis_server.url)

    def ready() -> tuple[int, dict[str, Any]]:
        r = httpx.get(gw.url + "/ready")
        return r.status_code, r.json()

    code, body = ready()
    assert code == 200
    assert body["store"]["name"] == "redis"

    redis_server.stop()
    deadline = time.monotonic() + 5
    while ready()[1]["store"]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    code, body = ready()
    assert code == 200  # requests without an Idempotency-Key still flow
    assert body["store"]["healthy"] is False
    assert "redis ping failed" in body["store"]["last_error"]
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'specgate_store_up{store="redis"} 0.0' in metrics

    redis_server.start()
    deadline = time.monotonic() + 5
    while not ready()[1]["store"]["healthy"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready()[1]["store"]["healthy"] is True


def test_ready_reports_the_memory_store_by_default(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread]
) -> None:
    up = fake("up")
    gw = gateway(rules_for([up.url], [up.url]))
    body = httpx.get(gw.url + "/ready").json()
    assert body["store"]["name"] == "memory"
    assert body["store"]["healthy"] is True
    assert body["store"]["last_error"] is None
