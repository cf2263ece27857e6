"""Forwarding: one proxied request from its first attempt to its last byte, as an ASGI app (``ProxyExchange``).

It runs the attempt loop up to the commit point (``gateway.proxy.attempt_loop``), relays the chosen pool's
response, and records the request (metrics, log line, stored result). Its client's presence is watched meanwhile
(``gateway.proxy.presence``): a client that goes away cancels the upstream request at once, one that stops reading
is cut off.

The commit point is the first byte of the response body sent to the client. Before it, a failed attempt moves on to
the next candidate; after it nothing is ever re-sent: a stream that breaks ends with the explicit failure of its API
(``gateway.proxy.dialect``: an error event and ``[DONE]`` for chat). Responses of speculative pools are read for
their per-request spec-decode metrics (``gateway.proxy.stream_tap``); those of standard pools are relayed without
a look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping

from starlette.types import Receive, Scope, Send

from gateway.config.schema import Defaults
from gateway.errors import GatewayError, Overloaded, UpstreamError, UpstreamResponseTooLarge
from gateway.fleet.pools import PoolState
from gateway.fleet.upstream import PoolClient
from gateway.observability.logs import AccessLog
from gateway.observability.metrics import GatewayMetrics
from gateway.periodic import DelayedCalls
from gateway.proxy.attempt_loop import Opened, open_upstream
from gateway.proxy.headers import client_response_headers
from gateway.proxy.http import error_response, is_bug
from gateway.proxy.job import ProxyJob
from gateway.proxy.outcome import outcome_of, relayed
from gateway.proxy.presence import ClientPresence
from gateway.proxy.stream_tap import StreamTap, cached_tokens_of, sample_from_body
from gateway.proxy.wire import JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, SSEOverflow, error_bytes, normalise_error
from gateway.routing.attempts import AttemptPolicy

logger = logging.getLogger("specgate.forward")


def response_headers(
    job: ProxyJob, opened: Opened | None, content_type: str, upstream: list[tuple[bytes, bytes]] | None = None
) -> list[tuple[bytes, bytes]]:
    """Upstream headers as raw bytes (never decoded and re-encoded), then ours: the content type, the job's extra
    headers, and where the answer came from (pool, endpoint, a fallback model, the attempts made)."""
    out = [(k, v) for k, v in upstream if k != b"content-type"] if upstream else []
    pairs = [("content-type", content_type), *job.extra_headers]
    if opened is not None:
        pairs.append(("x-specgate-pool", opened.pool.name))
        pairs.append(("x-specgate-endpoint", opened.endpoint.id))
        if opened.model is not None:
            pairs.append(("x-specgate-model", opened.model))
    pairs.append(("x-specgate-attempts", str(len(job.record.attempts))))
    out += [(k.encode("latin-1"), v.encode("latin-1", "replace")) for k, v in pairs]
    return out


class ProxyExchange:
    """One proxied request from its first attempt to its last byte, as an ASGI app: the attempt loop up to the
    commit point, then the relay of the chosen pool's response, then the record (metrics, log line, stored result).
    Called once. An exception before the commit point is answered here (``error_response``) and raised again."""

    _opened: Opened | None  # the attempt that answered, until its response is closed
    _tap: StreamTap | None  # reads a speculative pool's stream for its spec-decode metrics
    presence: ClientPresence

    __slots__ = (
        "_opened",
        "_tap",
        "access_log",
        "clients",
        "committed",
        "job",
        "metrics",
        "policy",
        "pools",
        "presence",
        "rng",
        "starts",
    )

    def __init__(
        self,
        job: ProxyJob,
        pools: Mapping[str, PoolState],
        clients: Mapping[str, PoolClient],
        metrics: GatewayMetrics,
        access_log: AccessLog,
        rng: random.Random,
        policy: AttemptPolicy | None = None,
        starts: DelayedCalls | None = None,
    ) -> None:
        if policy is None:  # a private budget (tests); the gateway passes its process-wide one
            defaults = Defaults()
            policy = AttemptPolicy(lambda: defaults, metrics)
        self.job, self.pools, self.clients = job, pools, clients
        self.metrics, self.access_log, self.rng = metrics, access_log, rng
        self.policy, self.committed, self.starts = policy, False, starts
        self._opened = self._tap = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The work runs in this task; the client's presence is watched beside it (gateway.proxy.presence).
        presence = self.presence = ClientPresence(
            self.job, self.metrics, self.policy.client_send_timeout_s, scope, receive, send, self.starts
        )
        out = presence.send  # the send deadline (gateway.proxy.stall)
        rec, claim = self.job.record, self.job.idempotency
        if claim is not None:  # record what the client gets, to store it for replays
            out = claim.recording(out, presence.is_gone)
            claim.start_renewal()
        try:
            await self._run(out)
        except asyncio.CancelledError:
            if not presence.ended_it():  # keyed: cut only past the detached budget
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
        except Exception as exc:
            # A bug, not an upstream failure: say so in the metrics, and never end a stream cleanly on it.
            rec.outcome = "gateway_error"
            rec.error = "internal error in the gateway"
            if not self.committed:  # answered as the front half answers (gateway.proxy.front.serve)
                await error_response(exc, scope["method"], rec.path)(scope, receive, send)
                if is_bug(exc):
                    raise  # for the server's log
                return
            if not presence.last_send:
                presence.last_send = True
                with contextlib.suppress(Exception):
                    body = self.job.dialect.failure(
                        self._for_client("internal error in the gateway"), type_="internal_error", code="internal_error"
                    )
                    await out({"type": "http.response.body", "body": body, "more_body": False})
            logger.exception("error after the commit point of %s", rec.request_id)
        finally:
            presence.done()
            stored = None
            try:
                if self._tap is not None:
                    rec.spec, rec.cached_tokens = self._tap.sample, self._tap.cached_tokens
                self._cleanup()
                if claim is not None:
                    rec.idempotency, stored = claim.outcome()
                rec.finish(rec.outcome, self.metrics, self.access_log)
                if self.job.ticket is not None:
                    self.job.ticket.finish(rec.outcome, bool(rec.attempts))
            finally:
                if claim is not None:  # after the last byte went out: the client does not wait for it
                    await claim.settle(stored)

    async def _run(self, send: Send) -> None:
        rec = self.job.record
        try:
            opened = await open_upstream(self.job, self.pools, self.clients, self.rng, self.metrics, self.policy)
        except GatewayError as exc:
            rec.error = exc.message
            rec.outcome = outcome_of(exc)
            if isinstance(exc, Overloaded):
                planned = self.job.plan.pools[0] if self.job.plan.pools else "none"
                self.metrics.shed.labels(rec.traffic_class or "none", planned, exc.reason).inc()
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

    # --- relaying --------------------------------------------------------------------------------------

    def _for_client(self, text: str) -> str:
        """An error text the gateway writes to the client, with the request id its log line carries."""
        return f"{text} (request id {self.job.record.request_id})"

    async def _send_error(self, send: Send, exc: GatewayError) -> None:
        body = error_bytes(exc, self.job.record.request_id)
        headers = response_headers(self.job, self._opened, JSON_CONTENT_TYPE) + [
            (k.encode(), v.encode()) for k, v in exc.headers.items()
        ]
        headers.append((b"content-length", str(len(body)).encode()))
        self.job.record.status = exc.status
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        self.committed = True
        self.presence.last_send = True
        await send({"type": "http.response.body", "body": body})

    async def _send_buffered(self, send: Send, opened: Opened) -> None:
        resp, rec = opened.response, self.job.record
        body = opened.buffered_body or b""
        ctype = (resp.content_type or JSON_CONTENT_TYPE).encode("latin-1", "replace").decode("latin-1")
        if resp.status >= 400:
            body = normalise_error(resp.status, body)
            ctype = JSON_CONTENT_TYPE
            rec.outcome = relayed(resp.status)
        rec.status = resp.status
        headers = response_headers(self.job, self._opened, ctype, client_response_headers(resp.raw_headers))
        headers.append((b"content-length", str(len(body)).encode()))
        if self.job.idempotency is not None and resp.status < 500:
            self.job.idempotency.generated = True  # an answer the client may act on: stored for replays
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        self.committed = True
        self.presence.last_send = True
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
        headers = response_headers(self.job, self._opened, SSE_CONTENT_TYPE, client_response_headers(resp.raw_headers))
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
            self.job.record.outcome = "stream_error"
            held = b"".join(opened.tap.flush()) if opened.tap is not None else b""
            failure = self.job.dialect.failure(self._for_client(told))
            await send({"type": "http.response.body", "body": held + failure, "more_body": True})
        self.presence.last_send = True
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
                self.job.record.outcome = "stream_error"
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
