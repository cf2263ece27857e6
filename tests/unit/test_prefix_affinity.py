"""Prefix affinity inside a pool: the chunk hashes of a prompt, one endpoint's index (bounded, LRU, longest prefix),
the load-bounded warm pick, the prompt rendering, the scraped cache size and hit counters, the YAML block."""

from __future__ import annotations

import io
import random
from typing import Any

import orjson
import pydantic
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from gateway.cli.render import render
from gateway.config.affinity import PrefixAffinity
from gateway.config.pool import Pool
from gateway.config.schema import MetricNames, RoutingRules, Scrape
from gateway.fleet.affinity import assess, load_bound, warm_pick
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.prefix_index import (
    CHUNK_CHARS,
    MAX_PROMPT_CHUNKS,
    MIN_SCALE,
    TOKENS_PER_CHUNK,
    PrefixIndex,
    chain_hashes,
)
from gateway.fleet.scraper import Scraper
from gateway.fleet.vllm_exposition import parse_vllm_metrics
from gateway.fleet.vllm_metrics import EndpointLoad
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.record import RequestRecord
from gateway.proxy.stream_tap import StreamTap, cached_tokens_of
from gateway.routing.prompt_key import prompt_chunks, render_prompt
from tests.conftest import MODEL, rules_for

NAMES = MetricNames()


def text(seed: int, n_chunks: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij ") for _ in range(n_chunks * CHUNK_CHARS))


# --- chunk hashes -------------------------------------------------------------------------------------------


def test_an_extended_prompt_shares_the_chunks_of_the_one_it_extends() -> None:
    base = text(1, 10)
    longer = base + text(2, 5)
    assert chain_hashes(longer)[:10] == chain_hashes(base)
    assert len(chain_hashes(longer)) == 15
    assert len(chain_hashes(base + "x" * (CHUNK_CHARS - 1))) == 10  # only whole chunks count


def test_a_difference_anywhere_changes_every_chunk_from_there_on() -> None:
    a = text(1, 10)
    b = a[: 3 * CHUNK_CHARS + 5] + ("Z" if a[3 * CHUNK_CHARS + 5] != "Z" else "Y") + a[3 * CHUNK_CHARS + 6 :]
    ha, hb = chain_hashes(a), chain_hashes(b)
    assert ha[:3] == hb[:3]
    assert all(x != y for x, y in zip(ha[3:], hb[3:], strict=True))


def test_only_the_head_of_a_huge_prompt_is_hashed() -> None:
    assert len(chain_hashes("a" * (MAX_PROMPT_CHUNKS + 10) * CHUNK_CHARS)) == MAX_PROMPT_CHUNKS


# --- the index ----------------------------------------------------------------------------------------------


def test_match_is_the_longest_warm_prefix() -> None:
    idx = PrefixIndex(1000)
    first = chain_hashes(text(1, 20))
    assert idx.record(first) == 0
    assert idx.match(first) == 20
    follow_up = chain_hashes(text(1, 20) + text(3, 8))
    assert idx.match(follow_up) == 20
    assert idx.record(follow_up) == 20  # the predicted hit of the next turn
    assert idx.match(chain_hashes(text(9, 20))) == 0
    assert idx.predicted_chunks == 20


def test_eviction_is_least_recently_used_and_eats_prefixes_from_their_end() -> None:
    idx = PrefixIndex(30)
    a, b = chain_hashes(text(1, 20)), chain_hashes(text(2, 20))
    idx.record(a)
    idx.record(b)  # 40 chunks into 30: a's last 10 go first
    assert len(idx) == 30
    assert idx.match(b) == 20
    assert idx.match(a) == 10
    idx.record(a)  # a is recent again: b loses its tail
    assert (idx.match(a), idx.match(b)) == (20, 10)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 60),
    prompts=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 30)), min_size=1, max_size=40),
)
def test_bounded_and_match_agrees_with_a_plain_scan(capacity: int, prompts: list[tuple[int, int]]) -> None:
    """Whatever is recorded: never more than the capacity, and the binary search finds exactly the leading chunks
    present (the present chunks of any prompt are always a prefix of it)."""
    idx = PrefixIndex(capacity)
    seen: list[tuple[int, ...]] = []
    for family, n in prompts:
        chunks = chain_hashes(text(family, 30))[:n]  # prompts of one family extend each other
        idx.record(chunks)
        seen.append(chunks)
        assert len(idx) <= capacity
        for s in seen:
            scan = 0
            while scan < len(s) and s[scan] in idx._chunks:
                scan += 1
            assert idx.match(s) == scan
            assert all(h not in idx._chunks for h in s[scan:])


