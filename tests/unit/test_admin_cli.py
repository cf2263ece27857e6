"""The admin CLI (``specgate pools | weight | drain | undrain | force | overrides | audit | reload``): its output and
its exit codes (0 ok, 1 refused, 2 usage or cannot connect, 3 authentication).

The change routes are exercised against a stub admin app in this file that answers as the contract says (and
checks every body against the OpenAPI request schemas), so these tests do not depend on the real routes' progress;
``pools``, ``audit`` and ``reload`` also run against the real admin app.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from typer.testing import CliRunner

from gateway.admin import client as ac
from gateway.admin.app import create_admin_app
from gateway.admin.openapi import openapi
from gateway.cli.main import app
from gateway.config.settings import Settings
from gateway.overrides.audit import AuditRecord
from gateway.proxy.app import create_app
from gateway.runtime.container import Runtime
from tests.conftest import ServerThread, closed_port_url, rules_for

TOKEN = "admin-cli-token"
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "SPECGATE_ADMIN_TOKEN": TOKEN}
POOLS = {"spec": ["spec-0"], "std": ["std-0"]}
CLASSES = {"precise", "creative"}


def _error(status: int, message: str, code: str, param: str | None = None, **extra: Any) -> Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code, **extra}}
    return JSONResponse(body, status)


def _override(kind: str, body: dict[str, Any], **target: Any) -> dict[str, Any]:
    ttl = body.get("ttl", 3600)
    now = time.time()
    value = body.get("weight", body.get("route"))
    return {
        "id": "ovr_0123456789ab",
        "kind": kind,
        "pool": target.get("pool"),
        "endpoint": target.get("endpoint"),
        "class": target.get("klass"),
        "value": value,
        "reason": body.get("reason"),
        "actor": "admin:ab12",
        "created_at": now,
        "expires_at": None if ttl == "never" else now + (ttl if isinstance(ttl, int | float) else 1800),
    }


def stub_admin_app() -> Starlette:
    """The contract's change routes, answering canned objects; bodies are checked against the OpenAPI schemas."""
    doc = openapi()
    seen: list[tuple[str, str, Any, dict[str, str]]] = []

    async def handle(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return _error(401, "invalid admin token", "invalid_admin_token")
        route = request.scope["route"]
        body = orjson.loads(await request.body() or b"null")
        seen.append((request.method, request.url.path, body, dict(request.query_params)))
        op = doc["paths"][route.path][request.method.lower()]
        if "requestBody" in op:
            schema = {**op["requestBody"]["content"]["application/json"]["schema"], "components": doc["components"]}
            try:
                jsonschema.validate(body, schema)
            except jsonschema.ValidationError as exc:
                return _error(400, f"schema: {exc.message}", "invalid_value")
        p = request.path_params
        if "pool" in p and p["pool"] not in POOLS:
            return _error(404, f"unknown pool {p['pool']!r}", "pool_not_found", "pool")
        if "endpoint" in p and p["endpoint"] not in POOLS[p["pool"]]:
            return _error(404, f"unknown endpoint {p['endpoint']!r}", "endpoint_not_found", "endpoint")
        if "class" in p and p["class"] not in CLASSES:
            return _error(404, f"unknown class {p['class']!r}", "class_not_found", "class")
        path = route.path
        if path.endswith("/undrain"):
            return JSONResponse({"removed": [_override("drain", {"reason": "x"}, pool=p["pool"])]})
        if path.endswith("/drain"):
            return JSONResponse({"override": _override("drain", body, pool=p["pool"])})
        if path.endswith("/weight"):
            kind = "endpoint_weight" if "endpoint" in p else "pool_weight"
            return JSONResponse({"override": _override(kind, body, pool=p["pool"], endpoint=p.get("endpoint"))})
        if path.endswith("/route"):
            if body["route"] == "auto":
                return JSONResponse({"removed": []})
            return JSONResponse({"override": _override("class_route", body, klass=p["class"])})
        if path == "/admin/overrides/{id}":
            if p["id"] != "ovr_0123456789ab":
                return _error(404, f"no active override {p['id']!r}", "override_not_found", "id")
            return JSONResponse({"removed": _override("drain", {"reason": "x"}, pool="spec")})
        if path == "/admin/overrides":
            return JSONResponse(
                {"overrides": [_override("pool_weight", {"weight": 0, "reason": "deploy"}, pool="std")]}
            )
        # /admin/reload: the first answers ok, then invalid
        if sum(1 for s in seen if s[1] == "/admin/reload") == 1:
            return JSONResponse({"result": "ok", "version": 2, "hash": "abc123", "dropped_overrides": []})
        issues = [{"path": "pools[0].endpoints", "line": 7, "message": "must not be empty"}]
        return _error(422, "rules.yaml: the routing YAML was rejected (1 error)", "invalid_config", errors=issues)

    methods = {"put": "PUT", "post": "POST", "delete": "DELETE", "get": "GET"}
    routes = [
        Route(path, handle, methods=[methods[m] for m in ops])
        for path, ops in doc["paths"].items()
        if path not in ("/admin/state", "/admin/explain", "/admin/audit", "/admin/config", "/admin/openapi.json")
    ]
    stub = Starlette(routes=routes)
    stub.state.seen = seen
    return stub


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, list[Any]]]:
    a = stub_admin_app()
    server = ServerThread(a).start()
    yield server.url, a.state.seen
    server.stop()


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Runtime]]:
    path = tmp_path_factory.mktemp("admin-cli") / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    rt: Runtime = create_app(Settings(rules=path, api_keys="client-key")).state.runtime
    server = ServerThread(create_admin_app(rt, TOKEN)).start()
    yield server.url, rt
    server.stop()


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, list(args), env=ENV if env is None else env)


