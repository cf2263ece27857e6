"""The scraper against two simulated vLLM servers on real sockets: load, acceptance, faults, and the gateway wiring."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config.pool import Pool
from gateway.config.schema import Scrape
from gateway.config.settings import Settings
from gateway.fleet.pools import PoolState
from gateway.fleet.scraper import Scraper
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.app import create_app
from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, closed_port_url, rules_for

pytestmark = pytest.mark.integration

K = 4
A = 0.8
SPEC = f'{{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": {K}}}'
BATCH = 8  # --max-num-seqs: a burst larger than this queues
BURST = 32


def start(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "model": MODEL,
        "port": 0,
        "time_scale": 0.02,
        "output_lengths": OutputLengths(median=600, sigma=0),
        "max_num_seqs": BATCH,
        "seed": 3,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    spec = start(speculative_config=SPEC, fixed_acceptance=A)
    std = start()
    yield spec, std
    spec.stop()
    std.stop()


def pools(spec_url: str, std_url: str) -> list[PoolState]:
    specs = [
        {
            "name": "spec",
            "kind": "speculative",
            "speculative": {"method": "eagle3", "num_speculative_tokens": K},
            "models": [MODEL],
            "endpoints": [{"url": spec_url, "id": "spec-0"}],
        },
        {"name": "std", "kind": "standard", "models": [MODEL], "endpoints": [{"url": std_url, "id": "std-0"}]},
    ]
    return [PoolState.from_spec(Pool.model_validate(p)) for p in specs]


CONFIG = Scrape.model_validate({"interval_s": 0.5, "timeout_s": 0.5, "window_s": 30})


def scraper_for(spec_url: str, std_url: str) -> tuple[Scraper, GatewayMetrics]:
    metrics = GatewayMetrics()
    ps = pools(spec_url, std_url)
    return Scraper(lambda: ps, lambda: CONFIG, metrics), metrics


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def truncated_geometric_rate(a: float, k: int) -> float:
    """E[accepted] / k per draft round: position i survives with a^(i+1)."""
    return (a - a ** (k + 1)) / ((1 - a) * k)


async def burst(url: str, client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "temperature": 0}
    r = await client.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200


async def scrape_until(scraper: Scraper, check: Callable[[dict[str, PoolLoadView]], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        await scraper.scrape_all()
        if check(scraper.views()):
            return True
        await asyncio.sleep(0.02)
    return False


async def test_load_and_acceptance_follow_the_simulators(sims: tuple[SimServer, SimServer]) -> None:
    spec, std = sims
    scraper, metrics = scraper_for(spec.url, std.url)
    try:
        await scraper.scrape_all()  # the window's base, before any load
        views = scraper.views()
        assert (views["spec"].running, views["spec"].waiting) == (0, 0)
        assert views["spec"].acceptance is None  # no drafts yet: unknown, not 0
        assert math.isnan(samples(metrics)[("specgate_pool_acceptance_ratio", (("pool", "spec"),))])

        async with httpx.AsyncClient(timeout=30) as client:
            tasks = [asyncio.create_task(burst(u, client)) for u in (spec.url, std.url) for _ in range(BURST)]

            def loaded(v: dict[str, PoolLoadView]) -> bool:
                return all(v[p].running == BATCH and (v[p].waiting or 0) > 0 for p in ("spec", "std"))

            assert await scrape_until(scraper, loaded, timeout_s=5), scraper.views()
            got = samples(metrics)
            assert got[("specgate_pool_batch_size", (("pool", "std"),))] == BATCH
            assert got[("specgate_pool_queue_depth", (("pool", "std"),))] > 0
            await asyncio.gather(*tasks)

        def drained(v: dict[str, PoolLoadView]) -> bool:
            return all(v[p].running == 0 and v[p].waiting == 0 for p in ("spec", "std"))

        assert await scrape_until(scraper, drained, timeout_s=5), scraper.views()
        views = scraper.views()
        acc = views["spec"].acceptance
        assert acc is not None
        assert acc.drafts > 2000
        # Δaccepted / Δdraft_tokens under the truncated geometric is NOT a: 0.5904 for a = 0.8, K = 4.
        assert acc.rate == pytest.approx(truncated_geometric_rate(A, K), abs=0.02)
        assert acc.mean_length == pytest.approx((1 - A ** (K + 1)) / (1 - A), abs=0.08)
        assert acc.per_position == pytest.approx([A ** (i + 1) for i in range(K)], abs=0.03)
        assert views["std"].acceptance is None  # a standard pool has no acceptance
        assert views["std"].tpot_mean_s is not None
        assert views["std"].tpot_mean_s > 0
        got = samples(metrics)
        assert got[("specgate_pool_acceptance_ratio", (("pool", "spec"),))] == pytest.approx(acc.rate)
        assert math.isnan(got[("specgate_pool_acceptance_ratio", (("pool", "std"),))])
        assert got[("specgate_scrapes_total", (("pool", "spec"), ("result", "ok")))] == scraper.rounds
        assert scraper.loads["spec"].endpoints["spec-0"].health_ok is True
    finally:
        await scraper.close()


async def test_malformed_metrics_mark_the_endpoint_stale_then_fresh(sims: tuple[SimServer, SimServer]) -> None:
    spec, std = sims
    scraper, metrics = scraper_for(spec.url, std.url)
    stale_key = ("specgate_endpoint_scrape_stale", (("endpoint", "spec-0"), ("pool", "spec")))
    try:
        await scraper.scrape_all()
        assert not scraper.views()["spec"].stale
        assert samples(metrics)[stale_key] == 0

        for fault, result in (("malformed", "malformed"), ("missing", "bad_status")):
            spec.update_faults({"metrics": fault})
            await scraper.scrape_all()
            view = scraper.views()["spec"]
            assert view.stale
            assert (view.running, view.waiting, view.acceptance) == (None, None, None)
            got = samples(metrics)
            assert got[stale_key] == 1
            assert math.isnan(got[("specgate_pool_queue_depth", (("pool", "spec"),))])
            assert got[("specgate_scrapes_total", (("pool", "spec"), ("result", result)))] == 1
            assert not scraper.views()["std"].stale  # the other pool is unaffected

            spec.update_faults({"metrics": "ok"})
            await scraper.scrape_all()
            assert not scraper.views()["spec"].stale
            assert samples(metrics)[stale_key] == 0
    finally:
        spec.update_faults({"metrics": "ok"})
        await scraper.close()


async def test_an_unreachable_endpoint_is_stale_and_unhealthy(sims: tuple[SimServer, SimServer]) -> None:
    spec, _ = sims
    scraper, metrics = scraper_for(spec.url, closed_port_url())
    try:
        await scraper.scrape_all()
        assert scraper.views()["std"].stale
        assert not scraper.views()["spec"].stale
        load = scraper.loads["std"].endpoints["std-0"]
        assert load.last_result == "error"
        # /health is the health checker's to fetch (once per interval): the scrape shows its last result
        (ep,) = [e for p in scraper._pools() for e in p.endpoints if e.id == "std-0"]
        ep.healthy = False  # as the checker finds it
        await scraper.scrape_all()
        assert scraper.loads["std"].endpoints["std-0"].health_ok is False
        assert samples(metrics)[("specgate_scrapes_total", (("pool", "std"), ("result", "error")))] == 2
    finally:
        await scraper.close()


def test_the_gateway_runs_the_scraper(sims: tuple[SimServer, SimServer], tmp_path: Path) -> None:
    spec, std = sims
    rules = rules_for([spec.url], [std.url], scrape={"interval_s": 0.1, "timeout_s": 0.1, "window_s": 5})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    app = create_app(Settings(rules=path, host="127.0.0.1", port=8080))
    runtime = app.state.runtime
    server = ServerThread(app).start()
    try:
        deadline = time.monotonic() + 5
        while runtime.scraper.rounds < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(runtime.loads) == {"spec", "std"}
        assert not runtime.scraper.views()["spec"].stale
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
    finally:
        server.stop()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert values[("specgate_pool_queue_depth", (("pool", "spec"),))] == 0
    assert values[("specgate_endpoint_scrape_stale", (("endpoint", "std-0"), ("pool", "std")))] == 0
    assert values[("specgate_scrapes_total", (("pool", "std"), ("result", "ok")))] >= 2


async def test_a_scrape_round_fetches_metrics_and_never_health(fake: Callable[..., FakeUpstreamServer]) -> None:
    """``/health`` is the health checker's, fetched once per interval: the scraper does not fetch it again."""
    upstream = fake("both")
    scraper, _ = scraper_for(upstream.url, upstream.url)
    try:
        await scraper.scrape_all()
    finally:
        await scraper.close()
    async with httpx.AsyncClient(timeout=5) as client:
        paths = [r["path"] for r in (await client.get(f"{upstream.url}/_fake/requests")).json()]
    assert paths.count("/metrics") == 2  # one per endpoint
    assert "/health" not in paths