def test_capacity_from_the_scrape_within_the_ceiling_and_the_measured_correction() -> None:
    idx = PrefixIndex(100, max_chunks=500)
    idx.record(chain_hashes(text(1, 90)))
    idx.set_capacity(50)
    assert (len(idx), idx.source) == (50, "scraped")
    idx.set_capacity(10_000)
    assert idx.capacity == 500
    idx.configure(default_chunks=20, max_chunks=400)  # a reload: the scraped size stays, the new ceiling applies
    assert idx.capacity == 400
    # The server hit far less than predicted: the index shrinks (never below MIN_SCALE), then grows back.
    idx.configure(default_chunks=20, max_chunks=4000)
    idx.set_capacity(4000)
    warm = chain_hashes(text(1, 400))  # 6,400 tokens a request: enough to judge at every scrape
    idx.record(warm)
    for _ in range(20):
        idx.record(warm)
        idx.observe_hits(0.0)
    assert idx.scale == MIN_SCALE
    assert len(idx) <= 4000 * MIN_SCALE
    for _ in range(20):
        idx.record(warm)
        idx.observe_hits(idx._since_scrape * TOKENS_PER_CHUNK)
    assert idx.scale == 1.0
    idx.observe_hits(0.0)  # too few predicted tokens since the last scrape to judge: nothing changes
    assert idx.scale == 1.0
    idx.clear()
    assert len(idx) == 0


# --- the pick -----------------------------------------------------------------------------------------------


def endpoints(n: int) -> list[EndpointState]:
    return [EndpointState(f"e{i}", f"http://e{i}", "p", 1.0) for i in range(n)]


CFG = PrefixAffinity(min_prefix_tokens=64, load_slack=0.25, load_margin=2.0)


def test_the_longest_warm_prefix_wins_and_a_short_one_does_not_count() -> None:
    eps = endpoints(3)
    convo = chain_hashes(text(1, 40))
    eps[0].prefixes.record(convo[:10])
    eps[1].prefixes.record(convo[:30])
    eps[2].prefixes.record(convo[:3])  # 48 tokens < min_prefix_tokens
    assert warm_pick(eps, convo, CFG) is eps[1]
    eps[1].in_flight = 3  # over the bound: the idlest has 0, x 1.25 + 2 = 2
    assert warm_pick(eps, convo, CFG) is eps[0]
    eps[0].in_flight, eps[2].in_flight = 3, 6  # the idlest now has 3: x 1.25 + 2 = 5.75, both warm ones within
    assert warm_pick(eps, convo, CFG) is eps[1]
    assert warm_pick(eps, convo[:3], CFG) is None  # the prompt itself is too short to count
    rows, chosen, why = assess(eps, convo, CFG)
    assert (chosen, why) == ("e1", "warm")
    assert [r.warm_tokens for r in rows] == [160, 480, 48]
    assert [r.counted for r in rows] == [True, True, False]


def test_equal_prefixes_go_to_the_less_loaded_and_a_cold_prompt_to_power_of_two() -> None:
    eps = endpoints(2)
    shared = chain_hashes(text(1, 20))
    for e in eps:
        e.prefixes.record(shared)
    eps[0].in_flight = 2
    assert warm_pick(eps, shared, CFG) is eps[1]
    assert warm_pick(eps, chain_hashes(text(5, 20)), CFG) is None
    assert assess(eps, chain_hashes(text(5, 20)), CFG)[1:] == (None, "cold")


def test_pool_pick_follows_affinity_only_when_enabled() -> None:
    def pool(enabled: bool) -> PoolState:
        spec = Pool.model_validate(
            {"name": "p", "kind": "standard", "models": ["m"], "endpoints": [{"url": f"http://e{i}"} for i in range(4)]}
        )
        return PoolState.from_spec(spec, PrefixAffinity(enabled=enabled, min_prefix_tokens=64))

    convo = chain_hashes(text(1, 20))
    on, off = pool(True), pool(False)
    for p in (on, off):
        p.endpoints[3].prefixes.record(convo)
    rng = random.Random(0)
    assert {on.pick(rng, prompt=convo).id for _ in range(30)} == {"e3:80"}  # type: ignore[union-attr]
    assert len({off.pick(rng, prompt=convo).id for _ in range(30)}) > 1  # type: ignore[union-attr]
    assert on.pick(rng, exclude=["e3:80"], prompt=convo).id != "e3:80"  # type: ignore[union-attr]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_a_shared_prefix_makes_no_hot_server(n: int) -> None:
    """Many concurrent requests sharing one long system prompt, each recorded where it went (as the proxy does),
    some finishing at random: no endpoint's load goes past the bound (plus the few a cold fallback pick may add),
    and every endpoint takes a share."""
    rng = random.Random(n)
    spec = Pool.model_validate(
        {"name": "p", "kind": "standard", "models": ["m"], "endpoints": [{"url": f"http://e{i}"} for i in range(n)]}
    )
    pool = PoolState.from_spec(spec, CFG)
    system = text(42, 40)
    running: list[EndpointState] = []
    for i in range(40 * n):
        prompt = chain_hashes(system + text(1000 + i, 4))
        ep = pool.pick(rng, prompt=prompt)
        assert ep is not None
        before = [e.in_flight for e in pool.endpoints]
        assert ep.in_flight <= load_bound(before, CFG) + 2
        ep.in_flight += 1
        ep.prefixes.record(prompt)
        running.append(ep)
        if rng.random() < 0.3:  # one finishes now and then: the loads keep moving
            running.pop(rng.randrange(len(running))).in_flight -= 1
    assert all(e.in_flight > 0 for e in pool.endpoints)