def words(output: str) -> list[list[str]]:
    return [line.split() for line in output.splitlines()]


# --- against the stub: every change command, its body, its output ------------------------------------------------


def test_weight_drain_undrain_force_send_the_contract_bodies(stub: tuple[str, list[Any]]) -> None:
    url, seen = stub
    r = invoke("weight", "spec", "0", "--ttl", "30m", "--reason", "vllm upgrade", "--url", url)
    assert r.exit_code == 0, r.output
    assert "done: pool spec: weight 0, expires in 29m" in r.output
    assert seen[-1][:3] == ("PUT", "/admin/pools/spec/weight", {"weight": 0, "ttl": 1800, "reason": "vllm upgrade"})

    r = invoke("weight", "spec/spec-0", "2.5", "--ttl", "never", "--reason", "canary", "--url", url)
    assert r.exit_code == 0, r.output
    assert "endpoint spec/spec-0: weight 2.50, expires never (until removed)" in r.output
    assert seen[-1][1:3] == (
        "/admin/pools/spec/endpoints/spec-0/weight",
        {"weight": 2.5, "ttl": "never", "reason": "canary"},
    )

    r = invoke("drain", "std", "--reason", "node reboot", "--url", url)  # no --ttl: the YAML default
    assert r.exit_code == 0, r.output
    assert "done: pool std: drained, expires in 59m" in r.output
    assert seen[-1][:3] == ("POST", "/admin/pools/std/drain", {"reason": "node reboot"})

    r = invoke("undrain", "std", "--reason", "back", "--url", url)
    assert r.exit_code == 0, r.output
    assert "removed 1 override(s)" in r.output
    assert seen[-1][2] == {"reason": "back"}

    r = invoke("force", "precise", "standard", "--ttl", "2h", "--reason", "spec pool degraded", "--url", url)
    assert r.exit_code == 0, r.output
    assert "done: class precise: route standard, expires in 1h59m" in r.output
    assert seen[-1][:3] == (
        "PUT",
        "/admin/classes/precise/route",
        {"route": "standard", "ttl": 7200, "reason": "spec pool degraded"},
    )

    r = invoke("force", "precise", "auto", "--reason", "recovered", "--url", url, "--json")
    assert r.exit_code == 0, r.output
    assert orjson.loads(r.stdout) == {"removed": []}


