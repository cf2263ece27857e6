"""gateway.fleet.vllm_metrics: parsing vLLM's exposition, endpoint windows (resets, staleness), pool aggregation; the
schema."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

from gateway.config.pool import Pool
from gateway.config.schema import MetricNames, Scrape
from gateway.fleet.pools import PoolState
from gateway.fleet.scraper import Scraper
from gateway.fleet.vllm_exposition import MetricsFormatError, VllmSample, parse_vllm_metrics, parse_vllm_metrics_bytes
from gateway.fleet.vllm_metrics import EndpointLoad, PoolLoad
from gateway.observability.metrics import GatewayMetrics
from gateway.sim.faults import MALFORMED_METRICS
from gateway.sim.metrics import VllmMetrics
from tests.conftest import closed_port_url

NAMES = MetricNames()


def sim_exposition() -> str:
    m = VllmMetrics("meta-llama/Llama-3.3-70B-Instruct", speculative=3)
    m.set_scheduler(running=5, waiting=2, kv_usage=0.42)
    m.observe_spec(drafts=10, draft_tokens=30, accepted=18, per_pos=[8, 6, 4])
    m.observe_spec(drafts=2, draft_tokens=6, accepted=1, per_pos=[1, 0, 0])
    m.generation_tokens.inc(120)
    for decode, tokens in ((1.0, 41), (3.0, 101)):
        m.observe_finished(
            "stop",
            e2e=decode + 0.5,
            queued=0.1,
            prefill=0.4,
            decode=decode,
            inference=decode + 0.4,
            prompt_tokens=100,
            generation_tokens=tokens,
            max_tokens=None,
        )
    return m.render().decode()


def test_parse_the_simulators_exposition() -> None:
    text = sim_exposition()
    s = parse_vllm_metrics(text, NAMES)
    assert (s.running, s.waiting, s.kv_usage) == (5, 2, pytest.approx(0.42))
    assert (s.drafts, s.draft_tokens, s.accepted) == (12, 36, 19)
    assert s.accepted_per_pos == (9, 6, 4)
    assert s.generation_tokens == 120
    assert s.tpot_count == 2
    assert s.tpot_sum == pytest.approx(1.0 / 40 + 3.0 / 100)
    assert (s.out_sum, s.out_count) == (41 + 101, 2)  # the per-request histogram of generated tokens
    assert s.created is not None  # the _created gauge of generation_tokens
    assert parse_vllm_metrics_bytes(text.encode(), NAMES) == s


def test_a_standard_server_has_no_spec_counters() -> None:
    m = VllmMetrics("m")
    s = parse_vllm_metrics(m.render().decode(), NAMES)
    assert (s.drafts, s.draft_tokens, s.accepted, s.accepted_per_pos) == (None, None, None, ())
    assert (s.running, s.waiting, s.generation_tokens) == (0, 0, 0)


# Two engines and two models, an older vLLM's names (gpu_cache_usage_perc, time_per_output_token_seconds),
# counters without "# TYPE" lines (the parser then names the family after the sample, `_total` included).
OLD_VLLM = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 3.0
vllm:num_requests_running{engine="1",model_name="a"} 4.0
vllm:num_requests_running{engine="0",model_name="b"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a"} 0.0
vllm:num_requests_waiting{engine="1",model_name="a"} 6.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:gpu_cache_usage_perc{engine="1",model_name="a"} 0.75
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.99
vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 100.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="a"} 50.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="a"} 500.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="a"} 250.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a"} 300.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="a"} 120.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="0"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="a",position="0"} 40.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="2"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="junk"} 1000.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="a"} 4.0
vllm:time_per_output_token_seconds_count{engine="0",model_name="a"} 4.0
vllm:time_per_output_token_seconds_sum{engine="0",model_name="a"} 0.2
vllm:time_per_output_token_seconds_count{engine="1",model_name="a"} 1.0
vllm:time_per_output_token_seconds_sum{engine="1",model_name="a"} 0.05
"""


