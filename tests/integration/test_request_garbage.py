"""A finished request leaves nothing for the cyclic garbage collector: its exchange, its upstream connection and its
Idempotency-Key claim are freed by reference counting as soon as it ends.

Under many concurrent streams a request that ends inside a reference cycle (an exception's traceback holding the
attempt loop's frame, a cancelled watcher task holding the exchange, an HTTP parser holding its connection's
callbacks) waits for a full collection, and the gateway's memory grows by the garbage of every request between
two of them. With the collector off for the duration of the requests, every kind of ending is checked: a whole
stream, a non-streaming answer, failed attempts retried on the other pool, a request shed by admission control, a
client that goes away mid-stream, and a keyed request.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.h1client import HostPool, _Conn
from gateway.proxy.forward import ProxyExchange
from gateway.proxy.idempotency import KeyClaim
from gateway.sim.server import SimServer
from tests.conftest import MODEL, ServerThread, rules_for, started_sims

pytestmark = pytest.mark.integration


@pytest.fixture
def sims() -> Iterator[list[SimServer]]:
    yield from started_sims(2, time_scale=0.01, median=30, max_num_seqs=64)


def _requests_total(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "specgate_requests_total"
    )


def _live() -> Counter[str]:
    """Live exchanges and claims, and closed upstream connections that no pool keeps (an idle one in a pool's
    reuse list is alive by design until its next use finds it closed)."""
    objects = gc.get_objects()
    kept = {id(c) for o in objects if isinstance(o, HostPool) for c in o._idle}
    return Counter(
        type(o).__name__
        for o in objects
        if isinstance(o, (ProxyExchange, KeyClaim)) or (isinstance(o, _Conn) and o.lost and id(o) not in kept)
    )


async def _one(session: aiohttp.ClientSession, url: str, i: int, *, stream: bool, leave: bool, keyed: bool) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.9,
        "stream": stream,
        "max_tokens": 300 if leave else 10,
    }
    headers = {"idempotency-key": f"garbage-{i}-{time.monotonic_ns()}"} if keyed else {}
    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if leave:
            await r.content.readany()  # the first bytes, then the client goes away
            r.close()
        else:
            await r.read()
        return r.status


async def _batch(url: str, n: int, **kind: bool) -> Counter[int]:
    async with aiohttp.ClientSession() as session:
        return Counter(await asyncio.gather(*(_one(session, url, i, **kind) for i in range(n))))


def _settled(url: str, expected: float) -> Counter[str]:
    """Wait until the gateway booked every request and its exchanges returned; what is still alive."""
    bound = time.monotonic() + 30  # a liveness bound for a loaded machine, not a latency check
    while _requests_total(url) < expected and time.monotonic() < bound:
        time.sleep(0.05)
    live = _live()
    while live["ProxyExchange"] and time.monotonic() < bound:  # the last sends after the booking
        time.sleep(0.1)
        live = _live()
    return live


@pytest.mark.parametrize(
    ("case", "kind"),
    [
        ("whole streams", {"stream": True, "leave": False, "keyed": False}),
        ("non-streaming", {"stream": False, "leave": False, "keyed": False}),
        ("client leaves mid-stream", {"stream": True, "leave": True, "keyed": False}),
        ("keyed streams", {"stream": True, "leave": False, "keyed": True}),
    ],
)
@pytest.mark.parametrize("trouble", ["none", "failing attempts", "shed"])
def test_a_finished_request_is_freed_without_the_cyclic_gc(
    sims: list[SimServer], gateway: Any, case: str, kind: dict[str, bool], trouble: str
) -> None:
    rules = rules_for([sims[0].url], [sims[1].url])
    if trouble == "shed":
        for pool in rules["pools"]:
            pool["max_num_seqs"] = 1  # admits 2 per pool: most of a burst of 60 is shed
    gw: ServerThread = gateway(rules)
    if trouble == "failing attempts":
        httpx.put(sims[0].url + "/sim/faults", json={"error_rate": 0.5, "error_status": 500}).raise_for_status()
        httpx.put(sims[1].url + "/sim/faults", json={"error_rate": 0.3, "error_status": 503}).raise_for_status()
    asyncio.run(_batch(gw.url, 10, **kind))  # warm: connections, caches, lazily built objects
    gc.collect()
    before = _requests_total(gw.url)
    gc.disable()
    try:
        statuses = asyncio.run(_batch(gw.url, 60, **kind))
        live = _settled(gw.url, before + 60)
    finally:
        gc.enable()
    if trouble == "shed":
        assert statuses[503] > 0, statuses
    elif trouble == "failing attempts":
        assert statuses[200] > 0, statuses
    assert live == Counter(), (case, trouble, live)