def test_overrides_list_and_remove(stub: tuple[str, list[Any]]) -> None:
    url, seen = stub
    r = invoke("overrides", "--url", url)
    assert r.exit_code == 0, r.output
    assert "1 active override(s)" in r.output
    row = next(w for w in words(r.output) if w and w[0] == "ovr_0123456789ab")
    assert row[:7] == ["ovr_0123456789ab", "pool_weight", "pool", "std", "weight", "0", "in"]
    r = invoke("overrides", "--remove", "ovr_0123456789ab", "--reason", "done", "--url", url)
    assert r.exit_code == 0, r.output
    assert "removed 1 override(s)" in r.output
    assert seen[-1][:2] == ("DELETE", "/admin/overrides/ovr_0123456789ab")
    assert seen[-1][3] == {"reason": "done"}
    r = invoke("overrides", "--remove", "ovr_ffffffffffff", "--reason", "done", "--url", url)
    assert r.exit_code == 1
    assert "the admin API answered 404: no active override 'ovr_ffffffffffff'" in r.output


def test_reload_ok_then_errors_exit_1(stub: tuple[str, list[Any]]) -> None:
    url, _ = stub
    r = invoke("reload", "--url", url)
    assert r.exit_code == 0, r.output
    assert "ok: version 2, hash abc123" in r.output
    r = invoke("reload", "--url", url)
    assert r.exit_code == 1
    assert "the admin API answered 422 with 1 error(s) (nothing was changed):" in r.output
    assert "pools[0].endpoints (line 7): must not be empty" in r.output
    r = invoke("reload", "--url", url, "--json")
    assert r.exit_code == 1
    assert orjson.loads(r.stdout)["error"]["code"] == "invalid_config"


def test_refusals_exit_1_with_the_message(stub: tuple[str, list[Any]]) -> None:
    url, _ = stub
    r = invoke("drain", "nope", "--reason", "x", "--url", url)
    assert r.exit_code == 1
    assert "the admin API answered 404: unknown pool 'nope'" in r.output
    r = invoke("weight", "spec/spec-9", "1", "--reason", "x", "--url", url)
    assert r.exit_code == 1
    assert "unknown endpoint 'spec-9'" in r.output
    r = invoke("force", "nope", "standard", "--reason", "x", "--url", url)
    assert r.exit_code == 1
    assert "unknown class 'nope'" in r.output


def test_authentication_failures_exit_3_and_say_what_to_do(stub: tuple[str, list[Any]]) -> None:
    url, _ = stub
    r = invoke("drain", "spec", "--reason", "x", "--url", url, env={"COLUMNS": "200"})
    assert r.exit_code == 3
    assert "401" in r.output
    assert "Set SPECGATE_ADMIN_TOKEN to the gateway's admin token" in r.output
    r = invoke("overrides", "--url", url, env={**ENV, "SPECGATE_ADMIN_TOKEN": "wrong"})
    assert r.exit_code == 3
    assert "SPECGATE_ADMIN_TOKEN is not the gateway's admin token" in r.output


def test_usage_errors_exit_2_before_sending_anything(stub: tuple[str, list[Any]]) -> None:
    url, seen = stub
    before = len(seen)
    r = invoke("drain", "spec", "--url", url)  # --reason is required
    assert r.exit_code == 2
    assert "--reason" in r.output
    r = invoke("drain", "spec", "--ttl", "soon", "--reason", "x", "--url", url)
    assert r.exit_code == 2
    assert "'soon' is not a duration" in r.output
    r = invoke("weight", "spec", "-1", "--reason", "x", "--url", url)
    assert r.exit_code == 2
    r = invoke("weight", "a/b/c", "1", "--reason", "x", "--url", url)
    assert r.exit_code == 2
    assert "expected POOL or POOL/ENDPOINT" in r.output
    r = invoke("force", "precise", "fast", "--reason", "x", "--url", url)
    assert r.exit_code == 2
    assert "route must be one of speculative, standard, auto" in r.output
    r = invoke("drain", "spec", "--reason", "   ", "--url", url)
    assert r.exit_code == 2
    assert "--reason must not be empty" in r.output
    r = invoke("overrides", "--remove", "ovr_0123456789ab", "--url", url)
    assert r.exit_code == 2
    assert "--remove needs --reason" in r.output
    r = invoke("audit", "--since", "yesterday", "--url", url)
    assert r.exit_code == 2
    assert len(seen) == before


