"""OpenTelemetry traces of the proxied requests (``specgate serve --tracing``; the ``tracing`` extra).

Off by default, and then nothing of this runs: the request path checks one ``None`` (``RequestRecord.trace``) and
OpenTelemetry is never imported. On, ``Tracing`` (one per process, built by the runtime) starts a
``RequestTrace`` per proxied request, which the request path calls at a few points::

    POST /v1/chat/completions   SERVER    the client's traceparent/tracestate continued, or a new trace
    ├── specgate.admission      INTERNAL  arrival → the first attempt: body read, decision, Idempotency-Key,
    │                                     admission control (the pools that admitted no more)
    ├── specgate.route          INTERNAL  the routing decision: class, task type, plan, reason, controller
    │                                     state/share/why, expected completion time per pool (explain's facts)
    ├── chat <model>            CLIENT    one per upstream attempt: pool, endpoint, status, error.type, TTFT,
    │   └── llm_request                   committed; vLLM's own span joins below it (the attempt's traceparent)
    └── chat <model>            CLIENT    the next attempt after a failure before the commit point

Attributes follow the OpenTelemetry GenAI conventions where they name the fact (``gen_ai.operation.name``,
``gen_ai.request.model``/``temperature``/``max_tokens``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``server.address``, ``error.type``) and ``specgate.*`` where they
do not (acceptance, the commit point, idempotency replay, fallback). No prompt or completion text is ever put in a
span: finish reasons and token counts are read from the pool's answer by a pattern that only matches the JSON
keys, and error messages (which may quote a pool's answer) stay in the access log; spans carry ``error.type``.

Where the spans go and which are kept: ``gateway.observability.trace_export``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

TRACE_ID_HEADER = "x-specgate-trace-id"
# gen_ai.operation.name of each proxied path (the GenAI conventions have no name of their own for the Responses API).
OPERATIONS: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
}
# Outcomes that mark the server span as failed (and so are kept by the tail decision); a client's own error or its
# going away is not the gateway's failure.
_FAILED = frozenset({"upstream_error", "no_capacity", "overloaded", "stream_error", "client_stalled", "gateway_error"})
# Read from the pool's JSON: only the keys match (a quote inside a JSON string is escaped, so text cannot fake them).
_FINISH = re.compile(rb'"finish_reason":\s*"([A-Za-z_]{1,32})"')
_USAGE = re.compile(rb'"(prompt_tokens|completion_tokens|input_tokens|output_tokens)":\s*(\d{1,12})[,}\s]')
_USAGE_KEY = {
    b"prompt_tokens": "gen_ai.usage.input_tokens",
    b"input_tokens": "gen_ai.usage.input_tokens",
    b"completion_tokens": "gen_ai.usage.output_tokens",
    b"output_tokens": "gen_ai.usage.output_tokens",
}
_MAX_FINISH_REASONS = 16


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the OpenTelemetry packages are not installed."""


class Tracing:
    """The process's tracer: a private OpenTelemetry provider set up from the ``OTEL_*`` variables
    (``trace_export.build_provider``). ``exporter`` replaces the OTLP exporter (tests)."""

    def __init__(self, env: Mapping[str, str] | None = None, exporter: Any = None) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            from gateway.observability import trace_export
        except ImportError as exc:
            raise TracingUnavailable(
                f"tracing needs the OpenTelemetry packages: pip install 'specgate[tracing]' ({exc})"
            ) from exc
        self.provider: TracerProvider = trace_export.build_provider(os.environ if env is None else env, exporter)
        self.tracer = self.provider.get_tracer("specgate")
        self.propagator = TraceContextTextMapPropagator()
        self.in_context = trace.set_span_in_context
        self.kinds = trace.SpanKind
        self.status = trace.Status
        self.error_code = trace.StatusCode.ERROR

    def start(
        self, method: str, path: str, request_id: str, traceparent: str | None, tracestate: str | None
    ) -> RequestTrace:
        """The server span of a request that arrived now, continuing the client's trace when it sent one."""
        parent: Context | None = None
        if traceparent is not None:
            carrier = {"traceparent": traceparent}
            if tracestate is not None:
                carrier["tracestate"] = tracestate
            parent = self.propagator.extract(carrier)
        return RequestTrace(self, method, path, request_id, parent)

    def shutdown(self) -> None:
        """Export what is buffered (bounded by the exporter's timeout), then stop."""
        self.provider.shutdown()


