"""The Responses API's handlers in-process (ASGI, no sockets): stickiness refusals, validation, envelopes.

Every case here is decided before any pool is contacted: the pools' URLs refuse connections.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.proxy.idempotency import store_owner, tenant_scope
from gateway.proxy.owned_ids import mint_response_id
from gateway.proxy.responses import Holder, for_create, record_key, recorder
from gateway.runtime.container import Runtime
from gateway.store.base import StoreUnavailable
from gateway.store.memory import MemoryStore
from tests.conftest import MODEL, closed_port_url, rules_for

SPEC_URL = closed_port_url()


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime]]:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([SPEC_URL], [closed_port_url()])))
    app = create_app(Settings(rules=path, api_keys="k1", max_body_bytes=4096))
    transport = httpx.ASGITransport(app=app)
    auth = {"authorization": "Bearer k1"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=auth) as c:
        yield c, app.state.runtime


async def _record(rt: Runtime, rid: str, holder: Holder, key: str = "k1") -> None:
    await rt.store.remember(record_key(tenant_scope(f"Bearer {key}"), rid), holder.encode(), ttl_ms=60_000)


def _error(r: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code, err
    return dict(err)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": 3}, "input"),
        ({"model": MODEL, "input": ["x"]}, "input"),
        ({"model": MODEL, "input": "x", "instructions": 1}, "instructions"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "text": {"format": "json"}}, "text.format"),
        ({"model": MODEL, "input": "x", "tools": {}}, "tools"),
        ({"model": MODEL, "input": "x", "reasoning": {"effort": 5}}, "reasoning.effort"),
        ({"model": MODEL, "input": "x", "store": "yes"}, "store"),
        ({"model": MODEL, "input": "x", "previous_response_id": "../admin"}, "previous_response_id"),
        ({"model": MODEL, "input": "x", "previous_response_id": "r" * 300}, "previous_response_id"),
    ],
)
async def test_bad_bodies_are_400_naming_the_field(
    gw: tuple[httpx.AsyncClient, Runtime], body: dict[str, object], param: str
) -> None:
    client, _ = gw
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_unknown_previous_response_is_404_and_not_sent(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, _ = gw
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_1"})
    err = _error(r, 404, "response_not_found")
    assert err["param"] == "previous_response_id"
    assert r.headers["x-should-retry"] == "false"
    assert "x-specgate-attempts" not in r.headers


async def test_holder_gone_from_config_is_409(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw
    await _record(rt, "resp_gone", Holder("spec", "spec-9", "http://10.0.0.9:8000"))
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_gone"})
    _error(r, 409, "response_endpoint_gone")
    _error(await client.get("/v1/responses/resp_gone"), 409, "response_endpoint_gone")
    _error(await client.post("/v1/responses/resp_gone/cancel"), 409, "response_endpoint_gone")


async def test_unhealthy_holder_is_503_with_retry_after_and_no_fallback(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw
    await _record(rt, "resp_down", Holder("spec", "spec-0", SPEC_URL))
    rt.live.pools["spec"].endpoints[0].healthy = False
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_down"})
    _error(r, 503, "response_endpoint_unavailable")
    assert r.headers["retry-after"] == "5"


async def test_healthy_holder_gets_exactly_one_attempt(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw
    await _record(rt, "resp_here", Holder("spec", "spec-0", SPEC_URL))
    body = {"model": MODEL, "input": "x", "previous_response_id": "resp_here"}  # default class: std first, then spec
    r = await client.post("/v1/responses", json=body)
    assert r.status_code == 503  # the holder refuses connections; no other pool is tried
    assert r.headers["x-specgate-route"] == "sticky"
    assert r.headers["x-specgate-attempts"] == "1"
    message = r.json()["error"]["message"]
    assert "spec: " in message  # the pool tried, not its endpoint (that is in the log line)
    assert "spec-0" not in message
    assert SPEC_URL not in message
    assert "std" not in message
    assert message.endswith(f"(request id {r.headers['x-request-id']})")


async def test_records_are_per_api_key(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw
    await _record(rt, "resp_theirs", Holder("spec", "spec-0", SPEC_URL), key="someone-else")
    _error(await client.get("/v1/responses/resp_theirs"), 404, "response_not_found")


async def test_store_down_is_503(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw

    class Down(MemoryStore):
        async def recall(self, key: str) -> bytes | None:
            raise StoreUnavailable("connection refused")

    rt.store = Down()
    r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_1"})
    _error(r, 503, "response_store_unavailable")
    assert "retry-after" in r.headers


async def test_retrieve_validates_its_parameters(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, _ = gw
    _error(await client.get("/v1/responses/resp_1?stream=maybe"), 400, "invalid_value")
    _error(await client.get("/v1/responses/resp_1?starting_after=-1"), 400, "invalid_value")
    _error(await client.get("/v1/responses/" + "r" * 300), 404, "response_not_found")
    _error(await client.post("/v1/responses/resp_1/cancel", content=b"x" * 5000), 413, "request_too_large")
    r = await client.get("/v1/responses/resp_1", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401


async def test_delete_drops_only_the_callers_record(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw
    holder = Holder("spec", "spec-0", SPEC_URL)
    await _record(rt, "resp_mine", holder)
    await _record(rt, "resp_theirs", holder, key="someone-else")
    _error(await client.delete("/v1/responses/resp_theirs"), 404, "response_not_found")
    assert await rt.store.recall(record_key(tenant_scope("Bearer someone-else"), "resp_theirs")) is not None
    r = await client.delete("/v1/responses/resp_mine")
    assert r.status_code == 200, r.text
    assert r.json() == {"id": "resp_mine", "object": "response.deleted", "deleted": True}
    assert await rt.store.recall(record_key(tenant_scope("Bearer k1"), "resp_mine")) is None
    _error(await client.delete("/v1/responses/resp_mine"), 404, "response_not_found")
    _error(await client.delete("/v1/responses/" + "r" * 300), 404, "response_not_found")
    _error(await client.request("DELETE", "/v1/responses/resp_1", content=b"x" * 5000), 413, "request_too_large")
    assert (await client.delete("/v1/responses/resp_1", headers={"authorization": "Bearer nope"})).status_code == 401


async def test_delete_with_the_store_down_is_503(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw

    class Down(MemoryStore):
        async def forget(self, key: str) -> bool:
            raise StoreUnavailable("connection refused")

    rt.store = Down()
    _error(await client.delete("/v1/responses/resp_1"), 503, "response_store_unavailable")


async def test_records_from_before_ids_were_minted_are_not_honoured(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    client, rt = gw  # a record under the former key prefix may name an id a client chose: it resolves nothing
    old = "resp:" + record_key(tenant_scope("Bearer k1"), "order-42").split(":", 1)[1]
    await rt.store.remember(old, Holder("spec", "spec-0", SPEC_URL).encode(), ttl_ms=60_000)
    _error(await client.get("/v1/responses/order-42"), 404, "response_not_found")


async def test_an_answer_under_another_id_is_not_recorded(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    _, rt = gw
    store, scope = MemoryStore(), tenant_scope("Bearer k1")
    minted = mint_response_id()
    assert re.fullmatch(r"resp_[0-9a-f]{32}", minted)
    assert minted != mint_response_id()
    pool = rt.live.pools["spec"]
    on_answer = recorder(store, scope, 60_000, minted)
    await on_answer(pool, pool.endpoints[0], orjson.dumps({"id": "order-42", "object": "response"}))
    assert await store.recall(record_key(scope, "order-42")) is None
    created = {"type": "response.created", "response": {"id": minted}}
    await on_answer(pool, pool.endpoints[0], b"event: response.created\ndata: " + orjson.dumps(created) + b"\n\n")
    assert Holder.decode(await store.recall(record_key(scope, minted)) or b"") == Holder("spec", "spec-0", SPEC_URL)


async def test_response_records_count_to_their_tenant_or_key(gw: tuple[httpx.AsyncClient, Runtime]) -> None:
    _, rt = gw
    store = MemoryStore(max_owner_records=2)
    pool = rt.live.pools["spec"]
    body = {"model": MODEL, "input": "x"}
    ids: dict[str | None, list[str]] = {"acme": [], None: []}
    for tenant in ("acme", None):
        for _ in range(3):
            sticky = await for_create(store, rt.live.pools, body, "Bearer k1", 60.0, tenant)
            assert sticky.on_answer is not None
            await sticky.on_answer(
                pool, pool.endpoints[0], orjson.dumps({"id": sticky.response_id, "object": "response"})
            )
            ids[tenant].append(sticky.response_id)
    scope = tenant_scope("Bearer k1")
    assert store.owner_usage(store_owner("acme", scope)) == (0, 0, 2)
    assert store.owner_usage(store_owner(None, scope)) == (0, 0, 2)
    for rids in ids.values():  # each owner lost only its own oldest
        kept = [await store.recall(record_key(scope, rid)) is not None for rid in rids]
        assert kept == [False, True, True]
