"""The admin API: a separate listener (``--admin-host`` / ``--admin-port``, loopback :8081 by default) that shows
what the gateway knows and why it routes as it does. ``specgate explain`` is its client.

Routes (every answer JSON; every error the OpenAI envelope ``{"error": {message, type, param, code}}``)::

    GET  /admin/state                  pools (endpoints, health, weights, in-flight, ejection, scraped load), classes
                                       (route, controller snapshot), the routing YAML in force, the audit log's size,
                                       the store, and ``admin``: whether changes are allowed, the TTL defaults
    POST /admin/explain[?path=P]       the body is the request exactly as a client would POST it to P (default
                                       /v1/chat/completions; also /v1/completions, /v1/embeddings); classification
                                       headers (``X-Task-Type``) are read from this request's own headers. Answers
                                       ``gateway.admin.explain.explain``; sends nothing upstream; bad bodies get the
                                       proxy's own errors (400 invalid_json, 404 model_not_found, ...)
    GET  /admin/audit[?limit=N&since=T] the newest N (default 100, at most 1000) audit records after epoch T
    GET  /admin/config                 the routing YAML in force: source, version, hash, loaded_at, yaml (its text)
    POST /admin/reload                 re-read the routing YAML (``gateway.runtime.reload``): 200 {"result": "ok" |
                                       "unchanged", "version", "hash", "dropped_overrides", ...}; 422 invalid, the
                                       envelope with error.errors: [{path, line, message}, ...] (nothing changed)
    GET  /admin/ui                     the on-call console (``gateway.admin.ui``): a page with no data in it, so
                                       it answers without the token; the page sends the token with every call

Token policy. The token is ``SPECGATE_ADMIN_TOKEN`` (environment only: never a flag, so it does not show in ``ps``).

- token set: every request, on any path, needs ``Authorization: Bearer <token>`` (compared in constant time);
  anything else is 401 with ``WWW-Authenticate: Bearer``. A client API key is not the admin token, so it never
  works here; the token may not equal a client key (refused at start-up).
- no token: the read-only routes (explain only reads) answer anyone who can reach the listener, which is
  loopback-only by default (``gateway.cli.serve`` refuses a non-loopback address without a token); routes that change
  something (``changes`` below: POST /admin/reload, ...) are refused with 403, saying to set the token. And the
  ``Host`` header must name the listener itself (``localhost``, ``127.0.0.1``, ``[::1]`` or ``--admin-host``, any
  port): else 421 ``invalid_host``. That stops DNS rebinding, a web page whose own name was made to resolve to
  127.0.0.1 reading the admin API through the browser of someone on this machine.

Several workers (``--workers N``): every worker serves this app on the one admin socket (``gateway.cli.serve``).
Reads first re-read the overrides from the shared store (Redis), so a change made through another worker or
replica shows at once; a follower of the cluster shows the leader's controller state. ``POST /admin/reload``
reloads every worker before it answers (``gateway.runtime.workers``). Without Redis (``--per-worker-state``) each
worker has its own overrides: the override changes are refused with 409 ``per_worker_state`` rather than applied to
one worker, and ``admin.changes_allowed`` in ``/admin/state`` is false.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.changes import actor_of, change_routes, fresh_overrides, read_routes
from gateway.admin.explain import DEFAULT_PATH, explain, load_numbers, route_dict
from gateway.admin.openapi import openapi
from gateway.admin.protocol import TOKEN_ENV
from gateway.admin.ui import ui_routes
from gateway.errors import Conflict, GatewayError, InvalidParameter, Unauthorized, finite_number
from gateway.proxy.http import exception_handlers, json_response, parse_object, read_request_body
from gateway.proxy.wire import envelope
from gateway.runtime.container import Runtime

MAX_AUDIT_LIMIT = 1000
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})  # Host names of a loopback listener (any port)


class AdminAuth:
    """ASGI middleware in front of every admin route: the token policy of the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        changes: Sequence[BaseRoute] = (),
        public: Sequence[BaseRoute] = (),
        refused: Sequence[BaseRoute] = (),
        refused_because: str = "",
        hosts: frozenset[str] = LOOPBACK_NAMES,
    ) -> None:
        self.app = app
        self._digest = None if token is None else hashlib.sha256(token.encode()).digest()
        self._hosts = hosts  # without a token: the Host names this listener answers (``own_host_names``)
        self._changes = tuple(changes)
        self._public = tuple(public)  # the console's shell: no data, so no token (``gateway.admin.ui``)
        # Changes that would reach only the worker answering (``--workers N --per-worker-state``): 409, not applied.
        self._refused = tuple(refused)
        self._refused_because = refused_because

    def _check(self, authorization: str | None) -> GatewayError | None:
        if self._digest is None:
            return None
        if not authorization or authorization[:7].lower() != "bearer ":
            message = f"missing admin token: send 'Authorization: Bearer <token>' with the gateway's {TOKEN_ENV}"
            return Unauthorized(message, code="invalid_admin_token")
        given = hashlib.sha256(authorization[7:].strip().encode()).digest()
        if not hmac.compare_digest(given, self._digest):
            return Unauthorized("invalid admin token", code="invalid_admin_token")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self._digest is None and not host_allowed(headers.get("host"), self._hosts):
            body = envelope(
                "this admin listener answers only requests addressed to it by a local name (localhost, 127.0.0.1, "
                f"[::1]); set {TOKEN_ENV} to reach it under other names",
                "invalid_request_error",
                code="invalid_host",
            )
            await json_response(body, 421)(scope, receive, send)
            return
        if any(r.matches(scope)[0] == Match.FULL for r in self._public):
            await self.app(scope, receive, send)
            return
        response: Response | None = None
        exc = self._check(headers.get("authorization"))
        if exc is not None:
            exc.headers["www-authenticate"] = 'Bearer realm="specgate-admin"'
            response = json_response(exc.envelope(), exc.status, exc.headers)
        elif self._digest is None and any(r.matches(scope)[0] == Match.FULL for r in self._changes):
            body = envelope(
                f"the admin API refuses changes while no admin token is set: set {TOKEN_ENV} and restart",
                "permission_error",
                code="admin_token_not_set",
            )
            response = json_response(body, 403)
        elif any(r.matches(scope)[0] == Match.FULL for r in self._refused):
            response = json_response(Conflict(self._refused_because, code="per_worker_state").envelope(), 409)
        if response is not None:
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def own_host_names(admin_host: str) -> frozenset[str]:
    """The names a loopback admin listener answers to in ``Host`` (lower case, IPv6 in brackets)."""
    bound = admin_host.lower()
    return LOOPBACK_NAMES | {f"[{bound}]" if ":" in bound else bound}


