"""The OpenAPI description of the admin API is kept correct: it describes exactly the admin app's routes (read from
``create_admin_app(...).routes``, never a list written here), its structure holds, the bodies the CLI sends
validate against its request schemas, and the real read-only answers validate against its response schemas."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
import yaml
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.admin import client as ac
from gateway.admin.app import create_admin_app
from gateway.admin.openapi import openapi
from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.runtime.container import Runtime
from tests.conftest import closed_port_url, rules_for

TOKEN = "admin-openapi-token"
METHODS = {"get", "put", "post", "delete", "patch"}

# A minimal structural schema for an OpenAPI 3.1 document (openapi-spec-validator is not a dependency).
OPERATION = {
    "type": "object",
    "required": ["summary", "responses"],
    "properties": {
        "summary": {"type": "string"},
        "parameters": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "in", "schema"],
                "properties": {"in": {"enum": ["path", "query", "header"]}, "name": {"type": "string"}},
            },
        },
        "requestBody": {
            "type": "object",
            "required": ["content"],
            "properties": {"content": {"type": "object", "required": ["application/json"]}},
        },
        "responses": {
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"pattern": "^[1-5][0-9][0-9]$"},
            "additionalProperties": {
                "type": "object",
                "anyOf": [{"required": ["description"]}, {"required": ["$ref"]}],
            },
        },
    },
}
OPENAPI_31 = {
    "type": "object",
    "required": ["openapi", "info", "paths", "components"],
    "properties": {
        "openapi": {"type": "string", "pattern": r"^3\.1\.\d+$"},
        "info": {"type": "object", "required": ["title", "version"]},
        "paths": {
            "type": "object",
            "propertyNames": {"pattern": "^/admin/"},
            "additionalProperties": {
                "type": "object",
                "propertyNames": {"enum": sorted(METHODS)},
                "additionalProperties": OPERATION,
            },
        },
        "components": {
            "type": "object",
            "required": ["schemas", "securitySchemes"],
            "properties": {
                "securitySchemes": {
                    "type": "object",
                    "required": ["bearerAuth"],
                    "properties": {"bearerAuth": {"const": {"type": "http", "scheme": "bearer"}}},
                }
            },
        },
        "security": {"const": [{"bearerAuth": []}]},
    },
}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return openapi()


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    path = tmp_path_factory.mktemp("openapi") / "rules.yaml"
    path.write_text(yaml.safe_dump(rules_for([closed_port_url()], [closed_port_url()])))
    runtime: Runtime = create_app(Settings(rules=path, api_keys="client-key")).state.runtime
    return runtime


@pytest.fixture(scope="module")
def admin_app(rt: Runtime) -> Starlette:
    return create_admin_app(rt, TOKEN)


@pytest.fixture
async def client(admin_app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"authorization": f"Bearer {TOKEN}"}
    transport = httpx.ASGITransport(app=admin_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=headers) as c:
        yield c


def app_operations(app: Starlette) -> set[tuple[str, str]]:
    ops: set[tuple[str, str]] = set()
    for route in app.routes:
        assert isinstance(route, Route), f"an admin route the test cannot read: {route!r}"
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # "{id:str}" → "{id}"
        for method in route.methods or ():
            if method != "HEAD":  # Starlette adds HEAD to every GET
                ops.add((path, method.lower()))
    return ops


def doc_operations(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, item in doc["paths"].items() for method in item}


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


def validator(doc: dict[str, Any], schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A validator for a schema inside the document: its "#/components/..." references resolve."""
    return jsonschema.Draft202012Validator({**schema, "components": doc["components"]})


def request_schema(doc: dict[str, Any], call: ac.Call) -> dict[str, Any]:
    op = doc["paths"][call.template][call.method.lower()]
    schema: dict[str, Any] = op["requestBody"]["content"]["application/json"]["schema"]
    return schema


def test_every_route_is_described_and_every_description_is_a_route(admin_app: Starlette, doc: dict[str, Any]) -> None:
    routes, described = app_operations(admin_app), doc_operations(doc)
    assert routes - described == set(), "admin routes missing from gateway/admin/openapi.py"
    assert described - routes == set(), "described in gateway/admin/openapi.py but not an admin route"


