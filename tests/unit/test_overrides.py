"""On-call overrides without sockets: TTL parsing, effective weights, replace semantics, class routes, expiry
audited exactly once by two replicas sharing one store, and the memory store's contract."""

from __future__ import annotations

import math
import random
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from gateway.config.schema import RoutingRules
from gateway.errors import InvalidParameter
from gateway.fleet.pools import PoolState
from gateway.overrides.audit import AuditRecord
from gateway.overrides.manager import OverrideManager
from gateway.overrides.model import parse_reason, parse_ttl, parse_weight
from gateway.overrides.override import Override, effective_weight
from gateway.overrides.store import MemoryOverrideStore, OverrideStore
from gateway.routing.plan import PoolView, plan_route
from gateway.routing.routing_state import RoutingState


def make_rules(**admin: Any) -> RoutingRules:
    ctl = {"window_s": 1, "min_samples": 1, "min_hold_s": 0, "share_step": 1}
    return RoutingRules.model_validate(
        {
            "defaults": {"controller": None},  # the "default" class has no controller (the explicit opt-out)
            "pools": [
                {
                    "name": "spec",
                    "kind": "speculative",
                    "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
                    "models": ["m"],
                    "endpoints": [{"url": "http://spec-a:8000", "id": "a"}, {"url": "http://spec-b:8000", "id": "b"}],
                },
                {"name": "std", "kind": "standard", "models": ["m"], "endpoints": [{"url": "http://std:8000"}]},
            ],
            "classes": [
                {
                    "name": "code",
                    "when": {"task_type": {"in": ["code"]}},
                    "route": {"preferred": "spec", "saturated": "std"},
                    "controller": ctl,
                },
                {"name": "default", "route": {"preferred": "std", "fallback": ["spec"]}},
            ],
            **({"admin": admin} if admin else {}),
        }
    )


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Replica:
    """One gateway's override component over its own pools and controllers, on a shared store."""

    def __init__(self, store: OverrideStore, clock: Clock) -> None:
        self.rules = make_rules()
        self.pools = {p.name: PoolState.from_spec(p) for p in self.rules.pools}
        registry = CollectorRegistry()
        self.routing = RoutingState(lambda: self.rules, registry, clock=clock)
        self.mgr = OverrideManager(
            store,
            pools=lambda: self.pools,
            rules=lambda: self.rules,
            routing=self.routing,
            registry=registry,
            clock=clock,
        )
        self.registry = registry

    def weights(self, pool: str) -> list[float]:
        return [e.weight for e in self.pools[pool].endpoints]

    def gauge(self, kind: str) -> float | None:
        return self.registry.get_sample_value("specgate_overrides_active", {"kind": kind})


def ovr(kind: Any, clock: Clock, ttl_s: float | None = 60.0, **kw: Any) -> Override:
    return Override.create(kind, reason="test", actor="admin:test", ttl_s=ttl_s, now=clock(), **kw)


# -- parsing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        (None, 3600.0),
        (90, 90.0),
        (2.5, 2.5),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("45", 45.0),
        (" 1.5h ", 5400.0),
        ("never", None),
        ("NEVER", None),
    ],
)
def test_ttl_forms(raw: object, seconds: float | None) -> None:
    assert parse_ttl(raw, default_s=3600, max_s=604800) == seconds


@pytest.mark.parametrize("raw", [True, 0, -5, "0s", "abc", "5w", "", [], {}, math.nan, math.inf, "8d", 10**7])
def test_bad_ttls_name_the_param(raw: object) -> None:
    with pytest.raises(InvalidParameter) as e:
        parse_ttl(raw, default_s=3600, max_s=604800)
    assert e.value.param == "ttl"


def test_reason_and_weight_validation() -> None:
    assert parse_reason("  ticket 42 ") == "ticket 42"
    for bad in (None, "", "   ", 5, "x" * 501):
        with pytest.raises(InvalidParameter) as e:
            parse_reason(bad)
        assert e.value.param == "reason"
    assert parse_weight(0) == 0.0
    assert parse_weight(2.5) == 2.5
    for bad_w in (-1, True, "2", None, math.inf, math.nan):
        with pytest.raises(InvalidParameter) as e:
            parse_weight(bad_w)
        assert e.value.param == "weight"


def test_admin_block_defaults_and_order() -> None:
    assert make_rules().admin.default_ttl_s == 3600
    assert make_rules().admin.max_ttl_s == 604800
    assert make_rules(default_ttl_s=60, max_ttl_s=120).admin.default_ttl_s == 60
    with pytest.raises(ValueError, match="out of order"):
        make_rules(default_ttl_s=600, max_ttl_s=60)


def test_override_json_round_trip() -> None:
    clock = Clock()
    o = ovr("class_route", clock, class_name="code", value="standard")
    d = o.as_dict()
    assert set(d) == {"id", "kind", "pool", "endpoint", "class", "value", "reason", "actor", "created_at", "expires_at"}
    assert d["id"].startswith("ovr_")
    assert len(d["id"]) == 16
    assert d["expires_at"] == clock() + 60
    assert Override.from_bytes(o.to_bytes()) == o
    assert o.target == "class/code"
    with pytest.raises(ValueError, match="unknown override kind"):
        Override.from_dict({**d, "kind": "nope"})
    with pytest.raises(ValueError, match="speculative or standard"):
        Override.from_dict({**d, "value": "fast"})