def host_allowed(host: str | None, names: frozenset[str]) -> bool:
    """Whether a ``Host`` header names this listener: one of ``names``, with any port or none. No header at all (an
    HTTP/1.0 client) is allowed: a browser always sends one, and the check is against browsers (DNS rebinding)."""
    if host is None:
        return True
    host = host.strip().lower()
    name, port = host, ""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return False
        name, port = host[: end + 1], host[end + 1 :]
        if port and not port.startswith(":"):
            return False
        port = port[1:]
    elif ":" in host:
        name, _, port = host.partition(":")
    if port and not (port.isdigit() and len(port) <= 5):
        return False
    return name in names


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def per_worker_refusal(rt: Runtime) -> str | None:
    """Why override changes are refused here: several workers, each with its own overrides (no Redis)."""
    s = rt.settings
    if s.workers > 1 and s.redis_url is None:
        return (
            f"this gateway runs {s.workers} workers with --per-worker-state (no Redis): each worker has its own "
            "overrides, so a change made here would reach only the worker that answered; set --redis-url to share "
            "them, or run one worker"
        )
    return None


def _hit_ratio(rt: Runtime, pool: str, endpoint: str, now: float) -> float | None:
    """An endpoint's measured prefix-cache hit rate over the scrape window (``specgate_prefix_measured_hit_ratio``);
    None while unknown (not scraped, stale, no prompt looked up)."""
    load = rt.scraper.loads.get(pool)
    ep = None if load is None else load.endpoints.get(endpoint)
    d = None if ep is None else ep.deltas(now)
    return None if d is None else d.prefix_hit_ratio