# --- the prompt rendering -----------------------------------------------------------------------------------


SYSTEM = "You are a careful assistant. " * 20


def chat(*turns: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": r, "content": c} for r, c in turns], **extra}


def test_the_next_turn_of_a_chat_extends_the_rendering_of_the_last() -> None:
    t1 = chat(("system", SYSTEM), ("user", "Write a poem about the sea " * 5))
    t2 = chat(*[(m["role"], m["content"]) for m in t1["messages"]], ("assistant", "Waves " * 40), ("user", "More"))
    r1, r2 = render_prompt("chat", t1), render_prompt("chat", t2)
    assert r2.startswith(r1)
    k1, k2 = prompt_chunks("chat", t1), prompt_chunks("chat", t2)
    assert k2[: len(k1)] == k1
    assert render_prompt("chat", {**t1, "model": "other"}) != r1  # another model: another cache
    with_tools = render_prompt("chat", {**t1, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert not with_tools.startswith(r1)  # the tools come first, as a template puts them


def test_parts_tool_calls_completions_and_responses_render_without_raising() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 10_000}}
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, image]},
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            "garbage",
        ],
    }
    rendered = render_prompt("chat", body)
    assert "look" in rendered
    assert "c1" in rendered
    assert "AAAA" not in rendered
    assert render_prompt("completions", {"model": MODEL, "prompt": ["one prompt"]}).endswith("one prompt")
    assert render_prompt("completions", {"model": MODEL, "prompt": ["a", "b"]}) == ""  # a batch: no key
    assert render_prompt("completions", {"model": MODEL, "prompt": [1, 2, 3]}) == ""
    r1 = render_prompt("responses", {"model": MODEL, "instructions": SYSTEM, "input": "hello"})
    items = [
        {"role": "user", "content": "hello"},
        {"type": "function_call", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "output": "ok"},
    ]
    r2 = render_prompt("responses", {"model": MODEL, "instructions": SYSTEM, "input": items})
    assert r2.startswith(r1)
    assert render_prompt("responses", {"model": MODEL, "input": 5}) == MODEL


# --- scraped numbers and the YAML ---------------------------------------------------------------------------


def test_cache_size_and_hit_counters_are_read_from_the_exposition() -> None:
    text_ = "\n".join(
        [
            "vllm:num_requests_running 1",
            "vllm:num_requests_waiting 0",
            "# TYPE vllm:prefix_cache_queries counter",
            'vllm:prefix_cache_queries_total{engine="0"} 1000',
            "# TYPE vllm:prefix_cache_hits counter",
            'vllm:prefix_cache_hits_total{engine="0"} 400',
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",enable_prefix_caching="True"} 1',
            "",
        ]
    )
    s = parse_vllm_metrics(text_, NAMES)
    assert (s.prefix_queries, s.prefix_hits, s.cache_tokens) == (1000, 400, 32768)
    bad = text_.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="lots"')
    assert parse_vllm_metrics(bad, NAMES).cache_tokens is None
    load = EndpointLoad("p", "e", "http://e", window_s=60)
    load.record(s, 0.0)
    later = parse_vllm_metrics(text_.replace(" 1000", " 1500").replace(" 400", " 800"), NAMES)
    load.record(later, 2.0)
    d = load.deltas(2.0)
    assert d is not None
    assert d.prefix_hit_ratio == pytest.approx(0.8)


def test_the_yaml_block_globally_and_per_pool() -> None:
    rules = rules_for(["http://s0"], ["http://t0", "http://t1"])
    assert RoutingRules.model_validate(rules).affinity_of(RoutingRules.model_validate(rules).pools[0]).enabled
    rules["defaults"]["prefix_affinity"] = {"min_prefix_tokens": 512, "load_slack": 0.5}
    rules["pools"][1]["prefix_affinity"] = {"enabled": False}
    parsed = RoutingRules.model_validate(rules)
    spec, std = parsed.pools
    assert parsed.affinity_of(spec).min_prefix_tokens == 512
    assert parsed.affinity_of(std).enabled is False
    for bad in ({"min_prefix_tokens": 1}, {"load_slack": -1}, {"bogus": 1}, {"max_index_tokens": 1 << 40}):
        rules["pools"][1]["prefix_affinity"] = bad
        with pytest.raises(pydantic.ValidationError):
            RoutingRules.model_validate(rules)


