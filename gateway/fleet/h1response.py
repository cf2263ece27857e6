"""The upstream HTTP/1.1 client's response side: ``H1Response`` (status, headers, the body as it arrives, decoded
and bounded) and the errors the client raises. The connection that feeds a response lives in
``gateway.fleet.h1client``."""

from __future__ import annotations

import asyncio
import zlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Protocol


class _Limits(Protocol):
    @property
    def max_body_bytes(self) -> int: ...


class _Conn(Protocol):
    """What a response needs of the connection that feeds it (``h1client._Conn``)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def pool(self) -> _Limits: ...

    def abandon(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def finish(self, *, reusable: bool) -> None: ...


# Body bytes buffered for a reader that is not reading (a slow client): above this, stop reading the socket.
READ_HIGH_WATER = 4 * 2**16


class ConnectFailed(OSError):
    """No connection to the endpoint: refused, unresolvable, connect timeout, or no free pooled one in time."""


class PoolExhausted(ConnectFailed):
    """Every connection of the pool stayed busy until the wait for one timed out: the endpoint is busy, not down."""


class ConnectionBroken(ConnectionError):
    """The connection broke, or the response could not be parsed, before the response was complete."""


class InvalidResponse(ConnectionBroken):
    """The pool's response cannot be relayed as it is (a status outside 200–599, or 101): answered 502, not
    retried; the connection is closed."""


class ResponseTooLarge(ConnectionBroken):
    """The response went past one of the client's limits: the connection is closed, what was read of it dropped.
    ``limit``: ``response_head``, ``response_header_count``, ``response_bytes`` or ``decoded_bytes``."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class H1Response:
    """One response: status and headers once ``HostPool.request`` returns, the body as it arrives.

    The body is read with ``iter_any()`` (what has arrived, as one bytes object per wait) or ``read()`` (the rest).
    Reading is stateful: a second ``iter_any()`` continues where the first stopped. Exactly one of ``release()``
    (the connection may be reused once the body was read to its end) or ``close()`` ends the response.
    """

    __slots__ = (
        "_chunks",
        "_conn",
        "_decoded",
        "_decoder",
        "_ended",
        "_eof",
        "_exc",
        "_head",
        "_size",
        "_waiter",
        "headers",
        "raw_headers",
        "status",
    )  # fmt: skip

    def __init__(self, conn: _Conn) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.headers: dict[str, str] = {}  # lower-case names; the last value of a repeated header
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False  # the body is complete
        self._exc: BaseException | None = None
        self._decoder: zlib._Decompress | None = None
        self._decoded = 0  # bytes the decoder produced so far
        self._ended = False  # released or closed
        self._head: asyncio.Future[None] = conn.loop.create_future()  # the headers arrived, or the request failed

    # ---- fed by the connection ----
    def _feed(self, data: bytes) -> None:
        if self._exc is not None:  # failed (the rest of the read may still be parsed): drop it
            return
        if self._decoder is not None:
            room = self._conn.pool.max_body_bytes - self._decoded
            try:
                data = self._decoder.decompress(data, room + 1)  # never more output than the limit allows
            except zlib.error as exc:
                self._fail(ConnectionBroken(f"undecodable {self.headers.get('content-encoding')} body: {exc}"))
                self._conn.abandon()
                return
            self._decoded += len(data)
            if len(data) > room:
                self._chunks.clear()
                self._size = 0
                limit = self._conn.pool.max_body_bytes
                message = f"the pool's compressed response decodes to more than {limit} bytes"
                self._fail(ResponseTooLarge(message, "decoded_bytes"))
                self._conn.abandon()
                return
        if data:
            self._chunks.append(data)
            self._size += len(data)
            if self._size > READ_HIGH_WATER:
                self._conn.pause()
            self._wake()

    def _end(self) -> None:
        if self._exc is not None:  # never flush a decoder that failed: flush() inflates all of its unread input
            return
        if self._decoder is not None:
            tail = self._decoder.flush()  # the input was all consumed (``_feed``): only zlib's small pending output
            if tail:
                self._chunks.append(tail)
                self._size += len(tail)
            if not self._decoder.eof:
                self._fail(ConnectionBroken(f"truncated {self.headers.get('content-encoding')} body"))
                return
        self._eof = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._eof or self._exc is not None:
            return
        self._exc = exc
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ---- the reader's side ----
    @property
    def complete(self) -> bool:
        """The whole body has arrived (it may still be buffered)."""
        return self._eof

    def _take(self) -> bytes:
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._size = 0
        self._conn.resume()
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises ConnectionBroken or TimeoutError when the response cannot complete."""
        while True:
            if self._chunks:
                yield self._take()
                continue
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return
            self._waiter = self._conn.loop.create_future()
            await self._waiter

    async def read(self) -> bytes:
        """The rest of the body; ResponseTooLarge (the connection closed) past the pool's ``max_body_bytes``."""
        limit = self._conn.pool.max_body_bytes
        if self._eof and self._exc is None and self._size <= limit:  # the usual case: it all came with the headers
            return self._take() if self._chunks else b""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.iter_any():
            size += len(chunk)
            if size > limit:
                parts.clear()
                self.close()
                raise ResponseTooLarge(f"the pool's response body is larger than {limit} bytes", "response_bytes")
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if the body was read to its end."""
        if not self._ended:
            self._ended = True
            self._conn.finish(reusable=self._eof and self._exc is None and not self._chunks)

    def close(self) -> None:
        """Done with the response: close the connection (vLLM aborts a generation whose client went away)."""
        if not self._ended:
            self._ended = True
            self._conn.finish(reusable=False)
