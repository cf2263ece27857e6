"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, forwarded unclassified to a pool that serves the model.

Tokenizing depends only on the model, never on speculative decoding, so there is no traffic class to pick: every
pool serving the requested model is a candidate (pools in the routing YAML's order, one endpoint each, within
``defaults.max_attempts``). The body must name the ``model`` (vLLM would assume its own; the gateway has several).
Counted under the class ``unclassified``; an unknown model is a 404 ``model_not_found`` decided without a pool.
Both are routes of the one front half (``gateway.proxy.front``); this is their own part of it.
"""

from __future__ import annotations

from gateway.errors import InvalidParameter, ModelNotFound
from gateway.proxy.body_read import read_json
from gateway.proxy.front import Incoming, ProxyRoute
from gateway.proxy.http import read_body
from gateway.proxy.job import ProxyJob
from gateway.routing.decision import not_found
from gateway.routing.plan import Plan
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig

CLASS = "unclassified"


async def _prepare(rt: Runtime, live: LiveConfig, route: ProxyRoute, req: Incoming) -> ProxyJob:
    rec = req.record
    rec.traffic_class = CLASS
    rt.authenticate(req.hdr.get("authorization"))
    # The body, checked as a proxied POST's (a large one parsed in the parsing process: only ``model`` is read).
    raw = await read_body(req.receive, rt.settings.max_body_bytes, req.hdr.get("content-length"))
    body, _ = await read_json(raw, rt.settings, rt.parse_pool, None, scan_chars=0, fingerprint=None, pools={})
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidParameter("'model' is required and must be a string", param="model")
    serving = [p for p in live.pools.values() if model in p.models]
    if not serving:
        raise ModelNotFound(not_found(model, live.model_set), param="model")
    plan = Plan(tuple(p.name for p in serving if p.routable()), CLASS)
    if plan.empty:
        raise Plan((), CLASS, tuple((p.name, "no routable endpoint") for p in serving)).unavailable()
    rec.route_reason = CLASS
    return ProxyJob(
        path=route.path,
        body=raw,
        client_headers=req.client_headers,
        stream=False,
        plan=plan,
        max_attempts=live.rules.defaults.max_attempts,
        record=rec,
        extra_headers=[*req.extra, ("x-specgate-route", CLASS)],
    )


TOKENIZE = ProxyRoute("/tokenize", None, _prepare)
DETOKENIZE = ProxyRoute("/detokenize", None, _prepare)
