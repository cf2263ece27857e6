"""The components of the admin API's OpenAPI description (``gateway.admin.openapi``): the JSON Schemas of every
request and answer body, and the shared error answers. Built afresh on every call."""

from __future__ import annotations

from typing import Any

from gateway.admin.protocol import MAX_REASON

CLASS_ROUTES = ["speculative", "standard", "auto"]


def ref(name: str) -> dict[str, str]:
    """A reference to the schema ``name`` of the components."""
    return {"$ref": f"#/components/schemas/{name}"}


def json_content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def schemas() -> dict[str, Any]:
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
    override_list = {"type": "array", "items": ref("Override")}
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
                        "errors": {"type": "array", "items": ref("ConfigIssue")},
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
            "properties": {"weight": {"type": "number", "minimum": 0}, "ttl": ref("Ttl"), "reason": ref("Reason")},
        },
        "DrainChange": {
            "type": "object",
            "required": ["reason"],
            "additionalProperties": False,
            "properties": {"ttl": ref("Ttl"), "reason": ref("Reason")},
        },
        "UndrainChange": {
            "type": "object",
            "required": ["reason"],
            "additionalProperties": False,
            "properties": {"reason": ref("Reason")},
        },
        "RouteChange": {
            "type": "object",
            "required": ["route", "reason"],
            "additionalProperties": False,
            "properties": {"route": {"enum": CLASS_ROUTES}, "ttl": ref("Ttl"), "reason": ref("Reason")},
        },
        "OverrideAnswer": {"type": "object", "required": ["override"], "properties": {"override": ref("Override")}},
        "RemovedAnswer": {"type": "object", "required": ["removed"], "properties": {"removed": override_list}},
        "RemovedOneAnswer": {"type": "object", "required": ["removed"], "properties": {"removed": ref("Override")}},
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
                "records": {"type": "array", "items": ref("AuditRecord")},
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


def responses() -> dict[str, Any]:
    def error(description: str) -> dict[str, Any]:
        return {"description": description, "content": json_content(ref("Error"))}

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
