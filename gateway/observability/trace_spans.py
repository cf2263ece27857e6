"""The spans of one finished, exported request, written as OTLP protobuf (``otlp_wire``) by the export thread
(``trace_export.Exporter``) from what its ``RequestTrace`` recorded: the server span, admission, route, one CLIENT
span per attempt.

Attributes follow the OpenTelemetry GenAI conventions where they name the fact (``gen_ai.operation.name``,
``gen_ai.request.model``/``temperature``/``max_tokens``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``server.address``, ``error.type``) and ``specgate.*`` where they
do not (acceptance, the commit point, idempotency replay, fallback). Attributes that repeat from request to request
are encoded once per distinct set of values (``Encoder.block``); ids, times and counts each time.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from gateway.observability import otlp_wire as wire

# ``tracing.RequestTrace``, its ``Attempt`` and ``Ending``: read here by attribute only. ``tracing`` imports this
# module, so naming its classes here (even for type checking) would make the two a cycle.
RequestTrace = Any
Attempt = Any
Ending = Any

_CONTROLLER_KEYS = ("specgate.controller.state", "specgate.controller.share", "specgate.controller.pick",
                    "specgate.controller.why")  # fmt: skip
_CHILD_FLAGS = wire.SPAN_FLAGS_HAS_IS_REMOTE | 1


def request_params(t: RequestTrace) -> tuple[str | None, float | None, int | None, bool | None]:
    """(model, temperature, max_tokens, stream) as the client sent them, when of the right type."""
    if t.params is None:
        return None, None, None, None
    model, temperature, max_tokens, stream = t.params
    return (
        model[:256] if isinstance(model, str) else None,
        float(temperature) if isinstance(temperature, int | float) and not isinstance(temperature, bool) else None,
        max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) else None,
        stream,
    )


def encode(t: RequestTrace) -> list[bytes]:
    """The request's spans, each a ``ScopeSpans.spans`` field (``otlp_wire.span``)."""
    e = t.ending
    assert e is not None
    tracing = t.trace
    enc = tracing.encoder
    tid = t.tid.to_bytes(16, "big")
    sid = tracing.span_id().to_bytes(8, "big")
    state = t.state.encode() if t.state else b""
    params = request_params(t)
    attrs = _server_attrs(t, e, enc, params)
    flags = 1 | wire.SPAN_FLAGS_HAS_IS_REMOTE | (wire.SPAN_FLAGS_IS_REMOTE if t.parent_id else 0)
    name = enc.name(f"{t.method} {t.path}")
    spans = [wire.span(tid, sid, t.parent_id, name, wire.SERVER, t.start_ns, e.end_ns, attrs, error=e.failed,
                       trace_state=state, flags=flags)]  # fmt: skip
    if t.admission is not None:
        spans.append(_admission_span(t, tid, sid, state, t.admission))
    if t.route_facts is not None:
        spans.append(_route_span(t, tid, sid, state))
    for at in t.attempts:
        spans.append(_attempt_span(t, at, tid, sid, state, e.end_ns, params[0]))
    return spans


def _server_attrs(t: RequestTrace, e: Ending, enc: wire.Encoder, params: tuple[Any, ...]) -> bytes:
    committed = t.answered is not None
    key = ("end", e.outcome, e.pool, e.attempts, e.fallback, committed, e.status, e.endpoint, e.idempotency,
           e.finish_reasons)  # fmt: skip

    def ending() -> list[tuple[str, Any]]:
        a: list[tuple[str, Any]] = [
            ("specgate.outcome", e.outcome),
            ("specgate.pool", e.pool),
            ("specgate.attempts", e.attempts),
            ("specgate.fallback", e.fallback),
            ("specgate.committed", committed),
        ]
        if e.status:
            a.append(("http.response.status_code", e.status))
        if e.endpoint is not None:
            a.append(("specgate.endpoint", e.endpoint))
        if e.idempotency is not None:
            a.append(("specgate.idempotency", e.idempotency))
        if e.finish_reasons:
            a.append(("gen_ai.response.finish_reasons", list(e.finish_reasons)))
        if e.outcome != "ok":
            a.append(("error.type", e.outcome))
        return a

    def request() -> list[tuple[str, Any]]:
        model, temperature, max_tokens, stream = params
        a: list[tuple[str, Any]] = [
            ("http.request.method", t.method),
            ("url.path", t.path),
            ("gen_ai.operation.name", t.operation),
        ]
        if model is not None:
            a.append(("gen_ai.request.model", model))
        if temperature is not None:
            a.append(("gen_ai.request.temperature", temperature))
        if max_tokens is not None:
            a.append(("gen_ai.request.max_tokens", max_tokens))
        if stream is not None:
            a.append(("specgate.stream", stream))
        if t.traffic_class is not None:
            a.append(("specgate.class", t.traffic_class))
        return a

    parts = [
        enc.block(key, ending),
        enc.block(("server", t.method, t.path, params, t.traffic_class), request),
        enc.string("specgate.request_id", t.request_id),
    ]
    if e.commit_s is not None:
        parts.append(enc.number("specgate.commit_s", float(e.commit_s)))
    if e.accepted is not None and e.drafted is not None:
        parts += (enc.number("specgate.spec.accepted", e.accepted), enc.number("specgate.spec.drafted", e.drafted))
        if e.drafted > 0:
            parts.append(enc.number("specgate.acceptance", e.accepted / e.drafted))
    for k, v in (e.usage or {}).items():
        parts.append(enc.number(k, v))
    return b"".join(parts)


def _admission_span(t: RequestTrace, tid: bytes, sid: bytes, state: bytes, adm: tuple[Any, ...]) -> bytes:
    enc = t.trace.encoder
    adm_end, full, refused = adm
    attrs = b""
    if full or refused is not None:

        def admission() -> list[tuple[str, Any]]:
            a: list[tuple[str, Any]] = [("specgate.admission.full_pools", list(full))] if full else []
            return a if refused is None else [*a, ("specgate.admission.refused", refused)]

        attrs = enc.block(("admission", full, refused), admission)
    return wire.span(tid, t.trace.span_id().to_bytes(8, "big"), sid, enc.name("specgate.admission"), wire.INTERNAL,
                     t.start_ns, adm_end, attrs, trace_state=state, flags=_CHILD_FLAGS)  # fmt: skip


def _route_span(t: RequestTrace, tid: bytes, sid: bytes, state: bytes) -> bytes:
    assert t.route_facts is not None
    enc = t.trace.encoder
    start_ns, end_ns, task_type, plan, reason, choice = t.route_facts
    expected = () if callable(t.expected) else tuple(t.expected)
    cls = t.traffic_class or ""
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

    attrs = enc.block(("route", cls, tuple(plan), reason, task_type, facts, expected), items)
    return wire.span(tid, t.trace.span_id().to_bytes(8, "big"), sid, enc.name("specgate.route"), wire.INTERNAL,
                     start_ns, end_ns, attrs, trace_state=state, flags=_CHILD_FLAGS)  # fmt: skip


def _attempt_span(
    t: RequestTrace, at: Attempt, tid: bytes, sid: bytes, state: bytes, end_ns: int, requested: str | None
) -> bytes:
    enc = t.trace.encoder
    operation = t.operation
    model = at.model or requested

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
                     attrs, error=not at.committed, trace_state=state, flags=_CHILD_FLAGS)  # fmt: skip
