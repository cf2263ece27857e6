"""The route reason under on-call actions and controller states, through the real app (in-process ASGI in front of
fake vLLM upstreams on sockets): the ``x-specgate-route`` header, the access log's ``route_reason``, the
``specgate_route_decisions_total`` label and explain's ``plan.reason`` give the same value, naming what decided."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway.admin.app import create_admin_app
from gateway.config.settings import Settings
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.observability.logs import AccessLog
from gateway.proxy.app import create_app
from gateway.proxy.idempotency import tenant_scope
from gateway.proxy.responses import Holder, record_key
from gateway.runtime.container import Runtime
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, SPEC_ONLY_MODEL, rules_for, static_routes

TOKEN = "admin-secret-token"
CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}
REASON = {"reason": "INC-7"}
# A controller that decides on every round (1 sample), never moves by load between the test's rounds (min_hold_s).
CONTROLLER = {"window_s": 0.2, "min_samples": 1, "min_hold_s": 600, "share_step": 1}
Fake = Callable[..., FakeUpstreamServer]


@dataclass
class Rig:
    rt: Runtime
    admin: httpx.AsyncClient
    proxy: httpx.AsyncClient
    log: io.BytesIO

    async def send(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
        return await self.proxy.post(path, json=body)

    async def seen(self, r: httpx.Response, body: dict[str, Any], path: str = "/v1/chat/completions") -> str:
        """The request's route reason, after checking that the log line, the metric label and explain say the
        same as its header."""
        header = r.headers["x-specgate-route"]
        self.rt.access_log.flush()
        line = orjson.loads(self.log.getvalue().splitlines()[-1])
        assert line["route_reason"] == header
        metrics = (await self.proxy.get("/metrics")).text
        assert f'specgate_route_decisions_total{{class="{line["class"]}",route="{header}"}}' in metrics
        explained = await self.admin.post("/admin/explain", params={"path": path}, json=body)
        assert explained.status_code == 200, explained.text
        assert explained.json()["plan"]["reason"] == header
        return header

    async def reason(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> str:
        return await self.seen(await self.send(body, path), body, path)

    def scrape_round(self) -> None:
        """One scrape round of calm, fresh pools, fed to the class controllers as the scraper does."""
        views = {p: calm(p) for p in ("spec", "std")}
        self.rt.routing.on_scrape_round(time.monotonic(), views)


def calm(pool: str) -> PoolLoadView:
    return PoolLoadView(pool, 1, 1, running=1, waiting=0, kv_usage=None, acceptance=None, tpot_mean_s=0.01,
                        generation_tokens_per_s=None)  # fmt: skip


@pytest.fixture
async def make_rig(tmp_path: Path, fake: Fake) -> AsyncIterator[Callable[..., Any]]:
    made: list[Rig] = []

    async def make(controller: dict[str, Any] | None = None, saturation: int | None = None, **fakes: Any) -> Rig:
        spec, std = fake("spec", tokens=4, **fakes), fake("std", tokens=4)
        doc = static_routes(rules_for([spec.url], [std.url]))
        route = doc["classes"][0]["route"]
        if controller is not None:
            doc["classes"][0]["controller"] = {**CONTROLLER, **controller}
        if saturation is not None:
            route["saturation"] = {"max_inflight_per_endpoint": saturation}
        path = tmp_path / f"rules-{len(made)}.yaml"
        path.write_text(yaml.safe_dump(doc))
        app = create_app(Settings(rules=path, api_keys="k1"))
        rt: Runtime = app.state.runtime
        log = io.BytesIO()
        rt.access_log = AccessLog(log)  # type: ignore[arg-type]
        admin = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_admin_app(rt, TOKEN)),
            base_url="http://admin",
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        proxy = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", headers={"authorization": "Bearer k1"}
        )
        made.append(Rig(rt, admin, proxy, log))
        return made[-1]

    yield make
    for rig in made:
        await rig.admin.aclose()
        await rig.proxy.aclose()
        await rig.rt.stop()


async def test_controller(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(controller={})
    assert await rig.reason(CODE) == "controller:speculative"


async def test_forced_on_a_controlled_class_and_on_a_static_one(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(controller={})
    await rig.admin.put("/admin/classes/precise/route", json={"route": "standard", "ttl": "10m", **REASON})
    assert await rig.reason(CODE) == "forced:standard"
    assert (await rig.send(CODE)).headers["x-specgate-pool"] == "std"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}  # "default": no controller
    assert await rig.reason(chat) == "preferred"
    await rig.admin.put("/admin/classes/default/route", json={"route": "speculative", **REASON})
    assert await rig.reason(chat) == "forced:speculative"


async def test_drained(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(controller={})
    await rig.admin.post("/admin/pools/spec/drain", json=REASON)
    r = await rig.send(CODE)
    assert r.headers["x-specgate-pool"] == "std"
    assert await rig.seen(r, CODE) == "spec drained"
    # a force whose pool is drained: the drain decided where the answer came from
    await rig.admin.put("/admin/classes/precise/route", json={"route": "speculative", **REASON})
    assert await rig.reason(CODE) == "spec drained"


async def test_unavailable_and_a_pick_that_does_not_serve_the_model(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(controller={})
    for ep in rig.rt.live.pools["spec"].endpoints:
        ep.healthy = False
    assert await rig.reason(CODE) == "spec unavailable"
    for ep in rig.rt.live.pools["spec"].endpoints:
        ep.healthy = True
    await rig.admin.put("/admin/classes/precise/route", json={"route": "standard", **REASON})
    only_spec = {**CODE, "model": SPEC_ONLY_MODEL}  # the standard pool does not serve it
    r = await rig.send(only_spec)
    assert r.headers["x-specgate-pool"] == "spec"
    assert await rig.seen(r, only_spec) == "std unavailable"


async def test_saturated(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(saturation=1, token_delay_s=0.2)
    slow = asyncio.create_task(rig.send(CODE))
    deadline = time.monotonic() + 10
    while rig.rt.live.views()["spec"].in_flight < 1:
        assert time.monotonic() < deadline, "the slow request never reached the speculative pool"
        await asyncio.sleep(0.01)
    r = await rig.send(CODE)
    assert r.headers["x-specgate-pool"] == "std"
    assert await rig.seen(r, CODE) == "saturated"
    assert (await slow).headers["x-specgate-route"] == "preferred"


async def test_probe(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(controller={"probe_share": 0.05})
    # standard by hand, then released: the class sits on the standard pool with its acceptance never measured
    await rig.admin.put("/admin/classes/precise/route", json={"route": "standard", **REASON})
    await rig.admin.put("/admin/classes/precise/route", json={"route": "auto", **REASON})
    rig.scrape_round()
    assert rig.rt.routing.snapshot()["precise"]["probe_share"] == 0.05
    for _ in range(2000):  # about one in twenty is a probe
        r = await rig.send(CODE)
        if r.headers["x-specgate-route"] != "controller:standard":
            break
    assert r.headers["x-specgate-route"] == "controller:probe:speculative"
    assert r.headers["x-specgate-pool"] == "spec"
    rig.rt.access_log.flush()
    assert orjson.loads(rig.log.getvalue().splitlines()[-1])["route_reason"] == "controller:probe:speculative"
    metrics = (await rig.proxy.get("/metrics")).text
    assert 'specgate_route_decisions_total{class="precise",route="controller:probe:speculative"}' in metrics
    seen = set()
    for _ in range(2000):  # explain draws as the proxy does
        seen.add((await rig.admin.post("/admin/explain", json=CODE)).json()["plan"]["reason"])
        if "controller:probe:speculative" in seen:
            break
    assert seen <= {"controller:standard", "controller:probe:speculative"}
    assert "controller:probe:speculative" in seen


async def test_guard(make_rig: Callable[..., Any]) -> None:
    # the latency guard: any real latency is far over a baseline p95 of a microsecond
    guard = {"latency_regression_pct": 20, "baseline_p95_s": 1e-6, "disable_after_windows": 1}
    rig: Rig = await make_rig(controller=guard)
    assert await rig.reason(CODE) == "controller:speculative"
    rig.scrape_round()  # the guard's first window starts
    await asyncio.sleep(0.25)
    assert (await rig.send(CODE)).status_code == 200  # a latency in the window
    rig.scrape_round()
    assert rig.rt.routing.snapshot()["precise"]["guard_tripped"] is True
    r = await rig.send(CODE)
    assert r.headers["x-specgate-pool"] == "std"
    assert await rig.seen(r, CODE) == "controller:guard:standard"


async def test_sticky(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig()
    ep = rig.rt.live.pools["spec"].endpoints[0]
    key = record_key(tenant_scope("Bearer k1"), "resp_abc")
    await rig.rt.store.remember(key, Holder("spec", ep.id, ep.url).encode(), ttl_ms=60_000)
    body = {"model": MODEL, "input": "more", "previous_response_id": "resp_abc"}
    r = await rig.send(body, "/v1/responses")  # the fake answers 404 to /v1/responses: the header is the point
    assert r.headers["x-specgate-pool"] == "spec"
    assert await rig.seen(r, body, "/v1/responses") == "sticky"
