"""Review findings on the core proxy that show without sockets (pure parts, or the app in-process over ASGI).

Tests marked ``xfail(strict=True)`` demonstrate a defect; the others pin behaviour checked during review.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.config.loader import load_rules_text
from gateway.config.settings import Settings
from gateway.fleet import upstream as upstream_mod
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.upstream import UpstreamResponse
from gateway.proxy.app import create_app
from gateway.proxy.wire import SSESplitter
from gateway.runtime.live import LiveConfig
from tests.conftest import MODEL, rules_for

CODE_REQ: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0.1,
    "messages": [{"role": "user", "content": "write a python function that adds two numbers"}],
}


# --------------------------------------------------------------------------------------------------------------
# LiveConfig.build with a previous config (the reload path)


def _live(previous: LiveConfig | None = None) -> LiveConfig:
    text = yaml.safe_dump(rules_for(["http://127.0.0.1:9"], ["http://127.0.0.1:10"]))
    return LiveConfig.build(load_rules_text(text), "rules.yaml", text, previous)


def test_in_flight_returns_to_zero_across_a_config_swap() -> None:
    old = _live()
    ep_old: EndpointState = old.pools["spec"].endpoints[0]
    ep_old.in_flight += 1  # a request is in flight (ProxyExchange holds ep_old)
    new = _live(previous=old)
    ep_old.in_flight -= 1  # ... and finishes after the swap (ProxyExchange._cleanup)
    assert new.pools["spec"].endpoints[0].in_flight == 0


# --------------------------------------------------------------------------------------------------------------
# SSESplitter cost


class _CountingBytes(bytes):
    """bytes whose ``find`` counts how many bytes each call may scan."""

    scanned = 0

    def find(self, sub: Any, start: Any = None, end: Any = None) -> int:
        _CountingBytes.scanned += len(self) - (start or 0)
        return super().find(sub, start, end)


def test_sse_splitter_is_linear_in_the_events_of_one_read() -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
    chunk = _CountingBytes(event * 1000)
    _CountingBytes.scanned = 0
    events = SSESplitter().feed(chunk)
    assert len(events) == 1000
    assert _CountingBytes.scanned <= 4 * len(chunk)


def test_sse_splitter_is_linear_in_the_size_of_one_event() -> None:
    import time

    def cost(size: int) -> float:
        """The best of three: the event loop time to split one event of ``size`` bytes read 64 KiB at a time."""
        event = b"data: " + b"x" * size + b"\n\n"
        best = float("inf")
        for _ in range(3):
            splitter = SSESplitter()
            t0 = time.perf_counter()
            events = [e for i in range(0, len(event), 1 << 16) for e in splitter.feed(event[i : i + (1 << 16)])]
            best = min(best, time.perf_counter() - t0)
            assert events == [event]
        return best

    # A ratio, not a deadline (a busy machine slows both alike): 16x the size costs ~16x when linear (somewhat
    # more with caches), ~256x when the buffer is rescanned or copied per read (quadratic).
    small, large = cost(1 << 20), cost(16 << 20)
    assert large / small < 64, f"1 MiB: {small * 1000:.1f} ms, 16 MiB: {large * 1000:.1f} ms"


# --------------------------------------------------------------------------------------------------------------
# Unexpected exceptions inside ProxyExchange (in-process app, upstream stubbed at the PoolClient seam)


class _RawStub:
    def __init__(self, content_type: str) -> None:
        self.headers = {"content-type": content_type}
        self.raw_headers = [(b"content-type", content_type.encode())]
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def release(self) -> None:
        pass


class _BreakingStream(UpstreamResponse):
    """A stream that delivers one event and then fails with something that is not an UpstreamError.

    Like aiohttp's body stream, it is stateful: every ``chunks()`` call continues where the last one stopped."""

    def chunks(self) -> AsyncIterator[bytes]:
        gen = self.__dict__.get("_gen")
        if gen is None:
            gen = self.__dict__["_gen"] = self._produce()
        return gen

    async def _produce(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
        raise RuntimeError("unexpected failure inside the relay")


@pytest.fixture
def app_client(tmp_path: Path) -> tuple[Any, httpx.AsyncClient]:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])))
    app = create_app(Settings(rules=path))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return app, httpx.AsyncClient(transport=transport, base_url="http://gw")


