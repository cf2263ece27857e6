"""OpenTelemetry traces of the proxied requests (``specgate serve --tracing``; the ``tracing`` extra).

Off by default, and then nothing of this runs: the request path checks one ``None`` (``RequestRecord.trace``) and
neither this module's exporter nor gRPC is imported. On, ``Tracing`` (one per process, built by the runtime)
starts a ``RequestTrace`` per proxied request, which the request path calls at a few points; the trace it becomes::

    POST /v1/chat/completions   SERVER    the client's traceparent/tracestate continued, or a new trace
    ├── specgate.admission      INTERNAL  arrival → the first attempt: body read, decision, Idempotency-Key,
    │                                     admission control (the pools that admitted no more)
    ├── specgate.route          INTERNAL  the routing decision: class, task type, plan, reason, controller
    │                                     state/share/why, expected completion time per pool (explain's facts)
    ├── chat <model>            CLIENT    one per upstream attempt: pool, endpoint, status, error.type, TTFT,
    │   └── llm_request                   committed; vLLM's own span joins below it (the attempt's traceparent)
    └── chat <model>            CLIENT    the next attempt after a failure before the commit point

How it stays cheap: while the request runs, ``RequestTrace`` keeps timestamps and references in its slots (the ids
are drawn at once, so a pool's ``traceparent`` names the attempt span written later); at the end its spans are
encoded straight to OTLP protobuf (``otlp_wire``) only when exported (head sample or tail decision,
``trace_export``), and a thread sends them in batches. Any other request builds no span at all.

Attributes follow the OpenTelemetry GenAI conventions where they name the fact (``gen_ai.operation.name``,
``gen_ai.request.model``/``temperature``/``max_tokens``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``server.address``, ``error.type``) and ``specgate.*`` where they
do not (acceptance, the commit point, idempotency replay, fallback). No prompt or completion text is ever put in a
span: finish reasons and token counts are read from the pool's answer by a pattern that only matches the JSON
keys, and error messages (which may quote a pool's answer) stay in the access log; spans carry ``error.type``.
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gateway.observability import otlp_wire as wire

if TYPE_CHECKING:
    from gateway.observability.trace_export import Exporter, HeadSampler

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
_USAGE_WINDOW = 512  # bytes after the "usage" key that hold its token counts
# The W3C traceparent, as the OpenTelemetry propagator reads it (a future version may add fields after the flags).
_TRACEPARENT = re.compile(r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$")
_TRACESTATE = re.compile(r"^[\x20-\x7e]{1,512}$")  # bounded and printable; passed on as it came
_MAX_ATTEMPTS_KEPT = 64
_CONTROLLER_KEYS = ("specgate.controller.state", "specgate.controller.share", "specgate.controller.pick",
                    "specgate.controller.why")  # fmt: skip


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the packages it needs (gRPC, the ``tracing`` extra) are not installed."""


