"""A lean HTTP/1.1 client for the proxy's upstream leg: keep-alive connections on asyncio protocols, responses parsed
by httptools (llhttp, the parser uvicorn uses on the client side of the gateway).

Why not aiohttp's client here: it was 36% of the gateway's busy CPU per proxied request at one connection (py-spy,
``specgate bench overhead``): request and response objects, header multidicts, payload registry, tracing hooks,
timer contexts, stream readers. The proxy needs a small part of that: POST a body of known length to a pool and
relay the response as bytes arrive. This module does that and nothing more, and the rest of the gateway keeps
aiohttp for the health checks and scrapes (off the hot path).

Scope: HTTP/1.1 (and 1.0 responses), plain TCP or TLS; responses framed by Content-Length, chunked encoding or the
connection's close; gzip and deflate bodies decoded (the gateway asks for ``identity``), never past
``max_body_bytes`` of decoded output. Bounded against a misbehaving pool: a response head larger than
``MAX_HEAD_BYTES`` fails as soon as that many bytes arrived without its end (not when a header line completes),
a head of more than ``MAX_HEADER_FIELDS`` fields fails at the first field too many, a status the gateway cannot
relay (``101``: never asked for; a final status outside 200–599) fails with ``InvalidResponse``, and ``read()``
(a buffered answer) fails past ``max_body_bytes``; ``ResponseTooLarge`` says which.
No redirects, cookies, proxies, pipelining or HTTP/2. Errors are plain exceptions the caller maps
(``gateway.fleet.upstream``): ``ConnectFailed`` (no connection could be made; its ``PoolExhausted``: no free pooled
one in time), ``ConnectionBroken`` (the connection broke or the response was malformed) and ``TimeoutError`` (the
request's total deadline passed: ``total_s`` from the request's sending, checked by one timer for the pool, so up to
a tenth of a second late).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl as ssl_mod
import time
import zlib
from collections.abc import Mapping
from urllib.parse import urlsplit

import httptools

from gateway.fleet.h1response import (
    ConnectFailed,
    ConnectionBroken,
    H1Response,
    InvalidResponse,
    PoolExhausted,
    ResponseTooLarge,
)
from gateway.periodic import DelayedCalls

# A response head larger than this (all header lines together) is refused: a pool has no reason to send one.
MAX_HEAD_BYTES = 2**16
# More header fields than this before the final response's head ends (1xx interim heads included) are refused.
MAX_HEADER_FIELDS = 100


def _encode_line(line: str) -> bytes:
    try:
        return line.encode("latin-1")
    except UnicodeEncodeError:
        return line.encode("utf-8", "replace")  # lone surrogates (undecodable environment bytes) replaced


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time. Also the httptools parser's callback object."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.response: H1Response | None = None
        self.lost = False
        self.keep_alive = False
        self.idle_since = 0.0  # when the last response on this connection ended
        self.abandoned = False  # we closed it: its end is not the end of a body
        self._framed = True  # the response has a Content-Length or chunked body (else it ends at EOF)
        self._messages = 0
        self._in_head = False  # between message begin and headers complete (later header fields are trailers)
        self._interim = False  # the message being parsed is a 1xx interim response
        self._head_bytes = 0
        self._header_fields = 0
        self._paused = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        r = self.response
        if r is None or r._eof:  # bytes nobody asked for: this connection cannot be trusted with another request
            self.keep_alive = False
            self.abandon()
            return
        if not r._head.done():  # the head: counted as the bytes arrive, not only when a header line ends
            room = MAX_HEAD_BYTES - self._head_bytes
            if len(data) > room:
                self._feed(r, data[:room])
                if not r._head.done() and r._exc is None:
                    r._fail(
                        ResponseTooLarge(
                            f"the pool's response head is larger than {MAX_HEAD_BYTES} bytes", "response_head"
                        )
                    )
                    self.abandon()
                    return
                data = data[room:]
            else:
                self._head_bytes += len(data)
        self._feed(r, data)

    def _feed(self, r: H1Response, data: bytes) -> None:
        parser = self.parser
        if r._exc is not None or not data or parser is None:
            return
        try:
            parser.feed_data(data)
        except Exception as exc:  # httptools.HttpParserError, or an error raised in a callback below
            inner = exc.__cause__ or exc.__context__  # httptools wraps what a callback raised
            cause = inner if isinstance(inner, ConnectionBroken) else None
            r._fail(cause or ConnectionBroken(f"malformed response from the pool: {exc}"))
            self.abandon()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost decides what the end means

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        # The parser holds this object's callbacks and the transport holds it as its protocol: let go of both, so a
        # closed connection is freed at once (not left for the cyclic GC, a thousand at a time when a pool restarts).
        self.parser = None
        self.transport = None
        r = self.response
        if r is None or r._eof:
            return
        if r._head.done() and not self._framed and r._exc is None and exc is None and not self.abandoned:
            r._end()  # a body delimited by the connection's close (no Content-Length, not chunked)
        else:
            why = f": {exc}" if exc else ""
            r._fail(ConnectionBroken(f"the pool closed the connection before the response was complete{why}"))

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self._messages += 1
        if self._messages > 1:
            raise ConnectionBroken("more than one response to one request")
        self._in_head = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            return  # a chunked body's trailer field: not a header of the response
        assert self.response is not None
        self._header_fields += 1
        if self._header_fields > MAX_HEADER_FIELDS:
            raise ResponseTooLarge(
                f"the pool's response has more than {MAX_HEADER_FIELDS} header fields", "response_header_count"
            )
        self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        self._in_head = False
        assert self.parser is not None  # callbacks run only inside feed_data
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # 100 Continue, 103 Early Hints: the real response follows
            self._interim = True
            r.raw_headers.clear()
            return
        if not 200 <= status <= 599:  # 101 (the gateway never asks to switch protocols), or no HTTP status at all
            raise InvalidResponse(f"the pool answered with status {status}, which the gateway does not relay")
        r.status = status
        headers = r.headers
        for name, value in r.raw_headers:
            headers[name.decode("latin-1").lower()] = value.decode("latin-1")
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self._framed = chunked or "content-length" in headers or r.status in (204, 304) or r.status < 200
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding == "gzip" or encoding == "x-gzip":
            r._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            r._decoder = zlib.decompressobj()
        elif encoding not in ("identity", ""):
            raise ConnectionBroken(f"unsupported content-encoding {encoding!r} (the gateway asks for identity)")
        if not r._head.done():
            r._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        if self._interim:
            self._interim = False
            self._messages = 0
            return
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()
        self.idle_since = time.monotonic()
        self.response._end()

    # ---- used by HostPool and H1Response ----
    def start(self, response: H1Response, payload: list[bytes]) -> None:
        assert self.transport is not None
        self.response = response
        self._messages = 0
        self._head_bytes = 0  # every byte before the final response's headers end (1xx interim heads included)
        self._header_fields = 0  # the same for header fields
        self._framed = True
        self._interim = False
        self.keep_alive = False
        self.pool.deadlines.add(self, _Conn._deadline_passed, self)  # the pool's ``total_s`` from now
        self.transport.writelines(payload)

    def _deadline_passed(self) -> None:
        if self.response is not None:
            self.response._fail(TimeoutError("the pool's total timeout passed before the response was complete"))
        self.abandon()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    @property
    def usable(self) -> bool:
        return not self.lost and self.transport is not None and not self.transport.is_closing()

    def abandon(self) -> None:
        """Close the connection now, unsent bytes and all (``close()`` would wait for a peer that does not read);
        the request's slot is given back by ``finish``."""
        self.keep_alive = False
        self.abandoned = True
        if self.transport is not None:
            self.transport.abort()

    def finish(self, *, reusable: bool) -> None:
        """The response is done with: cancel the deadline and give the connection (or its slot) back."""
        self.pool.deadlines.discard(self)
        self.response = None
        self.resume()
        self.pool.give_back(self, reusable and self.keep_alive and self.usable)


