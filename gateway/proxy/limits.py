"""Client-side limits enforced in the connection itself, before the HTTP parser or the app sees a request.

``LimitedHttpToolsProtocol`` is uvicorn's httptools protocol with the bounds of ``ClientLimits``:

- ``max_header_bytes``: counted in ``data_received`` *before* the bytes are fed to httptools. llhttp hands a long
  header to its callback in pieces and the binding joins them by repeated concatenation, so one 32 MiB header
  costs quadratic time (seconds of a frozen event loop) before any limit inside a callback could act. Counting
  the raw bytes first means the parser never holds more than the limit: the connection is answered 431 and
  closed after at most ``max_header_bytes`` bytes of head, in time linear in what was received.
- ``max_headers``: the number of header fields, counted in ``on_header``.
- time: a connection with no request on it (new, or after a response) is closed after ``keep_alive_s``; a request
  head must end within ``header_timeout_s`` of its first byte; a body within ``body_timeout_s`` of its head, or
  longer for a large body: its size at ``body_min_rate`` bytes per second. Past the head's or the body's deadline
  the client gets 408 ``request_timeout`` while no response has started (the app reading the body sees the
  client gone), and the connection is closed. One timer at a time, armed only when a head or a body spans reads:
  a request that arrives in one read (almost all of them) costs no timer.
- connections: ``ConnectionGate`` (``gateway.proxy.connections``) caps the open connections in total and per
  client address; past a cap the connection is answered 503 ``too_many_connections`` and closed. Counted in
  ``connection_made``, released in ``connection_lost`` (which asyncio calls once for every connection made) or
  when the connection is handed to another protocol (an upgrade).

Past any of them, the refusal is counted in ``specgate_limit_refusals_total{limit}``, and nothing reaches the app:
the limits apply before authentication.

Why a protocol subclass and not another server or an ASGI middleware: the app only sees a request once its head
is complete, which is exactly too late; uvicorn accepts a protocol class, so the gateway keeps uvicorn's
httptools server (its throughput and latency were measured for the gateway's overhead targets) and adds a few
integer comparisons per read and per header.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, fields
from typing import Any, cast

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.config.settings import Settings
from gateway.proxy.coalesce import CoalescingTransport
from gateway.proxy.connections import ConnectionGate, Held
from gateway.proxy.wire import envelope

logger = logging.getLogger("specgate.limits")

DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 100
# How long, and how many more bytes, a refused connection is drained (``_refuse``) before it is closed.
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """Bounds on a client's connection and its requests (the ``Settings`` of the same names; docs/limits.md).
    ``max_header_bytes`` covers the request line and every header line; a cap of 0 is no cap."""

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    header_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 32 * 1024
    max_body_bytes: int = 8 * 1024 * 1024  # the longest body a deadline is stretched for (the app refuses more)
    keep_alive_s: float = 5.0
    max_connections: int = 8192
    max_connections_per_client: int = 512


class _TooManyHeaders(Exception):
    """Raised from ``on_header`` to stop the parser (httptools wraps it in HttpParserCallbackError)."""


_STATUS_LINES = {
    400: b"HTTP/1.1 400 Bad Request\r\n",
    408: b"HTTP/1.1 408 Request Timeout\r\n",
    431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
    503: b"HTTP/1.1 503 Service Unavailable\r\n" + b"retry-after: 1\r\n",
}


def _refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response with the OpenAI error envelope, closing the connection."""
    type_ = "service_unavailable" if status == 503 else "invalid_request_error"
    body = orjson.dumps(envelope(message, type_, code=code))
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
    """uvicorn's httptools protocol with the limits of ``ClientLimits``, counted in ``gate`` (module docstring)."""

    def __init__(self, *args: Any, limits: ClientLimits, gate: ConnectionGate, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_limits = limits
        self.gate = gate
        # uvicorn's idle timer, armed after each response (typed int there; call_later takes a float)
        self.timeout_keep_alive = limits.keep_alive_s  # type: ignore[assignment]
        self._held: Held | None = None  # this connection's place in the gate, until released
        self._in_head = True  # the bytes arriving now belong to a request head (until on_headers_complete)
        self._head_open = False  # bytes of a request head have arrived, and the head has not ended
        self._begun = False  # ... and its request line began (not only the blank lines llhttp skips)
        self._head_bytes = 0
        self._header_count = 0
        self._heads = 0  # request heads completed on this connection
        self._timer: asyncio.TimerHandle | None = None  # the head's or the body's deadline, whichever runs
        self._body_started = 0.0
        self._body_bytes = 0  # bytes read while a body was arriving (its framing included)
        self._refused = False
        self._handed_over = False  # upgraded: the connection is another protocol's now
        self._drained = 0

    # ---- connections ----------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # a response's head leaves with its body's first bytes, in one write (gateway.proxy.coalesce)
        super().connection_made(cast(asyncio.Transport, CoalescingTransport(transport, self.loop)))
        port = self.server[1] if self.server is not None and self.server[1] is not None else 0
        held = self.gate.enter(port, self.client[0] if self.client is not None else None)
        if isinstance(held, str):
            who = "from one client address" if held == "connections_per_client" else "in total"
            cap = self.gate.per_client if held == "connections_per_client" else self.gate.total
            self._refuse(f"too many open connections {who} (the limit is {cap})", "too_many_connections", held, 503)
            return
        self._held = held
        # A new connection waits for its first request as an idle one waits for its next: keep_alive_s.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        super().connection_lost(exc)

    def handle_websocket_upgrade(self) -> None:
        self._release()  # the connection goes to another protocol: this one's connection_lost never comes
        self._handed_over = True
        super().handle_websocket_upgrade()

    def _release(self) -> None:
        self._cancel_timer()
        if self._held is not None:
            self.gate.leave(self._held)
            self._held = None

    # ---- deadlines ------------------------------------------------------------------------------------------

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm_timer(self) -> None:
        """After a read: a head or a body still arriving gets its deadline, unless it has one."""
        if self._timer is not None or self._refused or self._handed_over:
            return
        if self._head_open:
            self._timer = self.loop.call_later(self.head_limits.header_timeout_s, self._head_expired)
        elif not self._in_head:
            self._body_started = self.loop.time()
            self._timer = self.loop.call_later(self._body_allowance(), self._body_expired)

    def _body_allowance(self) -> float:
        """Seconds the body may take: ``body_timeout_s``, or its size at ``body_min_rate`` when that is longer (the
        size is the declared Content-Length, or for a chunked body what came so far; at most ``max_body_bytes``)."""
        lim = self.head_limits
        size = self._body_bytes
        for name, value in self.headers or ():
            if name == b"content-length" and value.isdigit():
                size = max(size, int(value))
                break
        return max(lim.body_timeout_s, min(size, lim.max_body_bytes) / lim.body_min_rate)

    def _head_expired(self) -> None:
        self._timer = None
        if not self._begun:  # only blank lines: no request to answer (a stray 408 could be read as the next answer)
            _count_refusal(self.app, "head_timeout")
            self._refused = True
            self._unset_keepalive_if_required()
            self._linger_close()
            return
        limit = self.head_limits.header_timeout_s
        self._refuse(f"the request head did not arrive within {limit:g} s", "request_timeout", "head_timeout", 408)

    def _body_expired(self) -> None:
        self._timer = None
        if self._in_head:  # pragma: no cover - the timer is cancelled when the body ends
            return
        left = self._body_started + self._body_allowance() - self.loop.time()
        if left > 0 or self.pipeline:  # a chunked body that kept its rate; or reading is paused for a queued request
            self._timer = self.loop.call_later(max(left, self.head_limits.body_timeout_s / 4), self._body_expired)
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            _count_refusal(self.app, "body_timeout")
            if cycle.response_complete:  # answered without the whole body (a refusal, say): nothing more to say
                self._refused = True
                self._linger_close()
            else:  # the response goes on; the connection closes after it, and what the client sends is not read
                cycle.keep_alive = False
                self.flow.pause_reading()
            return
        if cycle is not None:  # the app waiting for the body sees the client gone; its answer goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        took = self._body_allowance()
        self._refuse(f"the request body did not arrive within {took:g} s", "request_timeout", "body_timeout", 408)

    # ---- parser callbacks -----------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_open = True
        self._begun = True
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.head_limits.max_headers:
            raise _TooManyHeaders
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_open = False
        self._begun = False
        self._heads += 1
        self._body_bytes = 0
        if self._timer is not None:
            self._cancel_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._timer is not None:
            self._cancel_timer()
        super().on_message_complete()
        self._in_head = True  # what follows on this connection is the next request's head
        self._head_bytes = 0

    # ---- reading --------------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:  # draining after a refusal: dropped unread, up to LINGER_BYTES
            self._drained += len(data)
            if self._drained > LINGER_BYTES:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._in_head:
            self._head_open = True  # from its first byte (even the blank lines llhttp skips before a request line)
        self._receive(data)
        if self._head_open or not self._in_head:
            self._arm_timer()

    def _receive(self, data: bytes) -> None:
        limit = self.head_limits.max_header_bytes
        while data:
            if not self._in_head:
                self._body_bytes += len(data)
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

    def _refuse(self, message: str, code: str, limit: str, status: int = 431) -> None:
        self._refused = True
        self._cancel_timer()
        self._unset_keepalive_if_required()
        _count_refusal(self.app, limit)
        logger.info("refused a request from %s: %s", self.client, message)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.disconnected:
            self.transport.abort()  # a response is on the wire, or coming: nothing can be said on this connection
            return
        self.transport.write(_refusal(status, message, code))
        self._linger_close()

    def _linger_close(self) -> None:
        """Close after what was written: our side is half-closed at once, and what the client still sends is read
        and dropped (``data_received`` while ``_refused``) until it closes, LINGER_S passes or LINGER_BYTES more
        came. Closing at once with unread bytes would make the kernel reset the connection, and a client that is
        still sending could lose the answer it had not read yet; draining without end would let an attacker keep
        the loop busy."""
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
            self.loop.call_later(LINGER_S, transport.close)
        else:
            transport.close()

    def eof_received(self) -> None:
        if self._refused:
            self.transport.close()


def client_limits(settings: Settings) -> ClientLimits:
    """The ``Settings`` of the same names (every field of ``ClientLimits`` is one)."""
    return ClientLimits(**{f.name: getattr(settings, f.name) for f in fields(ClientLimits)})


def http_protocol(limits: ClientLimits) -> type[asyncio.Protocol]:
    """The ``http`` argument of ``uvicorn.Config`` that enforces ``limits``, with a ``ConnectionGate`` of its own:
    one per server, and one per worker process with ``--workers N`` (the factory is pickled into each)."""
    gate = ConnectionGate(total=limits.max_connections, per_client=limits.max_connections_per_client)
    factory: Any = functools.partial(LimitedHttpToolsProtocol, limits=limits, gate=gate)
    proto: type[asyncio.Protocol] = factory
    return proto
