"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, forwarded unclassified to a pool that serves the model.

Tokenizing depends only on the model, never on speculative decoding, so there is no traffic class to pick: every
pool serving the requested model is a candidate (pools in the routing YAML's order, one endpoint each, within
``defaults.max_attempts``). The body must name the ``model`` (vLLM would assume its own; the gateway has several).
Counted under the class ``unclassified``; an unknown model is a 404 ``model_not_found`` decided without a pool.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import GatewayError, InvalidParameter, ModelNotFound
from gateway.proxy.body_read import read_json
from gateway.proxy.forward import ProxyExchange
from gateway.proxy.headers import request_id
from gateway.proxy.http import error_response
from gateway.proxy.job import ProxyJob
from gateway.proxy.record import RequestRecord
from gateway.proxy.responses import read_limited
from gateway.routing.decision import not_found
from gateway.routing.plan import Plan
from gateway.runtime.container import Runtime

CLASS = "unclassified"


async def _body(request: Request, rt: Runtime) -> tuple[bytes, dict[str, Any]]:
    """The body, checked as a proxied POST's (a large one parsed in the parsing process: only ``model`` is read)."""
    raw = await read_limited(request, rt.settings.max_body_bytes)
    body, _ = await read_json(raw, rt.settings, rt.parse_pool, None, scan_chars=0, fingerprint=None, pools={})
    return raw, body


async def _forward(request: Request, path: str) -> Response | ProxyExchange:
    rt: Runtime = request.app.state.runtime
    headers = request.headers
    rec = RequestRecord(request_id(headers.get("x-request-id")), path)
    rec.traffic_class = CLASS
    extra = {"x-request-id": rec.request_id}
    try:
        rt.authenticate(headers.get("authorization"))
        raw, body = await _body(request, rt)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidParameter("'model' is required and must be a string", param="model")
        live = rt.live
        serving = [p for p in live.pools.values() if model in p.models]
        if not serving:
            raise ModelNotFound(not_found(model, live.model_set), param="model")
        plan = Plan(tuple(p.name for p in serving if p.routable()), CLASS)
        if plan.empty:
            raise Plan((), CLASS, tuple((p.name, "no routable endpoint") for p in serving)).unavailable()
    except GatewayError as exc:
        rec.status, rec.error = exc.status, exc.message
        rec.finish("client_error" if exc.status < 500 else "no_capacity", rt.metrics, rt.access_log)
        return error_response(exc, "POST", path, extra.items())
    rec.route_reason = CLASS
    job = ProxyJob(
        path=path,
        body=raw,
        client_headers=list(headers.items()),
        stream=False,
        plan=plan,
        max_attempts=live.rules.defaults.max_attempts,
        record=rec,
        extra_headers=[*extra.items(), ("x-specgate-route", CLASS)],
    )
    return ProxyExchange(job, live.pools, live.clients, rt.metrics, rt.access_log, rt.rng, rt.attempts)


async def tokenize(request: Request) -> Response | ProxyExchange:
    return await _forward(request, "/tokenize")


async def detokenize(request: Request) -> Response | ProxyExchange:
    return await _forward(request, "/detokenize")