class HostPool:
    """Keep-alive connections to one endpoint (scheme, host, port, base path), at most ``limit`` at a time."""

    def __init__(
        self,
        url: str,
        *,
        limit: int,
        connect_s: float,
        acquire_s: float,
        total_s: float,
        keepalive_s: float,
        max_body_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if self.https else 80)
        self.base_path = parts.path.rstrip("/")
        default_port = self.port == (443 if self.https else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.limit = limit
        self.connect_s = connect_s
        self.acquire_s = acquire_s
        self.total_s = total_s
        self.keepalive_s = keepalive_s
        self.max_body_bytes = max_body_bytes
        self.loop = asyncio.get_running_loop()
        # Each request's total deadline, by one timer for the pool (``periodic.DelayedCalls``): at most a tenth of a
        # second late (a hundredth of ``total_s`` when that is shorter), not a timer made and cancelled per request.
        self.deadlines = DelayedCalls(self.loop, total_s, min(0.1, total_s / 100))
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._ssl: ssl_mod.SSLContext | None = ssl_mod.create_default_context() if self.https else None
        self.closed = False

    async def request(self, path: str, body: bytes, headers: Mapping[str, str], *, method: str = "POST") -> H1Response:
        """POST ``body`` to ``path`` (or send ``method``: GET) and wait for the response headers.

        Raises ConnectFailed, ConnectionBroken or TimeoutError. A cancelled wait closes the connection."""
        head = self._head(path, len(body), headers, method)
        conn = await self._acquire()  # bounded by ``acquire_s``; ``total_s`` counts from the request's sending
        response = H1Response(conn)
        try:
            conn.start(response, [head, body])
            await response._head
        except BaseException:
            response.close()
            raise
        return response

    def _head(self, path: str, length: int, headers: Mapping[str, str], method: str = "POST") -> bytes:
        start = f"{method} {self.base_path}{path} HTTP/1.1\r\n"
        lines = [f"{start}host: {self.host_header}\r\ncontent-length: {length}\r\n"]
        lines.extend([f"{k}: {v}\r\n" for k, v in headers.items()])
        lines.append("\r\n")
        try:
            return "".join(lines).encode("latin-1")  # what the gateway's HTTP server decoded client headers with
        except UnicodeEncodeError:  # one of our own values (a pool's API key): that line as UTF-8
            return b"".join(_encode_line(line) for line in lines)

    async def _acquire(self) -> _Conn:
        if self.closed:
            raise ConnectFailed("the client is closed")
        if self._slots.locked():
            try:
                async with asyncio.timeout(self.acquire_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise PoolExhausted(f"no free connection (limit {self.limit}) within {self.acquire_s:g} s") from None
        else:
            await self._slots.acquire()
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.usable and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abandon()
        try:
            return await self._connect()
        except BaseException:
            self._slots.release()
            raise

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await self.loop.create_connection(
                    lambda: _Conn(self),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectFailed(f"connect timeout ({self.connect_s:g} s)") from None
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from exc
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._all.add(conn)
        return conn

    def give_back(self, conn: _Conn, reusable: bool) -> None:
        if reusable and not self.closed:
            self._idle.append(conn)
        else:
            conn.abandon()
        self._slots.release()

    def forget(self, conn: _Conn) -> None:
        self._all.discard(conn)

    @property
    def connections(self) -> int:
        """Open connections, idle or busy."""
        return len(self._all)

    def close(self) -> None:
        """Close every connection, idle or busy (busy ones fail their response with ConnectionBroken)."""
        self.closed = True
        self.deadlines.close()
        self._idle.clear()
        for conn in list(self._all):
            if conn.response is not None:
                conn.response._fail(ConnectionBroken("the pool's client was closed (the routing file was reloaded)"))
            conn.abandon()
