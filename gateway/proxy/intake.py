"""The front half of a proxied POST: from the client's request to the ASGI app that answers it.

``admit`` authenticates, reads the body (counted against the size limit), classifies and plans it
(``gateway.routing.decision``), and claims its Idempotency-Key. What it returns answers the client: an error
envelope, a stored response replayed, or a ``ProxyExchange`` (``gateway.proxy.forward``) that runs the attempts.
It works on the raw ASGI scope and receive: no Starlette request, router or middleware on the way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope

from gateway.errors import BadRequest, GatewayError
from gateway.fleet.pools import PoolState
from gateway.fleet.prefix_index import chain_hashes
from gateway.observability.acceptance import temperature_band
from gateway.observability.metrics import Outcome
from gateway.observability.tracing import TRACE_ID_HEADER, RequestTrace
from gateway.proxy.body_read import read_json
from gateway.proxy.dialect import CHAT, ResponsesDialect
from gateway.proxy.forward import ProxyExchange
from gateway.proxy.headers import forwarded_for, request_id
from gateway.proxy.http import error_response, read_body
from gateway.proxy.idempotency import (
    KEY_HEADER,
    KeyClaim,
    Replay,
    begin,
    fingerprint,
    parse_key,
    store_key,
    store_owner,
    tenant_scope,
)
from gateway.proxy.job import ProxyJob
from gateway.proxy.owned_ids import with_response_id, without_request_id
from gateway.proxy.record import RequestRecord
from gateway.proxy.responses import Sticky, for_create
from gateway.routing.classify import TASK_HEADER, Endpoint
from gateway.routing.decision import Decision, decide
from gateway.routing.plan import Plan
from gateway.routing.prompt_key import prompt_chunks
from gateway.runtime.container import Runtime
from gateway.runtime.tenants import PRIORITY_HEADER, TenantState, Ticket


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """A POST path the gateway forwards to a pool, and how its body is decided: ``endpoint`` names the request shape
    the classifier reads the routing features from (``None``: not classified; the YAML's embeddings pool answers)."""

    path: str
    endpoint: Endpoint | None


# The request headers ``admit`` reads, found in one pass over the raw list (first value; every Idempotency-Key).
_WANTED = frozenset(
    {
        "x-request-id",
        "authorization",
        "content-length",
        TASK_HEADER,
        KEY_HEADER,
        "traceparent",
        "tracestate",
        PRIORITY_HEADER,
    }
)


def _headers(scope: Scope) -> tuple[list[tuple[str, str]], dict[str, str], list[str]]:
    """The client's headers decoded (in order, as sent), the ones ``admit`` reads, its Idempotency-Keys."""
    items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    wanted: dict[str, str] = {}
    keys: list[str] = []
    for k, v in items:
        if k in _WANTED:
            if k == KEY_HEADER:
                keys.append(v)
            if k not in wanted:
                wanted[k] = v
    return items, wanted, keys


def outcome_for(status: int) -> Outcome:
    """The ``outcome`` label of a request the gateway refused with ``status``."""
    if status == 503:
        return "no_capacity"
    if status >= 500:
        return "gateway_error"
    return "client_error"


def _refused(rt: Runtime, exc: GatewayError, rec: RequestRecord, extra: list[tuple[str, str]]) -> Response:
    rec.status, rec.error = exc.status, exc.message
    rec.finish(outcome_for(exc.status), rt.metrics, rt.access_log)
    return error_response(exc, "POST", rec.path, extra)


def _replay(rt: Runtime, replay: Replay, rec: RequestRecord) -> Response:
    """A stored response again: it never reaches a pool."""
    status = replay.response.status
    rec.status = status
    rec.finish("ok" if status < 400 else outcome_for(status), rt.metrics, rt.access_log)
    return replay.response.replay()


async def _release(claim: KeyClaim | None, rec: RequestRecord) -> None:
    """Nothing was generated for a claimed key (refused before forwarding): free it for the client's retry."""
    if claim is not None:
        rec.idempotency = "released"
        await claim.settle(None)


async def admit(rt: Runtime, route: ProxyRoute, scope: Scope, receive: Receive) -> ASGIApp:
    """What answers this POST to ``route``. A refusal is answered here (and recorded); a client gone while its body
    was read raises ``ClientDisconnect``, a bug raises (both recorded); the caller renders those."""
    path = route.path
    client_headers, hdr, keys = _headers(scope)
    rec = RequestRecord(request_id(hdr.get("x-request-id")), path)
    extra = [("x-request-id", rec.request_id)]
    trace = None
    if rt.tracing is not None:  # tracing on (gateway.observability.tracing): the request's server span
        rec.trace = trace = rt.tracing.start(
            "POST", path, rec.request_id, hdr.get("traceparent"), hdr.get("tracestate")
        )
        extra.append((TRACE_ID_HEADER, trace.trace_id))
    claim: KeyClaim | None = None
    tenant: TenantState | None = None
    ticket: Ticket | None = None
    try:
        if rt.tenancy is None:
            rt.authenticate(hdr.get("authorization"))
        else:  # tenants configured: the key names its tenant
            tenant = rt.tenancy.identify(hdr.get("authorization"))
            rec.tenant = tenant.name
        idempotency_key = parse_key(keys)
        raw = await read_body(receive, rt.settings.max_body_bytes, hdr.get("content-length"))
        live = rt.live
        body, view = await read_json(
            raw,
            rt.settings,
            rt.parse_pool,
            route.endpoint,
            scan_chars=live.classifier.scan_chars,
            fingerprint=(scope["method"], path) if idempotency_key is not None else None,
            pools=live.pools,
        )
        decided_ns = time.time_ns() if trace is not None else 0
        texts = None if view is None else view.read_texts
        # a large body's prompt was rendered where it was parsed (``body`` holds stand-ins): hashed here, once
        hashes = None if view is None or not view.prompt else chain_hashes(view.prompt)
        d = decide(live, rt.routing, route.endpoint, body, hdr.get(TASK_HEADER), rt.rng, texts=texts, prompt=hashes)
        rec.traffic_class, plan, stream, max_attempts = d.traffic_class, d.plan, d.stream, d.max_attempts
        if d.features is not None:
            rec.task_type, rec.stream = d.features.task_type, d.features.stream
            extra += [("x-specgate-class", d.traffic_class), ("x-specgate-task-type", d.features.task_type)]
        d.check_model()
        sticky = Sticky(None, None)
        if route.endpoint == "responses":  # a follow-up goes to the endpoint holding its conversation, and only there
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
        if trace is not None:
            trace_decision(rt, trace, d, plan, body, decided_ns)
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
                fingerprint=view.fingerprint if view and view.fingerprint else fingerprint(scope["method"], path, body),
                record=rec,
                owner=store_owner(None if tenant is None else tenant.name, scope_key),
            )
            if isinstance(got, Replay):
                return _replay(rt, got, rec)
            claim = got
        if tenant is not None and rt.tenancy is not None:  # the tenant's limits (a replay above is free)
            ticket = await _take_ticket(rt, tenant, hdr.get(PRIORITY_HEADER), d, len(raw))
            extra += ticket.headers
        if plan.empty:
            raise plan.unavailable()
    except GatewayError as exc:
        await _release(claim, rec)
        if ticket is not None:
            ticket.finish(outcome_for(exc.status), False)
        return _refused(rt, exc, rec, extra)
    except ClientDisconnect:
        rec.finish("client_disconnect", rt.metrics, rt.access_log)
        raise
    except Exception:
        if ticket is not None:
            ticket.finish("gateway_error", False)
        await _release(claim, rec)
        rec.status, rec.error = 500, "internal error in the gateway"
        rec.finish("gateway_error", rt.metrics, rt.access_log)
        raise
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
    elif route.endpoint is not None and _affinity_on(live.pools, plan.pools):
        prompt = prompt_chunks(route.endpoint, body) if view is None else chain_hashes(view.prompt)
    job = ProxyJob(
        path=path,
        body=raw,
        client_headers=client_headers,
        stream=stream,
        plan=plan,
        max_attempts=max_attempts,
        record=rec,
        extra_headers=extra,
        parsed=body if stream or view is not None else None,
        serialize=None if view is None else view.serialize,
        idempotency=claim,
        dialect=ResponsesDialect() if route.endpoint == "responses" else CHAT,
        pinned=sticky.pinned,
        on_answer=sticky.on_answer,
        forwarded_for=forwarded_for(_client_addr(scope), client_headers, rt.trusted_proxies),
        detached=rt.detached,
        tenant=scope_key,
        prompt=prompt,
        ticket=ticket,
    )
    return ProxyExchange(job, live.pools, live.clients, rt.metrics, rt.access_log, rt.rng, rt.attempts)


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
    rt: Runtime, trace: RequestTrace, d: Decision, plan: Plan, body: Mapping[str, Any], start_ns: int
) -> None:
    """The request's sampling parameters and the routing decision, on its trace (tracing on only)."""
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
    )


def _client_addr(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None