def test_two_engines_and_an_old_name_set_through_the_mapping() -> None:
    names = MetricNames.model_validate(
        {
            "kv_usage": "vllm:gpu_cache_usage_perc",
            "drafts": "vllm:spec_decode_num_drafts_total",  # written with _total: the sample's spelling
            "accepted": "vllm:spec_decode_num_accepted_tokens",  # without: the family's spelling
            "tpot": "vllm:time_per_output_token_seconds",
        }
    )
    s = parse_vllm_metrics(OLD_VLLM, names)
    assert (s.running, s.waiting) == (8, 6)  # summed over engines and models
    assert s.kv_usage == 0.75  # the max over engines, and the configured name only
    assert (s.drafts, s.draft_tokens, s.accepted) == (150, 750, 420)
    assert s.accepted_per_pos == (130, 0, 10)  # a missing position is 0; a bad label is ignored
    assert (s.tpot_sum, s.tpot_count) == (pytest.approx(0.25), 5)
    assert s.generation_tokens is None
    # With the default names the old KV gauge is not read, the new one is.
    assert parse_vllm_metrics(OLD_VLLM, NAMES).kv_usage == 0.99


@pytest.mark.parametrize(
    "body",
    [MALFORMED_METRICS, b"", b"<html><body>Bad gateway</body></html>", b"\xff\xfe not utf-8"],
    ids=["malformed", "empty", "html", "binary"],
)
def test_unreadable_metrics_raise(body: bytes) -> None:
    with pytest.raises(MetricsFormatError):
        parse_vllm_metrics_bytes(body, NAMES)


# --------------------------------------------------------------------------------------------------------------
# Endpoint windows


def sample(
    drafts: float = 0,
    draft_tokens: float = 0,
    accepted: float = 0,
    per_pos: tuple[float, ...] = (),
    *,
    running: float = 1,
    waiting: float = 0,
    tpot: tuple[float, float] = (0.0, 0.0),
    gen: float = 0,
    out: tuple[float, float] = (0.0, 0.0),
    created: float | None = None,
    spec: bool = True,
) -> VllmSample:
    return VllmSample(
        running=running,
        waiting=waiting,
        kv_usage=0.5,
        drafts=drafts if spec else None,
        draft_tokens=draft_tokens if spec else None,
        accepted=accepted if spec else None,
        accepted_per_pos=per_pos,
        generation_tokens=gen,
        tpot_sum=tpot[0],
        tpot_count=tpot[1],
        out_sum=out[0],
        out_count=out[1],
        created=created,
    )


def endpoint(**kw: Any) -> EndpointLoad:
    kw.setdefault("stale_after_s", 6.0)
    kw.setdefault("window_s", 10.0)
    return EndpointLoad("spec", "spec-0", "http://x:1", **kw)


def test_acceptance_from_counter_deltas_over_the_window() -> None:
    ep = endpoint()
    ep.record(sample(1000, 4000, 3000, (900, 800, 700, 600), tpot=(10.0, 100), gen=5000, out=(9000, 90)), now=0.0)
    assert ep.acceptance(0.0) is None  # one snapshot: no window yet
    ep.record(sample(1100, 4400, 3200, (990, 860, 750, 600), tpot=(12.0, 120), gen=5300, out=(12000, 110)), now=2.0)
    acc = ep.acceptance(2.0)
    assert acc is not None
    assert acc.rate == pytest.approx(200 / 400)
    assert acc.mean_length == pytest.approx(1 + 200 / 100)
    assert acc.per_position == pytest.approx((0.9, 0.6, 0.5, 0.0))
    assert acc.drafts == 100
    assert ep.tpot_mean_s(2.0) == pytest.approx(2.0 / 20)
    d = ep.deltas(2.0)
    assert d is not None
    assert d.generation_tokens_per_s == pytest.approx(300 / 2)
    assert d.output_tokens_mean == pytest.approx(3000 / 20)  # 20 requests finished with 3000 tokens between them

    # The window slides: the base is the last snapshot at or before now - window_s.
    for t in (4.0, 6.0, 8.0, 10.0, 12.0):
        ep.record(
            sample(
                1100 + 100 * t,
                4400 + 400 * t,
                3200 + 300 * t,
                (990, 860, 750, 600),
                tpot=(12.0, 120),
                gen=5300,
                out=(12000, 110),
            ),
            now=t,
        )
    assert ep.resets == 0
    acc = ep.acceptance(12.0)
    assert acc is not None
    assert acc.drafts == pytest.approx(100 * 12)  # 12 - 10 = 2: the base is the t=2 snapshot
    assert acc.rate == pytest.approx(0.75)


