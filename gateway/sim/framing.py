"""The base of the simulator's vLLM wire format: its constants (``VLLM_VERSION``, SSE and JSON content types,
error types and messages, ``TASKS``, ``Kind``), ``WireError`` and vLLM's error envelope, SSE framing, and
``remember_transport`` (keeping uvicorn's transport in the scope so a fault can break a connection).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping, Sequence
from http import HTTPStatus
from types import MappingProxyType
from typing import Any, Literal

import orjson

VLLM_VERSION = "0.33.0"
SSE_DONE = b"data: [DONE]\n\n"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'  # vLLM's --api-key middleware answers this, not the envelope
ERROR_TYPES: Mapping[int, str] = MappingProxyType(
    {
        400: "BadRequestError",
        404: "NotFoundError",
        422: "UnprocessableEntityError",
        500: "InternalServerError",
        501: "NotImplementedError",
        503: "Service Unavailable",  # GracefulHTTPError: the status phrase (queue full)
    }
)
QUEUE_FULL_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or on a different instance."
)
QUEUED_TOKENS_MESSAGE = (
    "The engine has reached its prefill token backlog limit. Please try again later or on a different instance."
)
TASKS = ("chat", "code", "summarization", "rag", "extraction", "structured", "tool_use", "math", "creative")

Kind = Literal["chat", "completion"]


# --------------------------------------------------------------------------------------------------------------
# Errors and framing


class WireError(Exception):
    """A request vLLM would refuse: ``status`` and the JSON ``body`` to answer with."""

    def __init__(self, status: int, message: str, type_: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(status, message, type_, param)


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status) or HTTPStatus(status).phrase


def error_body(status: int, message: str, type_: str | None = None, param: str | None = None) -> dict[str, Any]:
    """vLLM's envelope: ``code`` is the integer HTTP status."""
    return {"error": {"message": message, "type": type_ or error_type(status), "param": param, "code": status}}


def model_not_found(model: object, served: Sequence[str]) -> WireError:
    message = f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}."
    return WireError(404, message, "NotFoundError", "model")


def queue_full(reason: str = "max_num_queued_reqs") -> WireError:
    """vLLM's QueueOverflowError (``--max-num-queued-reqs``) or MaxQueuedTokensError (``--max-num-queued-tokens``)."""
    return WireError(503, QUEUE_FULL_MESSAGE if reason == "max_num_queued_reqs" else QUEUED_TOKENS_MESSAGE)


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def sse_error(body: dict[str, Any]) -> bytes:
    """A failure mid-stream: the envelope as an event (vLLM renders it with ``json.dumps``), then ``[DONE]``."""
    return b"data: " + json.dumps(body).encode() + b"\n\n" + SSE_DONE


TRANSPORT_KEY = "specgate.transport"


def remember_transport(scope: MutableMapping[str, Any], send: Any) -> None:
    """Keep uvicorn's transport in the scope, so that a fault can break the connection abruptly.

    uvicorn hands the app its RequestResponseCycle.send, a bound method whose owner holds the transport; closing it
    mid-body is what a crashed server looks like to a client (no chunked terminator, no [DONE])."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is not None and callable(getattr(transport, "close", None)):
        scope[TRANSPORT_KEY] = transport