def test_the_document_structure(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, OPENAPI_31)
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    refs: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    assert refs
    for ref in refs:
        resolve(doc, ref)  # every reference points somewhere
    for path, item in doc["paths"].items():
        in_template = set(re.findall(r"\{(\w+)\}", path))
        for method, op in item.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == in_template, (path, method)
            errors = [s for s in op["responses"] if s != "200"]
            if op.get("security") == []:  # the console's page and files: no data, no token (test_admin_console)
                assert path.startswith("/admin/ui"), (path, method)
                assert set(op["responses"]["200"]["content"]) <= {"text/html", "text/javascript"}, (path, method)
                assert "401" not in errors, (path, method)
                continue
            assert op["responses"]["200"]["content"]["application/json"]["schema"], (path, method)
            assert "401" in errors, (path, method)  # every other route sits behind the token


@pytest.mark.parametrize(
    "call",
    [
        ac.weight_call("spec", 0, "30m", "vllm upgrade"),
        ac.weight_call("spec", 2.5, None, "more"),
        ac.weight_call("spec/spec-0", 1, "never", "canary"),
        ac.drain_call("std", "2h", "node reboot"),
        ac.drain_call("std", None, "node reboot"),
        ac.undrain_call("std", "back"),
        ac.force_call("precise", "standard", "1d", "spec degraded"),
        ac.force_call("precise", "speculative", "90", "x"),
        ac.force_call("precise", "auto", None, "recovered"),
    ],
    ids=lambda c: f"{c.method} {c.path}",
)
def test_the_cli_request_bodies_validate(doc: dict[str, Any], call: ac.Call) -> None:
    assert call.body is not None
    validator(doc, request_schema(doc, call)).validate(call.body)


def test_the_request_schemas_refuse_bad_bodies(doc: dict[str, Any]) -> None:
    good = ac.weight_call("spec", 1, "30m", "why")
    v = validator(doc, request_schema(doc, good))
    assert good.body is not None
    for bad in (
        {"weight": -1, "reason": "why"},
        {"weight": 1},
        {"weight": 1, "reason": ""},
        {"weight": 1, "reason": "x" * 501},
        {"weight": 1, "reason": "why", "ttl": "soon"},
        {"weight": 1, "reason": "why", "ttl": 0},
        {**good.body, "ttl_s": 5},
    ):
        assert not v.is_valid(bad), bad
    route = validator(doc, request_schema(doc, ac.force_call("c", "auto", None, "x")))
    assert not route.is_valid({"route": "fast", "reason": "x"})


def test_the_cli_query_parameters_are_described(doc: dict[str, Any]) -> None:
    for call in (ac.remove_override_call("ovr_0123456789ab", "done"), ac.audit_call(10, 1767225600.0)):
        op = doc["paths"][call.template][call.method.lower()]
        described = {p["name"] for p in op["parameters"] if p["in"] == "query"}
        assert set(call.params or {}) <= described


async def test_it_is_served_behind_the_token(client: httpx.AsyncClient, doc: dict[str, Any]) -> None:
    r = await client.get("/admin/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == doc
    r = await client.get("/admin/openapi.json", headers={"authorization": "Bearer client-key"})
    assert r.status_code == 401


async def test_real_answers_validate_against_the_response_schemas(
    client: httpx.AsyncClient, admin_app: Starlette, doc: dict[str, Any]
) -> None:
    """Every GET without path parameters that the app has, and the error envelope of a refused request."""
    checked = []
    for path, method in sorted(app_operations(admin_app)):
        if method != "get" or "{" in path or (path, method) not in doc_operations(doc):
            continue
        r = await client.get(path)
        assert r.status_code == 200, (path, r.text)
        content = doc["paths"][path]["get"]["responses"]["200"]["content"]
        if "application/json" not in content:  # the console's page
            assert r.headers["content-type"].split(";")[0] in content, path
            continue
        schema = content["application/json"]["schema"]
        validator(doc, schema).validate(r.json())
        checked.append(path)
    assert "/admin/state" in checked
    assert "/admin/audit" in checked
    r = await client.get("/admin/audit", params={"limit": "0"})
    assert r.status_code == 400
    validator(doc, resolve(doc, "#/components/schemas/Error")).validate(r.json())


async def test_reload_answer_validates(client: httpx.AsyncClient, admin_app: Starlette, doc: dict[str, Any]) -> None:
    if ("/admin/reload", "post") not in app_operations(admin_app):
        pytest.skip("no reload route yet")
    r = await client.post("/admin/reload")
    assert r.status_code == 200, r.text
    schema = doc["paths"]["/admin/reload"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    validator(doc, schema).validate(r.json())


def test_the_document_is_built_afresh(doc: dict[str, Any]) -> None:
    mutated = openapi()
    mutated["paths"].clear()
    assert openapi() == doc
