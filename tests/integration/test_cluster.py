"""Cluster mode with a private redis-server: several gateway runtimes (replicas, in one event loop) in front of
counting fake vLLM endpoints. One leader scrapes and health-checks for all; a dead leader is replaced within two
scrape intervals; the followers route on its snapshot (class shares included); in-flight counts are shared, so
saturation is judged on the cluster's total; with Redis gone each replica acts alone, and it rejoins."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config.settings import Settings
from gateway.routing.controller_rules import ControllerState
from gateway.runtime.container import Runtime
from gateway.testing.fake_upstream import FakeConfig
from gateway.testing.fake_upstream.app import create_fake_upstream
from tests.conftest import RedisServer, ServerThread, rules_for

pytestmark = pytest.mark.integration

INTERVAL = 0.4  # the YAML's scrape interval; the health interval is the same


class Counting:
    """A fake vLLM endpoint that counts the GETs of /metrics and /health it answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.hits: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.hits[scope["path"]] += 1
        await self.app(scope, receive, send)


@pytest.fixture
def endpoints() -> Iterator[list[tuple[Counting, ServerThread]]]:
    out = []
    for name in ("spec", "std"):
        app = Counting(create_fake_upstream(FakeConfig(name=name)))
        out.append((app, ServerThread(app).start()))
    try:
        yield out
    finally:
        for _, server in out:
            server.stop()


def _rules(path: Path, endpoints: list[tuple[Counting, ServerThread]], **class_extra: Any) -> Path:
    rules = rules_for([endpoints[0][1].url], [endpoints[1][1].url])
    rules["scrape"] = {"interval_s": INTERVAL, "timeout_s": 0.3}
    rules["classes"][0].update(class_extra)
    path.write_text(yaml.safe_dump(rules))
    return path


Start = Callable[..., Awaitable[Runtime]]


@pytest.fixture
async def replicas(tmp_path: Path) -> AsyncIterator[Start]:
    started: list[Runtime] = []

    async def start(rules: Path, redis_url: str | None) -> Runtime:
        settings = Settings(rules=rules, redis_url=redis_url, health_interval_s=INTERVAL, health_timeout_s=0.3)
        rt = Runtime.from_settings(settings)
        await rt.start()
        started.append(rt)
        return rt

    yield start
    hung = []
    for rt in started:
        try:  # a shutdown that never ends must fail here, never hang the suite
            await asyncio.wait_for(rt.stop(), 30)
        except TimeoutError:
            hung.append([t for t in asyncio.all_tasks() if not t.done()])
    assert not hung, f"Runtime.stop did not finish; tasks left: {hung}"


