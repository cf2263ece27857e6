"""Idempotency-Key in-process: the gateway over ASGI (no socket of its own) in front of a fake vLLM on a socket."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

from gateway.config.schema import Idempotency
from gateway.config.settings import Settings
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.app import create_app
from gateway.proxy.idempotency import KeyClaim, parse_key, store_key, tenant_scope
from gateway.proxy.record import RequestRecord
from gateway.proxy.stored_response import Recorder, StoredResponse
from gateway.store.base import ClaimResult, Completed, Running, StoreUnavailable
from gateway.store.memory import MemoryStore
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, rules_for

Fake = Callable[..., FakeUpstreamServer]
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}]}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "rm", "parameters": {"type": "object"}}}]


class Gateway:
    def __init__(self, app: Any, client: httpx.AsyncClient, upstream: FakeUpstreamServer) -> None:
        self.app, self.client, self.upstream = app, client, upstream

    @property
    def runtime(self) -> Any:
        return self.app.state.runtime

    def posts(self) -> int:
        return sum(1 for r in self.upstream.state.requests if r["method"] == "POST")

    async def chat(self, key: str | None, body: dict[str, Any] | None = None, **headers: str) -> httpx.Response:
        h = dict(headers)
        if key is not None:
            h["idempotency-key"] = key
        return await self.client.post("/v1/chat/completions", json=body or CHAT, headers=h)

    async def running(self, n: int = 1) -> None:
        """Until ``n`` requests reached the upstream."""
        for _ in range(500):
            if self.posts() >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the upstream never saw the request")

    async def metric(self, result: str) -> float:
        text = (await self.client.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(f'specgate_idempotency_total{{result="{result}"}}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
async def make_gateway(fake: Fake, tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[Gateway] = []

    async def make(
        *, idempotency: dict[str, Any] | None = None, classes: list[dict[str, Any]] | None = None, **settings: Any
    ) -> Gateway:
        upstream = fake("std", tokens=8)
        overrides: dict[str, Any] = {}
        if idempotency is not None:
            overrides["idempotency"] = idempotency
        if classes is not None:
            overrides["classes"] = classes
        path = tmp_path / f"rules-{len(made)}.yaml"
        path.write_text(yaml.safe_dump(rules_for([upstream.url], [upstream.url], **overrides)))
        settings.setdefault("api_keys", "k1,k2")
        app = create_app(Settings(rules=path, **settings))
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", headers={"authorization": "Bearer k1"}
        )
        made.append(Gateway(app, client, upstream))
        return made[-1]

    yield make
    for g in made:  # no lifespan ran: close what the runtime opened
        await g.client.aclose()
        await g.runtime.stop()


@pytest.fixture
async def gw(make_gateway: Callable[..., Any]) -> Gateway:
    gateway: Gateway = await make_gateway()
    return gateway


# --- replay -----------------------------------------------------------------------------------------------------


async def test_repeat_after_completion_is_replayed_without_reaching_the_pool(gw: Gateway) -> None:
    first = await gw.chat("key-1")
    assert first.status_code == 200, first.text
    assert "idempotent-replayed" not in first.headers
    again = await gw.chat("key-1", **{"x-request-id": "retry-1"})
    assert again.status_code == 200
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content  # the same completion id, the same text
    assert again.headers["x-request-id"] == first.headers["x-request-id"]  # the original request's id
    for h in ("content-type", "x-specgate-class", "x-specgate-pool", "x-specgate-route", "x-specgate-task-type"):
        assert again.headers[h] == first.headers[h]
    assert gw.posts() == 1
    assert await gw.metric("claimed") == 1
    assert await gw.metric("stored") == 1
    assert await gw.metric("replayed") == 1


async def test_a_stream_is_replayed_as_its_exact_transcript(gw: Gateway) -> None:
    body = {**CHAT, "stream": True}
    first = await gw.chat("s-1", body)
    assert first.status_code == 200
    assert first.content.endswith(b"data: [DONE]\n\n")
    again = await gw.chat("s-1", body)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"].startswith("text/event-stream")
    assert again.content == first.content
    assert gw.posts() == 1


async def test_quoted_and_bare_keys_are_the_same_key_and_whitespace_does_not_matter(gw: Gateway) -> None:
    first = await gw.chat('"abc-123"')
    # The same JSON with other key order and whitespace: the same request.
    raw = b'{ "messages": [{"content": "tell me a story", "role": "user"}],\n "model": "%s" }' % MODEL.encode()
    again = await gw.client.post("/v1/chat/completions", content=raw, headers={"idempotency-key": "abc-123"})
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content


async def test_an_upstream_4xx_is_stored_and_replayed(gw: Gateway) -> None:
    first = await gw.chat("bad-1", **{"x-fake-behavior": "status=400"})
    assert first.status_code == 400
    again = await gw.chat("bad-1")
    assert again.status_code == 400
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()


# --- conflicts ----------------------------------------------------------------------------------------------------


async def test_repeat_while_running_is_409_then_replayed(gw: Gateway) -> None:
    slow = asyncio.create_task(gw.chat("run-1", **{"x-fake-behavior": "first_token_delay=0.6"}))
    await gw.running()
    busy = await gw.chat("run-1")
    assert busy.status_code == 409
    assert busy.json()["error"]["code"] == "idempotency_key_in_use"
    assert busy.json()["error"]["type"] == "conflict_error"
    assert busy.headers["retry-after"] == "1"
    first = await slow
    assert first.status_code == 200
    again = await gw.chat("run-1")
    assert again.headers["idempotent-replayed"] == "true"
    assert gw.posts() == 1
    assert await gw.metric("conflict") == 1


async def test_wait_mode_replays_once_the_first_completes(make_gateway: Callable[..., Any]) -> None:
    gw = await make_gateway(idempotency={"on_running": "wait", "wait_timeout_s": 5})
    slow = asyncio.create_task(gw.chat("w-1", **{"x-fake-behavior": "first_token_delay=0.5"}))
    await gw.running()
    waited = await gw.chat("w-1")
    first = await slow
    assert waited.status_code == 200
    assert waited.headers["idempotent-replayed"] == "true"
    assert waited.content == first.content
    assert gw.posts() == 1
    assert await gw.metric("waited_replayed") == 1


async def test_wait_mode_gives_up_with_409(make_gateway: Callable[..., Any]) -> None:
    gw = await make_gateway(idempotency={"on_running": "wait", "wait_timeout_s": 0.2})
    slow = asyncio.create_task(gw.chat("w-2", **{"x-fake-behavior": "first_token_delay=1"}))
    await gw.running()
    assert (await gw.chat("w-2")).status_code == 409
    assert (await slow).status_code == 200


async def test_the_lease_is_renewed_while_a_long_request_runs(make_gateway: Callable[..., Any]) -> None:
    gw = await make_gateway(idempotency={"lease_s": 0.3})
    slow = asyncio.create_task(gw.chat("l-1", **{"x-fake-behavior": "first_token_delay=1.5"}))
    await gw.running()
    await asyncio.sleep(0.8)  # well past one lease: only renewal keeps the claim
    assert (await gw.chat("l-1")).status_code == 409
    await slow
    assert (await gw.chat("l-1")).headers["idempotent-replayed"] == "true"
    assert gw.posts() == 1


async def test_same_key_with_another_body_or_path_is_422(gw: Gateway) -> None:
    await gw.chat("m-1")
    other = await gw.chat("m-1", {**CHAT, "temperature": 0.3})
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_mismatch"
    completion = await gw.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"idempotency-key": "m-1"}
    )
    assert completion.status_code == 422
    assert gw.posts() == 1
    assert await gw.metric("mismatch") == 2


@pytest.mark.parametrize(
    "value", ["", '"unterminated', "has space", "x" * 256, '"a"b"', '"a\\b"', "caf\u00e9", '"ok";param=1']
)
async def test_malformed_key_is_400(gw: Gateway, value: str) -> None:
    r = await gw.client.post("/v1/chat/completions", json=CHAT, headers=[("idempotency-key", value.encode("utf-8"))])
    assert r.status_code == 400, value
    assert r.json()["error"]["code"] == "invalid_idempotency_key"
    assert gw.posts() == 0


async def test_two_key_headers_are_400(gw: Gateway) -> None:
    r = await gw.client.post(
        "/v1/chat/completions", json=CHAT, headers=[("idempotency-key", "a"), ("idempotency-key", "b")]
    )
    assert r.status_code == 400


async def test_a_class_can_require_a_key(make_gateway: Callable[..., Any]) -> None:
    classes = [
        {"name": "agents", "when": {"tools": True}, "require_idempotency_key": True, "route": {"preferred": "std"}},
        {"name": "default", "route": {"preferred": "std"}},
    ]
    gw = await make_gateway(classes=classes)
    refused = await gw.chat(None, {**CHAT, "tools": TOOLS})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "idempotency_key_required"
    assert refused.headers["x-specgate-class"] == "agents"
    assert (await gw.chat("t-1", {**CHAT, "tools": TOOLS})).status_code == 200
    assert (await gw.chat(None)).status_code == 200  # other classes need none
    assert gw.posts() == 2


async def test_keys_are_scoped_by_the_callers_api_key(gw: Gateway) -> None:
    a = await gw.chat("shared-key")
    b = await gw.chat("shared-key", authorization="Bearer k2")
    assert a.status_code == b.status_code == 200
    assert "idempotent-replayed" not in b.headers
    assert a.json()["id"] != b.json()["id"]
    assert gw.posts() == 2
    assert (await gw.chat("shared-key", authorization="Bearer k2")).json()["id"] == b.json()["id"]
    assert store_key(tenant_scope("Bearer k1"), "x") != store_key(tenant_scope("Bearer k2"), "x")


# --- release: nothing generated, the retry runs ---------------------------------------------------------------------


async def test_no_capacity_releases_the_key(gw: Gateway) -> None:
    endpoints = [ep for pool in gw.runtime.live.pools.values() for ep in pool.endpoints]
    for ep in endpoints:
        ep.healthy = False
    refused = await gw.chat("nc-1")
    assert refused.status_code == 503
    for ep in endpoints:
        ep.healthy = True
    retry = await gw.chat("nc-1")
    assert retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers
    assert await gw.metric("released") == 1


async def test_failed_attempts_release_the_key(gw: Gateway) -> None:
    refused = await gw.chat("f-1", **{"x-fake-behavior": "status=503"})
    assert refused.status_code == 503
    retry = await gw.chat("f-1")
    assert retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers


# --- the store ---------------------------------------------------------------------------------------------------


class DownStore(MemoryStore):
    name = "down"

    async def claim(
        self, key: str, fingerprint: str, *, lease_ms: int, max_bytes: int = 0, owner: str = ""
    ) -> ClaimResult:
        raise StoreUnavailable("connection refused")


async def test_store_unavailable_refuses_keyed_requests_by_default(gw: Gateway) -> None:
    gw.runtime.store = DownStore()
    r = await gw.chat("d-1")
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "idempotency_store_unavailable"
    assert "retry-after" in r.headers
    assert (await gw.chat(None)).status_code == 200  # requests without a key flow as usual
    assert gw.posts() == 1


async def test_store_unavailable_can_proceed_without_idempotency(make_gateway: Callable[..., Any]) -> None:
    gw = await make_gateway(idempotency={"store_unavailable": "proceed"})
    gw.runtime.store = DownStore()
    assert (await gw.chat("d-2")).status_code == 200
    assert (await gw.chat("d-2")).status_code == 200
    assert gw.posts() == 2
    assert await gw.metric("store_unavailable") == 2


async def test_the_access_log_names_the_idempotency_result(gw: Gateway) -> None:
    buf = io.BytesIO()
    gw.runtime.access_log = AccessLog(buf)  # type: ignore[arg-type]
    await gw.chat("log-1")
    await gw.chat("log-1")
    await gw.chat("log-1", {**CHAT, "n": 2})
    gw.runtime.access_log.flush()
    lines = [orjson.loads(line) for line in buf.getvalue().splitlines()]
    assert [line.get("idempotency") for line in lines] == ["stored", "replayed", "mismatch"]


# --- units ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ([], None),
        (["abc"], "abc"),
        (['"abc"'], "abc"),
        (['"a b \\"c\\" \\\\"'], 'a b "c" \\'),
        (["x" * 255], "x" * 255),
    ],
)
def test_parse_key(values: list[str], key: str | None) -> None:
    assert parse_key(values) == key


def test_stored_response_round_trip_is_binary_safe() -> None:
    stored = StoredResponse(
        200, ((b"content-type", b"text/event-stream"), (b"x-request-id", b"r\xe9")), b"\x00\xffdata"
    )
    assert StoredResponse.decode(stored.encode()) == stored
    with pytest.raises(ValueError, match="bad magic"):
        StoredResponse.decode(b"nope")


def test_a_stream_cut_short_is_stored_as_a_broken_stream() -> None:
    rec = Recorder()
    rec.record({"type": "http.response.start", "status": 200, "headers": [(b"Content-Type", b"text/event-stream")]})
    rec.record({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    stored = rec.response()
    assert stored is not None
    assert stored.body.startswith(b"data: {}\n\n")
    assert b'"error"' in stored.body
    assert stored.body.endswith(b"data: [DONE]\n\n")


async def test_a_late_finisher_cannot_overwrite_a_newer_claim() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    cfg = Idempotency(lease_s=1.0)
    metrics = GatewayMetrics()
    first = await store.claim("k", "fp", lease_ms=1000)
    assert not isinstance(first, (Running, Completed))
    now[0] = 2.0  # the first owner's lease ran out (its gateway stalled); another request claims the key
    second = await store.claim("k", "fp", lease_ms=1000)
    assert not isinstance(second, (Running, Completed))
    late = KeyClaim(store, "k", first.token, cfg, metrics, RequestRecord("r", "/").request_id)
    await late.settle(StoredResponse(200, (), b"late"))
    assert isinstance(await store.get("k"), Running)  # the newer claim stands
    assert metrics.idempotency.labels("lost")._value.get() == 1


async def test_a_lost_claim_is_taken_again_so_the_answer_the_client_got_is_what_a_repeat_replays() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    metrics = GatewayMetrics()
    first = await store.claim("k", "fp", lease_ms=1000)
    assert not isinstance(first, (Running, Completed))
    now[0] = 2.0  # the record is gone (lease ran out, evicted, Redis restarted) and nobody claimed it since
    claim = KeyClaim(store, "k", first.token, Idempotency(lease_s=1.0), metrics, "r", "fp")
    await claim.settle(StoredResponse(200, (), b"the answer"))
    got = await store.get("k")
    assert isinstance(got, Completed)
    assert StoredResponse.decode(got.response).body == b"the answer"
    assert metrics.idempotency.labels("stored")._value.get() == 1


class Flaky:
    """A store whose ``complete`` fails ``n`` times before it works."""

    def __init__(self, inner: MemoryStore, n: int) -> None:
        self.inner, self.n = inner, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def complete(self, key: str, token: str, response: bytes, *, ttl_ms: int) -> bool:
        if self.n > 0:
            self.n -= 1
            raise StoreUnavailable("blip")
        return await self.inner.complete(key, token, response, ttl_ms=ttl_ms)


async def test_a_store_blip_after_the_response_does_not_lose_it() -> None:
    inner = MemoryStore()
    store = Flaky(inner, 2)
    first = await inner.claim("k", "fp", lease_ms=5000)
    assert not isinstance(first, (Running, Completed))
    metrics = GatewayMetrics()
    claim = KeyClaim(store, "k", first.token, Idempotency(lease_s=5.0), metrics, "r", "fp")  # type: ignore[arg-type]
    await claim.settle(StoredResponse(200, (), b"kept"))
    assert isinstance(await inner.get("k"), Completed)  # stored on the third try (after 0.25 s and 0.5 s)
    assert metrics.idempotency.labels("stored")._value.get() == 1


# --- per-owner caps ----------------------------------------------------------------------------------------------


async def test_one_api_key_filling_its_share_never_evicts_another_keys_records(
    make_gateway: Callable[..., Any],
) -> None:
    gw = await make_gateway(idempotency_owner_records=3)
    other = {"authorization": "Bearer k2"}
    for key in ("b-1", "b-2"):
        assert (await gw.chat(key, **other)).status_code == 200
    for i in range(12):  # k1 writes four times its share
        assert (await gw.chat(f"a-{i}")).status_code == 200
    assert gw.posts() == 14
    for key in ("b-1", "b-2"):  # k2's records survived: replayed, not run again
        again = await gw.chat(key, **other)
        assert again.status_code == 200
        assert again.headers.get("idempotent-replayed") == "true"
    newest = await gw.chat("a-11")
    assert newest.headers.get("idempotent-replayed") == "true"
    oldest = await gw.chat("a-0")  # k1's own oldest made room: it runs again
    assert oldest.status_code == 200
    assert "idempotent-replayed" not in oldest.headers
    assert gw.posts() == 15