# -- effective weights -------------------------------------------------------------------------------------------


def test_effective_weight_precedence() -> None:
    clock = Clock()
    pool_w = ovr("pool_weight", clock, pool="spec", value=3.0)
    ep_w = ovr("endpoint_weight", clock, pool="spec", endpoint="a", value=0.5)
    drain = ovr("drain", clock, pool="spec")
    assert effective_weight("spec", "a", 1.0, {}) == 1.0
    assert effective_weight("spec", "a", 1.0, {pool_w.key: pool_w}) == 3.0
    both = {pool_w.key: pool_w, ep_w.key: ep_w}
    assert effective_weight("spec", "a", 1.0, both) == 0.5  # the endpoint's own override wins
    assert effective_weight("spec", "b", 1.0, both) == 3.0
    assert effective_weight("std", "a", 1.0, both) == 1.0  # another pool: untouched
    assert effective_weight("spec", "a", 1.0, {**both, drain.key: drain}) == 0.0  # drain wins


async def test_put_applies_replaces_and_counts() -> None:
    clock = Clock()
    r = Replica(MemoryOverrideStore(), clock)
    first, old = await r.mgr.put(ovr("pool_weight", clock, pool="spec", value=0.0))
    assert old is None
    assert r.weights("spec") == [0.0, 0.0]
    assert not any(e.routable for e in r.pools["spec"].endpoints)
    second, old = await r.mgr.put(ovr("pool_weight", clock, pool="spec", value=2.0))
    assert old == first  # one active per kind and target: the newer one replaces the older
    assert [o.id for o in r.mgr.active()] == [second.id]
    assert len(await r.mgr.store.list_overrides()) == 1
    assert r.weights("spec") == [2.0, 2.0]
    await r.mgr.put(ovr("endpoint_weight", clock, pool="spec", endpoint="b", value=0.0))
    assert r.weights("spec") == [2.0, 0.0]
    assert r.gauge("pool_weight") == 1
    assert r.gauge("endpoint_weight") == 1
    assert r.gauge("drain") == 0
    assert r.registry.get_sample_value("specgate_admin_changes_total", {"action": "pool_weight"}) == 2
    removed = await r.mgr.remove(lambda o: o.kind == "pool_weight", actor="admin:t", reason="done", action="remove")
    assert [o.id for o in removed] == [second.id]
    assert r.weights("spec") == [1.0, 0.0]
    records, size, total = await r.mgr.audit(100)
    assert [x.action for x in records] == ["pool_weight", "pool_weight", "endpoint_weight", "remove"]
    assert records[1].detail["replaced"]["id"] == first.id
    assert (size, total) == (4, 4)


async def test_drain_and_a_config_swap_keep_weights_right() -> None:
    clock = Clock()
    r = Replica(MemoryOverrideStore(), clock)
    await r.mgr.put(ovr("drain", clock, pool="std"))
    assert r.weights("std") == [0.0]
    # a reload: new pool state objects with the YAML's weights; apply() puts the overrides back on them
    r.pools = {p.name: PoolState.from_spec(p) for p in r.rules.pools}
    assert r.weights("std") == [1.0]
    assert r.mgr.apply() == []
    assert r.weights("std") == [0.0]
    # a config without the pool: the override is reported (not applied)
    r.pools = {"spec": r.pools["spec"]}
    [unknown] = r.mgr.apply()
    assert unknown.pool == "std"
    dropped = await r.mgr.drop([unknown], actor="reload", reason="pool gone")
    assert dropped == [unknown]
    assert r.mgr.active() == []


# -- class routes ----------------------------------------------------------------------------------------------


async def test_class_route_on_a_class_without_controller() -> None:
    clock = Clock()
    r = Replica(MemoryOverrideStore(), clock)
    assert r.routing.choose("default", random.Random(1)) is None
    await r.mgr.put(ovr("class_route", clock, class_name="default", value="speculative"))
    choice = r.routing.choose("default", random.Random(1))
    assert choice is not None
    assert (choice.pick, choice.forced) == ("speculative", True)
    route = r.rules.classes[1].route
    views = {n: PoolView(n, p.spec.kind, p.models, len(p.endpoints), 0) for n, p in r.pools.items()}
    plan = plan_route(route, "m", views, pick=choice.pick, forced=choice.forced)
    assert (plan.pools, plan.reason) == (("spec", "std"), "forced:speculative")
    await r.mgr.remove(lambda o: o.kind == "class_route", actor="t", reason="auto", action="class_route_auto")
    assert r.routing.choose("default", random.Random(1)) is None
    assert plan_route(route, "m", views).pools == ("std", "spec")


