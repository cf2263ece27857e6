"""Stalled clients: a send deadline on the relay to the client.

A client that stops reading its response (a hung process, a full receive window it never drains) makes the server's
``send`` wait for the socket to drain, forever. While it waits, the gateway holds the upstream connection (its slot
in the pool's connection pool) and the endpoint's in-flight count, so routing sees load that is not there and other
clients find no free connection. ``SendGuard`` times every send to the client; ``StallWatch`` checks it every
quarter of ``overload.client_send_timeout_s`` and, once one send has waited that long, the client's presence
(``gateway.proxy.presence``) cuts the client off: its connection is aborted (``abort_client``: the server then
reports the disconnect and its pending send returns), so the ordinary disconnect path cancels the upstream request
(a keyed request runs on to its end and is stored for the client's retry), and the exchange's cleanup releases the
connection slot and the in-flight count.

``abort_client`` needs the server's transport: ``remember_transport`` keeps it in the scope when the app is called
(uvicorn hands the app its ``RequestResponseCycle.send``, a bound method whose owner holds the transport). Without
it the stalled request is cancelled instead (its task), and the server closes the connection when the app returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from starlette.types import Message, Scope, Send

TRANSPORT_KEY = "specgate.transport"


def remember_transport(scope: MutableMapping[str, Any], send: Any) -> None:
    """Keep the server's transport of this request in the scope (uvicorn's httptools and h11 protocols)."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if callable(getattr(transport, "abort", None)):  # asyncio's or uvloop's (not an asyncio.Transport subclass)
        scope[TRANSPORT_KEY] = transport


def abort_client(scope: Scope) -> bool:
    """Drop the client's connection now, unsent bytes and all (``close`` would wait for a reader that never reads).
    False when the transport is unknown."""
    abort = getattr(scope.get(TRANSPORT_KEY), "abort", None)
    if not callable(abort):
        return False
    abort()
    return True


class SendGuard:
    """``send`` with the start time of the send in progress (None while none is), for ``blocked_for``."""

    __slots__ = ("_send", "since")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.since: float | None = None

    async def __call__(self, message: Message) -> None:
        self.since = time.monotonic()
        try:
            await self._send(message)
        finally:
            self.since = None

    def blocked_for(self, now: float) -> float:
        """How long the send in progress has waited (0 when none is in progress)."""
        since = self.since
        return 0.0 if since is None else now - since


def check_period(timeout_s: float) -> float:
    """How often a running response checks its guard: a stall is caught between 1 and 1.25 deadlines."""
    return max(0.01, timeout_s / 4)


class StallWatch:
    """The send deadline of one response: ``send`` is the guarded send; once ``start``-ed, a timer checks it every
    ``check_period`` and calls ``on_stall(timeout)`` once when a send has waited ``timeout()`` seconds (read on each
    check, so a reload applies). ``done()`` stops it (also: the last send went out)."""

    __slots__ = ("_handle", "_on_stall", "_timeout", "send")

    def __init__(self, send: Send, timeout: Callable[[], float], on_stall: Callable[[float], None]) -> None:
        self.send = SendGuard(send)
        self._timeout = timeout
        self._on_stall = on_stall
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._handle = asyncio.get_running_loop().call_later(check_period(self._timeout()), self._check)

    def _check(self) -> None:
        timeout = self._timeout()
        if self.send.blocked_for(time.monotonic()) < timeout:
            self._handle = asyncio.get_running_loop().call_later(check_period(timeout), self._check)
            return
        self._handle = None
        self._on_stall(timeout)

    def done(self) -> None:
        """Stop checking, and drop the callbacks (they hold the response: a cycle the GC would have to find)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._on_stall = _never
        self._timeout = _no_timeout


def _never(timeout: float) -> None:
    """The stall callback once a response is done."""


def _no_timeout() -> float:
    return float("inf")
