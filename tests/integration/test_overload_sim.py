"""Two small simulated pools at about 3x their capacity, with a short first-token deadline: overload is answered
with back-pressure, never with ejections. Open-loop Poisson arrivals of streams for a few seconds, through the
gateway and then straight to the simulators (the same arrivals, alternating between them).

Goodput: answers whose first token reached the client within the deadline (the class's SLO). Straight to vLLM
the queue grows without bound and the first tokens come later and later; through the gateway admission control
keeps the queue short and answers the rest 503 with ``Retry-After`` at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.server import SimServer
from tests.conftest import MODEL, ServerThread, rules_for, started_sims

pytestmark = pytest.mark.integration

BATCH = 2  # --max-num-seqs of each simulated server
DEADLINE_S = 1.0  # the class's first-token deadline
LOAD_S = 20.0  # seconds of offered load, through the gateway and then straight to the simulators
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.9, "stream": True}


@pytest.fixture
def sims() -> Iterator[list[SimServer]]:
    yield from started_sims(2, time_scale=0.4, median=50, max_num_seqs=BATCH)


@dataclass
class Answer:
    status: int
    retry_after: bool
    ttft_s: float | None  # None: no first token (an error, or none in time)


async def one(session: aiohttp.ClientSession, url: str, give_up_s: float) -> Answer:
    start = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=BODY) as r:
            if r.status != 200:
                await r.read()
                return Answer(r.status, "retry-after" in r.headers, None)
            ttft = None
            async with asyncio.timeout(give_up_s):
                async for line in r.content:
                    if ttft is None and line.startswith(b"data: {") and b'"error"' not in line:
                        ttft = time.monotonic() - start
            return Answer(200, False, ttft)
    except TimeoutError:
        return Answer(200, False, None)


async def offer(urls: list[str], rate: float, seconds: float, give_up_s: float) -> list[Answer]:
    rng = random.Random(7)
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0, at, i = time.monotonic(), 0.0, 0
        while True:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one(session, urls[i % len(urls)], give_up_s)))
            i += 1
        return list(await asyncio.gather(*tasks))


def capacity(url: str) -> float:
    """Requests per second one simulated server completes with a full batch (measured, on this machine now)."""

    async def run() -> float:
        async with aiohttp.ClientSession() as session:
            t0 = time.monotonic()
            answers = await asyncio.gather(*(one(session, url, 30) for _ in range(BATCH * 3)))
            assert all(a.status == 200 for a in answers)
            return BATCH * 3 / (time.monotonic() - t0)

    return asyncio.run(run())


def good(answers: list[Answer]) -> int:
    return sum(1 for a in answers if a.status == 200 and a.ttft_s is not None and a.ttft_s <= DEADLINE_S)


def metric(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def test_three_times_capacity_is_back_pressure_not_ejections(sims: list[SimServer], gateway: Any) -> None:
    urls = [s.url for s in sims]
    rate = 3 * sum(capacity(u) for u in urls)
    rules = rules_for(
        [urls[0]],
        [urls[1]],
        scrape={"interval_s": 0.25, "timeout_s": 0.25, "window_s": 1.0},
    )
    for pool in rules["pools"]:
        pool["max_num_seqs"] = BATCH
        pool["timeouts"] = {"connect_s": 1, "first_byte_s": DEADLINE_S, "total_s": 30}
    rules["classes"] = [
        {"name": "default", "route": {"preferred": "std", "fallback": ["spec"], "ttft_deadline_s": DEADLINE_S}}
    ]
    gw: ServerThread = gateway(rules)
    through = asyncio.run(offer([gw.url], rate, LOAD_S, give_up_s=30))
    text = httpx.get(gw.url + "/metrics").text

    # Every answer is a 200 or a clean refusal with Retry-After; nothing was ejected or marked down.
    assert {a.status for a in through} <= {200, 429, 503, 504}
    assert all(a.retry_after for a in through if a.status != 200)
    assert sum(v for _, v in metric(text, "specgate_endpoint_ejections_total")) == 0
    assert all(v == 1 for _, v in metric(text, "specgate_endpoint_healthy"))
    assert sum(v for _, v in metric(text, "specgate_shed_total")) > 0  # the excess was shed
    refused = sum(1 for a in through if a.status != 200)

    # The same arrivals straight to the simulators, a client giving up after the deadline's worth of waiting x 3.
    direct = asyncio.run(offer(urls, rate, LOAD_S, give_up_s=3 * DEADLINE_S))
    print(
        f"offered {rate:.1f}/s for {LOAD_S:g}s: through the gateway {good(through)} good of {len(through)} "
        f"({refused} refused with Retry-After); straight {good(direct)} good of {len(direct)}"
    )
    assert good(through) >= good(direct)