async def test_class_route_forces_the_controller_for_the_ttl() -> None:
    clock = Clock()
    r = Replica(MemoryOverrideStore(), clock)
    assert r.routing.state_of("code") == "speculative"
    await r.mgr.put(ovr("class_route", clock, ttl_s=120, class_name="code", value="standard"))
    assert r.routing.state_of("code") == "standard"
    snap = r.routing.snapshot()["code"]
    assert snap["forced_until"] == pytest.approx(clock() + 120)
    choice = r.routing.choose("code", random.Random(1))
    assert choice is not None
    assert (choice.pick, choice.forced, choice.why) == ("standard", True, "forced")  # the force decided, not the share
    await r.mgr.remove(lambda o: True, actor="t", reason="auto", action="class_route_auto")
    assert r.routing.snapshot()["code"]["forced_until"] is None  # released: the controller decides again


# -- expiry ----------------------------------------------------------------------------------------------------


async def test_expiry_on_two_replicas_is_audited_once() -> None:
    clock = Clock()
    store = MemoryOverrideStore()
    a, b = Replica(store, clock), Replica(store, clock)
    o, _ = await a.mgr.put(ovr("pool_weight", clock, ttl_s=2, pool="spec", value=0.0))
    await b.mgr.refresh()
    assert a.weights("spec") == b.weights("spec") == [0.0, 0.0]
    clock.t += 1.9
    assert await a.mgr.expire() == []
    assert await b.mgr.expire() == []
    clock.t += 0.2
    won = await b.mgr.expire() + await a.mgr.expire()
    assert [x.id for x in won] == [o.id]
    assert a.weights("spec") == b.weights("spec") == [1.0, 1.0]
    await a.mgr.flush_audit()
    await b.mgr.flush_audit()
    records, _, _ = await a.mgr.audit(100)
    expiries = [x for x in records if x.action == "expire"]
    assert len(expiries) == 1
    assert (expiries[0].actor, expiries[0].target) == ("system", "pool/spec")
    assert await store.list_overrides() == []
    assert a.gauge("pool_weight") == 0


async def test_an_override_expired_while_every_gateway_was_down_is_removed_and_audited_once() -> None:
    clock = Clock()
    store = MemoryOverrideStore()
    a = Replica(store, clock)
    await a.mgr.put(ovr("drain", clock, ttl_s=5, pool="std"))
    clock.t += 10
    b, c = Replica(store, clock), Replica(store, clock)  # restarted gateways
    await b.mgr.refresh()
    await c.mgr.refresh()
    assert b.weights("std") == [1.0]  # already over: never applied
    assert len(await b.mgr.expire() + await c.mgr.expire()) == 1


async def test_never_expires() -> None:
    clock = Clock()
    r = Replica(MemoryOverrideStore(), clock)
    await r.mgr.put(ovr("class_route", clock, ttl_s=None, class_name="code", value="standard"))
    clock.t += 10**8
    assert await r.mgr.expire() == []
    assert r.routing.snapshot()["code"]["forced_until"] == math.inf


async def test_controller_transitions_reach_the_store_audit() -> None:
    clock = Clock()
    r = Replica(MemoryOverrideStore(), clock)
    r.mgr.record(AuditRecord(5.0, "controller", "controller_transition", "class/code", "load", {}))
    records, size, total = await r.mgr.audit(10)
    assert [x.reason for x in records] == ["load"]
    assert (size, total) == (1, 1)


# -- the memory store's contract (the Redis one: tests/integration/test_overrides_replicas.py) ---------------------


async def test_memory_store_compare_and_delete_and_capped_audit() -> None:
    store = MemoryOverrideStore(audit_capacity=3)
    assert await store.put("k", "id1", b"one") is None
    assert await store.put("k", "id2", b"two") == b"one"
    assert await store.delete("k", "id1") is None  # not the one stored any more
    assert await store.delete("k", "id2") == b"two"
    assert await store.delete("k", "id2") is None  # only one caller wins
    for i in range(5):
        await store.append_audit(100.0 + i, orjson.dumps(i))
    assert await store.audit(10) == [b"2", b"3", b"4"]
    assert await store.audit(2) == [b"3", b"4"]
    assert await store.audit(10, since=102.5) == [b"3", b"4"]
    assert await store.audit_counts() == (3, 5)


async def test_memory_store_notifies_every_listener() -> None:
    store = MemoryOverrideStore()
    it1, it2 = store.changes(), store.changes()
    await anext(it1)  # the first yield: subscribed
    await anext(it2)
    await store.notify()
    await anext(it1)
    await anext(it2)
    await it1.aclose()  # type: ignore[attr-defined]
    await it2.aclose()  # type: ignore[attr-defined]


def test_a_huge_weight_is_refused_it_would_overflow_the_pick() -> None:
    from gateway.errors import InvalidParameter
    from gateway.overrides.model import MAX_WEIGHT, parse_weight

    assert parse_weight(MAX_WEIGHT) == MAX_WEIGHT
    for bad in (1e308, MAX_WEIGHT * 2, -1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(InvalidParameter):
            parse_weight(bad)