def test_cannot_connect_exits_2_and_names_admin_port_and_url() -> None:
    for args in (["pools"], ["drain", "spec", "--reason", "x"], ["reload"]):
        r = invoke(*args, "--url", closed_port_url())
        assert r.exit_code == 2, args
        assert "cannot reach the admin API" in r.output
        assert "--admin-port" in r.output
        assert "--url" in r.output
    r = invoke("pools", "--url", "ftp://nowhere")
    assert r.exit_code == 2
    assert "bad --url" in r.output


def test_url_from_the_environment(stub: tuple[str, list[Any]]) -> None:
    url, _ = stub
    r = invoke("overrides", env={**ENV, "SPECGATE_ADMIN_URL": url})
    assert r.exit_code == 0, r.output


def test_help_documents_the_exit_codes() -> None:
    for command in ("pools", "weight", "drain", "undrain", "force", "overrides", "audit", "reload"):
        r = invoke(command, "--help")
        assert r.exit_code == 0
        text = " ".join(r.output.split())
        assert "Exit codes: 0 ok; 1 the admin API refused" in text, command
        assert "3 authentication failed" in text, command


# --- against the real admin app -----------------------------------------------------------------------------------


def test_pools_table_from_the_real_state(real: tuple[str, Runtime]) -> None:
    url, _ = real
    r = invoke("pools", "--url", url)
    assert r.exit_code == 0, r.output
    header = words(r.output)[2]
    assert header[:5] == ["pool", "kind", "endpoint", "state", "weight"]
    rows = {w[0]: w for w in words(r.output) if w and w[0] in POOLS}
    assert rows["spec"][:5] == ["spec", "speculative", "spec-0", "ok", "1"]
    assert rows["std"][:5] == ["std", "standard", "std-0", "ok", "1"]
    assert "config " in r.output
    r = invoke("pools", "--url", url, "--json")
    assert r.exit_code == 0
    assert set(orjson.loads(r.stdout)["pools"]) == set(POOLS)


def test_reload_against_the_real_app(real: tuple[str, Runtime]) -> None:
    r = invoke("reload", "--url", real[0])  # the file has not changed
    assert r.exit_code == 0, r.output
    assert r.output.startswith("unchanged: version 1, hash ")


def test_audit_table_limit_and_since_against_the_real_app(real: tuple[str, Runtime]) -> None:
    url, rt = real
    # wherever GET /admin/audit reads from: the store (through rt.overrides) when there, else the local log
    overrides = getattr(rt, "overrides", None)
    record = overrides.record if overrides is not None else rt.audit.append
    now = time.time()
    record(AuditRecord(now - 7200, "controller", "controller_transition", "class/precise", "two hours ago", {}))
    record(AuditRecord(now - 5, "admin:ab12", "pool_weight", "pool/spec", "vllm upgrade", {"weight": 0}))
    r = invoke("audit", "--url", url)
    assert r.exit_code == 0, r.output
    assert "vllm upgrade" in r.output
    assert "two hours ago" in r.output
    assert '{"weight":0}' in r.output
    assert r.output.index("vllm upgrade") < r.output.index("two hours ago")  # newest first, as in the console
    r = invoke("audit", "--url", url, "--since", "1h")
    assert r.exit_code == 0, r.output
    assert "vllm upgrade" in r.output
    assert "two hours ago" not in r.output
    every = orjson.loads(invoke("audit", "--url", url, "--json").stdout)["records"]
    r = invoke("audit", "--url", url, "--limit", "1", "--json")
    assert r.exit_code == 0
    assert orjson.loads(r.stdout)["records"] == every[-1:]


