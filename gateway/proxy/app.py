"""The gateway's ASGI app: an outer dispatcher, the proxy routes, and Starlette for everything else.

::

    GatewayApp(scope)
    ├── POST to a path of PROXY_ROUTES  -> front.serve -> ProxyExchange (forward.py)      plain ASGI, no router
    ├── another method on such a path   -> 405 envelope
    └── anything else -> Starlette: the proxied routes it matches (/tokenize, /detokenize, /v1/responses/{id} and
        its cancel) -> front.serve, as above; GET /v1/models, /health, /ready, /metrics, 404s, lifespan

Errors on every way in are rendered by ``gateway.proxy.http.error_response``. To forward one more POST path to the
pools, add a ``ProxyRoute`` to ``PROXY_ROUTES`` (and, when its body is classified, its shape to
``gateway.routing.classify.ApiKind``); ``specgate explain`` covers every path of the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config.settings import Settings
from gateway.errors import GatewayError
from gateway.observability.metrics import CONTENT_TYPE, OPENMETRICS, OPENMETRICS_CONTENT_TYPE, multiprocess_dir
from gateway.periodic import DelayedCalls
from gateway.proxy.front import ProxyRoute, serve
from gateway.proxy.headers import request_id
from gateway.proxy.http import error_response, exception_handlers, json_response
from gateway.proxy.intake import classified
from gateway.proxy.presence import WATCH_AFTER_S
from gateway.proxy.stall import remember_transport
from gateway.proxy.stored_responses import CANCEL, DELETE, RETRIEVE
from gateway.proxy.tokens import DETOKENIZE, TOKENIZE
from gateway.runtime.container import Runtime

logger = logging.getLogger("specgate")

# The POST paths forwarded to the pools: the request path of the package map, without Starlette on the way.
PROXY_ROUTES: tuple[ProxyRoute, ...] = (
    ProxyRoute("/v1/chat/completions", "chat", classified),
    ProxyRoute("/v1/completions", "completions", classified),
    ProxyRoute("/v1/responses", "responses", classified),
    ProxyRoute("/v1/embeddings", None, classified),
)

# Young-generation threshold of the cyclic garbage collector. A request allocates a few hundred container objects
# that reference counting frees, yet CPython's default (700) ran a gen-0 collection every few requests and, through
# it, full collections over every object the imports and the config created: 10-15% of the gateway's CPU and 50-100 ms
# pauses in the p99 (measured with gc.callbacks under wrk). Nothing on the hot path relies on cycle collection.
GC_THRESHOLD = (20_000, 20, 10)


def tune_gc() -> None:
    """Once the app is built: move everything alive now (modules, config, compiled rules) out of the collector's
    view (``gc.freeze``), and collect the young generation less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def route_path(scope: Scope) -> str:
    """The request's path without the app's mount point (``root_path``), as Starlette's router matches it."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] == "/":
        return path[len(root) :]
    return path


class GatewayApp:
    """The gateway's ASGI app: a dispatcher in front of Starlette.

    A POST to one of ``proxy_routes`` (most of the traffic) goes straight to the front half (``front.serve``): a
    refusal rendered, or a ``ProxyExchange`` that runs the attempts and the relay. Starlette's stack (two
    middlewares, the router's scan of the routes, three wrappers around every ``send``, so around every event of a
    stream) measured 8-13% of the gateway's CPU per proxied request; here ``send`` is the server's. An exception
    before the response starts is answered by ``error_response``, as Starlette's handlers answer on the other
    routes, and a bug is raised again for the server's log; after the start nothing more can be sent, and it is
    raised for the server, which closes the connection.

    Everything else, lifespan included, goes to ``starlette``, whose ``state.runtime`` its handlers read.
    """

    def __init__(self, runtime: Runtime, proxy_routes: Iterable[ProxyRoute], starlette: Starlette) -> None:
        self.runtime = runtime
        self.proxy_routes = {route.path: route for route in proxy_routes}
        self.starlette = starlette
        # With ``--workers N`` each worker's one uvicorn server listens on the client socket and the admin socket
        # (both bound by the supervisor): connections to the admin port go to the admin app, decided by the port
        # the connection reached (the socket's own address, not a header).
        self.admin_port: int | None = None
        self.admin: ASGIApp | None = None

    def serve_admin_on(self, port: int, admin: ASGIApp) -> None:
        """Send the connections that reached local port ``port`` to ``admin`` (and never to the proxy)."""
        self.admin_port, self.admin = port, admin

    @property
    def state(self) -> State:
        return self.starlette.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.admin is not None and scope["type"] != "lifespan":
            server = scope.get("server")
            if server is not None and server[1] == self.admin_port:
                await self.admin(scope, receive, send)
                return
        if scope["type"] == "http":
            remember_transport(scope, send)  # to cut off a client that stops reading (gateway.proxy.stall)
            route = self.proxy_routes.get(route_path(scope))
            if route is not None:
                if scope["method"] == "POST":
                    await serve(self.runtime, route, scope, receive, send)
                else:  # as Starlette's router answers a route without the method
                    refused = HTTPException(405, headers={"Allow": "POST"})
                    await error_response(refused, scope["method"], scope["path"])(scope, receive, send)
                return
        await self.starlette(scope, receive, send)


class Routed:
    """A proxied route that Starlette's router matches (a path with a parameter, or one of the unclassified
    POSTs): the same front half as the dispatcher's table."""

    __slots__ = ("route", "runtime")

    def __init__(self, runtime: Runtime, route: ProxyRoute) -> None:
        self.runtime, self.route = runtime, route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await serve(self.runtime, self.route, scope, receive, send)


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


