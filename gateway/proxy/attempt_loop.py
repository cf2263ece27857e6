"""The attempt loop of a forwarded request, up to the commit point: which pool and endpoint to try next, one attempt's
request body, and what a successful attempt opened (``Opened``).

An attempt that failed for a retryable reason (connect error, timeout or no first event within the TTFT deadline,
429/5xx, an error event or a broken connection before the first event; ``gateway.routing.attempts``) moves on to
the next candidate, within ``max_attempts`` and the process's retry budget. A request pinned to one endpoint (a
Responses API follow-up to the server holding its state) tries only that one.

A stream sent to a speculative pool asks for the usage chunk that carries its per-request spec-decode metrics
(``gateway.proxy.stream_tap``), stripped again when the client did not ask for it itself.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from gateway.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamResponseTooLarge,
    UpstreamTimeout,
)
from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.upstream import PoolClient, UpstreamResponse
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.headers import upstream_request_headers
from gateway.proxy.job import ProxyJob
from gateway.proxy.pool_answer import check_status
from gateway.proxy.stream_tap import StreamTap, with_include_usage
from gateway.proxy.wire import SSEOverflow, SSESplitter
from gateway.routing.attempts import (
    AttemptFailure,
    AttemptPolicy,
    PoolStatusError,
    StreamStartError,
    attempt_order,
    exhausted,
    status_result,
)

# An attempt's request body; the model it asks for when not the requested one; whether the gateway added the usage
# chunk to a stream (to strip it again); the request's body with the usage option, once built (b"": not wanted).
Body = tuple[bytes, str | None, bool, bytes | None]


@dataclass(slots=True)
class Opened:
    """A successful attempt: headers received, and for a stream its first event."""

    pool: PoolState
    endpoint: EndpointState
    response: UpstreamResponse
    first_events: list[bytes] | None
    splitter: SSESplitter | None
    buffered_body: bytes | None
    tap: StreamTap | None = None  # streams from a speculative pool
    model: str | None = None  # the model asked for instead of the requested one (route.fallback_model)


async def open_upstream(
    job: ProxyJob,
    pools: Mapping[str, PoolState],
    clients: Mapping[str, PoolClient],
    rng: random.Random,
    metrics: GatewayMetrics,
    policy: AttemptPolicy,
) -> Opened:
    """The attempt loop up to the commit point. The request holds a retry-budget lease from its first attempt until
    its upstream response is closed; every retry it was granted counts as long."""
    rec = job.record
    failures: list[AttemptFailure] = []
    full: list[str] = []  # planned pools that admitted no more (admission control), in plan order
    sent = 0
    usage_body: bytes | None = None  # the body with stream_options.include_usage, once built (not when b"")
    tries = attempt_order(job.plan, pools, rng, job.prompt) if job.pinned is None else iter((job.pinned,))
    lease = policy.budget.lease()
    try:
        for pool, ep in tries:
            if sent >= job.max_attempts:
                break
            if pool.name in full:
                continue
            if job.pinned is None and not (
                policy.admits(pool) if job.ticket is None else await _admitted(job, policy, pool)
            ):
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
            client = clients[pool.name]
            headers = upstream_request_headers(
                job.client_headers, request_id=rec.request_id, api_key=client.api_key, forwarded_for=job.forwarded_for
            )
            span = None
            trace = rec.trace
            if (quiet := rec.quiet) is not None:  # tracing on, unsampled: kept only if it falls back (or fails)
                if quiet.fell_back(sent, pool.name):
                    trace = rec.keep_trace()
                else:  # its planned attempt: the traceparent to the pool, and a note of where it went
                    quiet.quiet_attempt(
                        headers, full, pool.name, pool.spec.kind, ep.id, ep.url, job.plan.model_for(pool.name)
                    )
            if trace is not None:  # sampled or kept: the attempt's CLIENT span, and its traceparent to the pool
                span = trace.send_attempt(
                    headers, full, pool.name, pool.spec.kind, ep.id, ep.url, job.plan.model_for(pool.name)
                )
            started = time.perf_counter()
            if rec.upstream_start is None:
                rec.upstream_start = started
            ep.in_flight += 1
            metrics.pool_in_flight(pool.name).inc(1)
            if job.ticket is not None:
                job.ticket.enter(pool.name)
            if job.prompt and pool.affinity.enabled:  # the endpoint's prefix cache will hold this prompt
                metrics.prefix_sent(pool.name, ep.id, len(job.prompt), ep.prefixes.record(job.prompt))
            opened: Opened | None = None
            try:
                out = _request_body(job, pool, usage_body)
                usage_body = out[3]
                opened = await _attempt(job, pool, ep, client, headers, out)
            except UpstreamError as exc:
                result = policy.classify(pool, ep, exc)
                status = exc.upstream_status if isinstance(exc, PoolStatusError) else None
                if span is not None and rec.trace is not None:
                    rec.trace.attempt_failed(span, status, result)
                    span = None
                rec.attempt(pool.name, ep.id, started, status, exc.message, result)
                metrics.attempt_done(pool.name, result)
                # Kept without its traceback: that holds this frame, which holds the failure (a cycle per request)
                failures.append(AttemptFailure(pool.name, ep.id, exc.with_traceback(None), result))
                policy.failed(ep, exc, pools.values(), result)
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
            policy.answered(ep, status, pools.values())
            opened.response.on_close = lease.close
            return opened
        raise policy.gave_up(failures, full)
    except BaseException:
        lease.close()
        raise


async def _admitted(job: ProxyJob, policy: AttemptPolicy, pool: PoolState) -> bool:
    """Admission control with tenants (``Ticket.admission``): fair share and priority at the bound, and at the plan's
    last pool a bounded wait for a slot, best priority and fair share first. Without tenants the loop calls
    ``policy.admits`` itself (no coroutine per attempt)."""
    ticket = job.ticket
    if ticket is None:
        return policy.admits(pool)
    last = job.plan.pools[-1] == pool.name
    return await ticket.admission(pool.name, lambda: policy.admission(pool), last)


async def _attempt(
    job: ProxyJob, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str], out: Body
) -> Opened:
    """One attempt up to the commit point: headers, and for a stream its first whole event.

    A stream must show its first event within the class's ``route.ttft_deadline_s``, else the pool's
    ``first_byte_s`` (vLLM answers 200 at once and then nothing until the first token); a non-streaming
    answer arrives whole when generation is done, so only ``total_s`` bounds it.
    """
    if not job.stream:
        return await _post(job, pool, ep, client, headers, out)
    deadline = job.plan.ttft_deadline_s or client.first_byte_s
    try:
        async with asyncio.timeout(deadline):
            return await _post(job, pool, ep, client, headers, out)
    except TimeoutError as exc:
        raise UpstreamTimeout(f"no first event from {ep.id} within {deadline:g}s") from exc


async def _post(
    job: ProxyJob, pool: PoolState, ep: EndpointState, client: PoolClient, headers: dict[str, str], out: Body
) -> Opened:
    """Send the attempt, and read a whole answer (not a stream, or a stream's error answer: relayed with its status)
    or a stream's first whole event."""
    rec, (body, model, strip, _) = job.record, out
    resp = await client.post(ep, job.path, body, headers, method=job.method)
    try:
        await check_status(pool, resp)
        if not job.stream or resp.status != 200:
            answer = await resp.read()
            rec.upstream_first = rec.upstream_done = time.perf_counter()
            resp.release()
            return Opened(pool, ep, resp, None, None, answer, model=model)
        if not resp.is_event_stream:
            answer = await resp.read()
            raise StreamStartError(f"a stream was asked for, the pool answered {resp.content_type!r}: {answer[:100]!r}")
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


def _request_body(job: ProxyJob, pool: PoolState, usage_body: bytes | None) -> Body:
    """The ``Body`` of an attempt on ``pool``: with the class's ``route.fallback_model`` where it asks for another
    model, the usage option for a stream to a speculative pool, the tenant's ``priority`` for a pool that schedules
    by it. ``usage_body``: the one an earlier attempt built (None: none yet)."""
    body, model, strip = job.body, job.plan.model_for(pool.name), False
    usage = job.stream and pool.spec.kind == "speculative" and job.dialect.asks_usage
    dumps = job.serialize or orjson.dumps
    if model is not None:
        parsed = {**(job.parsed if job.parsed is not None else orjson.loads(job.body)), "model": model}
        with_usage = with_include_usage(parsed, dumps) if usage else None
        body, strip = (dumps(parsed) if with_usage is None else with_usage), with_usage is not None
    elif usage and job.parsed is not None:
        if usage_body is None:
            usage_body = with_include_usage(job.parsed, dumps) or b""
        if usage_body:
            body, strip = usage_body, True
    ticket = job.ticket
    if ticket is not None and pool.spec.scheduling_policy == "priority":
        body = orjson.dumps({**orjson.loads(body), "priority": ticket.priority})
    return body, model, strip, usage_body
