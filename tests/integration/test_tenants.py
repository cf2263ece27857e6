"""Tenants through real sockets (uvicorn, the fake upstream, a private redis-server): requests and tokens per minute
answered as OpenAI answers them and shared by two replicas, the OpenAI SDK's own retry on the 429, fair shedding at
a full pool, and the tenant's priority in the body a pool that schedules by priority receives."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.app import state_dict
from gateway.admin.explain import explain
from gateway.config.tenants import load_tenants_text
from gateway.errors import RateLimited
from gateway.observability.tenant_metrics import TenantMetrics
from gateway.runtime.tenants import Tenancy
from gateway.store.ratelimit import RedisRateLimiter
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, RedisServer, ServerThread, closed_port_url
from tests.integration.test_overload import one_pool_rules, wait_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.9}
RESET = re.compile(r"^(\d+ms|[\d.]+s|\d+m[\d.]+s)$")


def tenants_file(tmp_path: Path, *tenants: dict[str, Any], waiting: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "tenants.yaml"
    spec: dict[str, Any] = {"tenants": list(tenants)}
    if waiting is not None:
        spec["waiting"] = waiting
    path.write_text(yaml.safe_dump(spec))
    return path


METRICS_TOKEN = "metrics-token-for-tests"


def metric(gw: ServerThread, name: str, **labels: str) -> float:
    text = httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def post(gw: ServerThread, key: str, body: dict[str, Any] | None = None, **headers: str) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json=body or CHAT,
        headers={"authorization": f"Bearer {key}", **headers},
        timeout=30,
    )


def test_requests_per_minute_are_shared_by_two_replicas_and_answered_like_openai(
    fake: Fake, gateway: Gateway, redis_server: RedisServer, tmp_path: Path
) -> None:
    std = fake("std")
    path = tenants_file(
        tmp_path,
        {"name": "team-a", "keys": ["sk-team-a-0001"], "limits": {"requests_per_minute": 3}},
        {"name": "team-b", "keys": ["sk-team-b-0001"]},
    )
    common = {"tenants_file": path, "metrics_token": METRICS_TOKEN, "redis_url": redis_server.url, "cluster": False}
    gw1 = gateway(one_pool_rules(std.url), **common)
    gw2 = gateway(one_pool_rules(std.url), **common)
    remaining = []
    for gw in (gw1, gw2, gw1):
        r = post(gw, "sk-team-a-0001")
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert RESET.match(r.headers["x-ratelimit-reset-requests"])
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]  # one count across both replicas
    r = post(gw2, "sk-team-a-0001")
    assert r.status_code == 429
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("requests", "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) >= 1
    assert 1 <= int(r.headers["retry-after-ms"]) <= 20_000  # one request refills in 60/3 s
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert RESET.match(r.headers["x-ratelimit-reset-requests"])
    # Another tenant is not touched, and has no limit headers (it has no limits).
    other = post(gw2, "sk-team-b-0001")
    assert other.status_code == 200
    assert "x-ratelimit-limit-requests" not in other.headers
    assert post(gw1, "sk-unknown-key-123").status_code == 401
    assert metric(gw2, "specgate_tenant_limited_total", tenant="team-a", limit="requests") == 1
    assert metric(gw1, "specgate_tenant_requests_total", tenant="team-a", outcome="ok") == 2


def test_tokens_per_minute_reserve_and_are_corrected_by_the_usage(
    fake: Fake, gateway: Gateway, redis_server: RedisServer, tmp_path: Path
) -> None:
    std = fake("std", tokens=16)
    path = tenants_file(tmp_path, {"name": "team-a", "keys": ["sk-team-a-0001"], "limits": {"tokens_per_minute": 1000}})
    gw = gateway(
        one_pool_rules(std.url),
        tenants_file=path,
        metrics_token=METRICS_TOKEN,
        redis_url=redis_server.url,
        cluster=False,
    )
    big = {**CHAT, "max_tokens": 900}
    r = post(gw, "sk-team-a-0001", big)
    assert r.status_code == 200
    assert r.headers["x-ratelimit-limit-tokens"] == "1000"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 100  # 900 + the prompt's estimate reserved

    def remaining() -> int:
        return int(post(gw, "sk-team-a-0001", {**big, "max_tokens": 1}).headers["x-ratelimit-remaining-tokens"])

    # The answer used 16 tokens and its short prompt: the rest of the reservation is given back.
    assert wait_for(lambda: remaining() > 900, timeout_s=10)
    r = post(gw, "sk-team-a-0001", {**big, "stream": True})  # no usage in the stream: the reservation stands
    assert r.status_code == 200
    r = post(gw, "sk-team-a-0001", big)
    assert r.status_code == 429
    assert r.json()["error"]["type"] == "tokens"
    assert "x-ratelimit-reset-tokens" in r.headers
    # A request larger than the whole budget is refused for good, not told to retry.
    r = post(gw, "sk-team-a-0001", {**CHAT, "max_tokens": 5000})
    assert r.status_code == 429
    assert "too large" in r.json()["error"]["message"]
    assert "retry-after" not in r.headers


def test_the_openai_sdk_retries_a_429_by_itself(fake: Fake, gateway: Gateway, tmp_path: Path) -> None:
    std = fake("std")
    path = tenants_file(tmp_path, {"name": "team-a", "keys": ["sk-team-a-0001"], "limits": {"requests_per_minute": 60}})
    gw = gateway(one_pool_rules(std.url), tenants_file=path, metrics_token=METRICS_TOKEN)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-team-a-0001", max_retries=4)
    # The burst of 60, then more until one is limited and waits for its refill (one a second): on a slow machine
    # the refill can keep up with the first requests, so the count is not fixed.
    sent = 0
    while metric(gw, "specgate_tenant_limited_total", tenant="team-a", limit="requests") < 1:
        assert sent < 600, "never limited"
        for _ in range(20):
            out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
            assert out.choices[0].message.content
        sent += 20
    assert metric(gw, "specgate_tenant_requests_total", tenant="team-a", outcome="ok") == sent
    no_retry = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-team-a-0001", max_retries=0)

    def burst() -> None:  # the bucket refills one a second: ten in a row cannot all pass
        for _ in range(10):
            no_retry.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])

    with pytest.raises(openai.RateLimitError):
        burst()


def test_a_full_pool_sheds_the_tenant_above_its_share(fake: Fake, gateway: Gateway, tmp_path: Path) -> None:
    std = fake("std", tokens=40, token_delay_s=0.1)  # each stream holds its slot about 4 s
    path = tenants_file(
        tmp_path,
        {"name": "flood", "keys": ["sk-flood-00001"]},
        {"name": "steady", "keys": ["sk-steady-0001"]},
        waiting={"wait_s": 0.5},  # the flood's third request waits half a second for a slot, then is shed
    )
    # Bound: 1 endpoint x (max_num_seqs 2 + 0 waiting) = 2 requests in flight.
    rules = one_pool_rules(std.url, max_num_seqs=2, admission={"max_waiting_per_endpoint": 0}, max_connections=8)
    gw = gateway(rules, tenants_file=path, metrics_token=METRICS_TOKEN, health_interval_s=600)
    held: list[httpx.Response] = []

    def hold() -> None:
        held.append(post(gw, "sk-flood-00001", {**CHAT, "stream": True}))

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: std.state.stats()["in_flight"] == 2)
    # explain: the flood holds the pool, above its share of 1 (of 2) once steady counts too.
    why = explain(gw.app.runtime, "/v1/chat/completions", CHAT, {"X-Specgate-Tenant": "flood"})["tenant"]
    assert (why["name"], why["in_flight"]) == ("flood", 2)
    assert why["pools"]["std"]["by_tenant"] == {"flood": 2}
    assert why["pools"]["std"]["bound"] == 2
    shown = {t["name"]: t for t in state_dict(gw.app.runtime)["tenants"]}  # /admin/state, the console's panel
    assert shown["flood"]["pools"]["std"] == {"in_flight": 2, "share": 2.0, "bound": 2}
    assert (shown["steady"]["in_flight"], shown["steady"]["pools"]) == (0, {})
    shed = post(gw, "sk-flood-00001")
    assert shed.status_code == 503
    assert shed.json()["error"]["code"] == "overloaded"
    steady = post(gw, "sk-steady-0001")  # at the bound, but under its share while flood is above its own
    assert steady.status_code == 200, steady.text
    for t in threads:
        t.join()
    assert [r.status_code for r in held] == [200, 200]
    assert metric(gw, "specgate_tenant_shed_total", tenant="flood") == 1
    assert metric(gw, "specgate_tenant_shed_total", tenant="steady") == 0
    assert metric(gw, "specgate_tenant_in_flight_requests", tenant="flood") == 0
    shown = {t["name"]: t for t in state_dict(gw.app.runtime)["tenants"]}
    assert (shown["flood"]["shed"], shown["steady"]["shed"], shown["flood"]["in_flight"]) == (1, 0, 0)
    # the console's "in the last minutes" counts
    assert shown["flood"]["recent"] == {"window_s": 300.0, "shed": 1, "limited": 0}
    assert shown["steady"]["recent"]["shed"] == 0


def test_priority_reaches_a_pool_that_schedules_by_it(fake: Fake, gateway: Gateway, tmp_path: Path) -> None:
    std = fake("std")
    path = tenants_file(
        tmp_path,
        {"name": "batch", "keys": ["sk-batch-00001"], "priority": 10},
        {"name": "online", "keys": ["sk-online-0001"], "priority": 0, "allow_priority_header": True},
    )
    api_keys = tmp_path / "keys"
    api_keys.write_text("sk-plain-key-0001\n")
    gw = gateway(
        one_pool_rules(std.url, scheduling_policy="priority"),
        tenants_file=path,
        metrics_token=METRICS_TOKEN,
        api_keys_file=api_keys,
    )
    assert post(gw, "sk-batch-00001", {**CHAT, "priority": -100}).status_code == 200  # its own value is replaced
    assert post(gw, "sk-online-0001", **{"x-specgate-priority": "-5"}).status_code == 200
    assert post(gw, "sk-plain-key-0001").status_code == 200  # a key of the keys file: no tenant, priority 0
    refused = post(gw, "sk-batch-00001", **{"x-specgate-priority": "-5"})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "priority_header_not_allowed"
    chats = [r["body"] for r in std.state.requests if r["path"] == "/v1/chat/completions"]
    assert [b["priority"] for b in chats] == [10, -5, 0]
    assert "x-specgate-priority" not in {k.lower() for k in std.state.requests[-1]["headers"]}


def test_a_fcfs_pool_gets_the_body_unchanged(fake: Fake, gateway: Gateway, tmp_path: Path) -> None:
    std = fake("std")
    path = tenants_file(tmp_path, {"name": "batch", "keys": ["sk-batch-00001"], "priority": 10})
    gw = gateway(one_pool_rules(std.url), tenants_file=path, metrics_token=METRICS_TOKEN)
    assert post(gw, "sk-batch-00001").status_code == 200
    body = [r["body"] for r in std.state.requests if r["path"] == "/v1/chat/completions"][-1]
    assert "priority" not in body


def test_with_redis_unreachable_each_process_still_limits_alone() -> None:
    port = closed_port_url().rsplit(":", 1)[1]
    spec = load_tenants_text("tenants:\n  - {name: a, keys: [sk-aaaa-0001], limits: {requests_per_minute: 2}}\n", "t")
    limiter = RedisRateLimiter.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout_s=0.2)
    tenancy = Tenancy(spec, frozenset(), TenantMetrics(CollectorRegistry()), limiter)
    tenant = tenancy.identify("Bearer sk-aaaa-0001")

    async def run() -> None:
        tickets = [await tenancy.admit(tenant, 0, 0) for _ in range(2)]
        with pytest.raises(RateLimited) as err:
            await tenancy.admit(tenant, 0, 0)
        assert err.value.headers["x-ratelimit-remaining-requests"] == "0"
        for t in tickets:
            t.finish("ok", True)
        await tenancy.close()

    asyncio.run(run())
    assert tenant.in_flight == 0


def test_a_changed_tenants_file_is_in_force_without_a_restart(fake: Fake, gateway: Gateway, tmp_path: Path) -> None:
    std = fake("std")
    path = tenants_file(tmp_path, {"name": "team-a", "keys": ["sk-team-a-0001"]})
    gw = gateway(one_pool_rules(std.url), tenants_file=path, metrics_token=METRICS_TOKEN)
    assert post(gw, "sk-team-a-0001").status_code == 200
    assert post(gw, "sk-team-b-0001").status_code == 401
    tenants_file(  # rewritten in place: the watcher sees it within about a second
        tmp_path,
        {"name": "team-a", "keys": ["sk-team-a-0001"], "limits": {"requests_per_minute": 1}},
        {"name": "team-b", "keys": ["sk-team-b-0001"], "priority": -1},
    )
    assert wait_for(lambda: post(gw, "sk-team-b-0001").status_code == 200)
    codes = [post(gw, "sk-team-a-0001").status_code for _ in range(2)]
    assert codes == [200, 429]  # its new limit: a burst of one
    shown = {t["name"]: t for t in state_dict(gw.app.runtime)["tenants"]}
    assert (shown["team-b"]["priority"], shown["team-a"]["limits"]["requests_per_minute"]) == (-1, 1)
