"""Forwarding: the attempt loop, the commit point, and the relay of the upstream response.

``ProxyResponse`` is the ASGI app a handler returns once the request is classified and planned. It runs the
attempts and the relay while watching for the client's disconnect, so that a client that goes away cancels
the upstream request at once, whether the gateway was waiting for headers, the first token, or relaying.

The commit point is the first byte of the response body sent to the client. Before it, an attempt that failed
for a retryable reason (connect error, first-byte timeout, 429/502/503/504, an error event or a broken
connection before the first event) moves on to the next candidate, within ``max_attempts``. After it nothing
is ever re-sent: a stream that breaks ends with an explicit error event and ``[DONE]``.

Responses of speculative pools are read for their per-request spec-decode metrics (``gateway.acceptance``): a
stream sent to such a pool asks for the usage chunk that carries them, which is stripped again when the client
did not ask for it itself. Responses of standard pools are relayed without a look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.acceptance import StreamTap, sample_from_body, with_include_usage
from gateway.decide import Plan
from gateway.errors import GatewayError, NoCapacity, UpstreamError, UpstreamTimeout, UpstreamUnreachable
from gateway.headers import client_response_headers, upstream_request_headers
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics, Outcome
from gateway.openai import (
    JSON_CONTENT_TYPE,
    SSE_CONTENT_TYPE,
    SSEOverflow,
    SSESplitter,
    error_bytes,
    is_done_event,
    is_error_event,
    normalise_error,
    sse_error,
)
from gateway.pools import EndpointState, PoolState
from gateway.record import RequestRecord
from gateway.upstream import RETRYABLE_STATUS, PoolClient, UpstreamResponse

logger = logging.getLogger("specgate.forward")


@dataclass(slots=True)
class ProxyJob:
    path: str
    body: bytes
    client_headers: list[tuple[str, str]]
    stream: bool
    plan: Plan
    max_attempts: int
    record: RequestRecord
    extra_headers: list[tuple[str, str]]
    parsed: Mapping[str, Any] | None = None  # the request body as parsed (to ask a speculative pool for usage)


@dataclass(slots=True)
class _Opened:
    """A successful attempt: headers received, and for a stream its first event."""

    pool: PoolState
    endpoint: EndpointState
    response: UpstreamResponse
    first_events: list[bytes] | None
    splitter: SSESplitter | None
    buffered_body: bytes | None
    tap: StreamTap | None = None  # streams from a speculative pool


def _candidates(
    plan: Plan, pools: Mapping[str, PoolState], rng: random.Random
) -> Iterator[tuple[PoolState, EndpointState]]:
    """Pools in plan order, one endpoint each, then round again with endpoints not yet tried."""
    tried: set[str] = set()
    while True:
        progressed = False
        for name in plan.pools:
            pool = pools.get(name)
            if pool is None:
                continue
            ep = pool.pick(rng, exclude=tried)
            if ep is None:
                continue
            tried.add(ep.id)
            progressed = True
            yield pool, ep
        if not progressed:
            return


class ProxyResponse(Response):
    """An ASGI response that runs the attempts and the relay itself (no body of its own)."""

    def __init__(
        self,
        job: ProxyJob,
        pools: Mapping[str, PoolState],
        clients: Mapping[str, PoolClient],
        metrics: GatewayMetrics,
        access_log: AccessLog,
        rng: random.Random,
    ) -> None:
        self.job = job
        self.pools = pools
        self.clients = clients
        self.metrics = metrics
        self.access_log = access_log
        self.rng = rng
        self.outcome: Outcome = "ok"
        self.committed = False
        self._opened: _Opened | None = None
        self._client_gone = False
        self._last_send = False  # from here on, a disconnect is the normal end of the exchange
        self._tap: StreamTap | None = None
        self._usage_body: bytes | None = None  # the body with stream_options.include_usage, once built
        self._usage_body_built = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The work runs in this task; a small watcher cancels it when the client goes away.
        task = asyncio.current_task()
        assert task is not None
        watch = asyncio.ensure_future(self._watch(receive, task))
        try:
            await self._run(send)
        except asyncio.CancelledError:
            if not self._client_gone:
                raise
            task.uncancel()
        except Exception:
            # A bug, not an upstream failure: say so in the metrics, and never end a stream cleanly on it.
            self.outcome = "gateway_error"
            self.job.record.error = "internal error in the gateway"
            if not self.committed:
                raise  # the app's exception handler answers 500 with an envelope
            if not self._last_send:
                self._last_send = True
                with contextlib.suppress(Exception):
                    body = sse_error("internal error in the gateway", type_="internal_error", code="internal_error")
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            logger.exception("error after the commit point of %s", self.job.record.request_id)
        finally:
            watch.cancel()
            if self._tap is not None and self._tap.sample is not None:
                self.job.record.spec = self._tap.sample
            self._cleanup()
            self.job.record.finish(self.outcome, self.metrics, self.access_log)

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._last_send:
                    return
                self._client_gone = True
                self.outcome = "client_disconnect"
                task.cancel()
                return

    # --- the attempt loop -------------------------------------------------------------------------------

    async def _run(self, send: Send) -> None:
        rec = self.job.record
        try:
            opened = await self._open()
        except GatewayError as exc:
            rec.error = exc.message
            self.outcome = "no_capacity" if isinstance(exc, NoCapacity) else "upstream_error"
            await self._send_error(send, exc)
            return
        self._opened = opened
        rec.pool, rec.endpoint = opened.pool.name, opened.endpoint.id
        if opened.first_events is not None:
            await self._relay_stream(send, opened)
        else:
            await self._send_buffered(send, opened)

    async def _open(self) -> _Opened:
        job, rec = self.job, self.job.record
        errors: list[str] = []
        last_exc: GatewayError | None = None
        for n, (pool, ep) in enumerate(_candidates(job.plan, self.pools, self.rng)):
            if n >= job.max_attempts:
                break
            client = self.clients[pool.name]
            headers = upstream_request_headers(job.client_headers, request_id=rec.request_id, api_key=client.api_key)
            started = time.perf_counter()
            if rec.upstream_start is None:
                rec.upstream_start = started
            ep.in_flight += 1
            self.metrics.in_flight.labels(pool.name).inc()
            opened: _Opened | None = None
            try:
                opened = await self._attempt(pool, ep, client, headers)
            except UpstreamError as exc:
                rec.attempt(pool.name, ep.id, started, None, exc.message)
                errors.append(f"{pool.name}/{ep.id}: {exc.message}")
                last_exc = exc
                if isinstance(exc, UpstreamUnreachable):
                    ep.mark_failure(exc.message)
                continue
            finally:
                if opened is None:
                    ep.in_flight -= 1
                    self.metrics.in_flight.labels(pool.name).dec()
            rec.attempt(pool.name, ep.id, started, opened.response.status, None)
            ep.mark_success()
            return opened
        if not errors:
            raise NoCapacity("no endpoint of the planned pools can take the request", retry_after_s=2)
        code = "upstream_timeout" if isinstance(last_exc, UpstreamTimeout) else "upstream_unavailable"
        raise NoCapacity(f"all {len(errors)} attempt(s) failed: " + "; ".join(errors), retry_after_s=2, code=code)

    async def _attempt(
        self, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str]
    ) -> _Opened:
        """One attempt up to the commit point: headers, and for a stream its first whole event.

        Streams must show their first event within the pool's ``first_byte_s`` (vLLM answers 200 at once and
        then nothing until the first token); a non-streaming answer arrives whole when generation is done, so
        only ``total_s`` bounds it.
        """
        if not self.job.stream:
            return await self._attempt_buffered(pool, ep, client, headers)
        try:
            async with asyncio.timeout(client.first_byte_s):
                return await self._attempt_stream(pool, ep, client, headers)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no first event from {ep.id} within {client.first_byte_s:g}s") from exc

    async def _attempt_buffered(
        self, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str]
    ) -> _Opened:
        job, rec = self.job, self.job.record
        resp = await client.post(ep, job.path, job.body, headers)
        try:
            self._check_status(pool, resp)
            body = await resp.read()
            rec.upstream_first = rec.upstream_done = time.perf_counter()
            resp.release()
            return _Opened(pool, ep, resp, None, None, body)
        except BaseException:
            resp.abort()
            raise

    async def _attempt_stream(
        self, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str]
    ) -> _Opened:
        job, rec = self.job, self.job.record
        body, strip = self._stream_body(pool)
        resp = await client.post(ep, job.path, body, headers)
        try:
            self._check_status(pool, resp)
            if resp.status != 200:  # an error answer: relayed whole, with its status
                body = await resp.read()
                rec.upstream_first = rec.upstream_done = time.perf_counter()
                resp.release()
                return _Opened(pool, ep, resp, None, None, body)
            if not resp.is_event_stream:
                body = await resp.read()
                raise UpstreamError(f"a stream was asked for, the pool answered {resp.content_type!r}: {body[:100]!r}")
            splitter = SSESplitter()
            async for chunk in resp.chunks():
                try:
                    events = splitter.feed(chunk)
                except SSEOverflow as exc:
                    raise UpstreamError(str(exc)) from exc
                if not events:
                    continue
                if is_error_event(events[0]):
                    raise UpstreamError(f"error event before the first token: {events[0][:200]!r}")
                rec.upstream_first = time.perf_counter()
                tap = StreamTap(strip) if pool.spec.kind == "speculative" else None
                return _Opened(pool, ep, resp, events, splitter, None, tap)
            raise UpstreamError("upstream closed the stream before the first event")
        except BaseException:
            resp.abort()
            raise

    def _stream_body(self, pool: PoolState) -> tuple[bytes, bool]:
        """The body for a stream to ``pool``, and whether the gateway added the usage chunk (to strip it)."""
        job = self.job
        if pool.spec.kind != "speculative" or job.parsed is None:
            return job.body, False
        if not self._usage_body_built:
            self._usage_body_built = True
            self._usage_body = with_include_usage(job.parsed)
        if self._usage_body is None:
            return job.body, False
        return self._usage_body, True

    @staticmethod
    def _check_status(pool: PoolState, resp: UpstreamResponse) -> None:
        """Statuses that another pool may answer better are attempt failures, not answers."""
        if resp.status in RETRYABLE_STATUS:
            raise UpstreamError(f"HTTP {resp.status}")
        if resp.status in (401, 403):
            # The client's key never reaches a pool: this is the gateway's pool key being refused.
            logger.error(
                "pool %s refused the gateway's credentials (HTTP %d): check api_key_env", pool.name, resp.status
            )
            raise UpstreamError(f"pool {pool.name} refused the gateway's credentials (HTTP {resp.status})")

    # --- sending --------------------------------------------------------------------------------------

    def _response_headers(
        self, content_type: str, upstream: list[tuple[bytes, bytes]] | None = None
    ) -> list[tuple[bytes, bytes]]:
        """Upstream headers as raw bytes (never decoded and re-encoded), then ours."""
        out = [(k, v) for k, v in (upstream or []) if k != b"content-type"]
        pairs = [("content-type", content_type), *self.job.extra_headers]
        opened = self._opened
        if opened is not None:
            pairs.append(("x-specgate-pool", opened.pool.name))
            pairs.append(("x-specgate-endpoint", opened.endpoint.id))
        pairs.append(("x-specgate-attempts", str(len(self.job.record.attempts))))
        out.extend((k.encode("latin-1"), v.encode("latin-1", "replace")) for k, v in pairs)
        return out

    async def _send_error(self, send: Send, exc: GatewayError) -> None:
        body = error_bytes(exc)
        headers = self._response_headers(JSON_CONTENT_TYPE) + [(k.encode(), v.encode()) for k, v in exc.headers.items()]
        headers.append((b"content-length", str(len(body)).encode()))
        self.job.record.status = exc.status
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        self.committed = True
        self._last_send = True
        await send({"type": "http.response.body", "body": body})

    async def _send_buffered(self, send: Send, opened: _Opened) -> None:
        resp, rec = opened.response, self.job.record
        body = opened.buffered_body or b""
        ctype = resp.raw.headers.get("content-type", JSON_CONTENT_TYPE).encode("latin-1", "replace").decode("latin-1")
        if resp.status >= 400:
            body = normalise_error(resp.status, body)
            ctype = JSON_CONTENT_TYPE
            self.outcome = "client_error" if resp.status < 500 else "upstream_error"
        rec.status = resp.status
        headers = self._response_headers(ctype, client_response_headers(resp.raw.raw_headers))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.committed = True
        self._last_send = True
        await send({"type": "http.response.body", "body": body})
        if resp.status == 200 and opened.pool.spec.kind == "speculative":
            rec.spec = sample_from_body(body)

    async def _relay_stream(self, send: Send, opened: _Opened) -> None:
        resp, rec = opened.response, self.job.record
        assert opened.first_events is not None
        assert opened.splitter is not None
        rec.status = resp.status
        self._tap = opened.tap
        headers = self._response_headers(SSE_CONTENT_TYPE, client_response_headers(resp.raw.raw_headers))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.committed = True
        done = await self._send_events(send, opened.first_events)
        rec.first_sent = time.perf_counter()
        try:
            if not done:
                async for chunk in resp.chunks():
                    if await self._send_events(send, opened.splitter.feed(chunk)):
                        done = True
                        break
        except UpstreamError as exc:
            rec.error = exc.message
        except SSEOverflow as exc:
            rec.error = str(exc)
        if not done:
            rec.error = rec.error or "upstream closed the stream without [DONE]"
            self.outcome = "stream_error"
            held = b"".join(opened.tap.flush()) if opened.tap is not None else b""
            await send({"type": "http.response.body", "body": held + sse_error(rec.error), "more_body": True})
        self._last_send = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if done:
            await resp.finish(timeout_s=1.0)  # read the body's end, so the connection can be reused

    async def _send_events(self, send: Send, events: list[bytes]) -> bool:
        """Relay the whole events of one upstream read, at once and unchanged; True once [DONE] went out.

        Nothing is held back: a partial event stays in the splitter only until its end arrives.
        """
        done = False
        for i, event in enumerate(events):
            if is_done_event(event):
                events = events[: i + 1]
                done = True
                break
            if is_error_event(event):
                self.outcome = "stream_error"
                self.job.record.error = event[6:300].decode("utf-8", "replace").strip()
        if self._tap is not None:
            events = self._tap.feed(events)
        if events:
            body = events[0] if len(events) == 1 else b"".join(events)
            await send({"type": "http.response.body", "body": body, "more_body": True})
        return done

    def _cleanup(self) -> None:
        opened = self._opened
        if opened is None:
            return
        self._opened = None
        # After [DONE] or a full body the connection was released; in every other case closing it aborts
        # the generation upstream (vLLM aborts a request whose client went away).
        opened.response.abort()
        opened.endpoint.in_flight -= 1
        self.metrics.in_flight.labels(opened.pool.name).dec()
