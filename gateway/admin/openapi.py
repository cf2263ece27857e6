"""The OpenAPI 3.1 description of the admin API, served at ``GET /admin/openapi.json``.

The paths and their operations are here; the schemas of the bodies and the shared error answers are
``gateway.admin.openapi_schemas``. ``openapi()`` builds a fresh dict on every call (no module-level mutable state).
``tests/app/test_admin_openapi.py`` keeps it correct: every route of ``create_admin_app`` is described here and
everything described here is a route, and the request bodies the CLI sends validate against the request schemas.
"""

from __future__ import annotations

from typing import Any

from gateway import __version__
from gateway.admin.openapi_schemas import json_content, ref, responses, schemas
from gateway.admin.protocol import MAX_REASON


def _ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": json_content(schema)}


def _err(description: str) -> dict[str, Any]:
    return {"$ref": f"#/components/responses/{description}"}


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def _body(schema_name: str, description: str) -> dict[str, Any]:
    return {"required": True, "description": description, "content": json_content(ref(schema_name))}


def _change(
    summary: str, params: list[dict[str, Any]], body: dict[str, Any] | None, ok: dict[str, Any], *, found: bool = True
) -> dict[str, Any]:
    """A route that changes something: refused with 403 while the gateway has no admin token; an override change
    (``found``: it names a target) with 409 while several workers have their own state."""
    op: dict[str, Any] = {
        "summary": summary,
        "tags": ["changes"],
        "responses": {
            "200": ok,
            "400": _err("BadRequest"),
            "401": _err("Unauthorized"),
            "403": _err("ChangesRefused"),
            **({"404": _err("NotFound")} if found else {}),
            **({"409": _err("PerWorkerState")} if found else {}),
        },
    }
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = body
    return op


def _read(summary: str, ok: dict[str, Any], params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "tags": ["read-only"],
        "responses": {"200": ok, "400": _err("BadRequest"), "401": _err("Unauthorized")},
    }
    if params:
        op["parameters"] = params
    return op


def _public(summary: str, media_type: str, params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A file of the console (``gateway.admin.ui``): the same bytes for everyone, so no token (``security: []``);
    the page then calls the other routes with the token."""
    op: dict[str, Any] = {
        "summary": summary,
        "tags": ["console"],
        "security": [],
        "responses": {
            "200": {"description": "The file, with a strict Content-Security-Policy.", "content": {media_type: {}}},
            "404": _err("NotFound"),
        },
    }
    if params:
        op["parameters"] = params
    return op


def openapi() -> dict[str, Any]:
    """The whole description, built afresh."""
    pool = _path_param("pool", "a pool name from the routing YAML")
    endpoint = _path_param("endpoint", "an endpoint id within the pool")
    klass = _path_param("class", "a traffic class name")
    reason_query = {
        "name": "reason",
        "in": "query",
        "required": False,
        "schema": {"type": "string", "maxLength": MAX_REASON},
        "description": "Why (kept in the audit log).",
    }
    override = _ok("The override now in force.", ref("OverrideAnswer"))
    paths: dict[str, Any] = {
        "/admin/state": {
            "get": _read(
                "Pools, endpoints, weights, load, classes and controllers, config", _ok("OK", ref("StateAnswer"))
            )
        },
        "/admin/explain": {
            "post": {
                **_read(
                    "Why a request would go where it goes (sends nothing upstream)",
                    _ok("The explanation", {"type": "object"}),
                    [
                        {
                            "name": "path",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "string", "default": "/v1/chat/completions"},
                            "description": "The client path the request would go to.",
                        }
                    ],
                ),
                "requestBody": {
                    "required": True,
                    "description": "The request body exactly as a client would POST it.",
                    "content": json_content({"type": "object"}),
                },
            }
        },
        "/admin/audit": {
            "get": _read(
                "The newest audit records, oldest first",
                _ok("OK", ref("AuditAnswer")),
                [
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                    {"name": "since", "in": "query", "schema": {"type": "number"}, "description": "epoch seconds"},
                ],
            )
        },
        "/admin/config": {"get": _read("The routing YAML in force", _ok("OK", ref("ConfigAnswer")))},
        "/admin/overrides": {"get": _read("The active overrides", _ok("OK", ref("OverridesAnswer")))},
        "/admin/openapi.json": {"get": _read("This description", _ok("OpenAPI 3.1", {"type": "object"}))},
        "/admin/pools/{pool}/weight": {
            "put": _change("Set a pool's weight", [pool], _body("WeightChange", "the weight"), override)
        },
        "/admin/pools/{pool}/endpoints/{endpoint}/weight": {
            "put": _change("Set one endpoint's weight", [pool, endpoint], _body("WeightChange", "the weight"), override)
        },
        "/admin/pools/{pool}/drain": {
            "post": _change("Drain a pool (requests in flight finish)", [pool], _body("DrainChange", "why"), override)
        },
        "/admin/pools/{pool}/undrain": {
            "post": _change(
                "End a pool's drain",
                [pool],
                _body("UndrainChange", "why"),
                _ok("The drains removed.", ref("RemovedAnswer")),
            )
        },
        "/admin/classes/{class}/route": {
            "put": _change(
                "Force a class's route; auto removes the force",
                [klass],
                _body("RouteChange", "the route"),
                _ok(
                    "speculative|standard: the override; auto: the overrides removed",
                    {"oneOf": [ref("OverrideAnswer"), ref("RemovedAnswer")]},
                ),
            )
        },
        "/admin/overrides/{id}": {
            "delete": _change(
                "Remove an override",
                [_path_param("id", "ovr_<12 hex>"), reason_query],
                None,
                _ok("The override removed.", ref("RemovedOneAnswer")),
            )
        },
        "/admin/ui": {"get": _public("The on-call console: one HTML page (no data in it)", "text/html")},
        "/admin/ui/assets/{name}": {
            "get": _public(
                "A file of the console: console.css, main.js, api.js, view.js, panels.js, actions.js",
                "text/javascript",
                [_path_param("name", "the file's name")],
            )
        },
        "/admin/reload": {
            "post": {
                **_change("Re-read the routing YAML now", [], None, _ok("OK", ref("ReloadAnswer")), found=False),
            }
        },
    }
    reload_responses = paths["/admin/reload"]["post"]["responses"]
    reload_responses["422"] = {
        "description": "The new YAML is invalid: nothing changed; error.errors lists every path-named error.",
        "content": json_content(ref("Error")),
    }
    reload_responses["500"] = {"description": "The reload failed.", "content": json_content(ref("Error"))}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "specgate admin API",
            "version": __version__,
            "description": "A listener of its own (--admin-port, loopback by default). With SPECGATE_ADMIN_TOKEN set, "
            "every route needs 'Authorization: Bearer <token>'; without it, read-only routes answer anyone who "
            "can reach the listener and every change is refused (403). Errors use the OpenAI envelope.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas(),
            "responses": responses(),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearerAuth": []}],
    }
