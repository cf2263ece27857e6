"""The fake upstream's Starlette app: ``create_fake_upstream`` (request admission and validation, the vLLM
routes and the ``/_fake/`` test hooks), ``_FakeApp`` (transport capture, request recording and the
``--api-key`` check, outermost) and ``fake_state``.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from gateway.sim.wire import (
    VLLM_VERSION,
    model_list,
    remember_transport,
)
from gateway.testing.fake_upstream.behavior import (
    BEHAVIOR_HEADER,
    Behavior,
    FakeConfig,
    Kind,
    parse_behavior,
)
from gateway.testing.fake_upstream.generation import (
    FakeGeneration,
    Job,
    count_prompt_tokens,
    error_response,
    json_response,
)
from gateway.testing.fake_upstream.state import FakeState

MAX_MODEL_LEN = 8192


# --------------------------------------------------------------------------------------------------------------
# The app


class _FakeApp(Starlette):
    """Starlette, plus what has to happen outermost: reach uvicorn's transport (for the abrupt break), record
    every request with its body, and check ``--api-key`` like vLLM's middleware (``/v1`` paths only)."""

    fake: FakeState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        remember_transport(scope, send)

        chunks: list[bytes] = []
        gone = False
        while True:
            message = await receive()
            if message["type"] != "http.request":
                gone = True
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        path: str = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if not path.startswith("/_fake/"):
            parsed: Any = None
            if body:
                try:
                    parsed = orjson.loads(body)
                except orjson.JSONDecodeError:
                    parsed = None
            query = scope.get("query_string", b"").decode("latin-1")
            self.fake.record(scope["method"], path, query, headers, parsed)
        if gone:
            return

        key = self.fake.config.api_key
        protected = key is not None and path.startswith("/v1") and scope["method"] != "OPTIONS"
        if protected and headers.get("authorization") != f"Bearer {key}":
            await json_response({"error": "Unauthorized"}, 401)(scope, receive, send)
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await super().__call__(scope, replay, send)


def fake_state(app: Starlette) -> FakeState:
    """The in-memory state of an app made by ``create_fake_upstream`` (same object as ``app.state.fake``)."""
    state = app.state.fake
    assert isinstance(state, FakeState)
    return state


