"""The front half of every proxied request: from "a proxied route was matched" to "a ``ProxyExchange`` runs, or a
refusal is rendered".

Every route that forwards to a pool goes this one way, whichever router matched it (the dispatcher's table of
classified POSTs, ``gateway.proxy.app.PROXY_ROUTES``, or Starlette's routes for the paths with a parameter and the
unclassified ``/tokenize`` and ``/detokenize``). ``admit`` makes the request's record and the headers every answer
carries, runs the route's own part (``ProxyRoute.prepare``: authenticate, read the body, decide where it goes), and
either builds the ``ProxyExchange`` that forwards it, returns the answer the route made itself (a stored response
replayed), or records and renders the refusal: one renderer for every route, the OpenAI error envelope
(``gateway.proxy.http.error_response``), and one way to name the outcome (``gateway.proxy.outcome``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import GatewayError
from gateway.observability.tracing import TRACE_ID_HEADER
from gateway.proxy.forward import ProxyExchange
from gateway.proxy.headers import request_id
from gateway.proxy.http import error_response, is_bug
from gateway.proxy.idempotency import KEY_HEADER, KeyClaim
from gateway.proxy.job import ProxyJob
from gateway.proxy.outcome import outcome_of
from gateway.proxy.record import RequestRecord
from gateway.routing.classify import TASK_HEADER, ApiKind
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig
from gateway.runtime.tenants import PRIORITY_HEADER, Ticket

# The request headers the front half reads, found in one pass over the raw list (first value; every Idempotency-Key).
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


class Incoming:
    """One request in the front half: the client's headers (decoded once, in order, as sent), the ones the front
    half reads (``hdr``, first value) and its Idempotency-Keys; its record and the headers every answer carries
    (``extra``, grown as the request earns them); and what a refusal must give back (its key claim, its tenant
    ticket), set by the route's part as it takes them."""

    __slots__ = ("claim", "client_headers", "extra", "hdr", "keys", "receive", "record", "scope", "ticket")

    def __init__(self, scope: Scope, receive: Receive, path: str, draw: Callable[[int], int] | None = None) -> None:
        self.scope = scope
        self.receive = receive
        self.client_headers = items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        self.hdr: dict[str, str] = {}
        self.keys: list[str] = []
        for k, v in items:
            if k in _WANTED:
                if k == KEY_HEADER:
                    self.keys.append(v)
                if k not in self.hdr:
                    self.hdr[k] = v
        self.record = RequestRecord(request_id(self.hdr.get("x-request-id"), draw), path)
        self.extra = [("x-request-id", self.record.request_id)]
        self.claim: KeyClaim | None = None
        self.ticket: Ticket | None = None

    async def give_back(self, exc: GatewayError | None) -> None:
        """Refused before forwarding (``exc``; None: a bug): the tenant's admission ends, and nothing was generated
        for the claimed key, which is freed for the client's retry."""
        if self.ticket is not None:
            self.ticket.finish("gateway_error" if exc is None else outcome_of(exc), False)
        if self.claim is not None:
            self.record.idempotency = "released"
            await self.claim.settle(None)


# A route's own part of the front half: the job to forward, or the answer it made itself (a replay); raises a
# ``GatewayError`` to refuse. It reads the live config it is given, the one the exchange then forwards with.
Prepare = Callable[[Runtime, LiveConfig, "ProxyRoute", Incoming], Awaitable[ProxyJob | Response]]


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """A route the gateway forwards to a pool: its path (a Starlette path template where it has a parameter), the
    request shape the classifier reads the routing features from (``None``: not classified; for the classified
    POSTs, the YAML's embeddings pool answers), and the route's own part of the front half."""

    path: str
    api: ApiKind | None
    prepare: Prepare


async def admit(rt: Runtime, route: ProxyRoute, scope: Scope, receive: Receive) -> ASGIApp:
    """What answers this request to ``route``. A refusal is answered here (and recorded); a client gone while its
    body was read raises ``ClientDisconnect``, a bug raises (both recorded); ``serve`` renders those."""
    req = Incoming(scope, receive, route.path, rt.ids.getrandbits)
    rec = req.record
    if rt.tracing is not None:  # tracing on (gateway.observability.tracing): the request's server span
        hdr = req.hdr
        trace = rt.tracing.start(
            scope["method"], route.path, rec.request_id, hdr.get("traceparent"), hdr.get("tracestate")
        )
        if trace.sampled:
            rec.trace = trace
        else:  # recorded only if the tail decision keeps it (``RequestRecord.keep_trace``)
            rec.quiet = trace
        req.extra.append((TRACE_ID_HEADER, trace.trace_id))
    live = rt.live
    try:
        got = await route.prepare(rt, live, route, req)
    except GatewayError as exc:
        await req.give_back(exc)
        rec.status, rec.error = exc.status, exc.message
        rec.finish(outcome_of(exc), rt.metrics, rt.access_log)
        return error_response(exc, scope["method"], rec.path, req.extra)
    except ClientDisconnect:
        rec.finish("client_disconnect", rt.metrics, rt.access_log)
        raise
    except Exception:
        await req.give_back(None)
        rec.status, rec.error = 500, "internal error in the gateway"
        rec.finish("gateway_error", rt.metrics, rt.access_log)
        raise
    if isinstance(got, ProxyJob):
        return ProxyExchange(
            got, live.pools, live.clients, rt.metrics, rt.access_log, rt.rng, rt.attempts, rt.watch_starts
        )
    return got


async def serve(rt: Runtime, route: ProxyRoute, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer one request to ``route``: ``admit``'s answer, or the exception it raised rendered by
    ``error_response`` (a bug is raised again for the server's log). The exchange answers its own errors."""
    try:
        answer = await admit(rt, route, scope, receive)
    except Exception as exc:
        await error_response(exc, scope["method"], route.path)(scope, receive, send)
        if is_bug(exc):
            raise
        exc.__traceback__ = None  # a handled exception kept alive elsewhere would pile up tracebacks
        return
    await answer(scope, receive, send)
