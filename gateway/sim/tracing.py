"""The simulator's OpenTelemetry span per request, as ``vllm serve --otlp-traces-endpoint`` exports it.

vLLM (V1 engine) ends every finished request with one SERVER span named ``llm_request``, started at the request's
arrival, a child of the ``traceparent``/``tracestate`` the request came with (else a new trace), sampled by the
SDK's default (parent-based always-on, or ``OTEL_TRACES_SAMPLER``), exported over OTLP gRPC. Its attributes are
``gen_ai.*`` names, the latencies in seconds:

    gen_ai.request.id, gen_ai.response.model, gen_ai.request.temperature / top_p / max_tokens / n,
    gen_ai.usage.prompt_tokens / completion_tokens / num_sequences,
    gen_ai.latency.time_in_queue / time_to_first_token / e2e / time_in_model_prefill / time_in_model_decode /
    time_in_model_inference

The simulator reports the same, from its engine's timestamps: simulated seconds (equal to wall seconds at
``--time-scale 1``), while the span's own start and end are wall-clock times. OpenTelemetry is imported only when
the simulator is given an endpoint (the ``tracing`` extra). No prompt or completion text is exported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.sim.parsing import SimRequest
from gateway.sim.sequence import Generation

TRACE_HEADERS = ("traceparent", "tracestate")


class SimTracer:
    """The OTLP exporter and tracer of one simulated server (``SimOptions.otlp_traces_endpoint``)."""

    def __init__(self, endpoint: str) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise RuntimeError(
                f"--otlp-traces-endpoint needs the OpenTelemetry packages: pip install 'specgate[tracing]' ({exc})"
            ) from exc
        attrs = {"vllm.instrumenting_module_name": "vllm.llm_engine", "vllm.process_id": str(os.getpid())}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attrs["service.name"] = "vllm"
        self.provider = TracerProvider(resource=Resource.create(attrs))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
        self.tracer = self.provider.get_tracer("vllm.llm_engine")
        self.propagator = TraceContextTextMapPropagator()
        self.server = SpanKind.SERVER

    def request_span(
        self,
        headers: Mapping[str, str],
        *,
        request_id: str,
        req: SimRequest,
        gens: Sequence[Generation],
        arrival_ns: int,
        top_p: float | None = None,
    ) -> None:
        """The ``llm_request`` span of a request that ended now. ``arrival_ns``: when it arrived (wall clock)."""
        if not gens:
            return
        g = gens[0]
        attrs: dict[str, Any] = {
            "gen_ai.request.id": request_id,
            "gen_ai.response.model": req.model,
            "gen_ai.usage.prompt_tokens": req.prompt_tokens,
            "gen_ai.usage.completion_tokens": sum(x.tokens for x in gens),
            "gen_ai.usage.num_sequences": len(gens),
            "gen_ai.request.n": len(gens),
        }
        if req.temperature:
            attrs["gen_ai.request.temperature"] = req.temperature
        if top_p:
            attrs["gen_ai.request.top_p"] = top_p
        if req.max_tokens:
            attrs["gen_ai.request.max_tokens"] = req.max_tokens
        arrival, sched, first, last = g.arrival, g.scheduled, g.first_token, g.last_token
        end = g.finished if g.finished is not None else last
        if arrival is not None:
            _put(attrs, "gen_ai.latency.e2e", end, arrival)
            _put(attrs, "gen_ai.latency.time_in_queue", sched, arrival)
            _put(attrs, "gen_ai.latency.time_to_first_token", first, arrival)
        _put(attrs, "gen_ai.latency.time_in_model_prefill", first, sched)
        _put(attrs, "gen_ai.latency.time_in_model_decode", last, first)
        _put(attrs, "gen_ai.latency.time_in_model_inference", last, sched)
        parent = self.propagator.extract(dict(headers)) if headers else None
        span = self.tracer.start_span("llm_request", parent, self.server, attrs, start_time=arrival_ns)
        span.end(time.time_ns())

    def shutdown(self) -> None:
        self.provider.shutdown()


def _put(attrs: dict[str, Any], name: str, end: float | None, start: float | None) -> None:
    if end is not None and start is not None:
        attrs[name] = max(0.0, end - start)
