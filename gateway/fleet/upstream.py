"""The HTTP client to the pools: one ``gateway.fleet.h1client`` connection pool per endpoint, failures mapped onto
``gateway.errors``.

Why not httpx's default transport: on this class of machine its connection pool collapses under concurrency (470–780
req/s at 32 connections through a minimal pass-through proxy, against 5k+ on aiohttp's). Why not aiohttp's client,
which does not collapse: it was still a third of the gateway's CPU per request (``gateway.fleet.h1client`` says
where). The proxy needs only POST with a body of known length and the response as bytes; everything above this
module sees plain bytes, statuses and our own errors. The client fails with ``OSError`` (``ConnectionBroken``,
``ConnectFailed``) or ``TimeoutError``, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config.pool import Pool as PoolSpec
from gateway.errors import (
    UpstreamConnectError,
    UpstreamInvalidResponse,
    UpstreamPoolFull,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from gateway.fleet.h1client import HostPool
from gateway.fleet.h1response import ConnectFailed, InvalidResponse, PoolExhausted, ResponseTooLarge
from gateway.fleet.pools import EndpointState


class RawResponse(Protocol):
    """What the gateway reads of a pool's response (``gateway.fleet.h1response.H1Response``; test doubles)."""

    @property
    def headers(self) -> Mapping[str, str]: ...  # lower-case names
    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]: ...
    def iter_any(self) -> AsyncIterator[bytes]: ...
    async def read(self) -> bytes: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class UpstreamResponse:
    """An upstream response whose headers have arrived; the body is still to be read or relayed."""

    status: int
    raw: RawResponse
    on_close: Callable[[], None] | None = None  # called once, when the connection is released or closed

    def _closed(self) -> None:
        hook, self.on_close = self.on_close, None
        if hook is not None:
            hook()

    @property
    def is_event_stream(self) -> bool:
        ctype = self.raw.headers.get("content-type", "")
        return ctype.startswith("text/event-stream")

    async def read(self) -> bytes:
        try:  # a failure mapped by ``_body_errors`` (no context manager entered for a body that arrives whole)
            return await self.raw.read()
        except (ResponseTooLarge, TimeoutError, OSError):
            with _body_errors("upstream total timeout while reading the body", "upstream broke while sending the body"):
                raise

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive. Raises UpstreamError when the connection breaks."""
        with _body_errors("upstream total timeout while streaming", "upstream connection broke"):
            async for chunk in self.raw.iter_any():
                yield chunk

    @property
    def content_type(self) -> str:
        return self.raw.headers.get("content-type", "")

    @property
    def raw_headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self.raw.raw_headers

    async def finish(self, timeout_s: float) -> None:
        """After [DONE]: read what is left of the body (the chunked terminator), then give the connection back.
        If it does not come in time, close the connection instead."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.raw.read()
            self.release()
        except (OSError, TimeoutError):
            self.abort()

    def abort(self) -> None:
        """Close the connection: vLLM aborts the generation when its client goes away."""
        self.raw.close()
        self._closed()

    def release(self) -> None:
        """The body was read to the end: the connection goes back to the pool."""
        self.raw.release()
        self._closed()


@contextlib.contextmanager
def _body_errors(timed_out: str, broke: str) -> Iterator[None]:
    """A failure while the body arrives, as the gateway's error: too large, the total timeout, a broken connection."""
    try:
        yield
    except ResponseTooLarge as exc:
        raise UpstreamResponseTooLarge(str(exc), limit=exc.limit, public=str(exc)) from exc
    except TimeoutError as exc:
        raise UpstreamTimeout(timed_out) from exc
    except OSError as exc:
        raise UpstreamConnectError(f"{broke}: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PoolClient:
    """The connection pools (one ``HostPool`` per endpoint URL) for one pool's endpoints."""

    def __init__(self, spec: PoolSpec, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.spec = spec
        key = env.get(spec.api_key_env) if spec.api_key_env else None
        self.api_key = key.strip() if key else None  # a key read from a secret file often ends in a newline
        self.first_byte_s = spec.timeouts.first_byte_s
        self._hosts: dict[str, HostPool] = {}
        self.closed = False  # close() was called (retired after a reload)

    def _host(self, url: str) -> HostPool:
        host = self._hosts.get(url)
        if host is None:
            t = self.spec.timeouts
            host = self._hosts[url] = HostPool(
                url,
                limit=self.spec.max_connections,
                connect_s=t.connect_s,
                acquire_s=t.first_byte_s,  # waiting for a free pooled connection counts against the first byte
                total_s=t.total_s,
                keepalive_s=4.0,  # below uvicorn's (vLLM's) 5 s, so we never reuse a connection it is closing
                max_body_bytes=self.spec.max_response_bytes,
            )
        return host

    async def post(
        self, ep: EndpointState, path: str, body: bytes, headers: dict[str, str], *, method: str = "POST"
    ) -> UpstreamResponse:
        """Send a request (a POST unless ``method`` says otherwise) and wait for the response headers (bounded by the
        pool's total timeout)."""
        try:
            raw = await self._host(ep.url).request(path, body, headers, method=method)
        except PoolExhausted as exc:  # busy, not broken: back-pressure (gateway.routing.attempts)
            raise UpstreamPoolFull(f"{ep.id} is busy: {exc}") from exc
        except ConnectFailed as exc:
            raise UpstreamUnreachable(f"cannot reach {ep.id}: {exc}") from exc
        except ResponseTooLarge as exc:
            raise UpstreamResponseTooLarge(f"{ep.id}: {exc}", limit=exc.limit, public=str(exc)) from exc
        except InvalidResponse as exc:
            raise UpstreamInvalidResponse(f"{ep.id}: {exc}") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no response from {ep.id} within the total timeout") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"{ep.id} failed before the response: {_describe(exc)}") from exc
        return UpstreamResponse(raw.status, raw)

    @property
    def open_connections(self) -> int:
        return sum(h.connections for h in self._hosts.values())

    async def close(self) -> None:
        """Close every connection (a request that still uses this client afterwards opens new ones)."""
        self.closed = True
        hosts, self._hosts = self._hosts, {}
        for host in hosts.values():
            host.close()