def test_no_drafts_means_no_acceptance_never_zero() -> None:
    std = endpoint()
    std.record(sample(spec=False), now=0.0)
    std.record(sample(spec=False, tpot=(1.0, 10)), now=2.0)
    assert std.acceptance(2.0) is None
    assert std.tpot_mean_s(2.0) == pytest.approx(0.1)

    idle = endpoint()
    idle.record(sample(100, 400, 300), now=0.0)
    idle.record(sample(100, 400, 300), now=2.0)
    assert idle.acceptance(2.0) is None
    assert idle.tpot_mean_s(2.0) is None
    d = idle.deltas(2.0)
    assert d is None or d.output_tokens_mean is None  # nothing finished: unknown, never 0
    few = endpoint()
    few.record(sample(spec=False, out=(100, 1)), now=0.0)
    few.record(sample(spec=False, out=(600, 3)), now=2.0)  # two finished in the window: too few for a mean
    d = few.deltas(2.0)
    assert d is not None
    assert d.output_tokens_mean is None


def test_a_counter_reset_starts_a_new_baseline() -> None:
    ep = endpoint()
    ep.record(sample(5000, 20000, 15000, (4000,)), now=0.0)
    ep.record(sample(5100, 20400, 15300, (4090,)), now=2.0)
    assert ep.record(sample(30, 120, 60, (25,)), now=4.0) is True  # restarted
    assert ep.resets == 1
    assert ep.acceptance(4.0) is None  # one snapshot since the restart
    ep.record(sample(130, 520, 160, (100,)), now=6.0)
    acc = ep.acceptance(6.0)
    assert acc is not None
    assert acc.rate == pytest.approx(100 / 400)
    assert acc.mean_length == pytest.approx(2.0)


def test_a_restart_that_overtook_the_old_counters_is_seen_by_created() -> None:
    ep = endpoint()
    ep.record(sample(10, 40, 30, created=1000.0), now=0.0)
    assert ep.record(sample(500, 2000, 100, created=1050.0), now=2.0) is True
    assert ep.acceptance(2.0) is None
    # One per-position counter going down is a reset as well.
    ep.record(sample(600, 2400, 200, (50, 20), created=1050.0), now=4.0)
    assert ep.record(sample(700, 2800, 300, (60, 10), created=1050.0), now=6.0) is True


def test_stale_on_failure_and_on_age() -> None:
    ep = endpoint(stale_after_s=6.0)
    assert ep.stale(0.0)  # never scraped
    assert ep.gauges(0.0) is None
    ep.record(sample(100, 400, 300, running=7, waiting=3), now=0.0)
    ep.record(sample(200, 800, 500, running=7, waiting=3), now=2.0)
    g = ep.gauges(3.0)
    assert g is not None
    assert (g.running, g.waiting, g.kv_usage, g.age_s) == (7, 3, 0.5, 1.0)

    assert not ep.stale(8.0)
    assert ep.stale(8.1)  # older than stale_after_s
    assert ep.gauges(8.1) is None
    assert ep.acceptance(8.1) is None

    ep.record_failure("timeout", "/metrics timed out after 1.0s")
    assert ep.stale(2.5)  # a failed scrape is stale at once
    assert ep.gauges(2.5) is None
    assert ep.acceptance(2.5) is None
    assert ep.last_result == "timeout"

    ep.record(sample(300, 1200, 700, running=1, waiting=0), now=10.0)  # fresh again; the window was kept
    assert not ep.stale(10.0)
    acc = ep.acceptance(10.0)
    assert acc is not None
    assert acc.rate == pytest.approx(400 / 800)  # base: the t=0 snapshot (the last at or before 10 - 10)


def test_in_flight_moves_the_scraped_numbers_between_scrapes() -> None:
    ep = endpoint()
    ep.record(sample(running=4, waiting=2), now=0.0, in_flight=6)
    g = ep.gauges(1.0, in_flight=9)
    assert g is not None
    assert (g.running, g.waiting) == (4, 5)  # new requests queue
    g = ep.gauges(1.0, in_flight=3)
    assert g is not None
    assert (g.running, g.waiting) == (3, 0)  # finished ones free a slot for a waiting one first
    g = ep.gauges(1.0, in_flight=0)
    assert g is not None
    assert (g.running, g.waiting) == (0, 0)  # never below 0


