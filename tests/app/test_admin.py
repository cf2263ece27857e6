"""The admin API in-process (ASGI): token policy on every route, explain, state and audit."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admin.app import AdminAuth, create_admin_app
from gateway.config.settings import Settings
from gateway.fleet.vllm_metrics import Acceptance, PoolLoadView
from gateway.observability.logs import JsonFormatter
from gateway.overrides.audit import AuditLog, AuditRecord
from gateway.proxy.app import create_app
from gateway.runtime.container import Runtime
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, closed_port_url, rules_for, static_routes

TOKEN = "admin-secret-token"
CLIENT_KEY = "client-key-1"
CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}]}


def make_runtime(tmp_path: Path, rules: dict[str, Any] | None = None, **settings: Any) -> Runtime:
    path = tmp_path / "rules.yaml"
    # by default no class has a controller (defaults.controller: null): explain shows the static routes
    path.write_text(yaml.safe_dump(rules or static_routes(rules_for([closed_port_url()], [closed_port_url()]))))
    settings.setdefault("api_keys", CLIENT_KEY)
    rt: Runtime = create_app(Settings(rules=path, max_body_bytes=2048, **settings)).state.runtime
    return rt


def client_for(app: Starlette, token: str | None = TOKEN) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost", headers=headers)


@pytest.fixture
def rt(tmp_path: Path) -> Runtime:
    return make_runtime(tmp_path)


@pytest.fixture
async def admin(rt: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(create_admin_app(rt, TOKEN)) as c:
        yield c


def assert_envelope(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


# -- explain ---------------------------------------------------------------------------------------------------


async def test_explain_shows_class_features_live_numbers_and_plan(admin: httpx.AsyncClient) -> None:
    r = await admin.post("/admin/explain", json=CODE)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["request"] == {"path": "/v1/chat/completions", "endpoint": "chat", "model": MODEL}
    assert (d["task_type"], d["task_source"]) == ("code", "rule")
    assert d["features"]["temperature"] == 0.2
    assert d["features"]["max_tokens"] is None  # no limit: +inf on the inside, null on the wire
    assert {"top_p", "stream", "n", "tools", "response_format", "prompt_tokens"} <= set(d["features"])
    tc = d["traffic_class"]
    assert tc["name"] == "precise"
    assert tc["route"]["preferred"] == "spec"
    assert tc["route"]["saturated"] == "std"
    assert tc["controlled"] is False
    assert d["controller"] is None
    assert d["choice"] is None
    assert d["plan"]["reason"] == "preferred"
    assert d["plan"]["steps"] == [
        {"attempt": 1, "pool": "spec", "kind": "speculative", "reason": "preferred"},
        {"attempt": 2, "pool": "std", "kind": "standard", "reason": "alternate"},
    ]
    assert d["plan"]["max_attempts"] == 2
    assert d["plan"]["skipped"] == []
    spec = d["live"]["spec"]
    assert (spec["kind"], spec["routable_endpoints"], spec["in_flight"], spec["saturated"]) == (
        "speculative",
        1,
        0,
        False,
    )
    # nothing scraped yet: unknown, never 0
    for key in ("running", "waiting", "kv_usage", "tpot_mean_s", "acceptance_rate", "mean_acceptance_length"):
        assert spec[key] is None, key
    assert spec["stale"] is True
    assert list(d["live"]) == ["spec", "std"]


async def test_explain_reads_task_header_and_path(admin: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "temperature": 0.1, "prompt": "hello"}
    r = await admin.post("/admin/explain?path=/v1/completions", json=body, headers={"x-task-type": "code"})
    d = r.json()
    assert d["request"]["endpoint"] == "completions"
    assert (d["task_type"], d["task_source"]) == ("code", "header")
    assert d["traffic_class"]["name"] == "precise"
    r = await admin.post("/admin/explain", json=CHAT)
    assert r.json()["traffic_class"]["name"] == "default"
    assert [s["reason"] for s in r.json()["plan"]["steps"]] == ["preferred", "fallback"]


async def test_explain_covers_the_responses_api(admin: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": "Write a python function."}],
        "temperature": 0.1,
        "max_output_tokens": 64,
        "text": {"format": {"type": "json_object"}},
        "reasoning": {"effort": "low"},
        "previous_response_id": "resp_1",
    }
    d = (await admin.post("/admin/explain?path=/v1/responses", json=body)).json()
    assert d["request"]["endpoint"] == "responses"
    f = d["features"]
    assert (f["endpoint"], f["max_tokens"], f["response_format"], f["reasoning"]) == (
        "responses",
        64.0,
        "json_object",
        "low",
    )
    assert (d["task_type"], d["traffic_class"]["name"]) == ("structured", "precise")
    assert d["stateful"]["previous_response_id"] == "resp_1"
    assert d["stateful"]["note"].startswith("pinned")
    assert (await admin.post("/admin/explain", json=CHAT)).json()["stateful"] is None


async def test_explain_model_served_by_one_pool_skips_the_other(admin: httpx.AsyncClient) -> None:
    d = (await admin.post("/admin/explain", json={**CHAT, "model": "spec-only-model"})).json()
    assert [s["pool"] for s in d["plan"]["steps"]] == ["spec"]
    assert d["plan"]["reason"] == "std unavailable"
    assert d["plan"]["skipped"] == [{"pool": "std", "reason": "model not served"}]


async def test_explain_unroutable_pools_say_503(rt: Runtime, admin: httpx.AsyncClient) -> None:
    for pool in rt.live.pools.values():
        for ep in pool.endpoints:
            ep.healthy = False
    d = (await admin.post("/admin/explain", json=CODE)).json()
    assert d["plan"]["empty"] is True
    assert d["plan"]["steps"] == []
    assert {s["reason"] for s in d["plan"]["skipped"]} == {"no routable endpoint"}


async def test_explain_with_scraped_numbers(
    rt: Runtime, admin: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    acc = Acceptance(rate=0.62, mean_length=3.1, per_position=(0.8, 0.6), drafts=120.0)
    views = {
        "spec": PoolLoadView("spec", 1, 1, 4.0, 2.0, 0.5, acc, 0.012, 300.0),
        "std": PoolLoadView("std", 1, 0, None, None, None, None, None, None),
    }
    monkeypatch.setattr(rt.scraper, "views", lambda now=None: views)
    live = (await admin.post("/admin/explain", json=CODE)).json()["live"]
    assert live["spec"]["running"] == 4.0
    assert live["spec"]["waiting"] == 2.0
    assert live["spec"]["kv_usage"] == 0.5
    assert live["spec"]["tpot_mean_s"] == 0.012
    assert live["spec"]["acceptance_rate"] == 0.62
    assert live["spec"]["mean_acceptance_length"] == 3.1
    assert live["spec"]["stale"] is False
    assert live["std"]["stale"] is True
    assert live["std"]["running"] is None


async def test_explain_of_a_controlled_class(tmp_path: Path) -> None:
    rules = static_routes(rules_for([closed_port_url()], [closed_port_url()]))  # only "precise" has a controller
    rules["classes"][0]["controller"] = {}
    rt = make_runtime(tmp_path, rules)
    async with client_for(create_admin_app(rt, TOKEN)) as c:
        d = (await c.post("/admin/explain", json=CODE)).json()
        assert d["traffic_class"]["controlled"] is True
        assert d["controller"]["state"] == "speculative"
        assert d["controller"]["speculative_pool"] == "spec"
        assert d["choice"]["pick"] == "speculative"
        assert d["plan"]["reason"] == "controller:speculative"
        assert [s["reason"] for s in d["plan"]["steps"]] == ["controller:speculative", "alternate"]
        state = (await c.get("/admin/state")).json()
        assert state["classes"][0]["controller"]["state"] == "speculative"
        assert state["classes"][1]["controller"] is None


async def test_explain_shows_each_pools_expected_completion_time_and_why_the_draw_went_there(tmp_path: Path) -> None:
    """A standard-home class under defaults.controller: once a round saw the speculative pool clearly faster for
    it, a share spills there; explain gives the estimates per pool with their inputs, and the probe (started while
    its acceptance was unmeasured) is in the audit log."""
    rules = rules_for([closed_port_url()], [closed_port_url()])
    rules["defaults"]["controller"] = {"window_s": 1, "min_samples": 1, "min_hold_s": 0, "share_step": 1.0}
    rt = make_runtime(tmp_path, rules)
    chat = {"model": MODEL, "temperature": 0.9, "messages": [{"role": "user", "content": "hi"}]}
    acc = Acceptance(rate=0.5, mean_length=3.0, per_position=(0.6, 0.5), drafts=100.0)
    even = {
        "spec": PoolLoadView("spec", 1, 1, 1.0, 0.0, 0.1, acc, 0.02, 50.0),
        "std": PoolLoadView("std", 1, 1, 1.0, 0.0, 0.1, None, 0.02, 50.0),
    }
    t0 = time.monotonic()  # the runtime's clock
    rt.routing.choose("default", rt.rng)
    rt.routing.on_scrape_round(t0 + 1.0, even)  # no gain for this class: home, but probing (acceptance unmeasured)
    fast = {**even, "spec": PoolLoadView("spec", 1, 1, 1.0, 0.0, 0.1, acc, 0.004, 50.0)}
    rt.routing.choose("default", rt.rng)
    rt.routing.on_scrape_round(t0 + 2.0, fast)
    async with client_for(create_admin_app(rt, TOKEN)) as c:
        d = (await c.post("/admin/explain", json=chat)).json()
        assert d["traffic_class"]["name"] == "default"
        assert d["controller"]["home"] == "standard"
        assert d["choice"]["pick"] == "speculative"
        assert d["choice"]["why"] == "spill"
        assert d["plan"]["reason"] == "controller:speculative"
        est = d["expected_completion"]
        assert set(est) == {"spec", "std"}
        assert est["spec"]["expected_s"] < est["std"]["expected_s"]
        assert est["spec"]["acceptance_source"] == "prior"
        assert est["spec"]["pool_acceptance"] == 0.5
        assert {"queue_s", "first_token_s", "decode_s", "output_tokens", "tpot_s", "class_tpot_s"} <= set(est["std"])
        audit = (await c.get("/admin/audit")).json()["records"]
        probes = [r for r in audit if r["action"] == "controller_probe"]
        assert [(r["target"], r["reason"]) for r in probes] == [
            ("class/default", "probe_started"),
            ("class/default", "probe_stopped"),
        ]
        transitions = [r for r in audit if r["action"] == "controller_transition"]
        assert [(r["target"], r["detail"]["to"]) for r in transitions] == [("class/default", "speculative")]


async def test_explain_errors_are_the_proxys_envelopes(admin: httpx.AsyncClient) -> None:
    assert_envelope(await admin.post("/admin/explain", content=b"{bad"), 400, "invalid_json")
    assert_envelope(await admin.post("/admin/explain", content=b""), 400, "invalid_json")
    assert_envelope(await admin.post("/admin/explain", content=b"[1]"), 400, "invalid_json")
    err = assert_envelope(await admin.post("/admin/explain", json={**CHAT, "model": "nope"}), 404, "model_not_found")
    assert err["param"] == "model"
    err = assert_envelope(await admin.post("/admin/explain", json={**CHAT, "temperature": "hot"}), 400)
    assert err["param"] == "temperature"
    err = assert_envelope(await admin.post("/admin/explain?path=/v1/nope", json=CHAT), 400)
    assert err["param"] == "path"
    embed = {"model": MODEL, "input": "x"}
    assert_envelope(await admin.post("/admin/explain?path=/v1/embeddings", json=embed), 404, "unknown_route")
    assert_envelope(await admin.post("/admin/explain", content=b"x" * 5000), 413, "request_too_large")


async def test_explain_never_contacts_an_upstream(tmp_path: Path, fake: Callable[..., FakeUpstreamServer]) -> None:
    upstream = fake("both")
    rt = make_runtime(tmp_path, rules_for([upstream.url], [upstream.url]))
    async with client_for(create_admin_app(rt, TOKEN)) as c:
        for body in (CODE, CHAT, {**CHAT, "stream": True}):
            assert (await c.post("/admin/explain", json=body)).status_code == 200
        assert (await c.get("/admin/state")).status_code == 200
    assert upstream.state.requests == []
    assert upstream.state.started == 0


# -- the token policy ------------------------------------------------------------------------------------------


CONSOLE_SHELL = frozenset({"/admin/ui", "/admin/ui/assets/{name}"})


def _calls(app: Starlette) -> list[tuple[str, str]]:
    """(method, path) of every admin route: new routes are covered without touching this test."""
    calls = []
    for route in app.routes:
        assert isinstance(route, Route)
        for method in sorted(route.methods or ()):
            if method != "HEAD":
                calls.append((method, route.path))
    assert len(calls) >= 3
    return calls


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, "missing admin token"),
        ("", "missing admin token"),
        (f"Basic {TOKEN}", "missing admin token"),
        ("Bearer wrong-token", "invalid admin token"),
        (f"Bearer {CLIENT_KEY}", "invalid admin token"),  # a client API key is never an admin token
        (f"Bearer {TOKEN}x", "invalid admin token"),
        ("Bearer ", "invalid admin token"),
    ],
)
async def test_every_route_refuses_without_the_admin_token(
    rt: Runtime, authorization: str | None, message: str
) -> None:
    app = create_admin_app(rt, TOKEN)
    headers = {} if authorization is None else {"authorization": authorization}
    async with client_for(app, token=None) as c:
        for method, path in [*_calls(app), ("GET", "/admin/nope"), ("DELETE", "/admin/state")]:
            if path in CONSOLE_SHELL:  # no data in it: public (tests/app/test_admin_console.py)
                continue
            r = await c.request(method, path, json=CODE, headers=headers)
            err = assert_envelope(r, 401, "invalid_admin_token")
            assert err["type"] == "authentication_error"
            assert message in err["message"]
            assert r.headers["www-authenticate"].startswith("Bearer")


async def test_every_route_answers_the_admin_token(admin: httpx.AsyncClient) -> None:
    for method, path in _calls(admin._transport.app):  # type: ignore[attr-defined]
        r = await admin.request(method, path, json=CODE)
        if "{" in path:  # a template (the pool, class or override named "{pool}"...): past the token, not found
            assert_envelope(r, 404)
        else:
            assert r.status_code == 200, (method, path, r.text)
    r = await admin.get("/admin/state", headers={"authorization": f"bearer  {TOKEN} "})
    assert r.status_code == 200


async def test_client_keys_do_not_open_the_admin_api_even_without_client_auth(tmp_path: Path) -> None:
    rt = make_runtime(tmp_path, api_keys="")
    async with client_for(create_admin_app(rt, TOKEN), token="anything") as c:
        assert_envelope(await c.get("/admin/state"), 401)


async def test_without_a_token_reads_are_open_and_changes_refused(rt: Runtime) -> None:
    async with client_for(create_admin_app(rt, None), token=None) as c:
        assert (await c.get("/admin/state")).status_code == 200
        assert (await c.post("/admin/explain", json=CODE)).status_code == 200
        assert (await c.get("/admin/audit")).status_code == 200

    async def change(request: Request) -> Response:
        return Response(b"changed")

    route = Route("/admin/change", change, methods=["POST"])
    app = Starlette(routes=[route], middleware=[Middleware(AdminAuth, token=None, changes=[route])])
    async with client_for(app, token=None) as c:
        err = assert_envelope(await c.post("/admin/change"), 403, "admin_token_not_set")
        assert "SPECGATE_ADMIN_TOKEN" in err["message"]
    app = Starlette(routes=[route], middleware=[Middleware(AdminAuth, token=TOKEN, changes=[route])])
    async with client_for(app) as c:
        assert (await c.post("/admin/change")).text == "changed"


def test_admin_token_must_not_be_a_client_key(rt: Runtime) -> None:
    with pytest.raises(ValueError, match="differ from every client API key"):
        create_admin_app(rt, CLIENT_KEY)
    with pytest.raises(ValueError, match="empty"):
        create_admin_app(rt, "  ")


async def test_unknown_route_and_method_are_envelopes(admin: httpx.AsyncClient) -> None:
    assert_envelope(await admin.get("/admin/nope"), 404, "unknown_route")
    r = await admin.delete("/admin/state")
    assert_envelope(r, 405, "method_not_allowed")
    assert "GET" in r.headers["allow"]


# -- state and audit -------------------------------------------------------------------------------------------


async def test_state_lists_pools_classes_and_config(rt: Runtime, admin: httpx.AsyncClient) -> None:
    rt.live.pools["spec"].endpoints[0].in_flight = 3
    s = (await admin.get("/admin/state")).json()
    assert set(s["pools"]) == {"spec", "std"}
    spec = s["pools"]["spec"]
    assert spec["kind"] == "speculative"
    assert spec["in_flight"] == 3
    [ep] = spec["endpoints"]
    assert ep["id"] == "spec-0"
    assert (ep["healthy"], ep["weight"], ep["in_flight"], ep["last_error"]) == (True, 1.0, 3, None)
    assert ep["url"].startswith("http://127.0.0.1:")
    assert spec["running"] is None  # not scraped: unknown
    assert [c["name"] for c in s["classes"]] == ["precise", "default"]
    assert s["classes"][0]["route"]["fallback"] == ["std"]
    assert s["config"]["digest"] == rt.live.digest
    assert s["config"]["source"].endswith("rules.yaml")
    assert isinstance(s["config"]["loaded_at"], float)
    assert s["audit"] == {"size": 0, "capacity": 1000, "total": 0}


async def test_audit_records_show_up(rt: Runtime, admin: httpx.AsyncClient) -> None:
    for i in range(5):
        rec = AuditRecord(1000.0 + i, "controller", "controller_transition", "class/precise", f"r{i}", {"i": i})
        rt.overrides.record(rec)  # the store's audit log (tests/app/test_admin_changes.py: admin changes)
    d = (await admin.get("/admin/audit")).json()
    assert [r["reason"] for r in d["records"]] == ["r0", "r1", "r2", "r3", "r4"]
    assert d["records"][0] == {
        "at": 1000.0,
        "actor": "controller",
        "action": "controller_transition",
        "target": "class/precise",
        "reason": "r0",
        "detail": {"i": 0},
    }
    assert (d["size"], d["total"]) == (5, 5)
    assert [r["reason"] for r in (await admin.get("/admin/audit?limit=2")).json()["records"]] == ["r3", "r4"]
    assert [r["reason"] for r in (await admin.get("/admin/audit?since=1002.5")).json()["records"]] == ["r3", "r4"]
    for bad in ("0", "1001", "x", "1.5", "nan"):
        assert_envelope(await admin.get(f"/admin/audit?limit={bad}"), 400, "invalid_value")
    assert (await admin.get("/admin/state")).json()["audit"]["size"] == 5


def test_audit_log_is_bounded_and_logs_json_lines(caplog: pytest.LogCaptureFixture) -> None:
    log = AuditLog(capacity=3)
    with caplog.at_level(logging.INFO, logger="specgate.audit"):
        for i in range(5):
            log.append(AuditRecord.now("admin", "weight", f"endpoint/e{i}", "test", {"weight": i}))
    assert len(log) == 3
    assert log.total == 5
    assert [r.target for r in log.records()] == ["endpoint/e2", "endpoint/e3", "endpoint/e4"]
    assert log.records(limit=0) == []
    lines = [orjson.loads(JsonFormatter().format(r)) for r in caplog.records if r.name == "specgate.audit"]
    assert len(lines) == 5
    assert lines[0]["event"] == "audit"
    assert (lines[0]["actor"], lines[0]["target"], lines[0]["detail"]) == ("admin", "endpoint/e0", {"weight": 0})
    with pytest.raises(ValueError, match="capacity"):
        AuditLog(capacity=0)
