"""Admission control and back-pressure in the real attempt loop (``ProxyExchange``), against scripted pools: a full
pool is skipped or the request shed at once (503 overloaded, Retry-After, nothing sent), and after back-pressure
a request moves only to an endpoint with headroom."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.config.pool import Pool
from gateway.config.schema import Defaults, Overload
from gateway.errors import UpstreamPoolFull
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.upstream import UpstreamResponse
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.forward import ProxyExchange
from gateway.proxy.job import ProxyJob
from gateway.proxy.record import RequestRecord
from gateway.routing.attempts import AttemptPolicy
from gateway.routing.plan import Plan
from tests.unit.test_attempt_loop import FakeRaw


@dataclass
class Client:
    """Answers every post by the pool's script: ok, 429, pool_full."""

    pool: str
    script: dict[str, str]
    posts: list[str] = field(default_factory=list)
    api_key = None
    first_byte_s = 5.0

    async def post(
        self, ep: EndpointState, path: str, body: bytes, headers: dict[str, str], *, method: str = "POST"
    ) -> UpstreamResponse:
        self.posts.append(ep.id)
        what = self.script.get(self.pool, "ok")
        if what == "pool_full":
            raise UpstreamPoolFull(f"{ep.id} is busy: no free connection")
        if what == "429":
            raw = FakeRaw(429, "application/json", [b'{"error": {"message": "slow down"}}'])
        else:
            raw = FakeRaw(200, "application/json", [orjson.dumps({"pool": self.pool, "choices": []})])
        return UpstreamResponse(raw.status, raw)  # type: ignore[arg-type]


def pools(**extra: Any) -> dict[str, PoolState]:
    out = {}
    for name in ("a", "b"):
        spec = Pool.model_validate(
            {
                "name": name,
                "kind": "standard",
                "models": ["m"],
                "endpoints": [{"url": f"http://{name}0:8000", "id": f"{name}0"}],
                "max_num_seqs": 2,
                "admission": {"max_waiting_per_endpoint": 1},  # bound 3 per pool
                **extra,
            }
        )
        out[name] = PoolState.from_spec(spec)
    return out


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    posts: dict[str, list[str]]
    metrics: GatewayMetrics
    response: ProxyExchange


def run(ps: dict[str, PoolState], script: dict[str, str]) -> Result:
    async def go() -> Result:
        clients = {name: Client(name, script) for name in ps}
        metrics = GatewayMetrics()
        spec = Overload(retry_after_s=4)
        policy = AttemptPolicy(Defaults, metrics, overload_spec=lambda: spec)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        job = ProxyJob(
            path="/v1/chat/completions",
            body=orjson.dumps(body),
            client_headers=[],
            stream=False,
            plan=Plan(("a", "b"), "preferred"),
            max_attempts=2,
            record=RequestRecord("req-1", "/v1/chat/completions", traffic_class="c"),
            extra_headers=[],
        )
        resp = ProxyExchange(
            job,
            ps,
            clients,  # type: ignore[arg-type]
            metrics,
            AccessLog(enabled=False),
            random.Random(0),
            policy,
        )
        messages: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)

        await resp({"type": "http"}, receive, send)  # type: ignore[arg-type]
        start = next(m for m in messages if m["type"] == "http.response.start")
        raw = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        posts = {n: c.posts for n, c in clients.items()}
        return Result(start["status"], headers, orjson.loads(raw), posts, metrics, resp)

    return asyncio.run(go())


def sample(m: GatewayMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def test_a_full_pool_is_skipped_for_the_next_planned_pool() -> None:
    ps = pools()
    ps["a"].endpoints[0].in_flight = 3
    r = run(ps, {})
    assert r.status == 200
    assert r.headers["x-specgate-pool"] == "b"
    assert r.posts == {"a": [], "b": ["b0"]}  # never sent to the full pool
    labels = {"class": "c", "from_pool": "a", "to_pool": "b", "reason": "admission"}
    assert sample(r.metrics, "specgate_fallbacks_total", **labels) == 1
    assert ps["a"].endpoints[0].in_flight == 3
    assert ps["b"].endpoints[0].in_flight == 0


def test_every_planned_pool_full_is_shed_at_once_with_retry_after() -> None:
    ps = pools()
    for p in ps.values():
        p.endpoints[0].in_flight = 3
    r = run(ps, {})
    assert r.status == 503
    assert r.headers["retry-after"] == "4"
    assert r.body["error"]["code"] == "overloaded"
    assert r.body["error"]["type"] == "service_unavailable"
    assert r.posts == {"a": [], "b": []}
    assert r.response.job.record.outcome == "overloaded"
    assert sample(r.metrics, "specgate_shed_total", **{"class": "c", "pool": "a", "reason": "admission"}) == 1
    assert sample(r.metrics, "specgate_requests_total", **{"class": "c", "pool": "none", "outcome": "overloaded"}) == 1


def test_back_pressure_moves_on_only_to_an_endpoint_with_headroom() -> None:
    ps = pools()
    ps["b"].endpoints[0].note_queue(2, fresh_until=float("inf"))  # b's vLLM says it queues
    r = run(ps, {"a": "429"})
    assert r.status == 503
    assert r.body["error"]["code"] == "overloaded"
    assert r.posts == {"a": ["a0"], "b": []}  # not piled onto a pool that is busy too
    assert sample(r.metrics, "specgate_shed_total", **{"class": "c", "pool": "a", "reason": "busy"}) == 1
    assert ps["a"].endpoints[0].consecutive_failures == 0

    ps = pools()
    r = run(ps, {"a": "pool_full"})  # b has room: it answers
    assert r.status == 200
    assert r.posts == {"a": ["a0"], "b": ["b0"]}
    assert sample(r.metrics, "specgate_upstream_attempts_total", pool="a", result="pool_full") == 1
    assert ps["a"].endpoints[0].healthy
    assert ps["a"].endpoints[0].consecutive_failures == 0


def test_without_max_num_seqs_nothing_is_shed() -> None:
    ps = {
        name: PoolState.from_spec(
            Pool.model_validate(
                {"name": name, "kind": "standard", "models": ["m"], "endpoints": [{"url": f"http://{name}0:8000"}]}
            )
        )
        for name in ("a", "b")
    }
    ps["a"].endpoints[0].in_flight = 10_000
    r = run(ps, {})
    assert r.status == 200
    assert r.headers["x-specgate-pool"] == "a"
