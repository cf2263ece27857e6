"""The HTTP client to the pools: one aiohttp session per pool, and failures mapped onto ``gateway.errors``.

Why aiohttp and not httpx's default transport: on this class of machine httpx's connection pool collapses
under concurrency (470–780 req/s at 32 connections through a pass-through proxy, against 5.2k–5.9k for an
aiohttp session; DESIGN.md, "The hot path"). The proxy needs only POST/GET with streaming bodies, which is
what aiohttp's client does best; everything above this module sees plain bytes, statuses and our own errors.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from gateway.errors import UpstreamConnectError, UpstreamTimeout, UpstreamUnreachable
from gateway.pools import EndpointState
from gateway.rules.schema import Pool as PoolSpec

CHUNK_LIMIT = 2**16


@dataclass(slots=True)
class UpstreamResponse:
    """An upstream response whose headers have arrived; the body is still to be read or relayed."""

    status: int
    raw: aiohttp.ClientResponse
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
        try:
            return await self.raw.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"upstream broke while sending the body: {_describe(exc)}") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream total timeout while reading the body") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive. Raises UpstreamError when the connection breaks."""
        try:
            async for chunk in self.raw.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"upstream connection broke: {_describe(exc)}") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout("upstream total timeout while streaming") from exc

    @property
    def content_type(self) -> str:
        return self.raw.headers.get("content-type", "")

    async def finish(self, timeout_s: float) -> None:
        """After [DONE]: read what is left of the body (the chunked terminator), then give the connection back.
        If it does not come in time, close the connection instead."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.raw.read()
            self.release()
        except (aiohttp.ClientError, OSError, TimeoutError):
            self.abort()

    def abort(self) -> None:
        """Close the connection: vLLM aborts the generation when its client goes away."""
        self.raw.close()
        self._closed()

    def release(self) -> None:
        """The body was read to the end: the connection goes back to the pool."""
        self.raw.release()
        self._closed()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PoolClient:
    """One aiohttp session (one connection pool) for one pool's endpoints."""

    def __init__(self, spec: PoolSpec, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.spec = spec
        self.api_key = env.get(spec.api_key_env) if spec.api_key_env else None
        t = spec.timeouts
        # connect: waiting for a free pooled connection plus the TCP connect; sock_connect: the TCP connect.
        self._timeout = aiohttp.ClientTimeout(total=t.total_s, connect=t.first_byte_s, sock_connect=t.connect_s)
        self.first_byte_s = t.first_byte_s
        self._session: aiohttp.ClientSession | None = None

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self.spec.max_connections * len(self.spec.endpoints),
                limit_per_host=self.spec.max_connections,
                ttl_dns_cache=30,
                enable_cleanup_closed=True,
                keepalive_timeout=4,  # below uvicorn's (vLLM's) 5 s, so we never reuse a connection it is closing
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                auto_decompress=True,  # we ask for identity; a pool that compresses anyway is decoded here
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                read_bufsize=CHUNK_LIMIT,
            )
        return self._session

    async def post(self, ep: EndpointState, path: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        """Send a request and wait for the response headers (bounded by the pool's total timeout)."""
        session = self._ensure_session()
        try:
            raw = await session.post(ep.url + path, data=body, headers=headers, allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as exc:
            raise UpstreamUnreachable(f"connect timeout to {ep.id}: {_describe(exc)}") from exc
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no response from {ep.id} within the total timeout") from exc
        except (aiohttp.ClientConnectorError, aiohttp.ClientConnectorDNSError) as exc:
            raise UpstreamUnreachable(f"cannot reach {ep.id}: {_describe(exc)}") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamConnectError(f"{ep.id} failed before the response: {_describe(exc)}") from exc
        return UpstreamResponse(raw.status, raw)

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
