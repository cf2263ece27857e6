"""The admin routes that change routing at run time: on-call overrides (``gateway.overrides.manager``), each with a
TTL and a
reason, stored where every replica sees them. Registered by ``gateway.admin.app.create_admin_app`` (``change_routes``
are refused without an admin token; ``read_routes`` are not)::

    PUT    /admin/pools/{pool}/weight                       {"weight": >=0, "ttl"?, "reason"} → {override, replaced}
    PUT    /admin/pools/{pool}/endpoints/{endpoint}/weight  {"weight": >=0, "ttl"?, "reason"} → {override, replaced}
    POST   /admin/pools/{pool}/drain                        {"ttl"?, "reason"}                → {override, replaced}
    POST   /admin/pools/{pool}/undrain                      {"reason"}                        → {removed: [...]}
    PUT    /admin/classes/{class}/route                     {"route": speculative|standard|auto, "ttl"?, "reason"}
                                                            → {override, replaced} (auto: {removed: [...]})
    DELETE /admin/overrides/{id}[?reason=]                  → {removed: override}
    GET    /admin/overrides                                 → {overrides: [...]} (active only)

``ttl``: seconds or "90s" / "30m" / "2h" / "1d"; "never" keeps it until removed; missing: the YAML's
``admin.default_ttl_s``; at most ``admin.max_ttl_s``. Bad input is 400 naming ``param``; an unknown pool, endpoint,
class or override is 404; the store unreachable is 503 (nothing changed). The actor recorded in the audit is the
``X-Specgate-Actor`` header when given (the CLI sends ``SPECGATE_ADMIN_ACTOR``), else plain ``admin``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from gateway.admin.protocol import ACTOR_HEADER
from gateway.errors import InvalidParameter, NotFound
from gateway.overrides.model import parse_reason, parse_ttl, parse_weight
from gateway.overrides.override import Kind, Override
from gateway.proxy.http import json_response, parse_object, read_request_body
from gateway.runtime.container import Runtime
from gateway.store.base import StoreUnavailable

MAX_BODY = 16 * 1024
ROUTES = ("speculative", "standard", "auto")


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def actor_of(request: Request) -> str:
    given = request.headers.get(ACTOR_HEADER, "").strip()
    if given:
        return given[:100]
    return str(getattr(request.app.state, "admin_actor", "admin"))


async def _body(request: Request, allowed: frozenset[str]) -> dict[str, Any]:
    body = parse_object(await read_request_body(request, MAX_BODY))
    for key in body:
        if key not in allowed:
            raise InvalidParameter(f"unknown field {key!r}; expected {', '.join(sorted(allowed))}", param=key)
    return body


def _ttl(rt: Runtime, body: dict[str, Any]) -> float | None:
    admin = rt.live.rules.admin
    return parse_ttl(body.get("ttl"), default_s=admin.default_ttl_s, max_s=admin.max_ttl_s)


def _pool(rt: Runtime, request: Request) -> str:
    name = str(request.path_params["pool"])
    if name not in rt.live.pools:
        known = ", ".join(rt.live.pools)
        raise NotFound(f"unknown pool {name!r}; the pools are: {known}", param="pool", code="pool_not_found")
    return name


async def _set(rt: Runtime, o: Override) -> Response:
    stored, old = await rt.overrides.put(o)
    return json_response({"override": stored.as_dict(), "replaced": None if old is None else old.as_dict()})


async def _weight(request: Request, kind: Kind, endpoint: str | None) -> Response:
    rt = _runtime(request)
    pool = _pool(rt, request)
    if endpoint is not None and all(e.id != endpoint for e in rt.live.pools[pool].endpoints):
        known = ", ".join(e.id for e in rt.live.pools[pool].endpoints)
        message = f"pool {pool!r} has no endpoint {endpoint!r}; its endpoints are: {known}"
        raise NotFound(message, param="endpoint", code="endpoint_not_found")
    body = await _body(request, frozenset({"weight", "ttl", "reason"}))
    if "weight" not in body:
        raise InvalidParameter("'weight' is required (a number >= 0; 0: no new requests)", param="weight")
    weight = parse_weight(body["weight"])
    reason = parse_reason(body.get("reason"))
    o = Override.create(
        kind, pool=pool, endpoint=endpoint, value=weight, reason=reason, actor=actor_of(request), ttl_s=_ttl(rt, body)
    )
    return await _set(rt, o)


async def put_pool_weight(request: Request) -> Response:
    return await _weight(request, "pool_weight", None)


async def put_endpoint_weight(request: Request) -> Response:
    return await _weight(request, "endpoint_weight", str(request.path_params["endpoint"]))


async def post_drain(request: Request) -> Response:
    rt = _runtime(request)
    pool = _pool(rt, request)
    body = await _body(request, frozenset({"ttl", "reason"}))
    reason = parse_reason(body.get("reason"))
    o = Override.create("drain", pool=pool, reason=reason, actor=actor_of(request), ttl_s=_ttl(rt, body))
    return await _set(rt, o)


async def post_undrain(request: Request) -> Response:
    rt = _runtime(request)
    pool = _pool(rt, request)
    body = await _body(request, frozenset({"reason"}))
    reason = parse_reason(body.get("reason"))
    removed = await rt.overrides.remove(
        lambda o: o.kind == "drain" and o.pool == pool, actor=actor_of(request), reason=reason, action="undrain"
    )
    return json_response({"removed": [o.as_dict() for o in removed]})


async def put_class_route(request: Request) -> Response:
    rt = _runtime(request)
    name = str(request.path_params["class"])
    if all(c.name != name for c in rt.live.rules.classes):
        known = ", ".join(c.name for c in rt.live.rules.classes)
        raise NotFound(f"unknown class {name!r}; the classes are: {known}", param="class", code="class_not_found")
    body = await _body(request, frozenset({"route", "ttl", "reason"}))
    route = body.get("route")
    if route not in ROUTES:
        raise InvalidParameter(f"'route' must be one of {', '.join(ROUTES)}, got {route!r}", param="route")
    reason = parse_reason(body.get("reason"))
    if route == "auto":
        removed = await rt.overrides.remove(
            lambda o: o.kind == "class_route" and o.class_name == name,
            actor=actor_of(request),
            reason=reason,
            action="class_route_auto",
        )
        return json_response({"removed": [o.as_dict() for o in removed]})
    ttl_s = _ttl(rt, body)
    o = Override.create(
        "class_route", class_name=name, value=route, reason=reason, actor=actor_of(request), ttl_s=ttl_s
    )
    return await _set(rt, o)


async def delete_override(request: Request) -> Response:
    rt = _runtime(request)
    override_id = str(request.path_params["id"])
    raw_reason = request.query_params.get("reason")
    reason = "removed through the admin API" if raw_reason is None else parse_reason(raw_reason)
    missing = NotFound(f"no active override {override_id!r}", param="id", code="override_not_found")
    if await rt.overrides.find(override_id) is None:
        raise missing
    removed = await rt.overrides.remove(
        lambda o: o.id == override_id, actor=actor_of(request), reason=reason, action="remove"
    )
    if not removed:  # expired or removed by someone else meanwhile
        raise missing
    return json_response({"removed": removed[0].as_dict()})


async def fresh_overrides(rt: Runtime) -> None:
    """Before a read: the overrides as the shared store has them now, so that a change made through another
    worker or replica a moment ago shows whichever one answers (best effort, bounded; no shared store: nothing)."""
    if rt.settings.redis_url is None:
        return
    with contextlib.suppress(TimeoutError, StoreUnavailable):
        async with asyncio.timeout(0.5):
            await rt.overrides.refresh()


async def get_overrides(request: Request) -> Response:
    rt = _runtime(request)
    await fresh_overrides(rt)
    return json_response({"overrides": [o.as_dict() for o in rt.overrides.active()]})


def change_routes() -> list[BaseRoute]:
    """The routes that change routing (refused without an admin token)."""
    return [
        Route("/admin/pools/{pool}/weight", put_pool_weight, methods=["PUT"]),
        Route("/admin/pools/{pool}/endpoints/{endpoint}/weight", put_endpoint_weight, methods=["PUT"]),
        Route("/admin/pools/{pool}/drain", post_drain, methods=["POST"]),
        Route("/admin/pools/{pool}/undrain", post_undrain, methods=["POST"]),
        Route("/admin/classes/{class}/route", put_class_route, methods=["PUT"]),
        Route("/admin/overrides/{id}", delete_override, methods=["DELETE"]),
    ]


def read_routes() -> list[BaseRoute]:
    return [Route("/admin/overrides", get_overrides, methods=["GET"])]
