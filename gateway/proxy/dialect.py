"""How a stream says it ended, failed, or must be ended by the gateway: one ``Dialect`` per API.

- Chat and legacy completions (``CHAT``): data-only events, an error is an event holding the error envelope, the
  stream ends with ``data: [DONE]``; a stream the gateway must end gets an error event and ``[DONE]``.
- The Responses API (``ResponsesDialect``, one per request: it remembers what it relayed): typed events
  (``event: <type>`` / ``data: <json>``, vLLM and OpenAI alike), no ``[DONE]``; it ends with
  ``response.completed``, ``response.incomplete`` or ``response.failed`` (or an ``error`` event). A stream the
  gateway must end gets the API's own failure: ``response.failed`` (the response as ``response.created`` announced
  it, ``status: failed`` and an ``error``), then an ``error`` event. The OpenAI SDK raises ``APIError`` on an event
  whose data holds an ``error`` object, so that event carries one besides the API's ``code`` / ``message``.

The relay (``gateway.proxy.forward``) asks every event ``is_error`` and ``is_done``; the chat dialect answers with one
prefix test each, so the hot path of chat streams costs what it did before.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.proxy.wire import is_done_event, is_error_event, sse_error

_TERMINAL = frozenset({b"response.completed", b"response.incomplete", b"response.failed", b"error"})
_FAILED = frozenset({b"response.failed", b"error"})


class ChatDialect:
    """Chat completions and completions streams (stateless: one instance serves every request)."""

    asks_usage = True  # a speculative pool is asked for the usage chunk that carries per-request acceptance

    def is_error(self, event: bytes) -> bool:
        return is_error_event(event)

    def is_done(self, event: bytes) -> bool:
        return is_done_event(event)

    def failure(self, message: str, *, type_: str = "upstream_error", code: str = "stream_interrupted") -> bytes:
        return sse_error(message, type_=type_, code=code)


CHAT = ChatDialect()


def event_data(event: bytes) -> Any:
    """The JSON of an event's ``data:`` line(s); None when there is none or it is not JSON."""
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


def event_type(event: bytes) -> bytes:
    """A typed event's type: its ``event:`` line (as vLLM sends it), else the ``type`` field of its data."""
    if event.startswith(b"event:"):
        end = event.find(b"\n")
        return event[6 : end if end >= 0 else len(event)].strip()
    data = event_data(event)
    kind = data.get("type") if isinstance(data, dict) else None
    if isinstance(kind, str):
        return kind.encode()
    return b"error" if is_error_event(event) else b""


def typed_event(payload: dict[str, Any]) -> bytes:
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesDialect(ChatDialect):
    """One Responses API stream: counts the events relayed (their ``sequence_number``) and keeps the response that
    ``response.created`` announced, to end a broken stream the way the API does."""

    asks_usage = False  # vLLM returns no per-request spec-decode metrics for this API (pool counters stand in)

    def __init__(self) -> None:
        self.events = 0
        self.response: dict[str, Any] | None = None

    def is_error(self, event: bytes) -> bool:
        return event_type(event) in _FAILED

    def is_done(self, event: bytes) -> bool:
        self.events += 1
        kind = event_type(event)
        if kind == b"response.created" and self.response is None:
            data = event_data(event)
            if isinstance(data, dict) and isinstance(data.get("response"), dict):
                self.response = data["response"]
        return kind in _TERMINAL

    def failure(self, message: str, *, type_: str = "upstream_error", code: str = "stream_interrupted") -> bytes:
        response: dict[str, Any] = dict(self.response or {"id": None, "object": "response", "output": []})
        response["status"] = "failed"
        response["error"] = {"code": "server_error", "message": message}
        seq = self.events
        failed = {"type": "response.failed", "sequence_number": seq, "response": response}
        error = {
            "type": "error",
            "sequence_number": seq + 1,
            "code": code,
            "message": message,
            "param": None,
            "error": {"message": message, "type": type_, "param": None, "code": code},
        }
        self.events += 2
        return typed_event(failed) + typed_event(error)


def response_id_of(payload: bytes) -> str | None:
    """The response id in a whole Responses API body, or in the ``response.created`` event of its stream."""
    if payload.startswith((b"event:", b"data:")):
        data = event_data(payload)
        data = data.get("response") if isinstance(data, dict) else None
    else:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
    rid = data.get("id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and rid else None
