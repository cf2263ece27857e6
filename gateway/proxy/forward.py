"""Forwarding: the attempt loop, the commit point, and the relay of the upstream response.

``ProxyExchange`` is the ASGI app that answers a request once it is classified and planned
(``gateway.proxy.intake``). It runs the attempts and the relay while watching for the client's disconnect, so that
a client that goes away cancels the upstream request at once, whether the gateway was waiting for headers, the
first token, or relaying.

The commit point is the first byte of the response body sent to the client. Before it, an attempt that failed
for a retryable reason (connect error, timeout or no first event within the TTFT deadline, 429/5xx, an error
event or a broken connection before the first event; ``gateway.routing.attempts``) moves on to the next candidate,
within ``max_attempts`` and the process's retry budget. After it nothing is ever re-sent: a stream that breaks ends
with the explicit failure of its API (``gateway.proxy.dialect``: an error event and ``[DONE]`` for chat).
A request pinned to one endpoint (a Responses API follow-up to the server holding its state) tries only that one.

Responses of speculative pools are read for their per-request spec-decode metrics (``gateway.proxy.stream_tap``): a
stream sent to such a pool asks for the usage chunk that carries them, which is stripped again when the client
did not ask for it itself. Responses of standard pools are relayed without a look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from gateway.config.schema import Defaults
from gateway.errors import (
    GatewayError,
    NoCapacity,
    Overloaded,
    UpstreamConnectError,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.upstream import PoolClient
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics, Outcome
from gateway.proxy.headers import client_response_headers, upstream_request_headers
from gateway.proxy.job import Opened, ProxyJob, response_headers
from gateway.proxy.pool_answer import check_status
from gateway.proxy.stall import StallWatch, abort_client
from gateway.proxy.stream_tap import StreamTap, cached_tokens_of, sample_from_body, with_include_usage
from gateway.proxy.wire import (
    JSON_CONTENT_TYPE,
    SSE_CONTENT_TYPE,
    SSEOverflow,
    SSESplitter,
    error_bytes,
    normalise_error,
)
from gateway.routing.attempts import (
    AttemptFailure,
    AttemptPolicy,
    BudgetLease,
    PoolStatusError,
    StreamStartError,
    candidates,
    exhausted,
    status_result,
)

logger = logging.getLogger("specgate.forward")

# How long a request runs before the gateway starts watching for its client's disconnect (ProxyExchange.__call__):
# the upper bound on how late a disconnect cancels the upstream request.
WATCH_AFTER_S = 0.05


class ProxyExchange:
    """One proxied request from its first attempt to its last byte, as an ASGI app: the attempt loop up to the
    commit point, then the relay of the chosen pool's response, then the record (metrics, log line, stored result).
    Called once; its fields are that request's state."""

    def __init__(
        self,
        job: ProxyJob,
        pools: Mapping[str, PoolState],
        clients: Mapping[str, PoolClient],
        metrics: GatewayMetrics,
        access_log: AccessLog,
        rng: random.Random,
        policy: AttemptPolicy | None = None,
    ) -> None:
        self.job = job
        if policy is None:  # a private budget (tests); the gateway passes its process-wide one
            defaults = Defaults()
            policy = AttemptPolicy(lambda: defaults, metrics)
        self.policy = policy
        self.pools = pools
        self.clients = clients
        self.metrics = metrics
        self.access_log = access_log
        self.rng = rng
        self.outcome: Outcome = "ok"
        self.committed = False
        self._opened: Opened | None = None
        self._client_gone = False
        self._last_send = False  # from here on, a disconnect is the normal end of the exchange
        self._tap: StreamTap | None = None
        self._usage_body: bytes | None = None  # the body with stream_options.include_usage, once built
        self._usage_body_built = False
        self._watcher: asyncio.Task[None] | None = None
        self._detached = False  # a keyed request running on without its client, counted in job.detached
        self._cut = False  # a keyed request cancelled for its client: the detached budget was spent
        self._stall: StallWatch
        self._scope: Scope

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The work runs in this task; a small watcher cancels it when the client goes away.
        task = asyncio.current_task()
        assert task is not None
        self._scope = scope
        self._stall = StallWatch(send, self.policy.client_send_timeout_s, lambda t: self._stalled(t, task))
        send = self._stall.send  # the send deadline (gateway.proxy.stall)
        claim = self.job.idempotency
        if claim is not None:  # record what the client gets, to store it for replays
            send = claim.recording(send, lambda: self._client_gone)
            claim.start_renewal()
        # The watcher starts only once the request has run for WATCH_AFTER_S: most requests to a fast upstream are
        # answered before, and a timer costs a tenth of a task. A disconnect before it starts is still seen at once
        # when it starts (the server's receive() answers http.disconnect for a client already gone).
        start = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start_watch, receive, task)
        try:
            await self._run(send)
        except asyncio.CancelledError:
            if not self._client_gone or (claim is not None and not self._cut):  # keyed: cut only past the budget
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
                    body = self.job.dialect.failure(
                        self._for_client("internal error in the gateway"), type_="internal_error", code="internal_error"
                    )
                    await send({"type": "http.response.body", "body": body, "more_body": False})
            logger.exception("error after the commit point of %s", self.job.record.request_id)
        finally:
            start.cancel()
            if self._watcher is not None:
                self._watcher.cancel()
                self._watcher = None  # the task's frame holds this exchange: no cycle left for the GC to find
            if self._detached and self.job.detached is not None:
                self._detached = False
                self.job.detached.release(self.job.tenant)
            self._stall.done()
            stored = None
            try:
                if self._tap is not None:
                    self.job.record.spec, self.job.record.cached_tokens = self._tap.sample, self._tap.cached_tokens
                self._cleanup()
                if claim is not None:
                    self.job.record.idempotency, stored = claim.outcome()
                self.job.record.finish(self.outcome, self.metrics, self.access_log)
                if self.job.ticket is not None:
                    self.job.ticket.finish(self.outcome, bool(self.job.record.attempts))
            finally:
                if claim is not None:  # after the last byte went out: the client does not wait for it
                    await claim.settle(stored)

    def _start_watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        self._watcher = asyncio.get_running_loop().create_task(self._watch(receive, task))
        self._stall.start()

    def _stalled(self, timeout: float, task: asyncio.Task[Any]) -> None:
        """The client has taken nothing for ``timeout`` s: cut it off (the disconnect path does the rest)."""
        if self._last_send:
            return
        self.outcome = "client_stalled"
        self.job.record.error = f"the client read nothing for {timeout:g}s: cut off"
        self.metrics.client_stalled.labels(self._opened.pool.name if self._opened is not None else "none").inc()
        logger.warning("request %s: %s", self.job.record.request_id, self.job.record.error)
        if not abort_client(self._scope):  # else the server reports the disconnect and the watcher acts on it
            self._client_gone = True
            task.cancel()

    async def _watch(self, receive: Receive, task: asyncio.Task[Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._last_send:
                    return
                self._client_gone = True
                if self.outcome != "client_stalled":
                    self.outcome = "client_disconnect"
                if self.job.idempotency is None:
                    task.cancel()
                    return
                # A keyed request runs on to its end (bounded by the pool's total_s): its response is stored, and
                # the client's retry with the same key gets the whole answer instead of a second generation; as
                # many as the detached budget allows (per client and in total), the others are cancelled.
                budget = self.job.detached
                if budget is None or budget.acquire(self.job.tenant):
                    self._detached = budget is not None
                else:
                    self._cut = True
                    self.metrics.limit_refused("detached")
                    task.cancel()
                return

    # --- the attempt loop -------------------------------------------------------------------------------

    async def _run(self, send: Send) -> None:
        rec = self.job.record
        try:
            opened = await self._open()
        except GatewayError as exc:
            rec.error = exc.message
            if isinstance(exc, Overloaded):
                self.outcome = "overloaded"
                planned = self.job.plan.pools[0] if self.job.plan.pools else "none"
                self.metrics.shed.labels(rec.traffic_class or "none", planned, exc.reason).inc()
            else:
                self.outcome = "no_capacity" if isinstance(exc, NoCapacity) else "upstream_error"
            await self._send_error(send, exc)
            return
        self._opened = opened
        rec.pool, rec.endpoint = opened.pool.name, opened.endpoint.id
        if self.job.on_answer is not None and opened.response.status == 200:
            first = opened.first_events[0] if opened.first_events else opened.buffered_body
            await self.job.on_answer(opened.pool, opened.endpoint, first or b"")
        if opened.first_events is not None:
            await self._relay_stream(send, opened)
        else:
            await self._send_buffered(send, opened)

    async def _open(self) -> Opened:
        """The attempt loop up to the commit point. The request holds a retry-budget lease from its first attempt
        until its upstream response is closed (``_cleanup``); every retry it was granted counts as long."""
        lease = self.policy.budget.lease()
        try:
            opened = await self._attempts(lease)
        except BaseException:
            lease.close()
            raise
        opened.response.on_close = lease.close
        return opened

    async def _attempts(self, lease: BudgetLease) -> Opened:
        job, rec, metrics, policy = self.job, self.job.record, self.metrics, self.policy
        failures: list[AttemptFailure] = []
        full: list[str] = []  # planned pools that admitted no more (admission control), in plan order
        sent = 0
        tries = candidates(job.plan, self.pools, self.rng, job.prompt) if job.pinned is None else iter((job.pinned,))
        for pool, ep in tries:
            if sent >= job.max_attempts:
                break
            if pool.name in full:
                continue
            if job.pinned is None and not (policy.admits(pool) if job.ticket is None else await self._admitted(pool)):
                full.append(pool.name)
                continue
            if failures and failures[-1].backpressure and policy.busy(pool, ep):
                continue  # after back-pressure, only an endpoint with headroom is worth a try
            if failures or full:
                last = failures[-1] if failures else None
                if last is not None and not lease.try_retry():
                    metrics.attempt_done(pool.name, "budget_exhausted")
                    raise exhausted(failures, budget_refused=True)
                from_pool, why = (last.pool, last.result) if last is not None else (full[-1], "admission")
                if from_pool != pool.name:
                    metrics.fallbacks.labels(rec.traffic_class, from_pool, pool.name, why).inc()
            sent += 1
            client = self.clients[pool.name]
            headers = upstream_request_headers(
                job.client_headers, request_id=rec.request_id, api_key=client.api_key, forwarded_for=job.forwarded_for
            )
            span = None
            if rec.trace is not None:  # tracing on: the attempt's CLIENT span, and its traceparent to the pool
                span = rec.trace.send_attempt(
                    headers, full, pool.name, pool.spec.kind, ep.id, ep.url, job.plan.model_for(pool.name)
                )
            started = time.perf_counter()
            if rec.upstream_start is None:
                rec.upstream_start = started
            ep.in_flight += 1
            metrics.pool_in_flight(pool.name).inc()
            if job.ticket is not None:
                job.ticket.enter(pool.name)
            if job.prompt and pool.affinity.enabled:  # the endpoint's prefix cache will hold this prompt
                metrics.prefix_sent(pool.name, ep.id, len(job.prompt), ep.prefixes.record(job.prompt))
            opened: Opened | None = None
            try:
                opened = await self._attempt(pool, ep, client, headers)
            except UpstreamError as exc:
                result = policy.classify(pool, ep, exc)
                status = exc.upstream_status if isinstance(exc, PoolStatusError) else None
                if span is not None and rec.trace is not None:
                    rec.trace.attempt_failed(span, status, result)
                    span = None
                rec.attempt(pool.name, ep.id, started, status, exc.message)
                metrics.attempt_done(pool.name, result)
                # Kept without its traceback: that holds this frame, which holds the failure (a cycle per request)
                failures.append(AttemptFailure(pool.name, ep.id, exc.with_traceback(None), result))
                policy.failed(ep, exc, self.pools.values(), result)
                if isinstance(exc, UpstreamResponseTooLarge):  # not retried: 502 now (UpstreamResponseTooLarge)
                    metrics.limit_refused(exc.limit)
                    raise
                if isinstance(exc, UpstreamInvalidResponse):  # a status the gateway never relays: 502 now
                    raise
                continue
            finally:
                if opened is None:
                    ep.in_flight -= 1
                    metrics.pool_in_flight(pool.name).dec()
                    if job.ticket is not None:
                        job.ticket.leave(pool.name)
                    if span is not None and rec.trace is not None:  # cancelled (the client left), or a bug
                        rec.trace.attempt_failed(span, None, "cancelled")
            status = opened.response.status
            if span is not None and rec.trace is not None:
                first = rec.upstream_first
                rec.trace.attempt_answered(span, status, None if first is None else first - started)
            rec.attempt(pool.name, ep.id, started, status, None)
            metrics.attempt_done(pool.name, status_result(status))
            policy.answered(ep, status, self.pools.values())
            return opened
        raise policy.gave_up(failures, full)

    async def _admitted(self, pool: PoolState) -> bool:
        """Admission control with tenants (``Ticket.admission``): fair share and priority at the bound, and at the
        plan's last pool a bounded wait for a slot, best priority and fair share first. Without tenants
        ``policy.admits`` alone (the loop calls it directly: no coroutine per attempt)."""
        ticket, policy = self.job.ticket, self.policy
        if ticket is None:
            return policy.admits(pool)
        last = self.job.plan.pools[-1] == pool.name
        return await ticket.admission(pool.name, lambda: policy.admission(pool), last)

    async def _attempt(self, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str]) -> Opened:
        """One attempt up to the commit point: headers, and for a stream its first whole event.

        A stream must show its first event within the class's ``route.ttft_deadline_s``, else the pool's
        ``first_byte_s`` (vLLM answers 200 at once and then nothing until the first token); a non-streaming
        answer arrives whole when generation is done, so only ``total_s`` bounds it.
        """
        if not self.job.stream:
            return await self._attempt_buffered(pool, ep, client, headers)
        deadline = self.job.plan.ttft_deadline_s or client.first_byte_s
        try:
            async with asyncio.timeout(deadline):
                return await self._attempt_stream(pool, ep, client, headers)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no first event from {ep.id} within {deadline:g}s") from exc

    async def _attempt_buffered(
        self, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str]
    ) -> Opened:
        job, rec = self.job, self.job.record
        body, model, _ = self._request_body(pool)
        resp = await client.post(ep, job.path, body, headers, method=job.method)
        try:
            await check_status(pool, resp)
            body = await resp.read()
            rec.upstream_first = rec.upstream_done = time.perf_counter()
            resp.release()
            return Opened(pool, ep, resp, None, None, body, model=model)
        except BaseException:
            resp.abort()
            raise

    async def _attempt_stream(
        self, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str]
    ) -> Opened:
        job, rec = self.job, self.job.record
        body, model, strip = self._request_body(pool)
        resp = await client.post(ep, job.path, body, headers, method=job.method)
        try:
            await check_status(pool, resp)
            if resp.status != 200:  # an error answer: relayed whole, with its status
                body = await resp.read()
                rec.upstream_first = rec.upstream_done = time.perf_counter()
                resp.release()
                return Opened(pool, ep, resp, None, None, body, model=model)
            if not resp.is_event_stream:
                body = await resp.read()
                raise StreamStartError(
                    f"a stream was asked for, the pool answered {resp.content_type!r}: {body[:100]!r}"
                )
            splitter = SSESplitter(pool.spec.max_event_bytes)
            try:
                async for chunk in resp.chunks():
                    events = splitter.feed(chunk)
                    if not events:
                        continue
                    if job.dialect.is_error(events[0]):
                        raise StreamStartError(f"error event before the first token: {events[0][:200]!r}")
                    rec.upstream_first = time.perf_counter()
                    tap = StreamTap(strip) if pool.spec.kind == "speculative" and job.dialect.asks_usage else None
                    return Opened(pool, ep, resp, events, splitter, None, tap, model)
            except SSEOverflow as exc:
                raise UpstreamResponseTooLarge(f"{ep.id}: {exc}", limit="event_bytes", public=str(exc)) from exc
            except (UpstreamConnectError, UpstreamTimeout) as exc:
                if isinstance(exc, StreamStartError):
                    raise
                raise StreamStartError(f"before the first event: {exc.message}") from exc
            raise StreamStartError("upstream closed the stream before the first event")
        except BaseException:
            resp.abort()
            raise

    def _request_body(self, pool: PoolState) -> tuple[bytes, str | None, bool]:
        """The body of an attempt on ``pool`` (with the tenant's ``priority`` for a pool that schedules by it)."""
        body, model, strip = self._pool_body(pool)
        ticket = self.job.ticket
        if ticket is not None and pool.spec.scheduling_policy == "priority":
            body = orjson.dumps({**orjson.loads(body), "priority": ticket.priority})
        return body, model, strip

    def _pool_body(self, pool: PoolState) -> tuple[bytes, str | None, bool]:
        """The body of an attempt on ``pool``; the model it asks for when not the requested one (the class's
        ``route.fallback_model``); whether the gateway added the usage chunk to a stream (to strip it again)."""
        job = self.job
        model = job.plan.model_for(pool.name)
        usage = job.stream and pool.spec.kind == "speculative" and job.dialect.asks_usage
        dumps = job.serialize or orjson.dumps
        if model is not None:
            parsed = {**(job.parsed if job.parsed is not None else orjson.loads(job.body)), "model": model}
            with_usage = with_include_usage(parsed, dumps) if usage else None
            return (dumps(parsed) if with_usage is None else with_usage), model, with_usage is not None
        if not usage or job.parsed is None:
            return job.body, None, False
        if not self._usage_body_built:
            self._usage_body_built = True
            self._usage_body = with_include_usage(job.parsed, dumps)
        if self._usage_body is None:
            return job.body, None, False
        return self._usage_body, None, True

    # --- sending --------------------------------------------------------------------------------------

    def _for_client(self, text: str) -> str:
        """An error text the gateway writes to the client, with the request id its log line carries."""
        return f"{text} (request id {self.job.record.request_id})"

    def _response_headers(
        self, content_type: str, upstream: list[tuple[bytes, bytes]] | None = None
    ) -> list[tuple[bytes, bytes]]:
        return response_headers(self.job, self._opened, content_type, upstream)

    async def _send_error(self, send: Send, exc: GatewayError) -> None:
        body = error_bytes(exc, self.job.record.request_id)
        headers = self._response_headers(JSON_CONTENT_TYPE) + [(k.encode(), v.encode()) for k, v in exc.headers.items()]
        headers.append((b"content-length", str(len(body)).encode()))
        self.job.record.status = exc.status
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        self.committed = True
        self._last_send = True
        await send({"type": "http.response.body", "body": body})

    async def _send_buffered(self, send: Send, opened: Opened) -> None:
        resp, rec = opened.response, self.job.record
        body = opened.buffered_body or b""
        ctype = (resp.content_type or JSON_CONTENT_TYPE).encode("latin-1", "replace").decode("latin-1")
        if resp.status >= 400:
            body = normalise_error(resp.status, body)
            ctype = JSON_CONTENT_TYPE
            self.outcome = "client_error" if resp.status < 500 else "upstream_error"
        rec.status = resp.status
        headers = self._response_headers(ctype, client_response_headers(resp.raw_headers))
        headers.append((b"content-length", str(len(body)).encode()))
        if self.job.idempotency is not None and resp.status < 500:
            self.job.idempotency.generated = True  # an answer the client may act on: stored for replays
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.committed = True
        self._last_send = True
        await send({"type": "http.response.body", "body": body})
        if resp.status == 200:
            if self.job.ticket is not None and self.job.ticket.wants_usage:
                self.job.ticket.observe(body)
            rec.cached_tokens = cached_tokens_of(body)
            if opened.pool.spec.kind == "speculative":
                rec.spec = sample_from_body(body)
        if rec.trace is not None:
            rec.trace.observe(body)

    async def _relay_stream(self, send: Send, opened: Opened) -> None:
        resp, rec = opened.response, self.job.record
        assert opened.first_events is not None
        assert opened.splitter is not None
        rec.status = resp.status
        self._tap = opened.tap
        headers = self._response_headers(SSE_CONTENT_TYPE, client_response_headers(resp.raw_headers))
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.committed = True
        if self.job.idempotency is not None:
            self.job.idempotency.generated = True  # from here on a retry must replay, never generate again
        done = await self._send_events(send, opened.first_events)
        rec.first_sent = time.perf_counter()
        told = "the pool's stream ended without its end marker"  # the client's text; rec.error has the log's
        try:
            if not done:
                async for chunk in resp.chunks():
                    if await self._send_events(send, opened.splitter.feed(chunk)):
                        done = True
                        break
        except UpstreamError as exc:
            rec.error = exc.message
            told = f"the pool's stream broke off: {exc.brief}"
            if isinstance(exc, UpstreamResponseTooLarge):
                self.metrics.limit_refused(exc.limit)
        except SSEOverflow as exc:
            rec.error = told = str(exc)  # the gateway's own limit, no upstream text in it
            self.metrics.limit_refused("event_bytes")
        if not done:
            rec.error = rec.error or "upstream closed the stream without [DONE]"
            self.outcome = "stream_error"
            held = b"".join(opened.tap.flush()) if opened.tap is not None else b""
            failure = self.job.dialect.failure(self._for_client(told))
            await send({"type": "http.response.body", "body": held + failure, "more_body": True})
        self._last_send = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if done:
            await resp.finish(timeout_s=1.0)  # read the body's end, so the connection can be reused

    async def _send_events(self, send: Send, events: list[bytes]) -> bool:
        """Relay the whole events of one upstream read, at once and unchanged; True once [DONE] went out.

        Nothing is held back: a partial event stays in the splitter only until its end arrives.
        """
        done = False
        dialect = self.job.dialect
        for i, event in enumerate(events):
            if dialect.is_error(event):
                self.outcome = "stream_error"
                self.job.record.error = event[6:300].decode("utf-8", "replace").strip()
            if dialect.is_done(event):
                events = events[: i + 1]
                done = True
                break
        ticket = self.job.ticket
        if ticket is not None and ticket.wants_usage:  # before the tap strips the usage chunk
            for event in events:
                ticket.observe(event)
        trace = self.job.record.trace
        if trace is not None:  # before the tap strips a usage chunk the client did not ask for
            for event in events:
                trace.observe(event)
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
        self.metrics.pool_in_flight(opened.pool.name).dec()
        if self.job.ticket is not None:
            self.job.ticket.leave(opened.pool.name)
