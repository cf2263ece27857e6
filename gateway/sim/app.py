"""The simulator's HTTP surface: ``vllm serve`` 0.33 on the wire, a simulated engine underneath, fault injection
and the ``/sim/*`` control API.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming and not), ``POST /v1/responses``,
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` (``responses``), ``POST /tokenize``,
``POST /detokenize``, ``GET /v1/models``,
``GET /health`` and ``GET /ping`` (200 empty; 503 when faulted or the engine is stopped), ``GET /version``,
``GET /metrics``, ``POST /reset_prefix_cache`` (vLLM's dev-mode route); ``GET /sim/stats``, ``GET/PUT /sim/faults``,
``POST /sim/faults/reset``, ``GET /sim/options``.
``--api-key`` protects ``/v1/*`` only, like vLLM's middleware.

A generation request: parse and validate like vLLM (``wire.parse_request``; an ``X-Vllm-Priority`` header
overrides the body's ``priority``), draw the injected faults, draw the
request's acceptance from the task (``X-Sim-Task``, else ``wire.guess_task``) and temperature, submit one
``GenRequest`` per output sequence to the engine (``QueueFull`` → 503), then stream one chunk per engine step
(every token that step emitted) or answer once generation ends. A watcher on ``receive`` notices the client going
away at once and aborts the generation, whatever the request was waiting on.

Refusing connections needs the server socket: the app's ``FaultState`` holds a ``faults.ListenerControl``
(``server.SimServer`` plugs itself in) and asks it to stop or resume listening.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.sim import responses as sim_responses
from gateway.sim import wire
from gateway.sim.call import GenerationCall, error_response, json_response
from gateway.sim.faults import MALFORMED_METRICS, Faults, RequestFaults
from gateway.sim.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.sim.state import TASK_HEADER, SimOptions, SimState, sim_state
from gateway.sim.tracing import TRACE_HEADERS

PRIORITY_HEADER = "x-vllm-priority"

__all__ = ["SimOptions", "SimState", "create_sim_app", "sim_state"]

# --------------------------------------------------------------------------------------------------------------
# The app


class _SimApp(Starlette):
    """Starlette, plus what must happen outermost: reach uvicorn's transport (to cut connections), check
    ``--api-key`` like vLLM (``/v1`` paths, OPTIONS exempt), echo ``X-Request-Id`` when enabled."""

    sim: SimState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        wire.remember_transport(scope, send)
        options = self.sim.options
        if options.api_keys and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            auth = _header(scope, b"authorization") or ""
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or token not in options.api_keys:
                unauthorized = Response(wire.UNAUTHORIZED_BODY, 401, media_type=wire.JSON_CONTENT_TYPE)
                await unauthorized(scope, receive, send)
                return
        if options.enable_request_id_headers:
            request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
            inner = send

            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {
                        **message,
                        "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())],
                    }
                await inner(message)

            send = send_with_id
        await super().__call__(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def create_sim_app(options: SimOptions) -> Starlette:
    """A simulated ``vllm serve``. The engine starts and stops with the app's lifespan."""
    state = SimState(options)
    store = sim_responses.ResponseStore(options.enable_responses_store)
    served = options.names

    async def parse_body(request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise wire.WireError(400, f"Invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise wire.WireError(400, "The request body must be a JSON object.")
        return body

    def with_header_priority(request: Request, req: wire.SimRequest) -> wire.SimRequest:
        """vLLM's ``X-Vllm-Priority`` header overrides the body's ``priority``."""
        priority = wire.priority_header(request.headers.get(PRIORITY_HEADER))
        return req if priority is None else dataclasses.replace(req, priority=priority)

    def admit() -> Response | RequestFaults:
        """The injected faults of an admitted request, or the error answer (injected, or the engine stopped)."""
        faults = state.faults.draw()
        if faults.error_status is not None:
            state.counts["error"] += 1
            return error_response(wire.WireError(faults.error_status, "Injected failure (simulator fault injection)."))
        if not state.alive:
            return error_response(wire.WireError(500, "The engine is not running."))
        return faults

    async def generate(request: Request, kind: wire.Kind) -> Response:
        state.counts["requests"] += 1
        try:
            body = await parse_body(request)
            req = wire.parse_request(
                kind, body, served=served, max_model_len=state.max_model_len, lengths=options.output_lengths
            )
        except wire.WireError as exc:
            return error_response(exc)
        req = with_header_priority(request, req)
        faults = admit()
        if isinstance(faults, Response):
            return faults
        task = (request.headers.get(TASK_HEADER) or "").strip().lower() or wire.guess_task(body)
        request_id = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex
        call = GenerationCall(state, req, str(request_id), task, faults)
        if state.tracer is not None:  # vLLM's llm_request span, under the caller's traceparent (sim.tracing)
            call.trace_headers = {k: v for k in TRACE_HEADERS if (v := request.headers.get(k))}
            call.top_p = body.get("top_p") if isinstance(body.get("top_p"), int | float) else None
        return call

    async def responses_create(request: Request) -> Response:
        state.counts["requests"] += 1
        try:
            body = await parse_body(request)
            prep = sim_responses.prepare(body, store)
            req = wire.parse_request(
                "chat", prep.chat_body, served=served, max_model_len=state.max_model_len, lengths=options.output_lengths
            )
        except wire.WireError as exc:
            return error_response(exc)
        req = with_header_priority(request, req)
        faults = admit()
        if isinstance(faults, Response):
            return faults
        task = (request.headers.get(TASK_HEADER) or "").strip().lower() or wire.guess_task(prep.chat_body)
        call = sim_responses.ResponsesCall(
            state, req, prep.response_id, task, faults, body=body, prepared=prep, store=store
        )
        if not prep.background:
            return call
        queued = sim_responses.queued(call)
        store.put(queued, prep.messages)
        store.tasks[prep.response_id] = asyncio.create_task(sim_responses.run_background(call, store))
        return json_response(queued)

    async def responses_get(request: Request) -> Response:
        rid = request.path_params["response_id"]
        if request.query_params.get("stream") in ("true", "True", "1"):
            return error_response(wire.WireError(400, "Streaming a stored response is not simulated.", param="stream"))
        response = store.responses.get(rid)
        return json_response(response) if response is not None else error_response(sim_responses.not_found(rid))

    async def responses_cancel(request: Request) -> Response:
        rid = request.path_params["response_id"]
        response = store.responses.get(rid)
        if response is None:
            return error_response(sim_responses.not_found(rid))
        if response["status"] not in ("queued", "in_progress"):
            error = wire.WireError(400, "Cannot cancel a synchronous response.", "invalid_request_error", "response_id")
            return error_response(error)
        response["status"] = "cancelled"
        task = store.tasks.get(rid)
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        return json_response(response)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def tokenize(request: Request) -> Response:
        try:
            body = await parse_body(request)
            model = body.get("model") or served[0]
            if model not in served:
                raise wire.model_not_found(model, served)
            if isinstance(body.get("prompt"), str):
                text = body["prompt"]
            elif isinstance(body.get("messages"), list):
                text = wire.chat_text(body)
            else:
                raise wire.WireError(400, "prompt or messages: Field required.", param="prompt")
        except wire.WireError as exc:
            return error_response(exc)
        tokens = wire.token_ids(text)
        return json_response(
            {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": None}
        )

    async def detokenize(request: Request) -> Response:
        try:
            body = await parse_body(request)
            model = body.get("model") or served[0]
            if model not in served:
                raise wire.model_not_found(model, served)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
                raise wire.WireError(400, "tokens: a list of non-negative integers is required.", param="tokens")
        except wire.WireError as exc:
            return error_response(exc)
        return json_response({"prompt": "".join(wire.pseudo_tokens(sum(tokens), len(tokens)))})

    async def models(request: Request) -> Response:
        return json_response(
            wire.model_list(served, created=state.created, max_model_len=state.max_model_len, root=options.model)
        )

    async def health(request: Request) -> Response:
        status = state.faults.faults.health_status
        if not state.alive or state.engine.dead:
            status = 503
        return Response(b"", status_code=status)

    async def version(request: Request) -> Response:
        return json_response({"version": wire.VLLM_VERSION})

    async def metrics(request: Request) -> Response:
        mode = state.faults.faults.metrics
        if mode == "missing":
            return json_response({"detail": "Not Found"}, 404)
        if mode == "malformed":
            return Response(MALFORMED_METRICS, media_type=METRICS_CONTENT_TYPE)
        engine = state.engine
        state.metrics.set_scheduler(engine.running, engine.waiting, engine.kv_usage)
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    async def sim_stats(request: Request) -> Response:
        return json_response(state.stats())

    async def sim_faults(request: Request) -> Response:
        if request.method == "PUT":
            try:
                patch = orjson.loads(await request.body())
                await state.faults.apply(state.faults.faults.merged(patch))
            except (orjson.JSONDecodeError, ValueError) as exc:
                return error_response(wire.WireError(400, str(exc)))
        return json_response(state.faults.faults.to_json())

    async def reset_prefix_cache(request: Request) -> Response:
        # vLLM's dev-mode route (VLLM_SERVER_DEV_MODE=1): 200 with no body; a cache that running sequences still
        # hold is left as it is, as vLLM leaves it (its log says so; the answer does not).
        state.engine.reset_prefix_cache()
        return Response(status_code=200)

    async def sim_faults_reset(request: Request) -> Response:
        await state.faults.apply(Faults())
        return json_response(state.faults.faults.to_json())

    async def sim_options(request: Request) -> Response:
        shown = dataclasses.replace(options, api_keys=("<redacted>",) * len(options.api_keys))
        raw = orjson.dumps(shown, default=lambda o: dict(o) if isinstance(o, Mapping) else str(o))
        return Response(raw, media_type=wire.JSON_CONTENT_TYPE)

    async def not_found(request: Request, exc: Exception) -> Response:
        return json_response({"detail": "Not Found"}, 404)

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return json_response({"detail": "Method Not Allowed"}, 405)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncGenerator[None, None]:
        if state.kv_events is not None:
            state.kv_events.start()
        await state.engine.start()
        state.alive = True
        try:
            yield
        finally:
            state.alive = False
            for task in list(store.tasks.values()):
                task.cancel()
            state.faults.close()
            await state.engine.stop()
            if state.kv_events is not None:
                state.kv_events.close()
            if state.tracer is not None:
                await asyncio.to_thread(state.tracer.shutdown)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses_create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses_get, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses_cancel, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/sim/stats", sim_stats, methods=["GET"]),
        Route("/sim/faults", sim_faults, methods=["GET", "PUT"]),
        Route("/sim/faults/reset", sim_faults_reset, methods=["POST"]),
        Route("/sim/options", sim_options, methods=["GET"]),
    ]
    app = _SimApp(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_allowed})
    app.sim = state
    app.state.sim = state
    app.state.responses = store
    return app