def test_pool_acceptance_is_pooled_from_deltas_and_stale_only_without_fresh_endpoints() -> None:
    a, b = endpoint(), EndpointLoad("spec", "spec-1", "http://y:1", stale_after_s=6.0, window_s=10.0)
    pool = PoolLoad("spec", {"spec-0": a, "spec-1": b})
    assert pool.view(0.0).stale
    assert pool.view(0.0).running is None
    assert pool.view(0.0).acceptance is None

    a.record(sample(0, 0, 0, running=2, waiting=1), now=0.0)
    a.record(sample(100, 400, 360, running=3, waiting=1), now=2.0)  # 0.9 on 400 draft tokens
    b.record(sample(0, 0, 0, running=5, waiting=4), now=0.0)
    b.record(sample(1000, 4000, 2000, running=6, waiting=5), now=2.0)  # 0.5 on 4000
    v = pool.view(2.0)
    assert not v.stale
    assert (v.fresh_endpoints, v.endpoints) == (2, 2)
    assert (v.running, v.waiting, v.kv_usage) == (9, 6, 0.5)
    assert v.acceptance is not None
    assert v.acceptance.rate == pytest.approx(2360 / 4400)  # not the mean of 0.9 and 0.5
    assert v.acceptance.mean_length == pytest.approx(1 + 2360 / 1100)

    b.record_failure("error", "connection refused")
    v = pool.view(2.0)
    assert (v.fresh_endpoints, v.running, v.waiting) == (1, 3, 1)
    assert v.acceptance is not None
    assert v.acceptance.rate == pytest.approx(0.9)
    a.record_failure("malformed", "garbage")
    v = pool.view(2.0)
    assert v.stale
    assert (v.running, v.waiting, v.acceptance) == (None, None, None)


# --------------------------------------------------------------------------------------------------------------
# Schema and the loop's resilience


def test_scrape_schema_defaults_and_checks() -> None:
    s = Scrape()
    assert (s.interval_s, s.timeout_s, s.window_s, s.stale_after) == (2.0, 1.0, 60.0, 6.0)
    assert Scrape.model_validate({"interval_s": 5, "stale_after_s": 20}).stale_after == 20.0
    assert s.metric_names.drafts == "vllm:spec_decode_num_drafts"
    for bad in (
        {"timeout_s": 3},  # longer than the interval
        {"stale_after_s": 2},  # not longer than the interval
        {"window_s": 3},  # less than two scrapes
        {"interval": 2},  # unknown field
        {"metric_names": {"running": "not a metric name"}},
        {"metric_names": {"gpu_cache": "vllm:gpu_cache_usage_perc"}},
        {"interval_s": "2"},  # strict: no strings for numbers
    ):
        with pytest.raises(pydantic.ValidationError):
            Scrape.model_validate(bad)


async def test_a_failing_round_does_not_stop_the_loop() -> None:
    calls = 0

    def pools() -> list[Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return []

    scraper = Scraper(pools, lambda: Scrape.model_validate({"interval_s": 0.01, "timeout_s": 0.01}))
    task = asyncio.create_task(scraper.run())
    try:
        for _ in range(200):
            if scraper.rounds >= 2:
                break
            await asyncio.sleep(0.005)
        assert scraper.rounds >= 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await scraper.close()
    assert scraper.views() == {}


async def test_series_of_pools_gone_after_a_reload_are_removed() -> None:
    def pool(name: str, *urls: str) -> PoolState:
        eps = [{"url": u, "id": f"{name}-{i}"} for i, u in enumerate(urls)]
        return PoolState.from_spec(
            Pool.model_validate({"name": name, "kind": "standard", "models": ["m"], "endpoints": eps})
        )

    closed = [closed_port_url() for _ in range(3)]
    current = [pool("a", closed[0], closed[1]), pool("b", closed[2])]
    metrics = GatewayMetrics()
    scraper = Scraper(lambda: current, lambda: Scrape.model_validate({"interval_s": 0.05, "timeout_s": 0.05}), metrics)
    try:
        await scraper.scrape_all()  # nothing listens there: every endpoint is stale
        text = metrics.render().decode()
        assert 'specgate_endpoint_scrape_stale{endpoint="a-1",pool="a"} 1.0' in text
        assert 'specgate_pool_queue_depth{pool="b"} NaN' in text
        current = [pool("a", closed[0])]
        await scraper.scrape_all()
        text = metrics.render().decode()
        assert 'endpoint="a-1"' not in text
        assert 'specgate_pool_queue_depth{pool="b"}' not in text
        assert 'specgate_endpoint_scrape_stale{endpoint="a-0",pool="a"} 1.0' in text
        assert set(scraper.loads) == {"a"}
    finally:
        await scraper.close()


def test_new_requests_join_the_batch_while_the_server_had_no_queue() -> None:
    ep = endpoint()
    ep.record(sample(running=1, waiting=0), now=0.0, in_flight=1)
    g = ep.gauges(0.5, in_flight=2)  # one more request since the scrape: it runs, it does not queue
    assert g is not None
    assert (g.running, g.waiting) == (2, 0)
