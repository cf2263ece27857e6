"""Handlers in-process (ASGI, no sockets): what the gateway decides before any upstream is contacted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from tests.conftest import MODEL, closed_port_url, rules_for


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    app = create_app(Settings(rules=path, api_keys="k1", max_body_bytes=2048))
    transport = httpx.ASGITransport(app=app)
    auth = {"authorization": "Bearer k1"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=auth) as c:
        yield c


async def test_health_is_live_and_ready_waits_for_health_checks(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    r = await client.get("/ready")
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False
    assert body["reason"] == "first health check round not finished"
    assert body["store"]["name"] == "memory"  # reported, never a reason to be unready


async def test_models_union(client: httpx.AsyncClient) -> None:
    data = (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [m["id"] for m in data["data"]] == [MODEL, "spec-only-model"]
    assert all(m["object"] == "model" for m in data["data"])


@pytest.mark.parametrize(
    ("headers", "status"),
    [({"authorization": ""}, 401), ({"authorization": "Basic k1"}, 401), ({"authorization": "Bearer k2"}, 401)],
)
async def test_client_keys(client: httpx.AsyncClient, headers: dict[str, str], status: int) -> None:
    r = await client.post("/v1/chat/completions", json={}, headers=headers)
    assert r.status_code == status
    assert r.json()["error"]["type"] == "authentication_error"


async def test_metrics_exposition(client: httpx.AsyncClient) -> None:
    await client.post("/v1/chat/completions", content=b"{bad")
    r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert 'specgate_requests_total{class="none",outcome="client_error",pool="none"} 1.0' in r.text


async def test_every_gateway_error_is_an_envelope(client: httpx.AsyncClient) -> None:
    cases = [
        (await client.post("/v1/chat/completions", content=b"{bad"), 400),
        (await client.post("/v1/completions", content=b'"just a string"'), 400),
        (await client.post("/v1/completions", json={"model": MODEL, "prompt": 42}), 400),
        (await client.post("/v1/chat/completions", content=b"x" * 5000), 413),
        (await client.post("/v1/nope", json={}), 404),
        (await client.delete("/v1/models"), 405),
        (await client.post("/v1/embeddings", json={"model": MODEL, "input": "x"}), 404),
    ]
    for r, status in cases:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["code"], str)
        assert r.headers.get("x-request-id") or status in (404, 405)


async def test_no_routable_endpoint_is_503_with_retry_after(client: httpx.AsyncClient) -> None:
    app = client._transport.app  # type: ignore[attr-defined]
    for pool in app.state.runtime.live.pools.values():
        for ep in pool.endpoints:
            ep.healthy = False
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "5"
    assert "no routable endpoint" in r.json()["error"]["message"]
    assert r.headers["x-specgate-class"] == "default"


async def test_one_json_log_line_per_request(client: httpx.AsyncClient) -> None:
    import io

    import orjson

    from gateway.observability.logs import AccessLog

    buf = io.BytesIO()
    app = client._transport.app  # type: ignore[attr-defined]
    app.state.runtime.access_log = AccessLog(buf)  # type: ignore[arg-type]
    await client.post("/v1/chat/completions", content=b"{bad", headers={"x-request-id": "r-1"})
    await client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    app.state.runtime.access_log.flush()
    lines = [orjson.loads(line) for line in buf.getvalue().splitlines()]
    assert len(lines) == 2
    assert lines[0]["request_id"] == "r-1"
    assert lines[0]["status"] == 400
    assert lines[0]["outcome"] == "client_error"
    assert lines[1]["class"] == "default"
    assert lines[1]["status"] == 404
    assert {"duration_ms", "pool", "endpoint", "attempts", "error"} <= set(lines[1])