def create_fake_upstream(config: FakeConfig) -> Starlette:
    state = FakeState(config)

    def behavior_of(request: Request) -> Behavior:
        header = request.headers.get(BEHAVIOR_HEADER)
        return parse_behavior(header if header is not None else state.default_behavior)

    async def parse_json(request: Request) -> dict[str, Any] | Response:
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"Invalid JSON body: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object.", "BadRequestError")
        return body

    def resolve_model(body: dict[str, Any]) -> str | Response:
        model = body.get("model")
        if model is None:
            return config.models[0]
        if not isinstance(model, str) or model not in config.models:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model

    async def admit(request: Request, kind: Kind) -> Response:
        parsed = await parse_json(request)
        if isinstance(parsed, Response):
            return parsed
        body = parsed
        try:
            behavior = behavior_of(request)
        except ValueError as exc:
            return error_response(400, str(exc), "BadRequestError")
        if behavior.status is not None:
            return error_response(behavior.status, f"Injected {behavior.status} (X-Fake-Behavior).")
        model = resolve_model(body)
        if isinstance(model, Response):
            return model
        stream = body.get("stream") is True
        stream_options = body.get("stream_options")
        if stream_options is not None and not stream:
            return error_response(
                400, "Stream options can only be defined when `stream=True`.", "BadRequestError", "stream_options"
            )
        if stream_options is not None and not isinstance(stream_options, dict):
            return error_response(400, "stream_options must be an object.", "BadRequestError", "stream_options")
        options: dict[str, Any] = stream_options or {}
        inputs: list[str] = []
        if kind == "chat" and not isinstance(body.get("messages"), list):
            return error_response(400, "Field required: messages", "BadRequestError", "messages")
        if kind == "completion" and body.get("prompt") is None:
            return error_response(400, "Field required: prompt", "BadRequestError", "prompt")
        if kind == "embedding":
            raw_input = body.get("input")
            if raw_input is None:
                return error_response(400, "Field required: input", "BadRequestError", "input")
            items = raw_input if isinstance(raw_input, list) and not _is_token_list(raw_input) else [raw_input]
            inputs = [i if isinstance(i, str) else orjson.dumps(i).decode() for i in items]
            stream = False
        max_tokens = body.get("max_completion_tokens") if kind == "chat" else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return error_response(400, "max_tokens must be at least 1.", "BadRequestError", "max_tokens")
        natural = behavior.tokens if behavior.tokens is not None else config.tokens
        tokens = natural if max_tokens is None else min(natural, max_tokens)
        job = Job(
            kind=kind,
            model=model,
            stream=stream,
            tokens=0 if kind == "embedding" else tokens,
            finish_reason="length" if max_tokens is not None and max_tokens < natural else "stop",
            include_usage=bool(options.get("include_usage")),
            continuous_usage=bool(options.get("include_usage")) and bool(options.get("continuous_usage_stats")),
            prompt_tokens=count_prompt_tokens(kind, body),
            behavior=behavior,
            first_token_delay=(
                behavior.first_token_delay if behavior.first_token_delay is not None else config.first_token_delay_s
            ),
            token_delay=behavior.token_delay if behavior.token_delay is not None else config.token_delay_s,
            inputs=inputs,
        )
        return FakeGeneration(state, job)

    async def chat_completions(request: Request) -> Response:
        return await admit(request, "chat")

    async def completions(request: Request) -> Response:
        return await admit(request, "completion")

    async def embeddings(request: Request) -> Response:
        if not config.embeddings:
            return error_response(404, "The model does not support Embeddings API", "NotFoundError")
        return await admit(request, "embedding")

    async def models(request: Request) -> Response:
        return json_response(model_list(config.models, created=state.created, max_model_len=MAX_MODEL_LEN))

    async def health(request: Request) -> Response:
        return Response(b"", status_code=state.health_status)

    async def version(request: Request) -> Response:
        return json_response({"version": VLLM_VERSION})

    async def metrics(request: Request) -> Response:
        return Response(state.prometheus(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def fake_requests(request: Request) -> Response:
        if request.method == "DELETE":
            state.requests.clear()
            return Response(b"", status_code=204)
        path = request.query_params.get("path")
        return json_response([r for r in state.requests if path is None or r["path"] == path])

    async def fake_stats(request: Request) -> Response:
        return json_response(state.stats())

    async def fake_behavior(request: Request) -> Response:
        if request.method == "PUT":
            parsed = await parse_json(request)
            if isinstance(parsed, Response):
                return parsed
            if "default" in parsed:
                default = parsed["default"]
                try:
                    parse_behavior(default)
                except (ValueError, AttributeError) as exc:
                    return error_response(400, str(exc), "BadRequestError", "default")
                state.default_behavior = default
            if "health_status" in parsed:
                status = parsed["health_status"]
                if not isinstance(status, int) or not 100 <= status <= 599:
                    message = "health_status must be an HTTP status."
                    return error_response(400, message, "BadRequestError", "health_status")
                state.health_status = status
        return json_response({"default": state.default_behavior, "health_status": state.health_status})

    async def not_found(request: Request, exc: Exception) -> Response:
        if isinstance(exc, HTTPException) and exc.status_code == 405:
            return json_response({"detail": "Method Not Allowed"}, 405)
        return json_response({"detail": "Not Found"}, 404)

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/_fake/requests", fake_requests, methods=["GET", "DELETE"]),
        Route("/_fake/stats", fake_stats, methods=["GET"]),
        Route("/_fake/behavior", fake_behavior, methods=["GET", "PUT"]),
    ]
    app = _FakeApp(routes=routes, exception_handlers={404: not_found, 405: not_found})
    app.fake = state
    app.state.fake = state
    return app


def _is_token_list(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(t, int) for t in value)
