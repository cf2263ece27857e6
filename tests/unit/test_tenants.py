"""Tenants, pure parts: the tenants file's validation, GCRA buckets on a fake clock, OpenAI's reset format, and the
fair-share decision at a full pool."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.config.settings import Settings
from gateway.config.tenants import TenantsError, load_tenants_text
from gateway.routing.fairshare import PoolTenants, TenantWeight, admit_at_bound, hold_back
from gateway.runtime.container import Runtime
from gateway.runtime.tenants import format_reset, usage_tokens
from gateway.store.ratelimit import MemoryRateLimiter


def test_a_tenants_file_loads_with_its_defaults() -> None:
    got = load_tenants_text(
        "tenants:\n  - name: search\n    keys: [sk-search-0001]\n    limits: {requests_per_minute: 10}\n", "t.yaml"
    )
    (t,) = got.tenants
    assert (t.name, t.priority, t.weight, t.allow_priority_header) == ("search", 0, 1.0, False)
    assert t.limits.requests_per_minute == 10
    assert t.limits.tokens_per_minute is None
    assert t.limited


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tenants:\n  - name: a\n    keys: [sk-aaaa-0001]\n    weight: 0\n", "t.yaml: tenants[0].weight: "),
        (
            "tenants:\n  - name: a\n    keys: [sk-aaaa-0001]\n    limits: {requests_per_minte: 3}\n",
            "tenants[0].limits.requests_per_minte: Extra inputs",
        ),
        ("tenants:\n  - name: Bad Name\n    keys: [sk-aaaa-0001]\n", "tenants[0].name"),
        ("tenants:\n  - name: a\n    keys: [short]\n", "tenants[0].keys[0]"),
        (
            "tenants:\n  - {name: a, keys: [sk-same-0001]}\n  - {name: b, keys: [sk-same-0001]}\n",
            "a key of tenant 'b' is also a key of tenant 'a'",
        ),
        ("tenants:\n  - {name: a, keys: [sk-aaaa-0001]}\n  - {name: a, keys: [sk-bbbb-0001]}\n", "defined twice"),
        ("tenants:\n  - {name: none, keys: [sk-aaaa-0001]}\n", "reserved"),
        ("[1, 2]\n", "top level must be a mapping"),
        ("tenants: [\n", "not valid YAML"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_the_path(text: str, expected: str) -> None:
    with pytest.raises(TenantsError) as err:
        load_tenants_text(text, "t.yaml")
    assert expected in str(err.value)
    assert "sk-same-0001" not in str(err.value)  # a key is never echoed


def test_gcra_admits_a_burst_then_one_per_interval() -> None:
    now = [1000.0]
    limiter = MemoryRateLimiter(clock=lambda: now[0])

    def acquire(cost: int = 1) -> tuple[bool, int | None, float]:
        v = asyncio.run(limiter.acquire("a", 6, None, cost))
        assert v.requests is not None
        return v.allowed, v.requests.remaining, v.retry_after_s

    assert [acquire()[:2] for _ in range(6)] == [(True, r) for r in (5, 4, 3, 2, 1, 0)]
    allowed, remaining, retry = acquire()
    assert (allowed, remaining) == (False, 0)
    assert retry == pytest.approx(10.0)  # 60 s / 6
    now[0] += 10.0
    assert acquire()[:2] == (True, 0)
    now[0] += 60.0
    assert acquire()[:2] == (True, 5)


def test_gcra_tokens_refuse_first_then_the_correction_gives_back() -> None:
    now = [0.0]
    limiter = MemoryRateLimiter(clock=lambda: now[0])
    v = asyncio.run(limiter.acquire("a", 100, 1000, 900))
    assert v.allowed
    assert v.tokens is not None
    assert v.tokens.remaining == 100
    v = asyncio.run(limiter.acquire("a", 100, 1000, 200))
    assert (v.allowed, v.refused_by) == (False, "tokens")
    assert v.retry_after_s == pytest.approx(6.0)  # 100 tokens short at 1000 / 60 s
    assert v.requests is not None
    assert v.requests.remaining == 99
    asyncio.run(limiter.adjust("a", 1000, -880))  # it used 20
    v = asyncio.run(limiter.acquire("a", 100, 1000, 200))
    assert v.allowed
    assert v.tokens is not None
    assert v.tokens.remaining == 780
    never = asyncio.run(limiter.acquire("a", None, 1000, 1001))
    assert never.never
    assert not never.allowed


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.02, "20ms"), (0.0, "0ms"), (1.0, "1s"), (1.5, "1.5s"), (360.0, "6m0s"), (3725, "1h2m5s")]
)
def test_reset_is_written_as_openai_writes_it(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_usage_is_read_from_bodies_and_events() -> None:
    assert usage_tokens(b'{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}') == 7
    assert usage_tokens(b'data: {"choices":[],"usage":{"total_tokens": 12}}\n\n') == 12
    assert usage_tokens(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n') is None


W = {"flood": TenantWeight(1.0, 0), "steady": TenantWeight(1.0, 0), "gold": TenantWeight(1.0, -1)}


def test_at_the_bound_a_tenant_under_its_share_gets_in_while_another_is_above() -> None:
    assert admit_at_bound("steady", PoolTenants({"flood": 8}, W, bound=8, in_flight=8))
    assert admit_at_bound("steady", PoolTenants({"flood": 5, "steady": 3}, W, bound=8, in_flight=8))
    assert not admit_at_bound("flood", PoolTenants({"flood": 8}, W, bound=8, in_flight=8))  # above its share: shed
    assert not admit_at_bound(
        "steady", PoolTenants({"flood": 4, "steady": 4}, W, bound=8, in_flight=8)
    )  # both at share
    assert not admit_at_bound(
        "steady", PoolTenants({"flood": 8, "steady": 8}, W, bound=8, in_flight=16)
    )  # the hard cap


def test_weights_size_the_shares() -> None:
    heavy = {**W, "steady": TenantWeight(3.0, 0)}
    assert admit_at_bound("steady", PoolTenants({"flood": 3, "steady": 5}, heavy, bound=8, in_flight=8))  # share 6 of 8
    assert not admit_at_bound("steady", PoolTenants({"flood": 2, "steady": 6}, heavy, bound=8, in_flight=8))


def test_a_better_priority_gets_in_over_a_worse_one() -> None:
    assert admit_at_bound("gold", PoolTenants({"flood": 4, "steady": 4, "gold": 6}, W, bound=8, in_flight=14))
    assert not admit_at_bound("flood", PoolTenants({"gold": 8}, W, bound=8, in_flight=8))
    assert admit_at_bound(
        "flood", PoolTenants({"gold": 8}, W, bound=8, in_flight=8), priority=-5
    )  # a per-request priority
    # Within a band, the shares are of what the better band leaves: 4 of 8 here, 2 each for flood and steady.
    assert admit_at_bound("steady", PoolTenants({"gold": 4, "flood": 4}, W, bound=8, in_flight=8))
    assert not admit_at_bound("steady", PoolTenants({"gold": 4, "flood": 2, "steady": 2}, W, bound=8, in_flight=8))


def test_below_the_bound_a_tenant_above_its_share_leaves_a_slot_to_each_other_tenant() -> None:
    # Bound 16; steady holds 3 (under its share of 8), flood 12: flood may not take the 16th slot, nor the 15th.
    one_band = {"flood": W["flood"], "steady": W["steady"]}
    assert not hold_back("flood", PoolTenants({"flood": 11, "steady": 3}, one_band, bound=16, in_flight=14))
    assert hold_back("flood", PoolTenants({"flood": 12, "steady": 3}, one_band, bound=16, in_flight=15))
    assert not hold_back(
        "steady", PoolTenants({"flood": 12, "steady": 3}, one_band, bound=16, in_flight=15)
    )  # within its share
    assert not hold_back("flood", PoolTenants({"flood": 15}, one_band, bound=16, in_flight=15))  # nobody else is there
    # A better band keeps a slot too (flood's share: half of what gold leaves); a worse one does not get one.
    assert hold_back("flood", PoolTenants({"flood": 10, "steady": 3, "gold": 2}, W, bound=16, in_flight=15))
    assert not hold_back("flood", PoolTenants({"flood": 8, "steady": 3, "gold": 2}, W, bound=16, in_flight=13))
    assert not hold_back("gold", PoolTenants({"gold": 13, "flood": 2}, W, bound=16, in_flight=15))
    # Within its share a tenant is not held back for a better band's slots, but for the last one (the fast lane)
    assert not hold_back("steady", PoolTenants({"flood": 4, "steady": 1, "gold": 1}, W, bound=8, in_flight=6))
    assert hold_back("steady", PoolTenants({"flood": 4, "steady": 2, "gold": 1}, W, bound=8, in_flight=7))


def test_a_better_priority_configured_but_idle_keeps_one_fast_lane() -> None:
    # gold (priority -1) holds nothing in the pool: flood, even alone (all the pool is its share), leaves the last
    # slot for gold's next request (vLLM would not preempt for it at a full batch); with steady, one more for it.
    assert hold_back("flood", PoolTenants({"flood": 15}, W, bound=16, in_flight=15))
    assert not hold_back("flood", PoolTenants({"flood": 14}, W, bound=16, in_flight=14))
    assert hold_back("flood", PoolTenants({"flood": 11, "steady": 3}, W, bound=16, in_flight=14))
    assert not hold_back("flood", PoolTenants({"flood": 10, "steady": 3}, W, bound=16, in_flight=13))
    # Only one lane however many better tenants are idle, none for the best band, none within one's share.
    many = {**W, "gold2": TenantWeight(1.0, -1), "platinum": TenantWeight(1.0, -2)}
    assert not hold_back("flood", PoolTenants({"flood": 14}, many, bound=16, in_flight=14))
    assert not hold_back("gold", PoolTenants({"gold": 15}, W, bound=16, in_flight=15))
    assert not hold_back("steady", PoolTenants({"steady": 6, "flood": 8}, W, bound=16, in_flight=14))
    assert not hold_back(
        "flood", PoolTenants({"flood": 15}, W, bound=16, in_flight=15), best=0
    )  # told no better band exists


def test_held_back_and_at_the_bound_count_a_share_alike() -> None:
    # steady's share: 2/3 of what gold leaves (13) = 8.67; its 9th request is within it (rounded up) and the pool
    # has a free slot: it is admitted, not held back for the others' slots.
    weights = {**W, "steady": TenantWeight(2.0, 0)}
    counts = {"flood": 4, "steady": 8, "gold": 3}
    assert not hold_back("steady", PoolTenants(counts, weights, bound=16, in_flight=14))
    # The 16th slot is gold's fast lane: nobody is above its share, so steady waits for another slot.
    assert hold_back("steady", PoolTenants(counts, weights, bound=16, in_flight=15))
    assert not admit_at_bound("steady", PoolTenants(counts, weights, bound=16, in_flight=15))
    assert admit_at_bound("steady", PoolTenants({"flood": 5, "steady": 8, "gold": 3}, weights, bound=16, in_flight=16))


def test_the_tenants_file_travels_to_the_workers_and_a_bad_one_stops_the_start(tmp_path: Path) -> None:
    rules = Path(__file__).parents[2] / "routing_rules" / "default.yaml"
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - name: a\n    keys: [sk-aaaa-0001]\n    limits: {requests_per_minute: -1}\n")
    settings = Settings(rules=rules, tenants_file=path)
    assert Settings.from_env(settings.to_env()).tenants_file == path
    with pytest.raises(TenantsError) as err:
        Runtime.from_settings(settings)
    assert f"{path}: tenants[0].limits.requests_per_minute: Input should be greater than 0" in str(err.value)
