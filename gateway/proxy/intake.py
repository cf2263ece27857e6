"""The part of a classified POST (chat, completions, responses, embeddings) in the front half
(``gateway.proxy.front``): from the client's request to the job the exchange forwards.

``classified`` authenticates, reads the body (counted against the size limit), classifies and plans it
(``gateway.routing.decision``), pins a Responses API follow-up to the endpoint holding its conversation
(``gateway.proxy.responses``), takes the tenant's admission and claims its Idempotency-Key. It returns the
``ProxyJob`` to forward, or a stored response replayed; a refusal it raises. It works on the raw ASGI scope and
receive: no Starlette request, router or middleware on the way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Scope

from gateway.errors import BadRequest
from gateway.fleet.pools import PoolState
from gateway.observability.acceptance import temperature_band
from gateway.observability.tracing import RequestTrace
from gateway.proxy.body_read import read_json
from gateway.proxy.dialect import CHAT, ResponsesDialect
from gateway.proxy.front import Incoming, ProxyRoute
from gateway.proxy.headers import forwarded_for
from gateway.proxy.http import read_body
from gateway.proxy.idempotency import Replay, begin, fingerprint, parse_key, store_key, store_owner, tenant_scope
from gateway.proxy.job import ProxyJob
from gateway.proxy.outcome import relayed
from gateway.proxy.owned_ids import with_response_id, without_request_id
from gateway.proxy.record import RequestRecord
from gateway.proxy.responses import Sticky, for_create
from gateway.routing.classify import TASK_HEADER
from gateway.routing.decision import Decision, decide
from gateway.routing.plan import Plan
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig
from gateway.runtime.tenants import PRIORITY_HEADER, TenantState, Ticket

_UNPINNED = Sticky(None, None)  # a request that is not a Responses API follow-up


def _replay(rt: Runtime, replay: Replay, rec: RequestRecord) -> Response:
    """A stored response again: it never reaches a pool."""
    rec.status = replay.response.status
    rec.finish(relayed(rec.status), rt.metrics, rt.access_log)
    return replay.response.replay()


async def classified(rt: Runtime, live: LiveConfig, route: ProxyRoute, req: Incoming) -> ProxyJob | Response:
    """The part of a classified POST (chat, completions, responses, embeddings) in the front half."""
    path, hdr, rec, extra = route.path, req.hdr, req.record, req.extra
    trace = rec.trace if rec.quiet is None else rec.quiet
    tenant: TenantState | None = None
    if rt.tenancy is None:
        rt.authenticate(hdr.get("authorization"))
    else:  # tenants configured: the key names its tenant
        tenant = rt.tenancy.identify(hdr.get("authorization"))
        rec.tenant = tenant.name
    idempotency_key = parse_key(req.keys)
    raw = await read_body(req.receive, rt.settings.max_body_bytes, hdr.get("content-length"))
    body, view = await read_json(
        raw,
        rt.settings,
        rt.parse_pool,
        route.api,
        scan_chars=live.classifier.scan_chars,
        fingerprint=("POST", path) if idempotency_key is not None else None,
        pools=live.pools,
    )
    decided_ns = time.time_ns() if trace is not None else 0
    texts = None if view is None else view.read_texts
    # a large body's prompt was rendered where it was parsed (``body`` holds stand-ins): hashed here, once
    hashes = None if view is None or not view.prompt else rt.prompt_hashes.of_text(view.prompt)
    d = decide(
        live,
        rt.routing,
        route.api,
        body,
        hdr.get(TASK_HEADER),
        rt.rng,
        texts=texts,
        prompt=hashes,
        hashes=rt.prompt_hashes,
    )
    rec.traffic_class, plan, stream, max_attempts = d.traffic_class, d.plan, d.stream, d.max_attempts
    if d.features is not None:
        rec.task_type, rec.stream = d.features.task_type, d.features.stream
        extra += [("x-specgate-class", d.traffic_class), ("x-specgate-task-type", d.features.task_type)]
    d.check_model()
    sticky = _UNPINNED
    if route.api == "responses":  # a follow-up goes to the endpoint holding its conversation, and only there
        sticky = await for_create(
            rt.store,
            live.pools,
            body,
            hdr.get("authorization"),
            live.rules.idempotency.ttl_s,
            None if tenant is None else tenant.name,
        )
        plan, max_attempts = sticky.plan or plan, 1 if sticky.pinned else max_attempts
    rec.route_reason = plan.reason
    extra.append(("x-specgate-route", plan.reason))
    if trace is not None:  # the facts are written now for a sampled trace, else only if the tail decision keeps it
        trace.decided(
            plan.pools[0] if plan.pools else None,
            partial(trace_decision, rt, d, plan, body, decided_ns, time.time_ns()),  # no reference to the trace
        )
    if d.klass is not None and d.klass.require_idempotency_key and idempotency_key is None:
        raise BadRequest(
            f"requests of class {d.traffic_class!r} need an Idempotency-Key header", code="idempotency_key_required"
        )
    scope_key = tenant_scope(hdr.get("authorization")) if idempotency_key is not None else b"anonymous"
    if idempotency_key is not None:  # before the capacity check: a replay needs no pool
        got = await begin(
            rt.store,
            live.rules.idempotency,
            rt.metrics,
            key=store_key(scope_key, idempotency_key),
            fingerprint=view.fingerprint if view and view.fingerprint else fingerprint("POST", path, body),
            record=rec,
            owner=store_owner(None if tenant is None else tenant.name, scope_key),
        )
        if isinstance(got, Replay):
            return _replay(rt, got, rec)
        req.claim = got
    if tenant is not None and rt.tenancy is not None:  # the tenant's limits (a replay above is free)
        req.ticket = ticket = await _take_ticket(rt, tenant, hdr.get(PRIORITY_HEADER), d, len(raw))
        extra += ticket.headers
    if plan.empty:
        raise plan.unavailable()
    rec.temperature_band = temperature_band(body.get("temperature"))
    # The ids the pool keeps things under are the gateway's (after the Idempotency-Key's fingerprint, which is the
    # client's body): the minted response id, and no client request_id anywhere else.
    dumps = orjson.dumps if view is None else view.serialize
    if sticky.response_id:
        raw, body = with_response_id(body, sticky.response_id, dumps)
    else:
        raw, body = without_request_id(raw, body, dumps)
    prompt: tuple[int, ...] = ()
    if sticky.pinned is not None:
        pass
    elif d.prompt is not None:  # hashed by the decision (a controlled class: warm homes)
        prompt = d.prompt
    elif route.api is not None and _affinity_on(live.pools, plan.pools):
        prompt = rt.prompt_hashes.of_request(route.api, body) if view is None else rt.prompt_hashes.of_text(view.prompt)
    return ProxyJob(
        path=path,
        body=raw,
        client_headers=req.client_headers,
        stream=stream,
        plan=plan,
        max_attempts=max_attempts,
        record=rec,
        extra_headers=extra,
        parsed=body if stream or view is not None else None,
        serialize=None if view is None else view.serialize,
        idempotency=req.claim,
        dialect=ResponsesDialect() if route.api == "responses" else CHAT,
        pinned=sticky.pinned,
        on_answer=sticky.on_answer,
        forwarded_for=forwarded_for(_client_addr(req.scope), req.client_headers, rt.trusted_proxies),
        detached=rt.detached,
        tenant=scope_key,
        prompt=prompt,
        ticket=req.ticket,
    )


async def _take_ticket(rt: Runtime, tenant: TenantState, header: str | None, d: Decision, size: int) -> Ticket:
    """The tenant's priority for this request, and its admission under the tenant's limits (raises 429)."""
    tenancy = rt.tenancy
    assert tenancy is not None
    priority = tenancy.priority_of(tenant, header)
    f = d.features
    if f is not None:
        cost = tenancy.reservation(tenant, f.prompt_tokens, f.max_tokens, f.n)
    else:  # not classified (embeddings): about four bytes a token, nothing generated
        cost = tenancy.reservation(tenant, size // 4, 0.0, 1)
    return await tenancy.admit(tenant, priority, cost)


def _affinity_on(pools: Mapping[str, PoolState], planned: tuple[str, ...]) -> bool:
    """Some planned pool picks its endpoint by prefix affinity (only then is the prompt hashed)."""
    for name in planned:
        pool = pools.get(name)
        if pool is not None and pool.affinity.enabled and len(pool.endpoints) > 1:
            return True
    return False


def trace_decision(
    rt: Runtime, d: Decision, plan: Plan, body: Mapping[str, Any], start_ns: int, end_ns: int, trace: RequestTrace
) -> None:
    """The request's sampling parameters and the routing decision (made from ``start_ns`` to ``end_ns``), on its
    trace (tracing on only; ``RequestTrace.decided`` says when)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", body.get("max_output_tokens")))
    trace.request(body.get("model"), body.get("temperature"), max_tokens, d.stream)
    trace.route(
        start_ns,
        traffic_class=d.traffic_class,
        task_type=None if d.features is None else d.features.task_type,
        plan=plan.pools,
        reason=plan.reason,
        choice=d.choice,
        expected=rt.routing.expected_s if d.choice is not None else (),  # asked only of a trace that is written
        end_ns=end_ns,
    )


def _client_addr(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None