def state_dict(rt: Runtime) -> dict[str, Any]:
    """Everything /admin/state shows: numbers the gateway does not know are null, never 0."""
    live = rt.live
    now = time.monotonic()
    views = live.views()
    loads = rt.scraper.views()
    snapshots = rt.routing.snapshot()
    pools: dict[str, Any] = {}
    for name, pool in live.pools.items():
        view = views[name]
        entry: dict[str, Any] = {
            "kind": pool.spec.kind,
            "models": sorted(pool.models),
            "routable_endpoints": view.routable_endpoints,
            "in_flight": pool.in_flight,
            "cluster_in_flight": pool.in_flight + sum(e.remote_in_flight for e in pool.endpoints),
            "endpoints": [
                {
                    "id": e.id,
                    "url": e.url,
                    "healthy": e.healthy,
                    "routable": e.routable,
                    "weight": e.weight,
                    "configured_weight": e.configured_weight,
                    "effective_weight": e.weight,
                    "in_flight": e.in_flight,
                    "remote_in_flight": e.remote_in_flight,
                    "consecutive_failures": e.consecutive_failures,
                    "ejected": e.ejected,
                    "ejected_for_s": max(0.0, e.ejected_until - now) if e.ejected else None,
                    "last_error": e.last_error,
                    # the server's own prefix-cache hit rate over the scrape window (null: unknown), and how many
                    # prompt chunks the gateway's index of it holds (gateway.fleet.prefix_index)
                    "prefix_hit_ratio": _hit_ratio(rt, name, e.id, now),
                    "prefix_index_chunks": len(e.prefixes),
                }
                for e in pool.endpoints
            ],
        }
        entry.update(load_numbers(loads.get(name)))
        pools[name] = entry
    overrides = [o.as_dict() for o in rt.overrides.active()]
    for name, entry in pools.items():
        entry["overrides"] = [o for o in overrides if o["pool"] == name]
    forced = rt.routing.forced()
    classes = [
        {
            "name": c.name,
            "description": c.description,
            "route": route_dict(c.route),
            "controller": snapshots.get(c.name),
            "forced_route": forced.get(c.name),
            "overrides": [o for o in overrides if o["class"] == c.name],
        }
        for c in live.rules.classes
    ]
    audit = rt.audit
    return {
        "config": {
            "source": live.source,
            "digest": live.digest,
            "version": live.rules.version,
            "hash": live.digest,
            "loaded_at": live.loaded_at,
        },
        "overrides": overrides,
        "store": {"idempotency": rt.store_health.status(), "overrides": rt.overrides.status()},
        "pools": pools,
        "embeddings_pool": live.rules.embeddings_pool,
        "classes": classes,
        "audit": {"size": len(audit), "capacity": audit.capacity, "total": audit.total},
        "started_at": rt.started_at,
        # Who leads the cluster, the age of the snapshot this replica routes on, each other replica's counts' age.
        "cluster": rt.cluster.describe() if rt.cluster is not None else {"enabled": False, "role": "local"},
        # With --workers N: the worker that answered, and every live worker's config digest.
        "worker": rt.worker_group.describe(live.digest) if rt.worker_group is not None else None,
        # With a tenants file: each tenant's settings, in-flight requests against its share of each pool, and how
        # many were shed and limited since start and in the last minutes (this process); null without tenants.
        "tenants": None
        if rt.tenancy is None
        else rt.tenancy.describe({name: rt.attempts.admission(pool)[1] for name, pool in live.pools.items()}),
    }


async def get_state(request: Request) -> Response:
    rt = _runtime(request)
    await fresh_overrides(rt)
    state = state_dict(rt)
    admin = rt.live.rules.admin
    state["now"] = time.time()  # the console counts TTLs down on the gateway's clock, not the browser's
    state["admin"] = {
        "changes_allowed": bool(request.app.state.changes_allowed) and per_worker_refusal(rt) is None,
        "changes_refused": per_worker_refusal(rt),  # why, when the token is not the reason (else null)
        "default_ttl_s": admin.default_ttl_s,
        "max_ttl_s": admin.max_ttl_s,
    }
    return json_response(state)


async def get_openapi(request: Request) -> Response:
    """The OpenAPI 3.1 description of this API (``gateway.admin.openapi``)."""
    return json_response(openapi())


async def post_explain(request: Request) -> Response:
    rt = _runtime(request)
    path = request.query_params.get("path", DEFAULT_PATH)
    body = parse_object(await read_request_body(request, rt.settings.max_body_bytes))
    await fresh_overrides(rt)
    return json_response(explain(rt, path, body, request.headers))


