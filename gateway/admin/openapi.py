"""The OpenAPI 3.1 description of the admin API, served at ``GET /admin/openapi.json``.

``openapi()`` builds a fresh dict on every call (no module-level mutable state). ``tests/app/test_admin_openapi.py``
keeps it correct: every route of ``create_admin_app`` is described here and everything described here is a route,
and the request bodies the CLI sends validate against the request schemas below.
"""

from __future__ import annotations

from typing import Any

from gateway import __version__
from gateway.admin.protocol import MAX_REASON

CLASS_ROUTES = ["speculative", "standard", "auto"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ok(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": _json_content(schema)}


def _err(description: str) -> dict[str, Any]:
    return {"$ref": f"#/components/responses/{description}"}


def _path_param(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def _body(schema_name: str, description: str) -> dict[str, Any]:
    return {"required": True, "description": description, "content": _json_content(_ref(schema_name))}


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


def _schemas() -> dict[str, Any]:
    nullable_str = {"type": ["string", "null"]}
    nullable_num = {"type": ["number", "null"]}
    ttl = {
        "description": "How long the change lasts: seconds, or '90s' | '30m' | '2h' | '1d'; 'never' = until removed "
        "(only when asked explicitly). Missing: the YAML's admin.default_ttl_s (at most admin.max_ttl_s).",
        "anyOf": [
            {"type": "number", "exclusiveMinimum": 0},
            {"type": "string", "pattern": "^[0-9]+[smhd]$"},
            {"const": "never"},
        ],
    }
    reason = {
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_REASON,
        "description": "Why: kept in the audit log.",
    }
    override_list = {"type": "array", "items": _ref("Override")}
    return {
        "Error": {
            "type": "object",
            "description": "The OpenAI error envelope; a refused reload adds error.errors (every path-named error).",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": nullable_str,
                        "code": nullable_str,
                        "errors": {"type": "array", "items": _ref("ConfigIssue")},
                    },
                }
            },
        },
        "ConfigIssue": {
            "type": "object",
            "required": ["path", "message"],
            "properties": {
                "path": {"type": "string"},
                "line": {"type": ["integer", "null"]},
                "message": {"type": "string"},
            },
        },
        "Ttl": ttl,
        "Reason": reason,
        "Override": {
            "type": "object",
            "required": [
                "id",
                "kind",
                "pool",
                "endpoint",
                "class",
                "value",
                "reason",
                "actor",
                "created_at",
                "expires_at",
            ],
            "properties": {
                "id": {"type": "string", "pattern": "^ovr_[0-9a-f]{12}$"},
                "kind": {"enum": ["pool_weight", "endpoint_weight", "drain", "class_route"]},
                "pool": nullable_str,
                "endpoint": nullable_str,
                "class": nullable_str,
                "value": {
                    "description": "weights: the weight; class_route: the forced route; drain: null",
                    "anyOf": [
                        {"type": "number", "minimum": 0},
                        {"enum": ["speculative", "standard"]},
                        {"type": "null"},
                    ],
                },
                "reason": {"type": "string"},
                "actor": {
                    "type": "string",
                    "description": "the X-Specgate-Actor header (the CLI sends SPECGATE_ADMIN_ACTOR), else 'admin'",
                },
                "created_at": {"type": "number", "description": "epoch seconds"},
                "expires_at": {**nullable_num, "description": "epoch seconds; null: until removed"},
            },
        },
        "WeightChange": {
            "type": "object",
            "required": ["weight", "reason"],
            "additionalProperties": False,
            "properties": {"weight": {"type": "number", "minimum": 0}, "ttl": _ref("Ttl"), "reason": _ref("Reason")},
        },
        "DrainChange": {
            "type": "object",
            "required": ["reason"],
            "additionalProperties": False,
            "properties": {"ttl": _ref("Ttl"), "reason": _ref("Reason")},
        },
        "UndrainChange": {
            "type": "object",
            "required": ["reason"],
            "additionalProperties": False,
            "properties": {"reason": _ref("Reason")},
        },
        "RouteChange": {
            "type": "object",
            "required": ["route", "reason"],
            "additionalProperties": False,
            "properties": {"route": {"enum": CLASS_ROUTES}, "ttl": _ref("Ttl"), "reason": _ref("Reason")},
        },
        "OverrideAnswer": {"type": "object", "required": ["override"], "properties": {"override": _ref("Override")}},
        "RemovedAnswer": {"type": "object", "required": ["removed"], "properties": {"removed": override_list}},
        "RemovedOneAnswer": {"type": "object", "required": ["removed"], "properties": {"removed": _ref("Override")}},
        "OverridesAnswer": {"type": "object", "required": ["overrides"], "properties": {"overrides": override_list}},
        "ReloadAnswer": {
            "type": "object",
            "required": ["result", "version", "hash", "dropped_overrides"],
            "properties": {
                "result": {"enum": ["ok", "unchanged"]},
                "version": {"type": "integer"},
                "hash": {"type": "string"},
                "dropped_overrides": {
                    **override_list,
                    "description": "overrides whose pool, endpoint or class the new config removed",
                },
                "source": {"type": "string"},
                "trigger": {"type": "string"},
                "previous_hash": {"type": "string"},
                "message": {"type": "string"},
                "at": {"type": "number"},
            },
        },
        "ConfigAnswer": {
            "type": "object",
            "required": ["source", "version", "hash", "loaded_at", "yaml"],
            "properties": {
                "source": {"type": "string"},
                "version": {"type": "integer"},
                "hash": {"type": "string"},
                "loaded_at": {"type": "number"},
                "yaml": {"type": "string", "description": "the routing YAML text in force"},
            },
        },
        "AuditRecord": {
            "type": "object",
            "required": ["at", "actor", "action", "target", "reason", "detail"],
            "properties": {
                "at": {"type": "number", "description": "epoch seconds"},
                "actor": {"type": "string"},
                "action": {"type": "string"},
                "target": {"type": "string"},
                "reason": {"type": "string"},
                "detail": {"type": "object"},
            },
        },
        "AuditAnswer": {
            "type": "object",
            "required": ["records", "size", "capacity", "total"],
            "properties": {
                "records": {"type": "array", "items": _ref("AuditRecord")},
                "size": {"type": "integer"},
                "capacity": {"type": "integer"},
                "total": {"type": "integer"},
            },
        },
        "StateAnswer": {
            "type": "object",
            "description": "Unknown numbers are null, never 0.",
            "required": ["config", "pools", "classes", "admin", "now"],
            "properties": {
                "config": {"type": "object", "description": "source, digest/hash, version, loaded_at"},
                "pools": {
                    "type": "object",
                    "description": "by pool name: kind, models, endpoints (id, url, healthy, routable, weights, "
                    "in_flight, ejected, ejected_for_s), in_flight, scraped load and acceptance, overrides",
                    "additionalProperties": {"type": "object"},
                },
                "classes": {"type": "array", "items": {"type": "object"}},
                "embeddings_pool": nullable_str,
                "overrides": override_list,
                "store": {"type": "object", "description": "idempotency: the store's health; overrides: its sync"},
                "audit": {"type": "object"},
                "started_at": {"type": "number"},
                "tenants": {
                    "type": ["array", "null"],
                    "items": {"type": "object"},
                    "description": "with a tenants file: name, priority, weight, in_flight, shed and limited since "
                    "start and (recent: window_s, shed, limited) in the last minutes (this process), limits, and by "
                    "pool its in_flight, fair share and the pool's bound; waiting: its requests in each pool's "
                    "waiting room",
                },
                "now": {"type": "number", "description": "the gateway's clock, epoch seconds"},
                "admin": {
                    "type": "object",
                    "required": ["changes_allowed", "default_ttl_s", "max_ttl_s"],
                    "properties": {
                        "changes_allowed": {
                            "type": "boolean",
                            "description": "false: every change is refused (no admin token, or changes_refused)",
                        },
                        "changes_refused": {
                            **nullable_str,
                            "description": "why changes are refused although a token may be set: several workers "
                            "with per-worker state (a change would reach one worker); null otherwise",
                        },
                        "default_ttl_s": {"type": "number", "description": "admin.default_ttl_s of the YAML"},
                        "max_ttl_s": {"type": "number", "description": "admin.max_ttl_s of the YAML"},
                    },
                },
            },
        },
    }


