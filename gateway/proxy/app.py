"""The Starlette app: routes, thin handlers, and the one place where errors become OpenAI envelopes."""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, cast

import orjson
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.config.settings import Settings
from gateway.errors import (
    BadRequest,
    GatewayError,
    InvalidJSON,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
)
from gateway.observability.acceptance import temperature_band
from gateway.observability.metrics import CONTENT_TYPE, Outcome, multiprocess_dir
from gateway.proxy.dialect import CHAT, ResponsesDialect
from gateway.proxy.forward import ProxyJob, ProxyResponse
from gateway.proxy.headers import request_id
from gateway.proxy.idempotency import (
    KEY_HEADER,
    KeyClaim,
    Replay,
    begin,
    fingerprint,
    parse_key,
    store_key,
    tenant_scope,
)
from gateway.proxy.limits import check_json_depth
from gateway.proxy.record import RequestRecord
from gateway.proxy.responses import Sticky, cancel_response, for_create, retrieve_response
from gateway.proxy.tokens import detokenize, tokenize
from gateway.proxy.wire import JSON_CONTENT_TYPE, envelope
from gateway.routing.classify import TASK_HEADER, Endpoint
from gateway.routing.decision import decide
from gateway.runtime.container import Runtime

logger = logging.getLogger("specgate")


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


def _runtime(request: Request) -> Runtime:
    rt: Runtime = request.app.state.runtime
    return rt


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers=headers, media_type=JSON_CONTENT_TYPE)


async def _read_body(request: Request, limit: int, declared: str | None = None) -> bytes:
    """The body, counted while reading: a Content-Length can lie, and chunked bodies have none.

    Reads the ASGI messages itself (as ``Request.stream`` does, without its async generator): the usual body is one
    message.
    """
    if declared is None:
        declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
    receive = request.receive
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            if not message.get("more_body", False):
                if not parts:
                    return chunk
                parts.append(chunk)
                return b"".join(parts)
            parts.append(chunk)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


# The request headers ``_proxy`` reads, found in one pass over the raw list (first value; every Idempotency-Key).
_PROXY_HEADERS = frozenset({"x-request-id", "authorization", "content-length", TASK_HEADER, KEY_HEADER})


def _proxy_headers(request: Request) -> tuple[list[tuple[str, str]], dict[str, str], list[str]]:
    """The client's headers decoded (as ``request.headers.items()``), the ones ``_proxy`` reads, its keys."""
    items = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]]
    wanted: dict[str, str] = {}
    keys: list[str] = []
    for k, v in items:
        if k in _PROXY_HEADERS:
            if k == KEY_HEADER:
                keys.append(v)
            if k not in wanted:
                wanted[k] = v
    return items, wanted, keys