def _query_number(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    return finite_number(raw, name, f"'{name}' must be a number, got {raw!r}")


async def get_audit(request: Request) -> Response:
    """The audit log in the store: every replica's admin changes, expiries and controller transitions."""
    overrides = _runtime(request).overrides
    limit = _query_number(request, "limit")
    if limit is not None and (limit != int(limit) or not 1 <= limit <= MAX_AUDIT_LIMIT):
        raise InvalidParameter(f"'limit' must be an integer in 1..{MAX_AUDIT_LIMIT}", param="limit")
    since = _query_number(request, "since")
    records, size, total = await overrides.audit(100 if limit is None else int(limit), since)
    return json_response(
        {
            "records": [r.as_dict() for r in records],
            "size": size,
            "capacity": overrides.store.audit_capacity,
            "total": total,
        }
    )


async def post_reload(request: Request) -> Response:
    """Re-read the routing YAML now (``gateway.runtime.reload``): 200 ok | unchanged, 422 listing every error, 500."""
    rt = _runtime(request)
    r = await rt.reload("admin", actor_of(request))
    body = r.as_dict()
    if r.result in ("ok", "unchanged"):
        group = rt.worker_group
        if group is not None:  # every worker reloads (a SIGHUP each) before the answer: any of them reads the same
            signalled = group.signal_reload()  # "unchanged" too: this worker's file watcher may have been first
            pending = await group.wait_for(rt.live.digest, signalled)
            body["workers"] = {"signalled": len(signalled), "pending": pending, **group.describe(rt.live.digest)}
        return json_response(body)
    if r.result == "invalid":
        err = envelope(
            r.error_message(),
            "invalid_request_error",
            param=(r.issues[0].path or None) if r.issues else None,
            code="invalid_config",
        )
        err["error"]["errors"] = body["errors"]  # every path-named error: [{path, line, message}, ...]
        return json_response({**err, "result": r.result, "version": r.version, "hash": r.hash}, 422)
    err = envelope(r.message, "internal_error", code="config_reload_failed")
    return json_response({**err, "result": r.result, "version": r.version, "hash": r.hash}, 500)


async def get_config(request: Request) -> Response:
    """The routing YAML in force: where it came from, its version and hash, when it was loaded, its text."""
    live = _runtime(request).live
    return json_response(
        {
            "source": live.source,
            "version": live.rules.version,
            "hash": live.digest,
            "loaded_at": live.loaded_at,
            "yaml": live.text,
        }
    )


def create_admin_app(runtime: Runtime, token: str | None) -> Starlette:
    """The admin app over a runtime that the main app's lifespan starts and stops (this app has no lifespan).

    Raises ``ValueError`` when ``token`` is empty or is also a client API key."""
    if token is not None:
        if not token.strip():
            raise ValueError(f"{TOKEN_ENV} is empty")
        if runtime.auth_enabled:
            try:
                runtime.authenticate(f"Bearer {token}")
            except Unauthorized:
                pass
            else:
                raise ValueError(f"{TOKEN_ENV} must differ from every client API key")
    routes: list[BaseRoute] = [
        Route("/admin/state", get_state, methods=["GET"]),
        Route("/admin/openapi.json", get_openapi, methods=["GET"]),
        Route("/admin/explain", post_explain, methods=["POST"]),
        Route("/admin/audit", get_audit, methods=["GET"]),
        Route("/admin/config", get_config, methods=["GET"]),
        *read_routes(),
    ]
    changes: list[BaseRoute] = [  # routes that change routing; refused without a token
        Route("/admin/reload", post_reload, methods=["POST"]),
        *change_routes(),  # on-call overrides (gateway.admin.changes)
    ]
    public = ui_routes()  # the console's page and files: they carry no data
    refusal = per_worker_refusal(runtime)
    refused = [r for r in changes if refusal is not None and getattr(r, "path", "") != "/admin/reload"]
    auth = Middleware(
        AdminAuth,
        token=token,
        changes=changes,
        public=public,
        refused=refused,
        refused_because=refusal or "",
        hosts=own_host_names(runtime.settings.admin_host),
    )
    app = Starlette(
        routes=routes + changes + public,
        middleware=[auth],
        exception_handlers=exception_handlers(),
    )
    app.state.runtime = runtime
    app.state.changes_allowed = token is not None
    # The audit's actor without an X-Specgate-Actor header. Nothing derived from the token: the audit is readable
    # by more people than the token, and a hash of a weak token can be guessed offline.
    app.state.admin_actor = "admin"
    return app
