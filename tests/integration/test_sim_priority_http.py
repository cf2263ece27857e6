"""``--scheduling-policy priority`` over HTTP: a saturated simulator serves a late high-priority request before the
low-priority ones queued ahead of it; the body's ``priority`` is validated like vLLM's; an fcfs server (vLLM's
default) accepts a non-zero priority and ignores it, as vLLM 0.33 does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths

pytestmark = pytest.mark.integration

MODEL = "m"
LOW, QUEUED, SLOTS = 10, 4, 2  # low-priority requests fill SLOTS running places and QUEUED waiting ones


def start(**kw: Any) -> SimServer:
    opts: dict[str, Any] = {"model": MODEL, "port": 0, "max_num_seqs": SLOTS, "seed": 3}
    return SimServer(SimOptions(**{**opts, **kw})).start()


@pytest.fixture(scope="module")
def prio() -> Iterator[SimServer]:
    # about 15 ms of wall time a step, 300-token answers: a running request holds its place for seconds
    server = start(scheduling_policy="priority", time_scale=1.0, output_lengths=OutputLengths(300, 0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fcfs() -> Iterator[SimServer]:
    server = start(time_scale=0.002, output_lengths=OutputLengths(20, 0))
    yield server
    server.stop()


def chat(priority: Any = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
    if priority is not None:
        body["priority"] = priority
    return {**body, **extra}


async def waiting(client: httpx.AsyncClient, server: SimServer, n: int, deadline_s: float = 30) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        stats = (await client.get(f"{server.url}/sim/stats")).json()
        if stats["waiting"] == n and stats["running"] == SLOTS:
            return
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("via", ["body", "header"])
async def test_high_priority_overtakes_the_queue(prio: SimServer, via: str) -> None:
    first: dict[str, float] = {}
    stop = asyncio.Event()

    async def stream(client: httpx.AsyncClient, key: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        url = f"{prio.url}/v1/chat/completions"
        async with client.stream("POST", url, json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if key not in first and line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first[key] = time.monotonic()
                if stop.is_set() or (key == "high" and key in first):
                    return  # closing the stream aborts the request

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=20)) as client:
        lows = [
            asyncio.create_task(stream(client, f"low{i}", chat(LOW, stream=True), {})) for i in range(SLOTS + QUEUED)
        ]
        try:
            await waiting(client, prio, QUEUED)
            if via == "body":
                high = stream(client, "high", chat(-5, stream=True, max_tokens=5), {})
            else:  # vLLM's X-Vllm-Priority header overrides the body's priority
                high = stream(client, "high", chat(LOW, stream=True, max_tokens=5), {"X-Vllm-Priority": "-5"})
            await asyncio.wait_for(high, timeout=60)
            before = sorted(k for k, t in first.items() if k != "high" and t < first["high"])
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*lows, return_exceptions=True), timeout=30)
    # the requests running when it arrived answered before it, and at most one queued one: the one admitted in the
    # same step as it, when both running requests finish together. Under fcfs it would have waited for all six.
    assert len(before) <= SLOTS + 1, (before, first)


async def test_priority_is_validated_like_vllm(prio: SimServer, fcfs: SimServer) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        for server in (prio, fcfs):
            for bad in ("high", 1.5, 2**63):
                r = await client.post(f"{server.url}/v1/chat/completions", json=chat(bad))
                assert r.status_code == 400
                error = r.json()["error"]
                assert error["param"] == "priority"
                assert error["code"] == 400
                assert "priority" in error["message"]
            r = await client.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "priority": []})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "priority"
        # vLLM 0.33 does not refuse a non-zero priority under fcfs: it is accepted and has no effect
        for path, body in (
            ("/v1/chat/completions", chat(7)),
            ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": -3, "max_tokens": 3}),
            ("/v1/responses", {"model": MODEL, "input": "hi", "priority": 2, "max_output_tokens": 3}),
        ):
            r = await client.post(f"{fcfs.url}{path}", json=body)
            assert r.status_code == 200, r.text
        r = await client.post(f"{fcfs.url}/v1/responses", json={"model": MODEL, "input": "hi", "priority": "x"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "priority"
