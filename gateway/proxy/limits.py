"""Request-head limits enforced as the bytes arrive, before the HTTP parser sees them.

``LimitedHttpToolsProtocol`` is uvicorn's httptools protocol with two limits on every request head (the request
line and the header fields together):

- ``max_header_bytes``: counted in ``data_received`` *before* the bytes are fed to httptools. llhttp hands a long
  header to its callback in pieces and the binding joins them by repeated concatenation, so one 32 MiB header
  costs quadratic time (seconds of a frozen event loop) before any limit inside a callback could act. Counting
  the raw bytes first means the parser never holds more than the limit: the connection is answered 431 and
  closed after at most ``max_header_bytes`` bytes of head, in time linear in what was received.
- ``max_headers``: the number of header fields, counted in ``on_header``.

Past either, the client gets 431 in the OpenAI envelope (``connection: close``), the refusal is counted in
``specgate_limit_refusals_total{limit}``, and nothing reaches the app: the limits apply before authentication.

Why a protocol subclass and not another server or an ASGI middleware: the app only sees a request once its head
is complete, which is exactly too late; uvicorn accepts a protocol class, so the gateway keeps uvicorn's
httptools server (its throughput and latency were measured for the gateway's overhead targets) and adds two
integer comparisons per read and per header.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config.settings import Settings
from gateway.errors import InvalidJSON
from gateway.proxy.wire import envelope

logger = logging.getLogger("specgate.limits")

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100
# How long, and how many more bytes, a refused connection is drained (``_refuse``) before it is closed.
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class HeadLimits:
    """Bounds on one request head. ``max_header_bytes`` covers the request line and every header line."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS


class _TooManyHeaders(Exception):
    """Raised from ``on_header`` to stop the parser (httptools wraps it in HttpParserCallbackError)."""


_STATUS_LINES = {400: b"HTTP/1.1 400 Bad Request\r\n", 431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n"}


def _refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with the OpenAI error envelope, closing the connection."""
    body = orjson.dumps(envelope(message, "invalid_request_error", code=code))
    head = (
        _STATUS_LINES[status] + b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n"
    )
    return head + body


def _count_refusal(app: Any, limit: str) -> None:
    """Count a refusal in the gateway's metrics, found through the (possibly wrapped) app: rare, so looked up then."""
    for _ in range(8):
        runtime = getattr(getattr(app, "state", None), "runtime", None)
        metrics = getattr(runtime, "metrics", None)
        if metrics is not None:
            metrics.limit_refused(limit)
            return
        app = getattr(app, "app", None)
        if app is None:
            return


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request-head limits of ``HeadLimits`` (module docstring)."""

    def __init__(self, *args: Any, limits: HeadLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_limits = limits
        self._in_head = True  # the bytes arriving now belong to a request head (until on_headers_complete)
        self._head_bytes = 0
        self._header_count = 0
        self._heads = 0  # request heads completed on this connection
        self._refused = False
        self._drained = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.head_limits.max_headers:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._heads += 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # what follows on this connection is the next request's head
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._refused:  # draining after a refusal: dropped unread, up to LINGER_BYTES
            self._drained += len(data)
            if self._drained > LINGER_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        limit = self.head_limits.max_header_bytes
        while data:
            if not self._in_head:
                self._feed(data)
                return
            room = limit - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                self._feed(data)
                return
            # More than the head may still hold: feed only what fits; if the head does not end within it, refuse.
            part, data = data[:room], data[room:]
            self._head_bytes = limit
            heads = self._heads
            if part and not self._feed(part):
                return
            if self._heads == heads:
                self._refuse(
                    f"request headers exceed the limit of {limit} bytes (request line and header lines together)",
                    "request_header_fields_too_large",
                    "header_bytes",
                )
                return
            # The head ended inside ``part``: the rest is body, or the next (pipelined) request, whose head is
            # counted from zero from here on (what of it was in ``part`` went uncounted: at most one limit more).

    def _feed(self, data: bytes) -> bool:
        """Feed the parser; False when the connection was answered and closed."""
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, _TooManyHeaders) as exc:
            if isinstance(exc, _TooManyHeaders) or isinstance(exc.__context__, _TooManyHeaders):
                self._refuse(
                    f"too many request headers; the limit is {self.head_limits.max_headers}",
                    "too_many_headers",
                    "header_count",
                )
                return False
            if isinstance(exc, httptools.HttpParserUpgrade):  # as uvicorn: the gateway serves no upgrades itself
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return False
            self._refuse(f"malformed HTTP request: {exc}", "invalid_http_request", "malformed", status=400)
            return False
        return True

    def _refuse(self, message: str, code: str, limit: str, *, status: int = 431) -> None:
        self._refused = True
        _count_refusal(self.app, limit)
        logger.info("refused a request head from %s: %s", self.client, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            self.transport.abort()  # a response is on the wire: nothing can be said on this connection
            return
        # A lingering close: the answer goes out, then our side is half-closed, and what the client still sends is
        # read and dropped until it closes, LINGER_S passes or LINGER_BYTES more came. Closing at once with unread
        # bytes would make the kernel reset the connection, and a client that is still sending could lose the
        # answer it had not read yet; draining without end would let an attacker keep the loop busy.
        transport = self.transport
        transport.write(_refusal(status, message, code))
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()


def check_json_depth(raw: bytes, body: object, limit: int) -> None:
    """Raise 400 ``invalid_json`` when ``body`` (parsed from ``raw``) nests arrays / objects deeper than ``limit``.

    The gateway re-serialises request bodies (the idempotency fingerprint, the usage option of a stream to a
    speculative pool, a fallback model), and orjson writes only about 254 levels of the 1024 it reads. Linear:
    two byte counts decide for almost every body, and only one with more brackets than ``limit`` is walked.
    """
    if raw.count(b"{") + raw.count(b"[") <= limit:
        return
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            raise InvalidJSON(f"request body nests arrays and objects deeper than {limit} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value if isinstance(v, dict | list))


def head_limits(settings: Settings) -> HeadLimits:
    return HeadLimits(max_header_bytes=settings.max_header_bytes, max_headers=settings.max_headers)


def http_protocol(limits: HeadLimits) -> type[asyncio.Protocol]:
    """The ``http`` argument of ``uvicorn.Config`` that enforces ``limits`` (picklable, for worker processes)."""
    factory: Any = functools.partial(LimitedHttpToolsProtocol, limits=limits)
    proto: type[asyncio.Protocol] = factory
    return proto