async def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` holds; fails with ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def _leaders(rts: list[Runtime]) -> list[Runtime]:
    return [rt for rt in rts if rt.cluster is not None and rt.cluster.lease.held]


async def test_one_leader_scrapes_and_checks_for_the_cluster(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    rules = _rules(tmp_path / "rules.yaml", endpoints)
    rts = [await replicas(rules, redis_server.url) for _ in range(4)]
    await _until(lambda: len(_leaders(rts)) == 1, 10, "one leader")
    await _until(lambda: all(rt.cluster and rt.cluster.role != "local" for rt in rts), 10, "leader + followers")
    for app, _ in endpoints:
        app.hits.clear()
    span = 8 * INTERVAL
    await asyncio.sleep(span)
    assert len(_leaders(rts)) == 1
    rounds = span / INTERVAL
    for app, _ in endpoints:
        # Once per interval for the whole cluster (4 replicas alone would be 4x), within ±50%.
        assert 0.5 * rounds <= app.hits["/metrics"] <= 1.5 * rounds, app.hits
        # /health: the health checker's probe alone (the scraper takes its result), only on the leader.
        assert app.hits["/health"] <= 1.5 * rounds, app.hits
    for rt in rts:
        assert rt.ready[0], rt.ready
        state = rt.cluster.describe() if rt.cluster else {}
        assert state["leader"] == _leaders(rts)[0].cluster.replica  # type: ignore[union-attr]
        assert state["snapshot_age_s"] is not None
        assert state["snapshot_age_s"] <= 3 * INTERVAL
        assert len(state["contributions"]) == 3  # the three others' shared counts are fresh


async def test_a_dead_leader_is_replaced_within_two_intervals(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    rules = _rules(tmp_path / "rules.yaml", endpoints)
    rts = [await replicas(rules, redis_server.url) for _ in range(3)]
    await _until(lambda: len(_leaders(rts)) == 1, 10, "one leader")
    leader = _leaders(rts)[0]
    rest = [rt for rt in rts if rt is not leader]
    seq_before = {id(rt): rt.cluster.snapshots_applied for rt in rest}  # type: ignore[union-attr]
    # Killed, not stopped: no handover, its lease must lapse.
    for task in leader._tasks:
        task.cancel()
    assert leader.cluster is not None
    for task in leader.cluster._tasks:
        task.cancel()
    leader.cluster.lease._valid_until = 0.0
    rts.remove(leader)
    t0 = time.monotonic()
    await _until(lambda: len(_leaders(rest)) == 1, 6 * INTERVAL, "a new leader")
    new = _leaders(rest)[0]
    other = next(rt for rt in rest if rt is not new)
    assert other.cluster is not None
    await _until(
        lambda: (
            other.cluster is not None
            and other.cluster.snapshot is not None
            and other.cluster.snapshot.get("leader") == new.cluster.replica
        ),  # type: ignore[union-attr]
        6 * INTERVAL,
        "the new leader's snapshot reaching a follower",
    )
    took = time.monotonic() - t0
    # The lease lasts 1.5 intervals at most past the last renewal and is retried every ttl/4: two intervals,
    # plus one scrape round to publish, plus slack for a loaded machine.
    assert took <= 2 * INTERVAL + 1.0 + 1.5, took
    assert other.cluster.snapshots_applied > seq_before[id(other)]


async def test_a_clean_shutdown_hands_the_lease_over_at_once(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    rules = _rules(tmp_path / "rules.yaml", endpoints)
    rts = [await replicas(rules, redis_server.url) for _ in range(2)]
    await _until(lambda: len(_leaders(rts)) == 1, 10, "one leader")
    leader = _leaders(rts)[0]
    await leader.stop()
    rest = [rt for rt in rts if rt is not leader]
    took = await _until(lambda: len(_leaders(rest)) == 1, 3, "the follower taking over")
    assert took <= 1.0 * 1.5 * INTERVAL + 0.5  # its next tick, not the lease's lapse


async def test_followers_route_on_the_leaders_class_share(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    controller = {"window_s": 2, "min_samples": 1000, "min_hold_s": 1}
    rules = _rules(tmp_path / "rules.yaml", endpoints, controller=controller)
    rts = [await replicas(rules, redis_server.url) for _ in range(3)]
    await _until(lambda: len(_leaders(rts)) == 1, 10, "one leader")
    leader = _leaders(rts)[0]
    followers = [rt for rt in rts if rt is not leader]
    # A change of the leader's class state (here an on-call style force on the leader's controller only).
    c = leader.routing._classes["precise"].controller
    c.force("standard", time.monotonic(), ttl_s=60)
    want: tuple[ControllerState, float] = (c.state, c.share)
    assert want[0] == "standard"

    def agree() -> bool:
        import random

        rng = random.Random(1)
        for rt in followers:
            choice = rt.routing.choose("precise", rng, count=False)
            if choice is None or (choice.state, choice.share) != want:
                return False
        return True

    took = await _until(agree, 5 * INTERVAL, "followers adopting the leader's share")
    assert took <= INTERVAL + 1.0


async def test_saturation_spill_uses_the_cluster_wide_in_flight(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    route = {
        "preferred": "spec",
        "saturated": "std",
        "fallback": ["std"],
        "saturation": {"max_inflight_per_endpoint": 4},
    }
    rules = _rules(tmp_path / "rules.yaml", endpoints, route=route)
    rts = [await replicas(rules, redis_server.url) for _ in range(2)]
    await _until(lambda: all(rt.cluster and rt.cluster.others for rt in rts), 10, "shared counts")
    a, b = rts
    spec_a = a.live.pools["spec"].endpoints[0]
    spec_a.in_flight = 4  # replica A alone holds the preferred pool's limit
    await _until(lambda: b.live.pools["spec"].endpoints[0].remote_in_flight == 4, 3, "B seeing A's in-flight")
    assert b.live.views()["spec"].in_flight == 4  # B's own count is 0: only the cluster total is saturated
    spec_a.in_flight = 0
    await _until(lambda: b.live.views()["spec"].in_flight == 0, 3, "A's count dropping back")


async def test_without_redis_each_replica_acts_alone_and_rejoins(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    rules = _rules(tmp_path / "rules.yaml", endpoints)
    rts = [await replicas(rules, redis_server.url) for _ in range(2)]
    await _until(lambda: len(_leaders(rts)) == 1, 10, "one leader")
    redis_server.stop()
    await _until(lambda: all(rt.cluster and rt.cluster.role == "local" for rt in rts), 8, "both acting alone")
    for app, _ in endpoints:
        app.hits.clear()
    await asyncio.sleep(4 * INTERVAL)
    for app, _ in endpoints:
        assert app.hits["/metrics"] >= 2 * 2, app.hits  # both scrape again
    for rt in rts:
        assert rt.ready == (True, "ok (cluster: no fresh leader snapshot, scraping and deciding alone)")
    redis_server.start()
    await _until(lambda: len(_leaders(rts)) == 1, 10, "a leader again")
    await _until(lambda: sum(rt.cluster.role == "follower" for rt in rts if rt.cluster) == 1, 10, "a follower again")


async def test_followers_see_the_leaders_scraped_queue_in_the_busy_test(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    rules = _rules(tmp_path / "rules.yaml", endpoints)
    rts = [await replicas(rules, redis_server.url) for _ in range(2)]
    await _until(lambda: all(rt.cluster and rt.cluster.role != "local" for rt in rts), 10, "leader + follower")
    follower = next(rt for rt in rts if rt.cluster is not None and rt.cluster.role == "follower")
    fake = endpoints[0][0].app.state.fake  # type: ignore[attr-defined]
    pool = follower.live.pools["spec"]
    [ep] = pool.endpoints

    def busy() -> bool:
        return follower.attempts.busy(pool, ep)

    assert not busy()
    model = next(iter(fake.waiting))
    fake.waiting[model] = 3  # vLLM's queue on the speculative endpoint, as the leader's next scrape sees it
    await _until(busy, 5 * INTERVAL, "the follower seeing the leader's scraped queue")
    assert ep.queue_waiting == 3
    fake.waiting[model] = 0
    await _until(lambda: not busy(), 5 * INTERVAL, "the queue emptying on the follower too")


async def test_a_replicas_passive_ejection_reaches_the_others(
    redis_server: RedisServer, endpoints: list[tuple[Counting, ServerThread]], replicas: Start, tmp_path: Path
) -> None:
    rules = _rules(tmp_path / "rules.yaml", endpoints)
    rts = [await replicas(rules, redis_server.url) for _ in range(3)]
    await _until(lambda: all(rt.cluster and rt.cluster.role != "local" for rt in rts), 10, "leader + followers")
    await _until(lambda: all(rt.cluster and len(rt.cluster.others) == 2 for rt in rts), 10, "shared counts")
    follower = next(rt for rt in rts if rt.cluster is not None and rt.cluster.role == "follower")
    others = [rt for rt in rts if rt is not follower]
    # The follower's own failures eject the standard endpoint (the spec pool still serves the model).
    [std] = follower.live.pools["std"].endpoints
    std.eject(time.monotonic(), base_s=30.0, max_s=60.0)
    # within a round or two of the shared counts (250 ms); the bound is only there to end a broken run
    await _until(
        lambda: all(not rt.live.pools["std"].endpoints[0].routable for rt in others), 10, "the others ejecting it"
    )
    for rt in others:
        e = rt.live.pools["std"].endpoints[0]
        assert e.ejected_until <= std.ejected_until + 0.5  # the time left of the follower's, not an ejection anew
        assert e.ejections == 0  # not counted as an ejection of their own (no doubling next time)
        assert not e.ejected_here  # not passed on again as theirs
    await asyncio.sleep(3 * INTERVAL)  # a few snapshots later the follower still has its own ejection
    assert std.ejected
    assert not std.routable
