"""A cluster's followers probe like the leader: the snapshot carries each class's probe share, and a follower that
adopts it sends that share of the never-measured class to the speculative pool (capped), not the leader alone."""

from __future__ import annotations

import random

import orjson

from gateway.cluster import snapshot
from gateway.config.controller import PROBE_CAP
from gateway.observability.metrics import GatewayMetrics
from gateway.routing.route_state import RoutingState
from tests.unit.test_class_prior_and_samples import rules


def _snap(classes: dict[str, dict[str, object]]) -> dict[str, object]:
    snap = snapshot.build(leader="r1", seq=1, at=1.0, now=1.0, config="x", pools=[], views={}, classes=classes)
    out: dict[str, object] = orjson.loads(orjson.dumps(snap))  # what crosses Redis
    return out


def test_the_snapshot_carries_the_leaders_probe_share() -> None:
    snap = _snap(
        {"chat": {"state": "standard", "share": 0.0, "probe_share": 0.05}, "old": {"state": "split", "share": 0.5}}
    )
    assert snapshot.class_probes(snap) == {"chat": 0.05, "old": 0.0}
    assert snapshot.class_probes({"classes": {"x": {"probe_share": "a lot"}, "y": 3}}) == {}


def test_a_follower_probes_with_the_leaders_share_and_never_above_the_cap() -> None:
    r = rules(probe_share=0.05)
    follower = RoutingState(lambda: r, GatewayMetrics().registry, clock=lambda: 0.0)
    snap = _snap({"chat": {"state": "standard", "share": 0.0, "probe_share": 0.05}})
    follower.adopt(snapshot.class_shares(snap), snapshot.class_probes(snap))
    rng = random.Random(5)
    picks = [follower.choose("chat", rng) for _ in range(4000)]
    probes = sum(1 for c in picks if c is not None and c.why == "probe")
    assert 100 <= probes <= 300  # 5% of 4,000 = 200
    follower.adopt({"chat": ("standard", 0.0)}, {"chat": 0.9})  # a corrupt or hostile snapshot
    picks = [follower.choose("chat", rng) for _ in range(4000)]
    assert sum(1 for c in picks if c is not None and c.why == "probe") <= 4000 * PROBE_CAP * 1.5
    follower.adopt({"chat": ("standard", 0.0)}, {"chat": 0.0})  # the leader stopped probing
    assert all(c is not None and c.why != "probe" for c in (follower.choose("chat", rng) for _ in range(500)))
