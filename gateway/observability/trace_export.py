"""Where the gateway's spans go, and which ones: the OpenTelemetry SDK set up from the standard ``OTEL_*`` variables,
with a tail decision that keeps failed and fallen-back requests whatever the head sample said.

Imported only when tracing is on (``gateway.observability.tracing.Tracing``): this module imports OpenTelemetry.

Sampling. ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` choose the head sampler as the SDK would
(``always_on``, ``always_off``, ``traceidratio``, ``parentbased_always_on``, ``parentbased_always_off``,
``parentbased_traceidratio``); unset, it is ``parentbased_traceidratio`` with the ratio ``OTEL_TRACES_SAMPLER_ARG``
(default 1.0): a client's sampled flag is followed, a new trace is kept with that chance.

The tail decision (``KeepFailed`` + ``TailProcessor``): a span the head sampler drops is recorded anyway (not
sampled: its ``traceparent`` says ``-00``, so the pools do not trace it), and held in memory until the request's
server span ends. When that span says the request failed (status ERROR) or fell back (``specgate.fallback``), the
held spans are exported as if sampled; otherwise they are dropped. The cost: every request builds its spans
whatever the ratio (a few microseconds each), and the gateway's spans of a trace kept this way have no vLLM span
below them (vLLM saw an unsampled ``traceparent``). At most ``MAX_HELD_TRACES`` traces are held; past it the
oldest are dropped.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import StatusCode
from opentelemetry.util.types import Attributes

FALLBACK_ATTR = "specgate.fallback"
MAX_HELD_TRACES = 10_000  # unsampled traces waiting for their server span's end (the tail decision)
DEFAULT_SERVICE_NAME = "specgate"


class TracingConfigError(ValueError):
    """An ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` the gateway cannot use; the message names it."""


def head_sampler(env: Mapping[str, str]) -> Sampler:
    """The head sampler the ``OTEL_TRACES_SAMPLER*`` variables ask for (default: parent-based, ratio 1.0)."""
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_traceidratio").strip().lower()
    raw = (env.get("OTEL_TRACES_SAMPLER_ARG") or "").strip()
    ratio = 1.0
    if raw and name.endswith("traceidratio"):
        try:
            ratio = float(raw)
        except ValueError:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: expected a ratio in 0..1") from None
        if not 0.0 <= ratio <= 1.0:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: expected a ratio in 0..1")
    samplers: dict[str, Sampler] = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "traceidratio": TraceIdRatioBased(ratio),
        "parentbased_always_on": ParentBased(ALWAYS_ON),
        "parentbased_always_off": ParentBased(ALWAYS_OFF),
        "parentbased_traceidratio": ParentBased(TraceIdRatioBased(ratio)),
    }
    if name not in samplers:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={name!r}: expected one of {', '.join(samplers)}")
    return samplers[name]


class KeepFailed(Sampler):
    """The head sampler's decision, except that a dropped span is recorded (not sampled) for the tail decision."""

    def __init__(self, head: Sampler) -> None:
        self.head = head

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        result = self.head.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
        if result.decision is Decision.DROP:  # a dropped span's result has no attributes: the span's own ones
            return SamplingResult(Decision.RECORD_ONLY, attributes, result.trace_state)
        return result

    def get_description(self) -> str:
        return f"KeepFailed{{{self.head.get_description()}}}"


def _sampled(span: ReadableSpan) -> ReadableSpan:
    """The same span with the sampled flag set: exporters send only sampled spans."""
    ctx = span.context
    assert ctx is not None
    flagged = SpanContext(ctx.trace_id, ctx.span_id, False, TraceFlags(TraceFlags.SAMPLED), ctx.trace_state)
    return ReadableSpan(
        name=span.name,
        context=flagged,
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class TailProcessor(SpanProcessor):
    """Sampled spans go straight to ``inner``; recorded-only ones wait for their local root span (the request's
    server span) and go to ``inner`` only when it failed or fell back (module docstring)."""

    def __init__(self, inner: SpanProcessor, max_held: int = MAX_HELD_TRACES) -> None:
        self.inner = inner
        self.max_held = max_held
        self._held: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self._lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        ctx = span.context
        if ctx is None:
            return
        if ctx.trace_flags.sampled:
            self.inner.on_end(span)
            return
        parent = span.parent
        if parent is not None and not parent.is_remote:  # a child: held until the root decides
            with self._lock:
                held = self._held.get(ctx.trace_id)
                if held is None:
                    held = self._held[ctx.trace_id] = []
                    while len(self._held) > self.max_held:
                        self._held.popitem(last=False)
                held.append(span)
            return
        with self._lock:
            children = self._held.pop(ctx.trace_id, [])
        attrs = span.attributes or {}
        if span.status.status_code is StatusCode.ERROR or attrs.get(FALLBACK_ATTR) is True:
            for s in (*children, span):
                self.inner.on_end(_sampled(s))

    @property
    def held(self) -> int:
        """Traces waiting for their tail decision (tests, memory)."""
        return len(self._held)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def build_provider(env: Mapping[str, str] | None = None, exporter: SpanExporter | None = None) -> TracerProvider:
    """A private tracer provider (never the process-global one): the sampler of ``env``, a resource whose
    ``service.name`` is ``OTEL_SERVICE_NAME`` (default ``specgate``), and a batch exporter, OTLP over gRPC to
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) unless ``exporter`` is given.
    Raises ``TracingConfigError``."""
    environ = os.environ if env is None else env
    sampler = KeepFailed(head_sampler(environ))
    attrs = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": DEFAULT_SERVICE_NAME}
    provider = TracerProvider(sampler=sampler, resource=Resource.create(attrs))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider.add_span_processor(TailProcessor(BatchSpanProcessor(exporter)))
    return provider
