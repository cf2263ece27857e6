"""The admin change routes in-process (ASGI) in front of fake vLLM upstreams on sockets: validation, 404s, the
override objects, state and audit, and the effect on routing (weights, drains, forced class routes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin.app import create_admin_app
from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.runtime.container import Runtime
from gateway.store.base import StoreUnavailable
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.app.test_admin import assert_envelope
from tests.conftest import MODEL, closed_port_url, rules_for, static_routes

TOKEN = "admin-secret-token"
CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}]}
Fake = Callable[..., FakeUpstreamServer]


@dataclass
class Rig:
    rt: Runtime
    admin: httpx.AsyncClient
    proxy: httpx.AsyncClient
    spec: FakeUpstreamServer | None = None
    std: FakeUpstreamServer | None = None

    async def pool_of(self, body: dict[str, Any]) -> str:
        r = await self.proxy.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.headers["x-specgate-pool"]


@pytest.fixture
async def make_rig(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    made: list[Rig] = []

    async def make(spec_url: str | None = None, std_url: str | None = None, **rules: Any) -> Rig:
        path = tmp_path / f"rules-{len(made)}.yaml"
        doc = rules_for([spec_url or closed_port_url()], [std_url or closed_port_url()], **rules)
        if "defaults" not in rules:  # classes without a block have no controller: on-call forces are forced:<kind>
            static_routes(doc)
        path.write_text(yaml.safe_dump(doc))
        app = create_app(Settings(rules=path, api_keys="k1"))
        rt: Runtime = app.state.runtime
        admin = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_admin_app(rt, TOKEN)),
            base_url="http://localhost",
            headers={"authorization": f"Bearer {TOKEN}"},
        )
        proxy = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", headers={"authorization": "Bearer k1"}
        )
        made.append(Rig(rt, admin, proxy))
        return made[-1]

    yield make
    for rig in made:
        await rig.admin.aclose()
        await rig.proxy.aclose()
        await rig.rt.stop()


@pytest.fixture
async def rig(make_rig: Callable[..., Any]) -> Rig:
    r: Rig = await make_rig()
    return r


@pytest.fixture
async def live_rig(make_rig: Callable[..., Any], fake: Fake) -> Rig:
    spec, std = fake("spec", tokens=4), fake("std", tokens=4)
    r: Rig = await make_rig(spec.url, std.url)
    r.spec, r.std = spec, std
    return r


REASON = {"reason": "INC-42"}
CHANGES: list[tuple[str, str, dict[str, Any]]] = [
    ("PUT", "/admin/pools/spec/weight", {"weight": 0, **REASON}),
    ("PUT", "/admin/pools/spec/endpoints/spec-0/weight", {"weight": 2, **REASON}),
    ("POST", "/admin/pools/spec/drain", REASON),
    ("POST", "/admin/pools/spec/undrain", REASON),
    ("PUT", "/admin/classes/precise/route", {"route": "standard", **REASON}),
]


# -- validation and 404s -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("PUT", "/admin/pools/spec/weight", {"reason": "x"}, "weight"),
        ("PUT", "/admin/pools/spec/weight", {"weight": -1, "reason": "x"}, "weight"),
        ("PUT", "/admin/pools/spec/weight", {"weight": "0", "reason": "x"}, "weight"),
        ("PUT", "/admin/pools/spec/weight", {"weight": True, "reason": "x"}, "weight"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1}, "reason"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1, "reason": "  "}, "reason"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1, "reason": "x" * 501}, "reason"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1, "reason": "x", "ttl": "5 weeks"}, "ttl"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1, "reason": "x", "ttl": 0}, "ttl"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1, "reason": "x", "ttl": "8d"}, "ttl"),
        ("PUT", "/admin/pools/spec/weight", {"weight": 1, "reason": "x", "ttl_s": 5}, "ttl_s"),
        ("PUT", "/admin/pools/spec/endpoints/spec-0/weight", {"weight": -0.5, "reason": "x"}, "weight"),
        ("POST", "/admin/pools/spec/drain", {}, "reason"),
        ("POST", "/admin/pools/spec/drain", {"reason": "x", "ttl": []}, "ttl"),
        ("POST", "/admin/pools/spec/undrain", {"reason": ""}, "reason"),
        ("POST", "/admin/pools/spec/undrain", {"reason": "x", "ttl": 5}, "ttl"),
        ("PUT", "/admin/classes/precise/route", {"route": "fast", "reason": "x"}, "route"),
        ("PUT", "/admin/classes/precise/route", {"reason": "x"}, "route"),
        ("PUT", "/admin/classes/precise/route", {"route": "standard"}, "reason"),
    ],
)
async def test_bad_input_is_400_naming_the_param(rig: Rig, method: str, path: str, body: Any, param: str) -> None:
    err = assert_envelope(await rig.admin.request(method, path, json=body), 400)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert rig.rt.overrides.active() == []


async def test_bodies_must_be_json_objects(rig: Rig) -> None:
    for method, path, _ in CHANGES:
        assert_envelope(await rig.admin.request(method, path, content=b"{bad"), 400, "invalid_json")
        assert_envelope(await rig.admin.request(method, path, content=b"[1]"), 400, "invalid_json")
        assert_envelope(await rig.admin.request(method, path, content=b"x" * 20000), 413)


async def test_unknown_targets_are_404(rig: Rig) -> None:
    cases = [
        ("PUT", "/admin/pools/nope/weight", {"weight": 0, **REASON}, "pool_not_found", "pool"),
        ("PUT", "/admin/pools/nope/endpoints/spec-0/weight", {"weight": 0, **REASON}, "pool_not_found", "pool"),
        ("PUT", "/admin/pools/spec/endpoints/std-0/weight", {"weight": 0, **REASON}, "endpoint_not_found", "endpoint"),
        ("POST", "/admin/pools/nope/drain", REASON, "pool_not_found", "pool"),
        ("POST", "/admin/pools/nope/undrain", REASON, "pool_not_found", "pool"),
        ("PUT", "/admin/classes/nope/route", {"route": "auto", **REASON}, "class_not_found", "class"),
        ("DELETE", "/admin/overrides/ovr_000000000000", None, "override_not_found", "id"),
    ]
    for method, path, body, code, param in cases:
        err = assert_envelope(await rig.admin.request(method, path, json=body), 404, code)
        assert err["param"] == param
        assert err["type"] == "not_found_error"
    # the message lists what exists
    err = assert_envelope(await rig.admin.put("/admin/pools/nope/weight", json={"weight": 0, **REASON}), 404)
    assert "spec, std" in err["message"]


async def test_changes_are_refused_without_a_configured_token(rig: Rig) -> None:
    app = create_admin_app(rig.rt, None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
        for method, path, body in [*CHANGES, ("DELETE", "/admin/overrides/ovr_000000000000", None)]:
            err = assert_envelope(await c.request(method, path, json=body), 403, "admin_token_not_set")
            assert "SPECGATE_ADMIN_TOKEN" in err["message"]
        assert (await c.get("/admin/overrides")).status_code == 200  # reading is not a change


# -- the override objects, state, audit, metrics --------------------------------------------------------------------


async def test_weight_override_object_state_and_audit(rig: Rig) -> None:
    r = await rig.admin.put("/admin/pools/spec/weight", json={"weight": 0, "ttl": "30m", "reason": "vllm upgrade"})
    assert r.status_code == 200, r.text
    o = r.json()["override"]
    assert r.json()["replaced"] is None
    assert o["id"].startswith("ovr_")
    assert (o["kind"], o["pool"], o["endpoint"], o["class"], o["value"]) == ("pool_weight", "spec", None, None, 0.0)
    assert o["reason"] == "vllm upgrade"
    assert o["actor"] == "admin"  # nothing derived from the token
    assert o["expires_at"] == pytest.approx(o["created_at"] + 1800)
    state = (await rig.admin.get("/admin/state")).json()
    [ep] = state["pools"]["spec"]["endpoints"]
    assert (ep["configured_weight"], ep["effective_weight"], ep["routable"]) == (1.0, 0.0, False)
    assert [x["id"] for x in state["pools"]["spec"]["overrides"]] == [o["id"]]
    assert [x["id"] for x in state["overrides"]] == [o["id"]]
    assert state["pools"]["std"]["overrides"] == []
    assert state["store"]["overrides"]["store"] == "memory"
    assert state["store"]["idempotency"]["name"] == "memory"
    assert state["config"]["hash"] == rig.rt.live.digest
    assert state["config"]["version"] == 1
    # the same target again: replaced; another actor named by the header
    r = await rig.admin.put(
        "/admin/pools/spec/weight", json={"weight": 3, "reason": "back"}, headers={"x-specgate-actor": "alice"}
    )
    assert r.json()["replaced"]["id"] == o["id"]
    assert r.json()["override"]["actor"] == "alice"
    assert r.json()["override"]["expires_at"] == pytest.approx(r.json()["override"]["created_at"] + 3600)  # default
    listed = (await rig.admin.get("/admin/overrides")).json()["overrides"]
    assert [x["value"] for x in listed] == [3.0]
    removed = await rig.admin.delete(f"/admin/overrides/{listed[0]['id']}?reason=done")
    assert removed.status_code == 200
    assert removed.json()["removed"]["id"] == listed[0]["id"]
    assert_envelope(await rig.admin.delete(f"/admin/overrides/{listed[0]['id']}"), 404, "override_not_found")
    audit = (await rig.admin.get("/admin/audit")).json()["records"]
    assert [(a["action"], a["actor"]) for a in audit] == [
        ("pool_weight", o["actor"]),
        ("pool_weight", "alice"),
        ("remove", o["actor"]),
    ]
    assert audit[2]["reason"] == "done"
    assert audit[0]["target"] == "pool/spec"
    assert audit[1]["detail"]["replaced"]["id"] == o["id"]
    text = (await rig.proxy.get("/metrics")).text
    assert 'specgate_admin_changes_total{action="pool_weight"} 2.0' in text
    assert 'specgate_admin_changes_total{action="remove"} 1.0' in text
    assert 'specgate_overrides_active{kind="pool_weight"} 0.0' in text


async def test_never_and_the_yaml_default_ttl(make_rig: Callable[..., Any]) -> None:
    rig: Rig = await make_rig(admin={"default_ttl_s": 60, "max_ttl_s": 600})
    r = await rig.admin.post("/admin/pools/std/drain", json=REASON)
    o = r.json()["override"]
    assert o["expires_at"] == pytest.approx(o["created_at"] + 60)
    err = assert_envelope(await rig.admin.post("/admin/pools/std/drain", json={**REASON, "ttl": "1h"}), 400)
    assert "600" in err["message"]
    r = await rig.admin.put("/admin/classes/default/route", json={"route": "speculative", "ttl": "never", **REASON})
    assert r.json()["override"]["expires_at"] is None
    assert r.json()["override"]["value"] == "speculative"
    state = (await rig.admin.get("/admin/state")).json()
    default = next(c for c in state["classes"] if c["name"] == "default")
    assert default["forced_route"] == "speculative"
    assert [x["kind"] for x in default["overrides"]] == ["class_route"]


async def test_undrain_and_auto_report_what_they_removed(rig: Rig) -> None:
    assert (await rig.admin.post("/admin/pools/spec/undrain", json=REASON)).json() == {"removed": []}
    drained = (await rig.admin.post("/admin/pools/spec/drain", json=REASON)).json()["override"]
    r = await rig.admin.post("/admin/pools/spec/undrain", json={"reason": "upgrade done"})
    assert [x["id"] for x in r.json()["removed"]] == [drained["id"]]
    forced = (await rig.admin.put("/admin/classes/precise/route", json={"route": "standard", **REASON})).json()
    r = await rig.admin.put("/admin/classes/precise/route", json={"route": "auto", **REASON})
    assert [x["id"] for x in r.json()["removed"]] == [forced["override"]["id"]]
    actions = [a["action"] for a in (await rig.admin.get("/admin/audit")).json()["records"]]
    assert actions == ["drain", "undrain", "class_route", "class_route_auto"]


# -- the effect on routing ----------------------------------------------------------------------------------------


async def test_weight_zero_and_drain_send_no_new_requests_there(live_rig: Rig) -> None:
    rig = live_rig
    assert await rig.pool_of(CODE) == "spec"
    assert await rig.pool_of(CHAT) == "std"
    await rig.admin.put("/admin/pools/spec/weight", json={"weight": 0, **REASON})
    assert {await rig.pool_of(CODE) for _ in range(5)} == {"std"}
    await rig.admin.put("/admin/pools/spec/endpoints/spec-0/weight", json={"weight": 1, **REASON})
    assert await rig.pool_of(CODE) == "spec"  # the endpoint's own weight beats the pool's
    await rig.admin.post("/admin/pools/spec/drain", json=REASON)
    assert await rig.pool_of(CODE) == "std"  # a drain beats both
    await rig.admin.post("/admin/pools/std/drain", json=REASON)
    r = await rig.proxy.post("/v1/chat/completions", json=CHAT)
    err = assert_envelope(r, 503, "no_capacity")
    assert "drained" in err["message"]
    await rig.admin.post("/admin/pools/spec/undrain", json=REASON)
    assert await rig.pool_of(CHAT) == "spec"  # default's fallback while std is drained


async def test_force_standard_and_speculative(live_rig: Rig) -> None:
    rig = live_rig
    await rig.admin.put("/admin/classes/precise/route", json={"route": "standard", **REASON})
    assert {await rig.pool_of(CODE) for _ in range(3)} == {"std"}
    explained = (await rig.admin.post("/admin/explain", json=CODE)).json()
    assert explained["plan"]["reason"] == "forced:standard"
    await rig.admin.put("/admin/classes/default/route", json={"route": "speculative", **REASON})
    assert {await rig.pool_of(CHAT) for _ in range(3)} == {"spec"}
    await rig.admin.put("/admin/classes/precise/route", json={"route": "auto", **REASON})
    await rig.admin.put("/admin/classes/default/route", json={"route": "auto", **REASON})
    assert await rig.pool_of(CODE) == "spec"
    assert await rig.pool_of(CHAT) == "std"


async def test_force_standard_on_a_controlled_class(make_rig: Callable[..., Any], fake: Fake) -> None:
    spec, std = fake("spec", tokens=4), fake("std", tokens=4)
    rules = rules_for([spec.url], [std.url])
    rules["classes"][0]["controller"] = {}
    rig: Rig = await make_rig(spec.url, std.url, classes=rules["classes"])
    assert await rig.pool_of(CODE) == "spec"
    await rig.admin.put("/admin/classes/precise/route", json={"route": "standard", "ttl": "10m", **REASON})
    assert {await rig.pool_of(CODE) for _ in range(3)} == {"std"}
    state = (await rig.admin.get("/admin/state")).json()
    ctl = state["classes"][0]["controller"]
    assert (ctl["state"], ctl["last_reason"]) == ("standard", "manual")
    assert ctl["forced_until"] is not None
    records = (await rig.admin.get("/admin/audit")).json()["records"]
    assert {"controller_transition", "class_route"} <= {a["action"] for a in records}


async def test_a_drain_lets_the_request_in_flight_finish(make_rig: Callable[..., Any], fake: Fake) -> None:
    spec, std = fake("spec", tokens=20, token_delay_s=0.03), fake("std", tokens=4)
    rig: Rig = await make_rig(spec.url, std.url)
    body = {**CODE, "stream": True}
    slow = asyncio.create_task(rig.proxy.post("/v1/chat/completions", json=body))
    for _ in range(200):
        if spec.state.started:
            break
        await asyncio.sleep(0.01)
    assert spec.state.started == 1
    r = await rig.admin.post("/admin/pools/spec/drain", json=REASON)
    assert r.status_code == 200
    assert rig.rt.live.pools["spec"].in_flight == 1  # still running, on a drained pool
    assert await rig.pool_of(CODE) == "std"  # new requests go elsewhere
    done = await slow
    assert done.status_code == 200
    assert done.headers["x-specgate-pool"] == "spec"
    assert done.text.rstrip().endswith("data: [DONE]")
    assert '"error"' not in done.text
    assert spec.state.completed == 1
    assert spec.state.aborted == 0


async def test_an_unreachable_store_changes_nothing_and_says_503(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    async def down(*args: Any, **kw: Any) -> Any:
        raise StoreUnavailable("redis put override failed (127.0.0.1:1/0): ConnectionError: refused")

    for op in ("put", "delete", "list_overrides"):
        monkeypatch.setattr(rig.rt.overrides.store, op, down)
    r = await rig.admin.put("/admin/pools/spec/weight", json={"weight": 0, **REASON})
    err = assert_envelope(r, 503, "override_store_unavailable")
    assert "nothing was changed" in err["message"]
    assert_envelope(await rig.admin.post("/admin/pools/spec/undrain", json=REASON), 503, "override_store_unavailable")
    assert rig.rt.live.pools["spec"].endpoints[0].weight == 1.0
    assert (await rig.admin.get("/admin/state")).json()["store"]["overrides"]["last_error"].startswith("redis put")
