"""The spans of one finished, exported request, written as OTLP protobuf (``otlp_wire``) by the export thread
(``trace_export.Exporter``) from what its ``RequestTrace`` recorded: the server span, admission, route, one CLIENT
span per attempt.

Attributes follow the OpenTelemetry GenAI conventions where they name the fact (``gen_ai.operation.name``,
``gen_ai.request.model``/``temperature``/``max_tokens``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``server.address``, ``error.type``) and ``specgate.*`` where they
do not (acceptance, the commit point, idempotency replay, fallback).

How it stays cheap (it runs in the gateway's process, holding the GIL the event loop needs): a span is one
``bytes.join`` of a few pieces. What repeats from request to request is encoded once per distinct set of values
and kept in the ``Encoder``'s cache: each span's name and kind, and its attribute blocks (pool, class, model, plan,
reason, status, ...), each looked up under one tuple of the values that determine it; the trace's status and flags
fields are constants. Only the ids, the times, the request id and the numbers (durations, token counts) are
encoded for each request. A trace's spans are returned joined, ready to go into an export request.
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
_TIMES = wire.TIMES
# status (when failed) and flags of a child span, and of the server span (its parent remote, or no parent)
_CHILD_OK, _CHILD_FAILED = wire.span_flags(_CHILD_FLAGS, False), wire.span_flags(_CHILD_FLAGS, True)
_ADMISSION = wire.field(0x2A, b"specgate.admission") + bytes((0x30, wire.INTERNAL))  # name and kind
_ROUTE = wire.field(0x2A, b"specgate.route") + bytes((0x30, wire.INTERNAL))
_SERVER_FLAGS = {
    (remote, failed): wire.span_flags(1 | wire.SPAN_FLAGS_HAS_IS_REMOTE | (wire.SPAN_FLAGS_IS_REMOTE if remote else 0),
                                      failed)
    for remote in (False, True)
    for failed in (False, True)
}  # fmt: skip


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


def encode(t: RequestTrace) -> bytes:
    """The request's spans, each a ``ScopeSpans.spans`` field, joined: the server span, admission (when it was
    recorded), route (when decided), one per attempt."""
    e = t.ending
    assert e is not None
    tracing = t.trace
    enc = tracing.encoder
    rnd = tracing.random.getrandbits
    tid = t.tid.to_bytes(16, "big")
    sid = (rnd(64) or 1).to_bytes(8, "big")
    state = wire.field(0x1A, t.state.encode()) if t.state else b""
    head = b"\x0a\x10" + tid
    below = state + b"\x22\x08" + sid  # a child's trace state and parent: the server span
    params = request_params(t)
    parent = b"" if t.parent_id is None else b"\x22\x08" + t.parent_id
    out = [
        wire.span_field(
            b"".join((head, b"\x12\x08", sid, state, parent, enc.name_kind(f"{t.method} {t.path}", wire.SERVER),
                      _TIMES.pack(0x39, t.start_ns, 0x41, e.end_ns), _server_attrs(t, e, enc, params),
                      _SERVER_FLAGS[t.parent_id is not None, e.failed]))
        )
    ]  # fmt: skip
    if t.admission is not None:
        adm_end, full, refused = t.admission
        attrs = b"" if not full and refused is None else enc.block(("admission", full, refused), _admission, full,
                                                                    refused)  # fmt: skip
        out.append(
            wire.span_field(
                b"".join((head, b"\x12\x08", (rnd(64) or 1).to_bytes(8, "big"), below,
                          _ADMISSION,
                          _TIMES.pack(0x39, t.start_ns, 0x41, adm_end), attrs, _CHILD_OK))
            )
        )  # fmt: skip
    if t.route_facts is not None:
        start_ns, end_ns = t.route_facts[0], t.route_facts[1]
        out.append(
            wire.span_field(
                b"".join((head, b"\x12\x08", (rnd(64) or 1).to_bytes(8, "big"), below,
                          _ROUTE, _TIMES.pack(0x39, start_ns, 0x41, end_ns),
                          _route_attrs(t, enc), _CHILD_OK))
            )
        )  # fmt: skip
    model = params[0]
    operation = t.operation
    for at in t.attempts:
        m = at.model or model
        key = ("attempt", operation, at.url, at.pool, at.kind, at.endpoint, at.number, at.committed, m,
               at.status, at.error_type)  # fmt: skip
        name_kind, attrs = enc.pair(key, _attempt, operation, at, m)
        out.append(
            wire.span_field(
                b"".join((head, b"\x12\x08", at.span_id.to_bytes(8, "big"), below, name_kind,
                          _TIMES.pack(0x39, at.start_ns, 0x41, at.end_ns or e.end_ns), attrs,
                          b"" if at.ttft_s is None else enc.number("specgate.ttft_s", float(at.ttft_s)),
                          _CHILD_OK if at.committed else _CHILD_FAILED))
            )
        )  # fmt: skip
    return b"".join(out)


def _ending(e: Ending, committed: bool) -> list[tuple[str, Any]]:
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


def _request(t: RequestTrace, params: tuple[Any, ...]) -> list[tuple[str, Any]]:
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


def _server_attrs(t: RequestTrace, e: Ending, enc: wire.Encoder, params: tuple[Any, ...]) -> bytes:
    committed = t.answered is not None
    key = ("server", e.outcome, e.pool, e.attempts, e.fallback, committed, e.status, e.endpoint, e.idempotency,
           e.finish_reasons, t.method, t.path, params, t.traffic_class)  # fmt: skip
    parts = [enc.block(key, _server, t, e, committed, params), enc.string("specgate.request_id", t.request_id)]
    if e.commit_s is not None:
        parts.append(enc.number("specgate.commit_s", float(e.commit_s)))
    if e.accepted is not None and e.drafted is not None:
        parts += (enc.number("specgate.spec.accepted", e.accepted), enc.number("specgate.spec.drafted", e.drafted))
        if e.drafted > 0:
            parts.append(enc.number("specgate.acceptance", e.accepted / e.drafted))
    if e.usage:
        for k, v in e.usage.items():
            parts.append(enc.number(k, v))
    return b"".join(parts)


def _server(t: RequestTrace, e: Ending, committed: bool, params: tuple[Any, ...]) -> list[tuple[str, Any]]:
    return _ending(e, committed) + _request(t, params)


def _admission(full: Any, refused: str | None) -> list[tuple[str, Any]]:
    a: list[tuple[str, Any]] = [("specgate.admission.full_pools", list(full))] if full else []
    return a if refused is None else [*a, ("specgate.admission.refused", refused)]


def _route_attrs(t: RequestTrace, enc: wire.Encoder) -> bytes:
    assert t.route_facts is not None
    _, _, task_type, plan, reason, choice = t.route_facts
    expected = () if callable(t.expected) else tuple(t.expected)
    cls = t.traffic_class or ""
    facts = None if choice is None else (str(choice.state), float(choice.share), str(choice.pick), str(choice.why))
    key = ("route", cls, tuple(plan), reason, task_type, facts, expected)
    return enc.block(key, _route, cls, plan, reason, task_type, facts, expected)


def _route(cls: str, plan: Any, reason: str, task_type: str | None, facts: Any, expected: Any) -> list[Any]:
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


def _attempt(operation: str, at: Attempt, model: str | None) -> tuple[str, int, list[tuple[str, Any]]]:
    """The attempt span's name, kind and attributes (``Encoder.pair``)."""
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
    return (f"{operation} {model}" if model else operation), wire.CLIENT, a