def test_on_call_changes_end_to_end_against_the_real_app(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    rt: Runtime = create_app(Settings(rules=path)).state.runtime
    server = ServerThread(create_admin_app(rt, TOKEN)).start()
    url = server.url
    try:
        assert invoke("weight", "spec", "0", "--ttl", "30m", "--reason", "vllm upgrade", "--url", url).exit_code == 0
        assert invoke("drain", "std", "--reason", "node reboot", "--url", url).exit_code == 0
        r = invoke("force", "precise", "standard", "--ttl", "never", "--reason", "spec degraded", "--url", url)
        assert r.exit_code == 0, r.output
        r = invoke("pools", "--url", url)
        assert r.exit_code == 0, r.output
        rows = {w[0]: w for w in words(r.output) if w and w[0] in POOLS}
        assert rows["spec"][:5] == ["spec", "speculative", "spec-0", "ok", "1→0"]  # configured 1, effective 0
        assert rows["std"][:4] == ["std", "standard", "std-0", "drained"]
        r = invoke("overrides", "--url", url, "--json")
        active = {o["kind"]: o for o in orjson.loads(r.stdout)["overrides"]}
        assert set(active) == {"pool_weight", "drain", "class_route"}
        assert active["class_route"]["expires_at"] is None
        r = invoke("overrides", "--remove", active["pool_weight"]["id"], "--reason", "upgrade done", "--url", url)
        assert r.exit_code == 0, r.output
        assert "removed 1 override(s)" in r.output
        assert invoke("undrain", "std", "--reason", "back", "--url", url).exit_code == 0
        assert invoke("force", "precise", "auto", "--reason", "recovered", "--url", url).exit_code == 0
        r = invoke("overrides", "--url", url)
        assert r.exit_code == 0
        assert "no active overrides" in r.output
        r = invoke("drain", "nope", "--reason", "x", "--url", url)
        assert r.exit_code == 1
        assert "unknown pool 'nope'" in r.output
        r = invoke("audit", "--url", url)
        assert r.exit_code == 0, r.output
        assert f"{active['pool_weight']['id']}: weight 0, until" in r.output
    finally:
        server.stop()


def test_auth_against_the_real_app(real: tuple[str, Runtime]) -> None:
    url, _ = real
    r = invoke("pools", "--url", url, env={"COLUMNS": "200"})
    assert r.exit_code == 3
    assert "missing admin token" in r.output
    assert "Set SPECGATE_ADMIN_TOKEN" in r.output
    r = invoke("audit", "--url", url, "--limit", "0")
    assert r.exit_code == 2  # typer refuses it before sending


def test_changes_refused_without_a_gateway_token_exit_3(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    rt: Runtime = create_app(Settings(rules=path)).state.runtime
    server = ServerThread(create_admin_app(rt, None)).start()
    try:
        r = invoke("reload", "--url", server.url, env={"COLUMNS": "200"})
        assert r.exit_code == 3, r.output
        assert "refuses changes" in r.output
        assert "set it on the gateway and restart" in r.output
        r = invoke("pools", "--url", server.url, env={"COLUMNS": "200"})  # reading needs no token here
        assert r.exit_code == 0, r.output
    finally:
        server.stop()


def test_not_a_specgate_admin_api_exits_2(stub: tuple[str, list[Any]]) -> None:
    url, _ = stub
    r = invoke("pools", "--url", url)  # the stub has no /admin/state: a plain-text 404
    assert r.exit_code == 2
    assert "is this the gateway's admin port" in r.output


# --- pure helpers ---------------------------------------------------------------------------------------------------


def test_durations_and_since() -> None:
    assert [ac.parse_ttl(x) for x in ("90", "90s", "30m", "2h", "1d", "1.5h", "never", None)] == [
        90,
        90,
        1800,
        7200,
        86400,
        5400,
        "never",
        None,
    ]
    for bad in ("0", "-5m", "soon", "5w", ""):
        with pytest.raises(ValueError, match="duration"):
            ac.parse_ttl(bad)
    assert ac.parse_since("30m", now=10_000) == 8200
    assert ac.parse_since("1767225600") == 1767225600
    assert ac.parse_since("2026-01-01T00:00:00+00:00") == 1767225600
    assert ac.expires_text(None) == "never (until removed)"
    assert ac.expires_text(1000.0, now=2000.0).startswith("expired")
    assert ac.expires_text(2000.0 + 3 * 3600 + 120, now=2000.0).startswith("in 3h02m")


def test_the_pools_table_counts_every_workers_requests() -> None:
    from gateway.cli.admin import cluster_in_flight

    pool = {"in_flight": 2, "cluster_in_flight": 7}
    assert cluster_in_flight(pool, {"in_flight": 2, "remote_in_flight": 5}) == 7  # not the answering worker's 2
    assert cluster_in_flight(pool, {"in_flight": 2}) == 2  # a single process: nothing remote
    assert cluster_in_flight(pool, {}) == 7  # a pool without endpoints: the pool's total
