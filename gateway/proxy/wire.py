"""OpenAI wire format: the error envelope, SSE framing, and normalising vLLM's error bodies."""

from __future__ import annotations

import re
from typing import Any

import orjson

from gateway.errors import GatewayError

SSE_DONE = b"data: [DONE]\n\n"
JSON_CONTENT_TYPE = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"

# vLLM puts the HTTP status's reason phrase or its exception class in `type`; the OpenAI SDK only reads
# the status, but clients that switch on `type` expect OpenAI's names.
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def envelope(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_bytes(exc: GatewayError, request_id: str | None = None) -> bytes:
    return orjson.dumps(exc.envelope(request_id))


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_error(message: str, *, type_: str = "upstream_error", code: str = "stream_interrupted") -> bytes:
    """The explicit end of a broken stream: an error event, then [DONE] (vLLM's own convention)."""
    return sse_event(envelope(message, type_, code=code)) + SSE_DONE


def normalise_error(status: int, body: bytes) -> bytes:
    """Make an upstream error body an OpenAI envelope with a string (or null) ``code``.

    vLLM sends ``code`` as the integer HTTP status, and its ``--api-key`` check answers
    ``{"error": "Unauthorized"}``; anything that is not JSON becomes the envelope's message.
    """
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    default_type = _TYPE_BY_STATUS.get(status, "upstream_error" if status >= 500 else "invalid_request_error")
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        out = {
            "message": str(err.get("message") or f"upstream returned {status}"),
            "type": str(err.get("type") or default_type) if not isinstance(code, int) else default_type,
            "param": err.get("param") if isinstance(err.get("param"), str) else None,
            "code": None if code is None else str(code),
        }
        if isinstance(data, dict) and "message" not in err and isinstance(data.get("message"), str):
            out["message"] = data["message"]
        return orjson.dumps({"error": out})
    if isinstance(err, str):
        message = err
    elif isinstance(data, dict) and isinstance(data.get("message"), str):
        message = data["message"]  # vLLM's older flat ErrorResponse
    else:
        text = body.decode("utf-8", "replace").strip()
        message = text[:500] if text else f"upstream returned {status}"
    return orjson.dumps(envelope(message, default_type, code=str(status)))


class SSEOverflow(ValueError):
    """An upstream event grew past the splitter's limit without ending."""


_EVENT_END = re.compile(rb"\r?\n\r?\n")


class SSESplitter:
    """Splits an upstream byte stream into whole SSE events (each with its blank-line terminator).

    Events are passed on exactly as the upstream framed them: never merged, never re-chunked. Linear in the bytes
    received: each byte is scanned about once, and a long pending event is never copied per read.
    """

    __slots__ = ("_buf", "_cr", "_max", "_scanned")

    def __init__(self, max_pending_bytes: int = 16 * 1024 * 1024) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for an event end
        self._max = max_pending_bytes
        self._cr = False  # a CR was seen: events may end in \r\n\r\n (the regex path from then on)

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self._cr and b"\r" not in chunk:
            return self._feed_lf(chunk)
        self._cr = True
        buf = self._buf
        buf += chunk
        events: list[bytes] = []
        start = 0
        for m in _EVENT_END.finditer(buf, max(0, self._scanned - 3)):
            end = m.end()
            if m.start() < start:  # overlaps the previous match's end
                continue
            events.append(bytes(buf[start:end]))
            start = end
        if start:
            del buf[:start]
        self._scanned = len(buf)
        if len(buf) > self._max:
            raise SSEOverflow(f"an upstream event exceeds {self._max} bytes without ending")
        return events

    def _feed_lf(self, chunk: bytes) -> list[bytes]:
        """vLLM's framing (events end in "\\n\\n", no CR): bytes.split, about 4x cheaper per event than the regex.
        The same leftmost non-overlapping cut as the regex path; still linear: the pending bytes are copied only
        when an event has ended in them."""
        buf = self._buf
        start = max(0, len(buf) - 1)  # an end may straddle the previous read and this one
        buf += chunk
        if buf.find(b"\n\n", start) < 0:
            self._scanned = len(buf)
            if len(buf) > self._max:
                raise SSEOverflow(f"an upstream event exceeds {self._max} bytes without ending")
            return []
        parts = bytes(buf).split(b"\n\n")
        rest = parts.pop()
        self._buf = bytearray(rest)
        self._scanned = len(rest)
        if len(rest) > self._max:
            raise SSEOverflow(f"an upstream event exceeds {self._max} bytes without ending")
        return [p + b"\n\n" for p in parts]

    @property
    def pending(self) -> bytes:
        return bytes(self._buf)


def is_done_event(event: bytes) -> bool:
    return event.startswith(b"data: [DONE]") or event.startswith(b"data:[DONE]")


def is_error_event(event: bytes) -> bool:
    if event.find(b"error", 0, 24) < 0:  # the usual event, decided without building the head
        return False
    head = event[:24].replace(b" ", b"")
    return head.startswith(b'data:{"error"')