def _parse_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise InvalidJSON("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidJSON(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _outcome_for(status: int) -> Outcome:
    if status == 503:
        return "no_capacity"
    if status >= 500:
        return "gateway_error"
    return "client_error"


def _error_response(rt: Runtime, exc: GatewayError, rec: RequestRecord, extra: list[tuple[str, str]]) -> Response:
    rec.status, rec.error = exc.status, exc.message
    rec.finish(_outcome_for(exc.status), rt.metrics, rt.access_log)
    headers = dict(extra)
    headers.update(exc.headers)
    return _json(exc.envelope(), exc.status, headers)


def _replay(rt: Runtime, replay: Replay, rec: RequestRecord) -> Response:
    """A stored response again: it never reaches a pool."""
    status = replay.response.status
    rec.status = status
    rec.finish("ok" if status < 400 else _outcome_for(status), rt.metrics, rt.access_log)
    return replay.response.replay()


async def _release(claim: KeyClaim | None, rec: RequestRecord) -> None:
    """Nothing was generated for a claimed key (refused before forwarding): free it for the client's retry."""
    if claim is not None:
        rec.idempotency = "released"
        await claim.settle(None)


async def _proxy(request: Request, endpoint: Endpoint | None, path: str) -> Response:
    rt = _runtime(request)
    client_headers, hdr, keys = _proxy_headers(request)
    rec = RequestRecord(request_id(hdr.get("x-request-id")), path)
    extra = [("x-request-id", rec.request_id)]
    claim: KeyClaim | None = None
    try:
        rt.authenticate(hdr.get("authorization"))
        idempotency_key = parse_key(keys)
        raw = await _read_body(request, rt.settings.max_body_bytes, hdr.get("content-length"))
        body = _parse_object(raw)
        check_json_depth(raw, body, rt.settings.max_json_depth)
        live = rt.live
        d = decide(live, rt.routing, endpoint, body, hdr.get(TASK_HEADER), rt.rng)
        rec.traffic_class, plan, stream, max_attempts = d.traffic_class, d.plan, d.stream, d.max_attempts
        if d.features is not None:
            rec.task_type, rec.stream = d.features.task_type, d.features.stream
            extra += [("x-specgate-class", d.traffic_class), ("x-specgate-task-type", d.features.task_type)]
        d.check_model()
        sticky = Sticky(None, None)
        if endpoint == "responses":  # a follow-up goes to the endpoint holding its conversation, and only there
            sticky = await for_create(
                rt.store, live.pools, body, hdr.get("authorization"), live.rules.idempotency.ttl_s
            )
            plan, max_attempts = sticky.plan or plan, 1 if sticky.pinned else max_attempts
        rec.route_reason = plan.reason
        extra.append(("x-specgate-route", plan.reason))
        if d.klass is not None and d.klass.require_idempotency_key and idempotency_key is None:
            raise BadRequest(
                f"requests of class {d.traffic_class!r} need an Idempotency-Key header", code="idempotency_key_required"
            )
        tenant = tenant_scope(hdr.get("authorization")) if idempotency_key is not None else b"anonymous"
        if idempotency_key is not None:  # before the capacity check: a replay needs no pool
            got = await begin(
                rt.store,
                live.rules.idempotency,
                rt.metrics,
                key=store_key(tenant, idempotency_key),
                fingerprint=fingerprint(request.method, path, body),
                record=rec,
            )
            if isinstance(got, Replay):
                return _replay(rt, got, rec)
            claim = got
        if plan.empty:
            raise plan.unavailable()
    except GatewayError as exc:
        await _release(claim, rec)
        return _error_response(rt, exc, rec, extra)
    except ClientDisconnect:
        rec.finish("client_disconnect", rt.metrics, rt.access_log)
        raise
    except Exception:
        await _release(claim, rec)
        rec.status, rec.error = 500, "internal error in the gateway"
        rec.finish("gateway_error", rt.metrics, rt.access_log)
        raise
    rec.temperature_band = temperature_band(body.get("temperature"))
    job = ProxyJob(
        path=path,
        body=raw,
        client_headers=client_headers,
        stream=stream,
        plan=plan,
        max_attempts=max_attempts,
        record=rec,
        extra_headers=extra,
        parsed=body if stream else None,
        idempotency=claim,
        dialect=ResponsesDialect() if endpoint == "responses" else CHAT,
        pinned=sticky.pinned,
        on_answer=sticky.on_answer,
        client_addr=_client_addr(request.scope),
        detached=rt.detached,
        tenant=tenant,
    )
    return ProxyResponse(job, live.pools, live.clients, rt.metrics, rt.access_log, rt.rng, rt.attempts)


def _client_addr(scope: Scope) -> str | None:
    client = scope.get("client")
    return str(client[0]) if client else None


async def chat_completions(request: Request) -> Response:
    return await _proxy(request, "chat", "/v1/chat/completions")


async def completions(request: Request) -> Response:
    return await _proxy(request, "completions", "/v1/completions")


async def responses(request: Request) -> Response:
    return await _proxy(request, "responses", "/v1/responses")


async def embeddings(request: Request) -> Response:
    return await _proxy(request, None, "/v1/embeddings")


async def models(request: Request) -> Response:
    rt = _runtime(request)
    rt.authenticate(request.headers.get("authorization"))
    data = [
        {"id": m, "object": "model", "created": rt.started_at, "owned_by": "specgate", "root": m, "parent": None}
        for m in rt.live.models
    ]
    return _json({"object": "list", "data": data})


async def health(request: Request) -> Response:
    return Response(b"", 200)


async def ready(request: Request) -> Response:
    rt = _runtime(request)
    ok, why = rt.ready
    # A degraded idempotency store is reported, not a reason to be unready: requests without a key still flow.
    return _json({"ready": ok, "reason": why, "store": rt.store_health.status()}, 200 if ok else 503)


async def metrics(request: Request) -> Response:
    m = _runtime(request).metrics
    if m.shared_dir is None:
        body = m.render()
    else:  # merging N workers' files costs about N renders: off the event loop, which keeps proxying
        body = await run_in_threadpool(m.render)
    return Response(body, 200, media_type=CONTENT_TYPE)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _json(exc.envelope(), exc.status, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    err: GatewayError
    if exc.status_code == 404:
        err = RouteNotFound(f"no route for {request.method} {request.url.path}")
    elif exc.status_code == 405:
        err = MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
        err.headers.update(exc.headers or {})
    else:
        err = GatewayError(str(exc.detail))
    return _json(err.envelope(), exc.status_code, err.headers)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(b"", 499)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    body = envelope("internal error in the gateway", "internal_error", code="internal_error")
    return _json(body, 500)


Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]  # as the ones ``create_app`` registers


class GatewayApp(Starlette):
    """Starlette, with a direct way in for the proxy routes (most of the traffic).

    Around a handler, Starlette runs two middlewares, the router's scan of the routes, and three wrappers of every
    ``send`` (every event of a stream passes them): measured, 8-13% of the gateway's CPU per proxied request.
    ``__call__`` gives a POST to one of ``proxy_routes`` straight to its handler, and does itself what that stack
    does with an exception from it: the handler registered for its class (``GatewayError``, ``HTTPException``,
    ``ClientDisconnect``) answers while no response has started; anything else, or a handled exception after the
    start, goes to the ``Exception`` handler (the 500 envelope, unless the response started) and is raised again
    for the server to log. Every other request (and one under a ``root_path``, or with middleware added) goes
    through Starlette as before.
    """

    def __init__(self, proxy_routes: Mapping[str, Handler], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.proxy_routes = dict(proxy_routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            handler = self.proxy_routes.get(scope["path"])
            if handler is not None and self._direct_ok():
                scope["app"] = self
                await self._direct(handler, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def _direct_ok(self) -> bool:
        """The direct way in does what Starlette's stack does only for this app as ``create_app`` builds it: no
        middleware, no body-size limit, no debug pages, and a last-resort ``Exception`` handler."""
        return (
            not self.user_middleware
            and getattr(self, "max_body_size", None) is None
            and not self.debug
            and Exception in self.exception_handlers
        )

    async def _direct(self, handler: Handler, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            response = await handler(request)
            await response(scope, receive, sender)
        except Exception as exc:
            await self._failed(request, exc, started, send)

    async def _failed(self, request: Request, exc: Exception, started: bool, send: Send) -> None:
        """What ``ExceptionMiddleware`` and then ``ServerErrorMiddleware`` do with ``exc``."""
        error: Exception = exc
        handler = self._handler_for(exc)
        if handler is not None:
            if not started:
                response = await handler(request, exc)
                await response(request.scope, request.receive, send)
                exc.__traceback__ = None  # as Starlette: a reused exception would pile up tracebacks
                return
            error = RuntimeError("Caught handled exception, but response already started.")
            error.__cause__ = exc
        fallback = cast(ErrorHandler, self.exception_handlers[Exception])
        response = await fallback(request, error)
        if not started:
            await response(request.scope, request.receive, send)
        raise error

    def _handler_for(self, exc: Exception) -> ErrorHandler | None:
        for cls in type(exc).__mro__:
            if cls is Exception:
                return None  # the last resort: ServerErrorMiddleware's, not ExceptionMiddleware's
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                return cast(ErrorHandler, handler)
        return None


def exception_handlers() -> dict[Any, ErrorHandler]:
    """Errors as OpenAI envelopes: the gateway's own, Starlette's (404 / 405), a client gone, and a bug (500)."""
    return {
        GatewayError: _gateway_error,
        HTTPException: _http_error,
        ClientDisconnect: _client_gone,
        Exception: _internal_error,
    }


def create_app(settings: Settings, runtime: Runtime | None = None) -> Starlette:
    """Build the app. Loads and validates the routing YAML now, so a broken file fails at start-up."""
    rt = runtime if runtime is not None else Runtime.from_settings(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await rt.start()
        try:
            yield
        finally:
            await rt.stop()

    proxy_routes: dict[str, Handler] = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        "/v1/responses": responses,
        "/v1/embeddings": embeddings,
    }
    routes = [
        *(Route(path, handler, methods=["POST"]) for path, handler in proxy_routes.items()),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = GatewayApp(
        proxy_routes,
        routes=routes,
        lifespan=lifespan,
        exception_handlers=exception_handlers(),
    )
    app.state.runtime = rt
    return app


def create_app_from_env() -> Starlette:
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
    metrics = _runtime_of(app).metrics
    metrics.share_across_workers(shared)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[Any]:
        try:
            async with inner(app) as state:
                yield state
        finally:
            metrics.worker_exited()

    app.router.lifespan_context = lifespan
    return app


def _runtime_of(app: Starlette) -> Runtime:
    rt: Runtime = app.state.runtime
    return rt