# --- visible: the access log's cached tokens -----------------------------------------------------------------


def test_cached_tokens_reach_the_access_log_from_a_body_and_from_a_stream() -> None:
    body = b'{"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens":768},"completion_tokens":5}}'
    assert cached_tokens_of(body) == 768
    assert cached_tokens_of(b'{"usage":{"input_tokens_details": {"cached_tokens": 32}}}') == 32  # Responses API
    assert cached_tokens_of(b'{"usage":{"prompt_tokens":9}}') is None
    tap = StreamTap(strip=True)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens":512}}}\n\n'
    out = tap.feed([b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', usage, b"data: [DONE]\n\n"])
    assert usage not in out
    assert tap.cached_tokens == 512
    stream = io.BytesIO()
    log = AccessLog(stream)
    rec = RequestRecord("r1", "/v1/chat/completions")
    rec.cached_tokens = tap.cached_tokens
    rec.finish("ok", GatewayMetrics(), log)
    log.flush()
    assert orjson.loads(stream.getvalue())["cached_tokens"] == 512


# --- the scraper sizes, corrects and clears the indexes ------------------------------------------------------


def exposition(queries: int, hits: int, blocks: int, created: float = 1.0) -> str:
    return "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            "vllm:num_requests_running 0",
            "# TYPE vllm:num_requests_waiting gauge",
            "vllm:num_requests_waiting 0",
            "# TYPE vllm:generation_tokens counter",
            "vllm:generation_tokens_total 10",
            f"vllm:generation_tokens_created {created}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total {queries}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total {hits}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1',
            "",
        ]
    )


async def test_the_scrape_sizes_the_index_exports_the_hit_rate_and_a_restart_empties_it() -> None:
    body = {"text": exposition(0, 0, 100)}

    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(text=body["text"])

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    spec = Pool.model_validate(
        {
            "name": "p",
            "kind": "standard",
            "models": ["m"],
            "endpoints": [{"url": f"http://127.0.0.1:{port}", "id": "e"}],
        }
    )
    pool = PoolState.from_spec(spec, PrefixAffinity())
    ep = pool.endpoints[0]
    metrics = GatewayMetrics()
    scraper = Scraper(lambda: [pool], lambda: Scrape.model_validate({"interval_s": 1, "timeout_s": 1}), metrics)
    try:
        await scraper.scrape_all()
        assert (ep.prefixes.capacity, ep.prefixes.source) == (100, "scraped")  # 100 blocks x 16 tokens / 16
        ep.prefixes.record(chain_hashes(text(1, 80)))
        body["text"] = exposition(1000, 250, 100)
        await scraper.scrape_all()
        assert 'specgate_prefix_measured_hit_ratio{endpoint="e",pool="p"} 0.25' in metrics.render().decode()
        assert 'specgate_prefix_index_chunks{endpoint="e",pool="p"} 80.0' in metrics.render().decode()
        body["text"] = exposition(10, 0, 100, created=2.0)  # the server restarted: its cache is empty
        await scraper.scrape_all()
        assert len(ep.prefixes) == 0
    finally:
        await scraper.close()
        await runner.cleanup()


def test_specgate_explain_prints_each_endpoints_warm_prefix_and_the_verdict() -> None:
    def row(ep: str, warm: int, load: float, *, counted: bool = True, over: bool = False) -> dict[str, Any]:
        return {
            "endpoint": ep,
            "warm_tokens": warm,
            "counted": counted,
            "load": load,
            "over_bound": over,
            "index_chunks": 10,
            "index_capacity": 100,
            "capacity_source": "scraped",
        }

    pools = {
        "std": {"endpoints": [row("std-0", 1024, 1.0), row("std-1", 0, 0.0, counted=False)], "pick": "std-0"},
        "spec": {"endpoints": [row("spec-0", 512, 9.0, over=True), row("spec-1", 0, 0.0)], "pick": None},
    }
    pools["spec"]["why"] = "over_bound"
    data = {"plan": {"steps": []}, "prefix_affinity": {"prompt_tokens": 1040, "pools": pools}, "config": {}}
    console = Console(width=100, record=True, color_system=None)
    render(data, console)
    words = [line.split() for line in console.export_text().splitlines()]
    assert ["std", "std-0", "1024", "1.0", "10/100", "picked:", "warm"] in words
    assert ["spec", "spec-0", "512", "9.0", "10/100", "over", "the", "load", "bound"] in words
    assert ["spec", "warm", "ones", "too", "busy:", "least", "loaded"] in words
