"""The cluster snapshot as data: built from a leader's structures, applied to a follower's; and the route state's
follower mode (adopted shares, an on-call force still winning) and the other replicas' counts in its windows."""

from __future__ import annotations

import math
import random

import orjson
from prometheus_client import CollectorRegistry

from gateway.cluster import snapshot
from gateway.config.pool import Pool as PoolSpec
from gateway.fleet.pools import PoolState
from gateway.fleet.vllm_metrics import Acceptance, PoolLoadView
from gateway.routing import overload
from gateway.routing.routing_state import RoutingState
from tests.unit.test_routing_state import rules


def _pool(name: str, kind: str, ids: list[str]) -> PoolState:
    spec = PoolSpec.model_validate(
        {
            "name": name,
            "kind": kind,
            "models": ["m"],
            "endpoints": [{"url": f"http://{i}:8000", "id": i} for i in ids],
            **({"speculative": {"method": "eagle3", "num_speculative_tokens": 4}} if kind == "speculative" else {}),
        }
    )
    return PoolState.from_spec(spec)


def test_round_trip_through_json() -> None:
    leader = [_pool("spec", "speculative", ["a", "b"]), _pool("std", "standard", ["c"])]
    leader[0].endpoints[1].healthy = False
    leader[0].endpoints[1].last_error = "/health returned 503"
    leader[1].endpoints[0].ejected = True
    leader[1].endpoints[0].ejected_until = 110.0
    views = {
        "spec": PoolLoadView("spec", 2, 1, 3.0, 1.0, 0.5, Acceptance(0.7, 3.1, (0.9, 0.6), 12.0), 0.02, math.nan, 181),
        "std": PoolLoadView("std", 1, 0, None, None, None, None, None, None),
    }
    classes = {"precise": {"state": "split", "share": 0.25}, "bad": {"state": "nope", "share": 2}}
    snap = snapshot.build(
        leader="r1", seq=3, at=1.0, now=100.0, config="abc", pools=leader, views=views, classes=classes
    )
    snap = orjson.loads(orjson.dumps(snap))  # what crosses Redis

    follower = [_pool("spec", "speculative", ["a", "b"]), _pool("std", "standard", ["c", "new"])]
    changed = snapshot.apply_endpoints(snap, follower, now=50.0)
    assert [e.id for e in changed] == ["b"]
    a, b = follower[0].endpoints
    c, new = follower[1].endpoints
    assert a.healthy
    assert not b.healthy
    assert b.last_error == "/health returned 503"
    assert c.ejected
    assert c.ejected_until == 60.0
    assert new.healthy
    assert not new.ejected
    got = snapshot.load_views(snap)
    assert got["spec"].acceptance == views["spec"].acceptance
    assert got["spec"].generation_tokens_per_s is None  # NaN crosses as unknown, never 0
    assert got["spec"].output_tokens_mean == 181.0  # followers estimate queues on the leader's numbers
    assert got["std"].stale
    assert snapshot.class_shares(snap) == {"precise": ("split", 0.25)}


def test_malformed_parts_are_left_out() -> None:
    snap = {"pools": {"spec": {"endpoints": "x"}}, "classes": {"c": {"state": "split", "share": -1}}, "endpoints": 3}
    assert snapshot.load_views(snap) == {}
    assert snapshot.class_shares(snap) == {}
    assert snapshot.apply_endpoints(snap, [_pool("spec", "speculative", ["a"])], now=0.0) == []


def test_a_follower_routes_on_the_adopted_share_and_a_force_still_wins() -> None:
    r = rules(preferred="spec", saturated="std")
    rs = RoutingState(lambda: r, CollectorRegistry(), clock=lambda: 0.0)
    name = "code"
    own = rs.choose(name, random.Random(0), count=False)
    assert own is not None
    rs.adopt({name: ("split", 0.5), "unknown-class": ("standard", 0.0)})
    assert rs.adopted
    picks = {rs.choose(name, random.Random(i), count=False).pick for i in range(50)}  # type: ignore[union-attr]
    assert picks == {"speculative", "standard"}
    rs.set_forced({name: ("standard", None)})
    forced = rs.choose(name, random.Random(0), count=False)
    assert forced is not None
    assert forced.state == "standard"
    assert forced.share == 0.0
    rs.set_forced({})
    rs.adopt({})
    again = rs.choose(name, random.Random(0), count=False)
    own_now = rs.snapshot()[name]
    assert again is not None
    assert (again.state, again.share) == (own_now["state"], own_now["share"])


def test_the_other_replicas_requests_count_as_samples() -> None:
    r = rules({"min_samples": 1000, "window_s": 10}, preferred="spec", saturated="std")
    now = [0.0]
    rs = RoutingState(lambda: r, CollectorRegistry(), clock=lambda: now[0])
    name = "code"
    remote = {name: (0.0, 0.0, 0.0)}
    rs.remote_counts = lambda: remote
    rs.on_scrape_round(0.0, {})
    remote[name] = (500.0, 0.0, 0.0)
    now[0] = 1.0
    rs.on_scrape_round(1.0, {})
    assert rs.local_counts()[name][0] == 0.0
    assert rs.snapshot(1.0)[name]["last_observation"]["samples"] == 500
    remote[name] = (0.0, 0.0, 0.0)  # a replica left: its counts vanish, the window never goes negative
    now[0] = 2.0
    rs.on_scrape_round(2.0, {})
    assert rs.snapshot(2.0)[name]["last_observation"]["samples"] == 0


