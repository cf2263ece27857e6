"""The routes on one stored Responses API response, as routes of the one front half (``gateway.proxy.front``):
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel`` go to the endpoint holding it, once, no fallback
(``gateway.proxy.responses.locate``); ``DELETE /v1/responses/{id}`` is answered by the gateway itself.

They have a path parameter, so Starlette's router matches them; what they run is ``ProxyRoute``'s front half.
"""

from __future__ import annotations

import orjson
from starlette.datastructures import QueryParams
from starlette.responses import Response
from starlette.types import Scope

from gateway.errors import InvalidParameter
from gateway.proxy.dialect import CHAT, ResponsesDialect
from gateway.proxy.front import Incoming, ProxyRoute
from gateway.proxy.http import read_body
from gateway.proxy.idempotency import tenant_scope
from gateway.proxy.job import ProxyJob
from gateway.proxy.responses import forget, locate
from gateway.routing.plan import STICKY, Plan
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig

STATE_CLASS = "responses-state"  # the class label of the routes on a stored response (not classified)


def _query(scope: Scope) -> tuple[bool, str]:
    """``GET /v1/responses/{id}``'s own parameters, checked and passed on: ``stream`` and ``starting_after``."""
    params = QueryParams(scope["query_string"])
    stream_raw = params.get("stream", "false").lower()
    if stream_raw not in ("true", "false"):
        raise InvalidParameter("'stream' must be true or false", param="stream")
    parts = ["stream=true"] if stream_raw == "true" else []
    after = params.get("starting_after")
    if after is not None:
        if not after.isdigit() or len(after) > 9:
            raise InvalidParameter("'starting_after' must be a non-negative integer", param="starting_after")
        parts.append(f"starting_after={int(after)}")
    return stream_raw == "true", ("?" + "&".join(parts)) if parts else ""


def _response_id(req: Incoming, suffix: str) -> str:
    """The route's response id; the record names it (cut short) in its path, and counts it under its own class."""
    rid = str(req.scope["path_params"]["response_id"])
    req.record.path = f"/v1/responses/{rid[:300]}{suffix}"
    req.record.traffic_class = STATE_CLASS
    return rid


async def _held(rt: Runtime, live: LiveConfig, req: Incoming, method: str, suffix: str) -> ProxyJob:
    """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: to the endpoint holding it, once."""
    rid = _response_id(req, suffix)
    rec, authorization = req.record, req.hdr.get("authorization")
    rt.authenticate(authorization)
    stream, query = _query(req.scope) if method == "GET" else (False, "")
    if method == "POST":  # cancel takes no body; one is read (within the limit) and not passed on
        await read_body(req.receive, rt.settings.max_body_bytes, req.hdr.get("content-length"))
    pool, ep = await locate(rt.store, live.pools, tenant_scope(authorization), rid, param="response_id")
    rec.route_reason, rec.stream = STICKY, stream
    return ProxyJob(
        path=f"/v1/responses/{rid}{suffix}{query}",
        body=b"",
        client_headers=req.client_headers,
        stream=stream,
        plan=Plan((pool.name,), STICKY),
        max_attempts=1,
        record=rec,
        extra_headers=[*req.extra, ("x-specgate-route", STICKY)],
        dialect=ResponsesDialect() if stream else CHAT,
        pinned=(pool, ep),
        method=method,
    )


async def _retrieve(rt: Runtime, live: LiveConfig, route: ProxyRoute, req: Incoming) -> ProxyJob:
    return await _held(rt, live, req, "GET", "")


async def _cancel(rt: Runtime, live: LiveConfig, route: ProxyRoute, req: Incoming) -> ProxyJob:
    return await _held(rt, live, req, "POST", "/cancel")


async def _delete(rt: Runtime, live: LiveConfig, route: ProxyRoute, req: Incoming) -> Response:
    """``DELETE /v1/responses/{id}``: the caller's record is dropped, and the id resolves no more (for ``GET``,
    ``cancel``, ``previous_response_id``, ``DELETE``). vLLM 0.33 has no route to delete a stored response: nothing
    is sent to the pool, which keeps it in memory until it restarts, out of every client's reach."""
    rid = _response_id(req, "")
    rec, authorization = req.record, req.hdr.get("authorization")
    rec.route_reason = "gateway"
    rt.authenticate(authorization)
    await read_body(req.receive, rt.settings.max_body_bytes, req.hdr.get("content-length"))  # read and ignored
    await forget(rt.store, tenant_scope(authorization), rid)
    rec.status = 200
    rec.finish("ok", rt.metrics, rt.access_log)
    body = orjson.dumps({"id": rid, "object": "response.deleted", "deleted": True})
    return Response(body, 200, dict(req.extra), "application/json")


RETRIEVE = ProxyRoute("/v1/responses/{response_id}", None, _retrieve)
CANCEL = ProxyRoute("/v1/responses/{response_id}/cancel", None, _cancel)
DELETE = ProxyRoute("/v1/responses/{response_id}", None, _delete)
