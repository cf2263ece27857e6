"""What the gateway reads back from Redis is checked, never trusted: a private redis-server holding poisoned
Idempotency-Key records, cluster snapshots and overrides (as anyone with write access to it could plant them).
Each gets the client a clean answer (never a 500, never a dropped connection), is counted in
``specgate_store_rejected_records_total{kind}``, and the fleet keeps routing."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.cluster.snapshot import MAX_SNAPSHOT_BYTES
from gateway.proxy.idempotency import fingerprint, store_key
from gateway.proxy.stored_response import StoredResponse
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, RedisServer, ServerThread, rules_for

pytestmark = pytest.mark.integration

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
PATH = "/v1/chat/completions"


def _rejected(gw: ServerThread, kind: str) -> float:
    text = httpx.get(gw.url + "/metrics").text
    m = re.search(rf'^specgate_store_rejected_records_total\{{kind="{kind}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _head(head: Any) -> bytes:
    raw = orjson.dumps(head)
    return b"SGI1" + len(raw).to_bytes(4, "big") + raw


POISONED = {
    "no-headers-field": _head({"status": 200}) + b'{"x": 1}',
    "status-1000": _head({"status": 1000, "headers": []}) + b"{}",
    "status-not-a-number": _head({"status": "200", "headers": []}) + b"{}",
    "set-cookie-and-location": _head(
        {"status": 200, "headers": [["set-cookie", "sid=stolen"], ["location", "http://evil.example/"]]}
    )
    + b"{}",
    "header-with-crlf": _head({"status": 200, "headers": [["x-request-id", "a\r\nset-cookie: sid=x"]]}) + b"{}",
    "bad-magic": b"not a stored response",
    "head-past-the-end": b"SGI1" + (2**31).to_bytes(4, "big") + b"{}",
    "head-not-json": b"SGI1" + (4).to_bytes(4, "big") + b"{{{{",
    "64-mib": _head({"status": 200, "headers": [["content-type", "application/json"]]}) + b"x" * (64 * 2**20),
}


@pytest.mark.parametrize("policy", ["refuse", "proceed"])
def test_poisoned_idempotency_records_get_a_clean_answer_and_are_counted(
    fake: Callable[..., FakeUpstreamServer],
    gateway: Callable[..., ServerThread],
    redis_server: RedisServer,
    policy: str,
) -> None:
    std = fake("std")
    rules = rules_for([std.url], [std.url], idempotency={"store_unavailable": policy})
    gw = gateway(rules, redis_url=redis_server.url, cluster=False)
    r = redis.Redis.from_url(redis_server.url)
    fp = fingerprint("POST", PATH, CHAT)

    def plant(key: str, blob: bytes) -> None:
        record = {"s": "done", "t": "planted", "f": fp, "r": blob}
        r.hset("specgate:idem:" + store_key(b"anonymous", key), mapping=record)  # type: ignore[arg-type]

    with httpx.Client(base_url=gw.url, timeout=30) as client:
        # The control: a well-formed record is replayed, so the poisoned ones below are found and read the same way.
        plant("good", StoredResponse(200, ((b"content-type", b"application/json"),), b'{"planted": 1}').encode())
        good = client.post(PATH, json=CHAT, headers={"Idempotency-Key": "good"})
        assert good.status_code == 200
        assert good.headers["idempotent-replayed"] == "true"
        assert good.json() == {"planted": 1}
        for name, blob in POISONED.items():
            plant(name, blob)
            resp = client.post(PATH, json=CHAT, headers={"Idempotency-Key": name})
            assert "set-cookie" not in resp.headers, name
            assert "location" not in resp.headers, name
            assert "idempotent-replayed" not in resp.headers, name
            if policy == "refuse":
                assert resp.status_code == 503, (name, resp.text[:200])
                assert resp.json()["error"]["code"] == "idempotency_store_unavailable"
            else:  # runs without its key: the pool answers
                assert resp.status_code == 200, (name, resp.text[:200])
                assert resp.json()["choices"][0]["message"]["content"]
    assert _rejected(gw, "idempotency") == len(POISONED)


# --- cluster snapshots -----------------------------------------------------------------------------------------

PREFIX = "specgate:{fleet}:"


def _follower(gateway: Callable[..., ServerThread], redis_server: RedisServer, rules: dict[str, Any]) -> Any:
    """A gateway that follows a "leader" this test plays: the lease is held by a name no replica has."""
    r = redis.Redis.from_url(redis_server.url)
    r.set(PREFIX + "leader", "planted-leader", px=120_000)
    gw = gateway(rules, redis_url=redis_server.url)
    return gw, gw.app.state.runtime, r


def _publish(r: redis.Redis, raw: bytes) -> None:
    r.set(PREFIX + "snapshot", raw, px=120_000)
    r.publish(PREFIX + "snapshot:published", raw)


def _snapshot(seq: int, endpoints: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "v": 1,
        "leader": "planted-leader",
        "seq": seq,
        "at": time.time(),
        "config": "x",
        "endpoints": endpoints,
        "pools": {},
        "classes": {},
        **extra,
    }


def test_a_poisoned_snapshot_cannot_take_the_fleet_out_and_an_oversize_one_is_ignored(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread], redis_server: RedisServer
) -> None:
    spec, std_a, std_b = fake("spec"), fake("std-a"), fake("std-b")
    gw, rt, r = _follower(gateway, redis_server, rules_for([spec.url], [std_a.url, std_b.url]))
    forever = {"healthy": True, "error": None, "ejected": True, "ejected_for_s": 1e300, "waiting": 0}
    names = ["spec/spec-0", "std/std-0", "std/std-1"]
    _publish(r, orjson.dumps(_snapshot(1, dict.fromkeys(names, forever))))
    _wait(lambda: rt.cluster.snapshots_applied >= 1 and rt.cluster.role == "follower", "the snapshot applied")

    pools = rt.live.pools
    spec_ep = pools["spec"].endpoints[0]
    std_eps = pools["std"].endpoints
    assert not spec_ep.ejected  # the only endpoint of a model: never ejected on another replica's word
    assert sum(e.ejected for e in std_eps) == 1  # at most 50% of a pool (at least one)
    now = time.monotonic()
    assert all(e.ejected_until <= now + 300.0 for e in std_eps)  # outlier_detection.max_ejection_s
    assert _rejected(gw, "snapshot") >= 1
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for _ in range(4):  # the default class prefers std, falls back to spec: the fleet still routes
            assert client.post(PATH, json=CHAT).status_code == 200
        code = {**CHAT, "temperature": 0.1, "messages": [{"role": "user", "content": "def f(): in python"}]}
        assert client.post(PATH, json=code).status_code == 200

    # Larger than the cap: never read past it, never applied (here: every endpoint down), counted.
    before_applied, before_rejected = rt.cluster.snapshots_applied, _rejected(gw, "snapshot")
    down = {"healthy": False, "error": "planted", "ejected": False, "ejected_for_s": 0.0}
    oversize = _snapshot(2, dict.fromkeys(names, down), padding="x" * MAX_SNAPSHOT_BYTES)
    _publish(r, orjson.dumps(oversize))
    _wait(lambda: _rejected(gw, "snapshot") > before_rejected, "the oversize snapshot counted")
    assert rt.cluster.snapshots_applied == before_applied
    assert all(e.healthy for p in pools.values() for e in p.endpoints)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        assert client.post(PATH, json=CHAT).status_code == 200


def test_poisoned_shared_counts_are_left_out(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread], redis_server: RedisServer
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), redis_url=redis_server.url)
    rt = gw.app.state.runtime
    r = redis.Redis.from_url(redis_server.url)
    saturating = {"at": time.time() + 3600, "in_flight": {"std/std-0": 10**12, "spec/spec-0": 10**12}}
    r.hset(PREFIX + "contributions", "planted-replica", orjson.dumps(saturating))
    _wait(lambda: _rejected(gw, "contribution") >= 1, "the poisoned contribution counted")
    assert rt.cluster.remote_in_flight() == {}
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        assert client.post(PATH, json=CHAT).status_code == 200


# --- overrides -------------------------------------------------------------------------------------------------


def test_poisoned_overrides_are_ignored_and_counted(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread], redis_server: RedisServer
) -> None:
    std = fake("std")
    gw = gateway(rules_for([std.url], [std.url]), redis_url=redis_server.url, cluster=False)
    rt = gw.app.state.runtime
    r = redis.Redis.from_url(redis_server.url)
    base = {"pool": "std", "endpoint": None, "class": None, "reason": "x", "actor": "x", "created_at": time.time()}
    planted = {
        "pool_weight|std||": {**base, "id": "ovr_inf", "kind": "pool_weight", "value": 1e300},
        "drain|spec||": {**base, "id": "ovr_drain", "kind": "drain", "pool": ["spec"], "value": None},
        "class_route|||default": {**base, "id": "ovr_r", "kind": "class_route", "class": "default", "value": "x"},
        "pool_weight|spec||": {**base, "id": "ovr_big", "kind": "pool_weight", "value": 1, "reason": "y" * 20_000},
    }
    good = {**base, "id": "ovr_ok", "kind": "endpoint_weight", "endpoint": "std-0", "value": 0.5}
    for key, o in planted.items():
        r.hset("specgate:overrides", key, o["id"].encode() + b"\n" + orjson.dumps(o))
    r.hset("specgate:overrides", "endpoint_weight|std|std-0|", b"ovr_ok\n" + orjson.dumps(good))  # the control
    r.publish("specgate:overrides:changed", b"1")
    _wait(lambda: _rejected(gw, "override") >= len(planted), "the poisoned overrides counted")
    _wait(lambda: [o.id for o in rt.overrides.active()] == ["ovr_ok"], "the valid override applied")
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        assert client.post(PATH, json=CHAT).status_code == 200