async def models(request: Request) -> Response:
    rt = _runtime(request)
    extra = {"x-request-id": request_id(request.headers.get("x-request-id"))}
    try:
        rt.authenticate(request.headers.get("authorization"))
    except GatewayError as exc:
        return error_response(exc, "GET", "/v1/models", extra.items())
    data = [
        {"id": m, "object": "model", "created": rt.started_at, "owned_by": "specgate", "root": m, "parent": None}
        for m in rt.live.models
    ]
    return json_response({"object": "list", "data": data}, headers=extra)


async def health(request: Request) -> Response:
    return Response(b"", 200)


async def ready(request: Request) -> Response:
    rt = _runtime(request)
    ok, why = rt.ready
    # A degraded idempotency store is reported, not a reason to be unready: requests without a key still flow.
    return json_response({"ready": ok, "reason": why, "store": rt.store_health.status()}, 200 if ok else 503)


async def metrics(request: Request) -> Response:
    rt = _runtime(request)
    rt.authenticate_metrics(request.headers.get("authorization"))  # names and traffic: not for strangers
    m = rt.metrics
    if rt.tracing is not None:
        m.trace_spans(rt.tracing.span_counts())
    # With tracing on, a scraper that accepts OpenMetrics gets it: the latency histograms' trace-id exemplars.
    if rt.tracing is not None and m.shared_dir is None and OPENMETRICS in request.headers.get("accept", ""):
        return Response(m.render(openmetrics=True), 200, media_type=OPENMETRICS_CONTENT_TYPE)
    if m.shared_dir is None:
        body = m.render()
    else:  # merging N workers' files costs about N renders: off the event loop, which keeps proxying
        body = await run_in_threadpool(m.render)
    return Response(body, 200, media_type=CONTENT_TYPE)


def create_app(settings: Settings, runtime: Runtime | None = None) -> GatewayApp:
    """Build the app. Loads and validates the routing YAML now, so a broken file fails at start-up."""
    rt = runtime if runtime is not None else Runtime.from_settings(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await rt.start()
        rt.watch_starts = DelayedCalls(asyncio.get_running_loop(), WATCH_AFTER_S)
        if rt.tracing is not None:  # its export process (a process that never serves, a supervisor, starts none)
            rt.tracing.start_export()
        try:
            yield
        finally:
            starts, rt.watch_starts = rt.watch_starts, None
            if starts is not None:
                starts.close()
            await rt.stop()

    routes = [
        Route(RETRIEVE.path, Routed(rt, RETRIEVE), methods=["GET"]),
        Route(DELETE.path, Routed(rt, DELETE), methods=["DELETE"]),
        Route(CANCEL.path, Routed(rt, CANCEL), methods=["POST"]),
        Route(TOKENIZE.path, Routed(rt, TOKENIZE), methods=["POST"]),
        Route(DETOKENIZE.path, Routed(rt, DETOKENIZE), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    starlette = Starlette(routes=routes, lifespan=lifespan, exception_handlers=exception_handlers())
    starlette.state.runtime = rt
    return GatewayApp(rt, PROXY_ROUTES, starlette)


def create_app_from_env() -> GatewayApp:
    """uvicorn factory for multi-worker mode: settings come from SPECGATE_* variables.

    When ``specgate serve --workers N`` has set up prometheus_client's multiprocess directory, this worker's
    /metrics answers the totals of all workers, and its lifespan shutdown withdraws its gauges from them.
    """
    from gateway.observability.logs import configure_logging

    settings = Settings.from_env()
    configure_logging(settings.log_level)
    app = create_app(settings)
    tune_gc()
    shared = multiprocess_dir()
    if shared is None:
        if settings.workers > 1:
            logger.warning("PROMETHEUS_MULTIPROC_DIR is not set up: /metrics shows this worker's numbers only")
        return app
    metrics = app.runtime.metrics
    metrics.share_across_workers(shared)
    router = app.starlette.router
    inner = router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(starlette: Starlette) -> AsyncIterator[Any]:
        try:
            async with inner(starlette) as state:
                yield state
        finally:
            metrics.worker_exited()

    router.lifespan_context = lifespan
    return app