class Tracing:
    """The process's tracing: the head sampler and the exporter set up from the ``OTEL_*`` variables
    (``trace_export``). ``send`` replaces the OTLP/gRPC call with a function of the encoded
    ``ExportTraceServiceRequest`` (tests)."""

    def __init__(self, env: Mapping[str, str] | None = None, send: Callable[[bytes], None] | None = None) -> None:
        try:
            from gateway.observability import trace_export

            if send is None:
                import grpc  # noqa: F401
        except ImportError as exc:
            raise TracingUnavailable(f"tracing needs gRPC: pip install 'specgate[tracing]' ({exc})") from exc
        environ = os.environ if env is None else env
        self.sampler: HeadSampler = trace_export.head_sampler(environ)
        self.exporter: Exporter = trace_export.Exporter(trace_export.ExportConfig.from_env(environ), send)
        self.encoder = wire.Encoder()
        self.random = random.Random()

    def start(
        self, method: str, path: str, request_id: str, traceparent: str | None, tracestate: str | None
    ) -> RequestTrace:
        """The trace of a request that arrived now, continuing the client's trace when it sent a valid one."""
        parent_id: bytes | None = None
        parent_sampled: bool | None = None
        state = ""
        trace_id = 0
        if traceparent is not None:
            m = _TRACEPARENT.match(traceparent)
            if m is not None and m.group(1) != "ff" and not (m.group(1) == "00" and m.group(5)):
                tid, sid = int(m.group(2), 16), int(m.group(3), 16)
                if tid and sid:
                    trace_id, parent_id = tid, sid.to_bytes(8, "big")
                    parent_sampled = bool(int(m.group(4), 16) & 1)
                    if tracestate is not None and _TRACESTATE.match(tracestate):
                        state = tracestate.strip()
        if not trace_id:
            trace_id = self.random.getrandbits(128) or 1
        h = self.sampler
        if h.parent_based and parent_sampled is not None:
            sampled = parent_sampled
        else:
            sampled = (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < h.bound
        return RequestTrace(self, method, path, request_id, trace_id, parent_id, state, sampled)

    def span_id(self) -> int:
        return self.random.getrandbits(64) or 1

    def flush(self) -> None:
        """Send what is queued now (tests)."""
        self.exporter.flush()

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop."""
        self.exporter.shutdown()


class Attempt:
    """One upstream attempt, recorded; its CLIENT span is written when the request ends."""

    __slots__ = (
        "committed",
        "end_ns",
        "endpoint",
        "error_type",
        "kind",
        "model",
        "number",
        "pool",
        "span_id",
        "start_ns",
        "status",
        "ttft_s",
        "url",
    )

    def __init__(
        self, span_id: int, number: int, pool: str, kind: str, endpoint: str, url: str, model: str | None
    ) -> None:
        self.span_id = span_id
        self.number = number
        self.pool, self.kind, self.endpoint, self.url, self.model = pool, kind, endpoint, url, model
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.status: int | None = None
        self.error_type: str | None = None
        self.ttft_s: float | None = None
        self.committed = False


class RequestTrace:
    """What one request's spans will say (module docstring). Not thread-safe: one request's task calls it."""

    __slots__ = (
        "_admission",
        "_attempts",
        "_finish_reasons",
        "_open",
        "_params",
        "_parent_id",
        "_planned",
        "_route",
        "_server_id",
        "_start_ns",
        "_state",
        "_t",
        "_trace_id",
        "_usage",
        "method",
        "operation",
        "path",
        "request_id",
        "sampled",
        "trace_id",
        "traffic_class",
    )

    def __init__(
        self,
        t: Tracing,
        method: str,
        path: str,
        request_id: str,
        trace_id: int,
        parent_id: bytes | None,
        state: str,
        sampled: bool,
    ) -> None:
        self._t = t
        self._start_ns = time.time_ns()
        self.method, self.path, self.request_id = method, path, request_id
        self.operation = OPERATIONS.get(path, "chat")
        self._trace_id = trace_id
        self.trace_id = f"{trace_id:032x}"
        self._parent_id = parent_id
        self._state = state
        self.sampled = sampled
        self._admission: tuple[int, Sequence[str], str | None] | None = None
        self._route: tuple[Any, ...] | None = None
        self._attempts: list[Attempt] = []
        self._open: Attempt | None = None  # the attempt that answered (ended with the request)
        self._planned: str | None = None
        self._finish_reasons: list[str] | None = None
        self._usage: dict[str, int] | None = None
        self._params: tuple[Any, Any, Any, bool] | None = None
        self.traffic_class: str | None = None

    def request(self, model: Any, temperature: Any, max_tokens: Any, stream: bool) -> None:
        """The client's sampling parameters that the conventions name (never its messages); checked when the
        spans are written (``_server_items``)."""
        self._params = (model, temperature, max_tokens, stream)

    def _request_params(self) -> tuple[str | None, float | None, int | None, bool | None]:
        """(model, temperature, max_tokens, stream) as the client sent them, when of the right type."""
        if self._params is None:
            return None, None, None, None
        model, temperature, max_tokens, stream = self._params
        return (
            model[:256] if isinstance(model, str) else None,
            float(temperature) if isinstance(temperature, int | float) and not isinstance(temperature, bool) else None,
            max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else None,
            stream,
        )

    def route(
        self,
        start_ns: int,
        *,
        traffic_class: str,
        task_type: str | None,
        plan: Sequence[str],
        reason: str,
        choice: Any = None,
        expected: Sequence[tuple[str, float]] | Callable[[str], Sequence[tuple[str, float]]] = (),
    ) -> None:
        """The routing decision, timed from ``start_ns`` to now. ``choice``: the class controller's answer
        (``RouteChoice``) or None; ``expected``: (pool, expected completion seconds) of the last scrape round, or
        what gives them for the class (asked now only when the spans will be written: the head sample said so)."""
        if callable(expected):
            expected = expected(traffic_class) if self.sampled else expected
        self._route = (start_ns, time.time_ns(), task_type, plan, reason, choice, expected)
        self._planned = plan[0] if plan else None
        self.traffic_class = traffic_class

    def admitted(self, full: Sequence[str] = (), refused: str | None = None) -> None:
        """The admission span ends now (the first attempt leaves, or the request is refused)."""
        if self._admission is None:
            self._admission = (time.time_ns(), tuple(full), refused)

    def send_attempt(
        self,
        headers: dict[str, str],
        full: Sequence[str],
        pool: str,
        kind: str,
        endpoint: str,
        url: str,
        model: str | None,
    ) -> Attempt:
        """An attempt leaves now: the admission span ends at the first one, the attempt's span starts, and its
        ``traceparent`` replaces the client's in ``headers`` (to the pool), so the pool's spans join below it.
        ``model``: the one asked of this pool when not the requested one (a class's fallback model)."""
        if self._admission is None:
            self._admission = (time.time_ns(), tuple(full), None)
        span_id = self._t.random.getrandbits(64) or 1
        attempt = Attempt(span_id, len(self._attempts) + 1, pool, kind, endpoint, url, model)
        if len(self._attempts) < _MAX_ATTEMPTS_KEPT:
            self._attempts.append(attempt)
        headers["traceparent"] = f"00-{self.trace_id}-{span_id:016x}-{'01' if self.sampled else '00'}"
        if self._state:
            headers["tracestate"] = self._state
        else:
            headers.pop("tracestate", None)
        return attempt

    def attempt_failed(self, attempt: Attempt, status: int | None, error_type: str) -> None:
        attempt.end_ns = time.time_ns()
        attempt.status = status
        attempt.error_type = error_type

    def attempt_answered(self, attempt: Attempt, status: int, ttft_s: float | None) -> None:
        """The attempt the client's answer comes from: it stays open until the request ends."""
        attempt.status = status
        attempt.ttft_s = ttft_s
        self._open = attempt

    def observe(self, data: bytes) -> None:
        """Finish reasons and token usage in a piece of the pool's answer (a whole body, or stream events)."""
        if b'"finish_reason":"' in data or b'"finish_reason": "' in data:
            reasons = self._finish_reasons
            if reasons is None:
                reasons = self._finish_reasons = []
            for m in _FINISH.finditer(data):
                if len(reasons) < _MAX_FINISH_REASONS:
                    reasons.append(m.group(1).decode())
        at = data.rfind(b'"usage"')  # a quote inside a JSON string is escaped: only the key matches
        if at >= 0 and data.find(b"_tokens", at, at + _USAGE_WINDOW) >= 0:  # not "usage":null
            usage = self._usage
            if usage is None:
                usage = self._usage = {}
            for m in _USAGE.finditer(data, at, at + _USAGE_WINDOW):
                usage[_USAGE_KEY[m.group(1)]] = int(m.group(2))

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
    ) -> bool:
        """The request ended (once, from ``RequestRecord.finish``): its spans are written and queued for export
        when the head sample or the tail decision keeps them (True); otherwise nothing more happens (False)."""
        end_ns = time.time_ns()
        failed = outcome in _FAILED
        fallback = attempts > 1 or (attempts == 1 and self._planned is not None and pool != self._planned)
        if not (self.sampled or failed or fallback):
            return False
        if self._admission is None:  # refused before any attempt (or an idempotent replay: ok)
            self._admission = (end_ns, (), outcome if attempts == 0 and outcome != "ok" else None)
        opened = self._open
        if opened is not None:
            opened.end_ns = end_ns
            opened.committed = True
            if outcome != "ok":
                opened.error_type = outcome
        enc = self._t.encoder
        reasons = tuple(dict.fromkeys(self._finish_reasons)) if self._finish_reasons else ()
        key = ("end", outcome, pool, attempts, fallback, opened is not None, status, endpoint, idempotency, reasons)

        def items() -> list[tuple[str, Any]]:
            a: list[tuple[str, Any]] = [
                ("specgate.outcome", outcome),
                ("specgate.pool", pool),
                ("specgate.attempts", attempts),
                ("specgate.fallback", fallback),
                ("specgate.committed", opened is not None),
            ]
            if status:
                a.append(("http.response.status_code", status))
            if endpoint is not None:
                a.append(("specgate.endpoint", endpoint))
            if idempotency is not None:
                a.append(("specgate.idempotency", idempotency))
            if reasons:
                a.append(("gen_ai.response.finish_reasons", list(reasons)))
            if outcome != "ok":
                a.append(("error.type", outcome))
            return a

        server = [enc.block(key, items), enc.string("specgate.request_id", self.request_id)]
        if commit_s is not None:
            server.append(enc.number("specgate.commit_s", float(commit_s)))
        if accepted is not None and drafted is not None:
            server += (enc.number("specgate.spec.accepted", accepted), enc.number("specgate.spec.drafted", drafted))
            if drafted > 0:
                server.append(enc.number("specgate.acceptance", accepted / drafted))
        for k, v in (self._usage or {}).items():
            server.append(enc.number(k, v))
        self._t.exporter.submit(self._spans(server, end_ns, failed))
        return True

    def _spans(self, server: list[bytes], end_ns: int, failed: bool) -> list[bytes]:
        """The request's spans, OTLP-encoded: server, admission, route, one per attempt. ``server``: the server
        span's attributes from the end of the request."""
        t = self._t
        enc = t.encoder
        tid = self._trace_id.to_bytes(16, "big")
        sid = t.span_id().to_bytes(8, "big")
        state = self._state.encode() if self._state else b""
        child_flags = wire.SPAN_FLAGS_HAS_IS_REMOTE | 1
        params = self._request_params()
        server.append(enc.block(("server", self.method, self.path, params, self.traffic_class), self._server_items))
        flags = 1 | wire.SPAN_FLAGS_HAS_IS_REMOTE | (wire.SPAN_FLAGS_IS_REMOTE if self._parent_id else 0)
        name = enc.name(f"{self.method} {self.path}")
        spans = [
            wire.span(tid, sid, self._parent_id, name, wire.SERVER, self._start_ns, end_ns, b"".join(server),
                      error=failed, trace_state=state, flags=flags)
        ]  # fmt: skip
        if self._admission is not None:
            adm_end, full, refused = self._admission
            attrs = b""
            if full or refused is not None:

                def admission() -> list[tuple[str, Any]]:
                    a: list[tuple[str, Any]] = [("specgate.admission.full_pools", list(full))] if full else []
                    return a if refused is None else [*a, ("specgate.admission.refused", refused)]

                attrs = enc.block(("admission", full, refused), admission)
            spans.append(
                wire.span(tid, t.span_id().to_bytes(8, "big"), sid, enc.name("specgate.admission"), wire.INTERNAL,
                          self._start_ns, adm_end, attrs, trace_state=state, flags=child_flags)
            )  # fmt: skip
        if self._route is not None:
            spans.append(self._route_span(tid, sid, state, child_flags))
        for at in self._attempts:
            spans.append(self._attempt_span(at, tid, sid, state, child_flags, end_ns))
        return spans

    def _server_items(self) -> list[tuple[str, Any]]:
        """The server span's attributes known before the request ends (one ``Encoder.block``)."""
        a: list[tuple[str, Any]] = [
            ("http.request.method", self.method),
            ("url.path", self.path),
            ("gen_ai.operation.name", self.operation),
        ]
        model, temperature, max_tokens, stream = self._request_params()
        if model is not None:
            a.append(("gen_ai.request.model", model))
        if temperature is not None:
            a.append(("gen_ai.request.temperature", temperature))
        if max_tokens is not None:
            a.append(("gen_ai.request.max_tokens", max_tokens))
        if stream is not None:
            a.append(("specgate.stream", stream))
        if self.traffic_class is not None:
            a.append(("specgate.class", self.traffic_class))
        return a

    def _route_span(self, tid: bytes, sid: bytes, state: bytes, flags: int) -> bytes:
        assert self._route is not None
        t = self._t
        start_ns, end_ns, task_type, plan, reason, choice, expected = self._route
        if callable(expected):  # not asked when the request arrived (not head-sampled): the latest round's
            expected = expected(self.traffic_class or "")
        cls = self.traffic_class or ""
        facts = None if choice is None else (str(choice.state), float(choice.share), str(choice.pick), str(choice.why))

        def items() -> list[tuple[str, Any]]:
            a: list[tuple[str, Any]] = [
                ("specgate.class", cls),
                ("specgate.plan", list(plan)),
                ("specgate.route.reason", reason),
            ]
            if task_type is not None:
                a.append(("specgate.task_type", task_type))
            if facts is not None:
                a += zip(_CONTROLLER_KEYS, facts, strict=True)
            if expected:
                a.append(("specgate.expected.pools", [p for p, _ in expected]))
                a.append(("specgate.expected.seconds", [float(s) for _, s in expected]))
            return a

        attrs = t.encoder.block(("route", cls, tuple(plan), reason, task_type, facts, tuple(expected)), items)
        return wire.span(tid, t.span_id().to_bytes(8, "big"), sid, t.encoder.name("specgate.route"), wire.INTERNAL,
                         start_ns, end_ns, attrs, trace_state=state, flags=flags)  # fmt: skip

    def _attempt_span(self, at: Attempt, tid: bytes, sid: bytes, state: bytes, flags: int, end_ns: int) -> bytes:
        enc = self._t.encoder
        operation = self.operation
        model = at.model or self._request_params()[0]

        def items() -> list[tuple[str, Any]]:
            parts = urlsplit(at.url)
            try:
                port = parts.port
            except ValueError:
                port = None
            a: list[tuple[str, Any]] = [
                ("gen_ai.operation.name", operation),
                ("server.address", parts.hostname or ""),
                ("specgate.pool", at.pool),
                ("specgate.pool.kind", at.kind),
                ("specgate.endpoint", at.endpoint),
                ("specgate.attempt", at.number),
                ("specgate.committed", at.committed),
            ]
            if port is not None:
                a.append(("server.port", port))
            if model is not None:
                a.append(("gen_ai.request.model", model[:256]))
            if at.status is not None:
                a.append(("http.response.status_code", at.status))
            if at.error_type is not None:
                a.append(("error.type", at.error_type))
            return a

        key = ("attempt", operation, at.url, at.pool, at.kind, at.endpoint, at.number, at.committed, model,
               at.status, at.error_type)  # fmt: skip
        attrs = enc.block(key, items)
        if at.ttft_s is not None:
            attrs += enc.number("specgate.ttft_s", float(at.ttft_s))
        name = enc.name(f"{operation} {model}" if model else operation)
        return wire.span(tid, at.span_id.to_bytes(8, "big"), sid, name, wire.CLIENT, at.start_ns, at.end_ns or end_ns,
                         attrs, error=not at.committed, trace_state=state, flags=flags)  # fmt: skip
