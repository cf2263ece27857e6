"""HTTP plumbing shared by the gateway's two servers (the proxy and the admin API): JSON answers, request bodies
read under a limit, and the one place where an exception becomes what the client gets (``error_response``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive

from gateway.errors import GatewayError, InvalidJSON, MethodNotAllowed, PayloadTooLarge, RouteNotFound
from gateway.proxy.wire import JSON_CONTENT_TYPE, envelope

logger = logging.getLogger("specgate")

ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]  # a Starlette exception handler
_LOGGED = "_specgate_logged"  # set on a bug once ``error_response`` has logged it


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status, headers=headers, media_type=JSON_CONTENT_TYPE)


async def read_body(receive: Receive, limit: int, declared: str | None) -> bytes:
    """The body, counted while reading: a Content-Length (``declared``) can lie, and chunked bodies have none.

    Reads the ASGI messages itself (as Starlette's ``Request.stream`` does, without its async generator): the usual
    body is one message. Raises ``PayloadTooLarge``, or ``ClientDisconnect`` when the client goes away.
    """
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}")
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


async def read_request_body(request: Request, limit: int) -> bytes:
    """``read_body`` for a Starlette route."""
    return await read_body(request.receive, limit, request.headers.get("content-length"))


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be a JSON object; ``InvalidJSON`` otherwise."""
    if not raw:
        raise InvalidJSON("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidJSON(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def error_response(exc: Exception, method: str, path: str, extra: Iterable[tuple[str, str]] = ()) -> Response:
    """What the client gets for an exception raised before its response started, on every way in.

    The gateway's own errors as their OpenAI envelope (status and headers included); Starlette's 404 / 405 as
    ``unknown_route`` / ``method_not_allowed`` envelopes; a client gone as an empty 499 (for the log: nobody reads
    it); anything else is a bug: logged with its traceback (once, however many times it is rendered), and a 500
    ``internal_error`` envelope that shows nothing of it. The caller raises a bug again for the server, as
    Starlette's outermost middleware does. ``extra``: headers of the gateway's own errors that the request has
    earned so far (``x-request-id``, the decision's); the request id also ends the error's message, so a client can
    quote it and the operator find the log line that says more.
    """
    if isinstance(exc, HTTPException):
        err: GatewayError
        if exc.status_code == 404:
            err = RouteNotFound(f"no route for {method} {path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"method {method} is not allowed on {path}")
            err.headers.update(exc.headers or {})
        else:
            err = GatewayError(str(exc.detail))
        return json_response(err.envelope(), exc.status_code, err.headers)
    if isinstance(exc, GatewayError):
        headers = dict(extra)
        headers.update(exc.headers)
        return json_response(exc.envelope(headers.get("x-request-id")), exc.status, headers)
    if isinstance(exc, ClientDisconnect):
        return Response(b"", 499)
    if not getattr(exc, _LOGGED, False):
        # Once per bug: an exchange answers a bug and raises it again for the server, and on a route Starlette
        # matched, Starlette's last-resort handler renders that same exception once more (its answer not sent).
        setattr(exc, _LOGGED, True)
        logger.error("unhandled error on %s %s", method, path, exc_info=exc)
    return json_response(envelope("internal error in the gateway", "internal_error", code="internal_error"), 500)


def is_bug(exc: Exception) -> bool:
    """Whether ``error_response`` treats ``exc`` as a bug (to be raised again for the server's log)."""
    return not isinstance(exc, GatewayError | HTTPException | ClientDisconnect)


async def _on_error(request: Request, exc: Exception) -> Response:
    return error_response(exc, request.method, request.url.path)


def exception_handlers() -> dict[Any, ErrorHandler]:
    """``error_response`` as Starlette's exception handlers: the ``Exception`` one is its last resort (500)."""
    return {GatewayError: _on_error, HTTPException: _on_error, ClientDisconnect: _on_error, Exception: _on_error}