def _outcomes(app: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in app.state.runtime.metrics.registry.collect():
        if fam.name == "specgate_requests":
            for s in fam.samples:
                if s.name == "specgate_requests_total" and s.value:
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
    return out


def _in_flight(app: Any) -> int:
    return sum(e.in_flight for p in app.state.runtime.live.pools.values() for e in p.endpoints)


async def test_unexpected_exception_before_commit_is_not_counted_ok(
    app_client: tuple[Any, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, client = app_client

    async def boom(self: Any, ep: Any, path: str, body: bytes, headers: dict[str, str], **kw: Any) -> UpstreamResponse:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(upstream_mod.PoolClient, "post", boom)
    async with client:
        r = await client.post("/v1/chat/completions", json=CODE_REQ)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error"  # envelope, no traceback
    assert _in_flight(app) == 0
    assert _outcomes(app) == {"gateway_error": 1}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])  # the dispatcher's table, Starlette's router
async def test_unexpected_exception_before_commit_is_logged_once_and_answered_once(
    app_client: tuple[Any, httpx.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    app, client = app_client

    async def boom(self: Any, ep: Any, path: str, body: bytes, headers: dict[str, str], **kw: Any) -> UpstreamResponse:
        raise RuntimeError("unexpected")

    monkeypatch.setattr(upstream_mod.PoolClient, "post", boom)
    body = {"model": MODEL, "prompt": "hello"} if path == "/tokenize" else CODE_REQ
    with caplog.at_level(logging.ERROR, logger="specgate"):
        async with client:
            r = await client.post(path, json=body)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "internal_error"  # one response, the envelope, no traceback
    logged = [rec for rec in caplog.records if rec.exc_info is not None and rec.exc_info[1] is not None]
    assert [str(rec.exc_info[1]) for rec in logged if rec.exc_info] == ["unexpected"]
    assert _outcomes(app) == {"gateway_error": 1}


async def test_unexpected_exception_after_commit_still_ends_with_error_event_and_done(
    app_client: tuple[Any, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, client = app_client

    async def post(self: Any, ep: Any, path: str, body: bytes, headers: dict[str, str], **kw: Any) -> UpstreamResponse:
        raw = _RawStub("text/event-stream")
        return _BreakingStream(200, raw)  # type: ignore[arg-type]

    monkeypatch.setattr(upstream_mod.PoolClient, "post", post)
    async with client:
        r = await client.post("/v1/chat/completions", json={**CODE_REQ, "stream": True})
    assert r.status_code == 200
    assert _in_flight(app) == 0
    assert r.content.endswith(b"data: [DONE]\n\n"), r.content
    assert b'"error"' in r.content


# --------------------------------------------------------------------------------------------------------------
# Saturation counts requests of endpoints that take no new work


def test_saturation_counts_only_routable_endpoints() -> None:
    from gateway.config.schema import Route
    from gateway.routing.plan import plan_route

    rules = rules_for(["http://127.0.0.1:9", "http://127.0.0.1:11"], ["http://127.0.0.1:10"])
    text = yaml.safe_dump(rules)
    live = LiveConfig.build(load_rules_text(text), "rules.yaml", text)
    draining, serving = live.pools["spec"].endpoints
    draining.weight = 0  # drained: its 10 long requests run to completion, it takes nothing new
    draining.in_flight = 10
    serving.in_flight = 1  # the one routable endpoint is nearly idle
    route = Route.model_validate(
        {"preferred": "spec", "saturated": "std", "fallback": ["std"], "saturation": {"max_inflight_per_endpoint": 4}}
    )
    plan = plan_route(route, MODEL, live.views())
    assert plan.pools[0] == "spec", plan


# --------------------------------------------------------------------------------------------------------------
# Multi-worker mode


async def test_workers_share_one_view_of_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--workers N: whichever worker answers /metrics, it shows the counts of every worker.

    prometheus_client chooses where values live when it is imported, and a worker is a fresh interpreter started
    with PROMETHEUS_MULTIPROC_DIR set (``specgate serve`` sets it), so each stand-in worker here gets the value
    class such a worker gets, under a pid of its own. The real process tree: tests/integration/test_workers.py.
    """
    from prometheus_client import values

    from gateway.proxy.app import create_app_from_env

    shared = tmp_path / "prometheus"
    shared.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(shared))
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for(["http://127.0.0.1:9"], ["http://127.0.0.1:10"])))
    for k, v in Settings(rules=path, workers=2).to_env().items():
        monkeypatch.setenv(k, v)
    try:
        texts = []
        for pid in (os.getppid(), os.getpid()):  # two processes that exist, so neither is swept as dead
            monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda pid=pid: pid))
            worker = create_app_from_env()  # what each of uvicorn's workers runs
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=worker), base_url="http://gw") as c:
                await c.post("/v1/chat/completions", content=b"{bad json")
                texts.append((await c.get("/metrics")).text)
    finally:
        values.close_all_multiprocess_files()
    line = 'specgate_requests_total{class="none",outcome="client_error",pool="none"}'
    assert f"{line} 1.0" in texts[0]  # the first worker, before the second served anything
    assert f"{line} 2.0" in texts[1]  # the second worker answers for both


# --------------------------------------------------------------------------------------------------------------
# Access log writes with several workers on one stderr pipe


class _RecordingStream:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.writes.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        pass


def test_access_log_writes_are_atomic_on_a_pipe() -> None:
    import select

    from gateway.observability.logs import AccessLog

    stream = _RecordingStream()
    log = AccessLog(stream, enabled=True)  # type: ignore[arg-type]
    for i in range(100):  # ~20 ms of traffic at 5k req/s
        log.write({"event": "request", "request_id": f"{i:032x}", "path": "/v1/chat/completions", "pad": "x" * 300})
    log.flush()
    assert b"".join(stream.writes).count(b"\n") == 100
    assert max(len(w) for w in stream.writes) <= select.PIPE_BUF
    assert all(w.endswith(b"\n") for w in stream.writes)


# --------------------------------------------------------------------------------------------------------------
# specgate demo


def test_demo_stand_ins_simulate_llm_pools_and_serve_embeddings() -> None:
    from gateway.sim.launch import plan_stand_ins

    rules = yaml.safe_load(
        (Path(__file__).parents[2] / "routing_rules/examples/ngram-summarization-rag.yaml").read_text()
    )
    ports = {p["name"]: 9000 + i for i, p in enumerate(rules["pools"])}
    plans = {s.pool: s.cmd for s in plan_stand_ins(rules, ports)}
    assert "--embeddings" in plans[rules["embeddings_pool"]]
    for pool in rules["pools"]:
        cmd = plans[pool["name"]]
        if pool["name"] == rules["embeddings_pool"]:
            continue
        assert cmd[cmd.index("-m") + 1 : cmd.index("-m") + 3] == ["gateway", "sim"]
        assert ("--speculative-config" in cmd) == (pool["kind"] == "speculative")


# --------------------------------------------------------------------------------------------------------------
# Checked and found correct


def test_settings_round_trip_through_the_environment_for_workers(tmp_path: Path) -> None:
    s = Settings(
        rules=Path("routing_rules/default.yaml"),
        host="127.0.0.1",
        port=9000,
        workers=3,
        max_body_bytes=4096,
        api_keys="a,b",
        api_keys_file=tmp_path / "keys",
        health_interval_s=1.5,
        health_timeout_s=0.5,
        log_level="debug",
    )
    assert Settings.from_env(s.to_env()) == s


def test_pick_never_returns_drained_or_unhealthy_endpoints() -> None:
    import random

    live = _live()
    pool: PoolState = live.pools["spec"]
    ep = pool.endpoints[0]
    ep.weight = 0
    assert pool.pick(random.Random(0)) is None
    ep.weight = 1
    ep.mark_failure("down")
    assert pool.pick(random.Random(0)) is None


def test_cancelled_attempt_releases_in_flight(app_client: tuple[Any, httpx.AsyncClient], monkeypatch: Any) -> None:
    """A CancelledError that is not the client going away (server shutdown) propagates, and counters settle."""
    app, client = app_client

    async def hang(self: Any, ep: Any, path: str, body: bytes, headers: dict[str, str], **kw: Any) -> UpstreamResponse:
        await asyncio.sleep(3600)
        raise AssertionError

    monkeypatch.setattr(upstream_mod.PoolClient, "post", hang)

    async def run() -> None:
        async with client:
            task = asyncio.ensure_future(client.post("/v1/chat/completions", json=CODE_REQ))
            for _ in range(100):
                await asyncio.sleep(0.01)
                if _in_flight(app) == 1:
                    break
            assert _in_flight(app) == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert _in_flight(app) == 0

    asyncio.run(run())