def _responses() -> dict[str, Any]:
    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": _json_content(_ref("Error"))}

    return {
        "BadRequest": error("Bad input; error.param names it."),
        "Unauthorized": error("Missing or wrong admin token (WWW-Authenticate: Bearer)."),
        "ChangesRefused": error("The gateway has no admin token: it refuses every change (code admin_token_not_set)."),
        "NotFound": error("Unknown pool, endpoint, class or override."),
        "PerWorkerState": error(
            "Several workers without Redis (--per-worker-state): each has its own overrides, so a change would reach "
            "only the worker that answered; refused (code per_worker_state)."
        ),
    }


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
    override = _ok("The override now in force.", _ref("OverrideAnswer"))
    paths: dict[str, Any] = {
        "/admin/state": {
            "get": _read(
                "Pools, endpoints, weights, load, classes and controllers, config", _ok("OK", _ref("StateAnswer"))
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
                    "content": _json_content({"type": "object"}),
                },
            }
        },
        "/admin/audit": {
            "get": _read(
                "The newest audit records, oldest first",
                _ok("OK", _ref("AuditAnswer")),
                [
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                    {"name": "since", "in": "query", "schema": {"type": "number"}, "description": "epoch seconds"},
                ],
            )
        },
        "/admin/config": {"get": _read("The routing YAML in force", _ok("OK", _ref("ConfigAnswer")))},
        "/admin/overrides": {"get": _read("The active overrides", _ok("OK", _ref("OverridesAnswer")))},
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
                _ok("The drains removed.", _ref("RemovedAnswer")),
            )
        },
        "/admin/classes/{class}/route": {
            "put": _change(
                "Force a class's route; auto removes the force",
                [klass],
                _body("RouteChange", "the route"),
                _ok(
                    "speculative|standard: the override; auto: the overrides removed",
                    {"oneOf": [_ref("OverrideAnswer"), _ref("RemovedAnswer")]},
                ),
            )
        },
        "/admin/overrides/{id}": {
            "delete": _change(
                "Remove an override",
                [_path_param("id", "ovr_<12 hex>"), reason_query],
                None,
                _ok("The override removed.", _ref("RemovedOneAnswer")),
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
                **_change("Re-read the routing YAML now", [], None, _ok("OK", _ref("ReloadAnswer")), found=False),
            }
        },
    }
    reload_responses = paths["/admin/reload"]["post"]["responses"]
    reload_responses["422"] = {
        "description": "The new YAML is invalid: nothing changed; error.errors lists every path-named error.",
        "content": _json_content(_ref("Error")),
    }
    reload_responses["500"] = {"description": "The reload failed.", "content": _json_content(_ref("Error"))}
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
            "schemas": _schemas(),
            "responses": _responses(),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearerAuth": []}],
    }