class RequestTrace:
    """The spans of one request (module docstring). Not thread-safe: one request's task calls it."""

    __slots__ = (
        "_admission_end",
        "_attempts",
        "_ctx",
        "_finish_reasons",
        "_model",
        "_open",
        "_planned",
        "_start_ns",
        "_t",
        "_usage",
        "operation",
        "span",
        "trace_id",
    )

    def __init__(self, t: Tracing, method: str, path: str, request_id: str, parent: Context | None) -> None:
        self._t = t
        self._start_ns = time.time_ns()
        self.operation = OPERATIONS.get(path, "chat")
        attrs = {
            "http.request.method": method,
            "url.path": path,
            "gen_ai.operation.name": self.operation,
            "specgate.request_id": request_id,
        }
        self.span: Span = t.tracer.start_span(
            f"{method} {path}", parent, t.kinds.SERVER, attrs, start_time=self._start_ns
        )
        ctx = self.span.get_span_context()
        self.trace_id = f"{ctx.trace_id:032x}"
        self._ctx = t.in_context(self.span)
        self._admission_end: int | None = None
        self._attempts = 0
        self._open: Span | None = None  # the attempt that answered (ended with the request)
        self._planned: str | None = None
        self._finish_reasons: list[str] = []
        self._usage: dict[str, int] = {}
        self._model: str | None = None

    def request(self, model: Any, temperature: Any, max_tokens: Any, stream: bool) -> None:
        """The client's sampling parameters that the conventions name (never its messages)."""
        span = self.span
        if isinstance(model, str):
            self._model = model[:256]
            span.set_attribute("gen_ai.request.model", self._model)
        if isinstance(temperature, int | float) and not isinstance(temperature, bool):
            span.set_attribute("gen_ai.request.temperature", float(temperature))
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            span.set_attribute("gen_ai.request.max_tokens", max_tokens)
        span.set_attribute("specgate.stream", stream)

    def route(
        self,
        start_ns: int,
        *,
        traffic_class: str,
        task_type: str | None,
        plan: Sequence[str],
        reason: str,
        choice: Any = None,
        expected: Sequence[tuple[str, float]] = (),
    ) -> None:
        """The routing decision, timed from ``start_ns`` to now. ``choice``: the class controller's answer
        (``RouteChoice``) or None; ``expected``: (pool, expected completion seconds) of the last scrape round."""
        attrs: dict[str, Any] = {
            "specgate.class": traffic_class,
            "specgate.plan": list(plan),
            "specgate.route.reason": reason,
        }
        if task_type is not None:
            attrs["specgate.task_type"] = task_type
        if choice is not None:
            attrs["specgate.controller.state"] = choice.state
            attrs["specgate.controller.share"] = float(choice.share)
            attrs["specgate.controller.pick"] = choice.pick
            attrs["specgate.controller.why"] = choice.why
        if expected:
            attrs["specgate.expected.pools"] = [p for p, _ in expected]
            attrs["specgate.expected.seconds"] = [float(s) for _, s in expected]
        self._planned = plan[0] if plan else None
        t = self._t
        t.tracer.start_span("specgate.route", self._ctx, t.kinds.INTERNAL, attrs, start_time=start_ns).end()
        self.span.set_attribute("specgate.class", traffic_class)

    def admitted(self, full: Sequence[str] = (), refused: str | None = None) -> None:
        """The admission span, from arrival to now (the first attempt leaves, or the request is refused)."""
        if self._admission_end is not None:
            return
        self._admission_end = end = time.time_ns()
        attrs: dict[str, Any] = {}
        if full:
            attrs["specgate.admission.full_pools"] = list(full)
        if refused is not None:
            attrs["specgate.admission.refused"] = refused
        t = self._t
        span = t.tracer.start_span("specgate.admission", self._ctx, t.kinds.INTERNAL, attrs, start_time=self._start_ns)
        span.end(end)

    def attempt(self, pool: str, kind: str, endpoint: str, url: str, model: str | None) -> Span:
        """The CLIENT span of an attempt leaving now; its traceparent is ``traceparent(span)``. ``model``: the one
        asked of this pool when not the requested one (a class's fallback model)."""
        self._attempts += 1
        model = model or self._model
        parts = urlsplit(url)
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": self.operation,
            "server.address": parts.hostname or "",
            "specgate.pool": pool,
            "specgate.pool.kind": kind,
            "specgate.endpoint": endpoint,
            "specgate.attempt": self._attempts,
        }
        if parts.port is not None:
            attrs["server.port"] = parts.port
        if model is not None:
            attrs["gen_ai.request.model"] = model[:256]
        t = self._t
        name = f"{self.operation} {model}" if model else self.operation
        return t.tracer.start_span(name, self._ctx, t.kinds.CLIENT, attrs)

    def send_attempt(
        self,
        headers: dict[str, str],
        full: Sequence[str],
        pool: str,
        kind: str,
        endpoint: str,
        url: str,
        model: str | None,
    ) -> Span:
        """An attempt leaves now: the admission span ends at the first one, the attempt's span starts, and its
        ``traceparent`` replaces the client's in ``headers`` (to the pool), so the pool's spans join below it."""
        self.admitted(full)
        span = self.attempt(pool, kind, endpoint, url, model)
        parent, state = self.traceparent(span)
        headers["traceparent"] = parent
        if state is not None:
            headers["tracestate"] = state
        else:
            headers.pop("tracestate", None)
        return span

    def traceparent(self, span: Span) -> tuple[str, str | None]:
        """The W3C ``traceparent`` (and ``tracestate``, None when empty) that puts the pool's spans under ``span``."""
        ctx = span.get_span_context()
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}", state or None

    def attempt_failed(self, span: Span, status: int | None, error_type: str) -> None:
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        span.set_attribute("error.type", error_type)
        span.set_attribute("specgate.committed", False)
        span.set_status(self._t.status(self._t.error_code))
        span.end()

    def attempt_answered(self, span: Span, status: int, ttft_s: float | None) -> None:
        """The attempt the client's answer comes from: it stays open until the request ends."""
        span.set_attribute("http.response.status_code", status)
        if ttft_s is not None:
            span.set_attribute("specgate.ttft_s", ttft_s)
        self._open = span

    def observe(self, data: bytes) -> None:
        """Finish reasons and token usage in a piece of the pool's answer (a whole body, or stream events)."""
        if b'"finish_reason":"' in data or b'"finish_reason": "' in data:
            reasons = self._finish_reasons
            for m in _FINISH.finditer(data):
                if len(reasons) < _MAX_FINISH_REASONS:
                    reasons.append(m.group(1).decode())
        if b"_tokens" in data:
            for m in _USAGE.finditer(data):
                self._usage[_USAGE_KEY[m.group(1)]] = int(m.group(2))

    def finish(
        self,
        *,
        status: int,
        outcome: str,
        pool: str,
        endpoint: str | None,
        attempts: int,
        commit_s: float | None,
        accepted: int | None,
        drafted: int | None,
        idempotency: str | None,
    ) -> None:
        """End the request's spans (once, from ``RequestRecord.finish``)."""
        self.admitted(refused=outcome if attempts == 0 and outcome != "ok" else None)  # ok: an idempotent replay
        span = self.span
        fallback = attempts > 1 or (attempts == 1 and self._planned is not None and pool != self._planned)
        attrs: dict[str, Any] = {
            "specgate.outcome": outcome,
            "specgate.pool": pool,
            "specgate.attempts": attempts,
            "specgate.fallback": fallback,
            "specgate.committed": self._open is not None,
        }
        if status:
            attrs["http.response.status_code"] = status
        if endpoint is not None:
            attrs["specgate.endpoint"] = endpoint
        if commit_s is not None:
            attrs["specgate.commit_s"] = commit_s
        if accepted is not None and drafted is not None:
            attrs["specgate.spec.accepted"] = accepted
            attrs["specgate.spec.drafted"] = drafted
            if drafted > 0:
                attrs["specgate.acceptance"] = accepted / drafted
        if idempotency is not None:
            attrs["specgate.idempotency"] = idempotency
        if self._finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = list(dict.fromkeys(self._finish_reasons))
        attrs.update(self._usage)
        if outcome != "ok":
            attrs["error.type"] = outcome
        span.set_attributes(attrs)
        opened = self._open
        if opened is not None:
            self._open = None
            opened.set_attribute("specgate.committed", True)
            if outcome != "ok":
                opened.set_attribute("error.type", outcome)
            opened.end()
        if outcome in _FAILED:
            span.set_status(self._t.status(self._t.error_code))
        span.end()