def test_the_scraped_queue_and_ejections_reach_a_follower() -> None:
    leader = [_pool("spec", "speculative", ["a", "b"])]
    a, b = leader[0].endpoints
    a.note_queue(3.0, fresh_until=102.0)  # scraped at the leader's 100 - stale_after + ..., fresh for 2 s more
    b.eject(100.0, base_s=5.0, max_s=60.0)
    snap = orjson.loads(
        orjson.dumps(
            snapshot.build(leader="r1", seq=1, at=1.0, now=100.0, config="abc", pools=leader, views={}, classes={})
        )
    )
    follower = [_pool("spec", "speculative", ["a", "b"])]
    fa, fb = follower[0].endpoints
    fb.eject(49.0, base_s=30.0, max_s=60.0)  # its own, longer than the leader's
    snapshot.apply_endpoints(snap, follower, now=50.0)
    assert fa.queueing(51.9)
    assert not fa.queueing(52.1)  # the time left on the leader's clock, on the follower's
    assert overload.endpoint_busy(fa, follower[0].spec, 51.0)
    assert (fb.ejected, fb.ejected_until, fb.ejected_here) == (True, 79.0, True)  # its own ejection kept
    again = snapshot.build(leader="r1", seq=2, at=2.0, now=110.0, config="abc", pools=leader, views={}, classes={})
    b.ejected = False  # the leader ended its ejection; the follower's own runs on until its end
    again["endpoints"]["spec/b"]["ejected"] = False
    snapshot.apply_endpoints(again, follower, now=60.0)
    assert fb.ejected
    snapshot.apply_endpoints(again, follower, now=80.0)
    assert (fb.ejected, fb.ejected_here) == (False, False)


def test_a_follower_shows_the_leaders_controller() -> None:
    r = rules(preferred="spec", saturated="std")
    leader = RoutingState(lambda: r, CollectorRegistry(), clock=lambda: 0.0)
    leader._classes["code"].controller.force("standard", 0.0, ttl_s=60)
    snap = orjson.loads(
        orjson.dumps(
            snapshot.build(
                leader="r1", seq=1, at=1.0, now=0.0, config="abc", pools=[], views={}, classes=leader.snapshot(0.0)
            )
        )
    )
    follower = RoutingState(lambda: r, CollectorRegistry(), clock=lambda: 0.0)
    follower.adopt(snapshot.class_shares(snap), snapshot.class_controllers(snap))
    shown = follower.snapshot()["code"]
    assert shown["source"] == "cluster_leader"
    assert (shown["state"], shown["last_reason"]) == ("standard", leader.snapshot()["code"]["last_reason"])
    follower.adopt({})
    assert "source" not in follower.snapshot()["code"]


def test_admission_and_busy_count_the_other_replicas_requests() -> None:
    spec = PoolSpec.model_validate(
        {
            "name": "p",
            "kind": "standard",
            "models": ["m"],
            "max_num_seqs": 4,
            "endpoints": [{"url": "http://a:8000", "id": "a"}],
        }
    )
    pool = PoolState.from_spec(spec)
    [ep] = pool.endpoints
    limit = overload.admission_limit(spec, 1)
    assert limit is not None
    ep.remote_in_flight = limit
    assert not overload.admits(pool)
    assert overload.endpoint_busy(ep, spec, 0.0)
    ep.remote_in_flight = 0
    assert overload.admits(pool)
    assert not overload.endpoint_busy(ep, spec, 0.0)


def test_a_follower_probes_at_the_leaders_probe_share() -> None:
    r = rules(preferred="spec", saturated="std")
    follower = RoutingState(lambda: r, CollectorRegistry(), clock=lambda: 0.0)
    leader_view = {"state": "standard", "share": 0.0, "probe_share": 0.05}
    follower.adopt({"code": ("standard", 0.0)}, {"code": leader_view})
    whys = [follower.choose("code", random.Random(i), count=False).why for i in range(2000)]  # type: ignore[union-attr]
    assert 50 < whys.count("probe") < 150  # 5% of 2,000
    # a corrupt or hostile snapshot asking for more never probes above the cap a YAML may set
    follower.adopt({"code": ("standard", 0.0)}, {"code": {**leader_view, "probe_share": 0.9}})
    whys = [follower.choose("code", random.Random(i), count=False).why for i in range(2000)]  # type: ignore[union-attr]
    assert whys.count("probe") < 150
    follower.adopt({"code": ("standard", 0.0)}, {"code": {**leader_view, "probe_share": 0.0}})
    assert all(follower.choose("code", random.Random(i), count=False).why != "probe" for i in range(100))  # type: ignore[union-attr]
