"""OpenTelemetry traces end to end: the gateway (real uvicorn, ``tracing=True``) in front of two simulated vLLM pools
that export their ``llm_request`` spans, both sending OTLP over gRPC to a receiver in this process (the
``opentelemetry-proto`` TraceService on a free port, as vLLM's own tracing tests do).

A streamed request yields one trace: the gateway's server span (continuing the client's traceparent), its
admission and route spans, the attempt's CLIENT span, and the simulator's ``llm_request`` below the attempt. A
request whose first pool fails shows two attempts; with a head sample of 0 only the fallback's trace is exported
(the tail decision). No prompt or completion text is in anything exported.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from gateway.sim.app import SimOptions  # noqa: E402
from gateway.sim.faults import Faults  # noqa: E402
from gateway.sim.server import SimServer  # noqa: E402
from gateway.sim.wire import OutputLengths  # noqa: E402
from tests.conftest import MODEL, SPEC_ONLY_MODEL, ServerThread, closed_port_url, rules_for  # noqa: E402

pytestmark = pytest.mark.integration

SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
PROMPT_MARK = "zebra-quartz-marmalade-7731"  # a prompt no attribute could contain by chance
CODE_REQ: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0.1,
    "max_tokens": 64,
    "stream": True,
    "messages": [{"role": "user", "content": f"write a python function that adds two numbers {PROMPT_MARK}"}],
}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
WAIT_S = 20.0


@dataclass
class SpanRow:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attrs: dict[str, Any]
    status_code: int
    start_ns: int = 0
    end_ns: int = 0


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    """The OTLP TraceService: keeps every export request (raw, for the no-text check) and its spans."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.spans: list[SpanRow] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        rows = []
        for rs in request.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    rows.append(
                        SpanRow(
                            service=service,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            kind=s.kind,
                            attrs={a.key: _value(a.value) for a in s.attributes},
                            status_code=s.status.code,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.raw.append(request.SerializeToString())
            self.spans.extend(rows)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[SpanRow]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, done: Callable[[list[SpanRow]], bool]) -> list[SpanRow]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"trace {trace_id} incomplete after {WAIT_S}s: {[s.name for s in self.trace(trace_id)]}")


_PICTURED = ("specgate.class", "specgate.plan", "specgate.route.reason", "specgate.pool", "http.response.status_code",
             "error.type", "specgate.fallback", "specgate.committed", "specgate.ttft_s",
             "gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token")  # fmt: skip


def render_tree(spans: list[SpanRow]) -> str:
    """The trace as an indented tree with start offsets and durations (docs/tracing.md shows one)."""
    t0 = min(s.start_ns for s in spans)
    children: dict[str, list[SpanRow]] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_id, []).append(s)
    ids = {s.span_id for s in spans}
    lines: list[str] = []

    def walk(s: SpanRow, depth: int) -> None:
        def show(v: Any) -> str:
            return f"{v * 1000:.1f} ms" if isinstance(v, float) else str(v)

        facts = ", ".join(f"{k.split('.')[-1]} {show(s.attrs[k])}" for k in _PICTURED if k in s.attrs)
        lines.append(f"{'  ' * depth}{s.name:<{40 - 2 * depth}} {s.service:<9} {(s.start_ns - t0) / 1e6:7.1f} ms "
                     f"+{(s.end_ns - s.start_ns) / 1e6:7.1f} ms  {facts}")  # fmt: skip
        for c in children.get(s.span_id, []):
            walk(c, depth + 1)

    for root in (s for s in spans if s.parent_id not in ids):
        walk(root, 0)
    return "\n".join(lines)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Receiver, str]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms (default 5 s)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    yield servicer, endpoint
    server.stop(grace=None)


def start_sim(endpoint: str, **overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "port": 0,
        "time_scale": 0.01,
        "output_lengths": OutputLengths(median=24, sigma=0),
        "seed": 1,
        "otlp_traces_endpoint": endpoint,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture
def sims(receiver: tuple[Receiver, str]) -> Iterator[tuple[SimServer, SimServer]]:
    endpoint = receiver[1]
    spec = start_sim(
        endpoint,
        speculative_config=SPEC,
        fixed_acceptance=0.6,
        served_model_names=(MODEL, SPEC_ONLY_MODEL),
        per_request_spec_decode_metrics="summary",
    )
    std = start_sim(endpoint)
    yield spec, std
    spec.stop()
    std.stop()


def stream(gw: ServerThread, headers: dict[str, str] | None = None) -> tuple[httpx.Headers, str, bytes]:
    """One streamed chat request: the response headers, the completion text, the raw body."""
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=CODE_REQ, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        raw = b"".join(r.iter_bytes())
    text = ""
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in orjson.loads(line[6:]).get("choices", []):
                text += (choice.get("delta") or {}).get("content") or ""
    return r.headers, text, raw


def one(spans: list[SpanRow], name: str) -> SpanRow:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


def attempts_of(spans: list[SpanRow]) -> list[SpanRow]:
    return sorted((s for s in spans if s.kind == 3), key=lambda s: s.attrs["specgate.attempt"])  # 3: CLIENT


def test_streamed_request_is_one_trace_into_the_simulator(
    receiver: tuple[Receiver, str], sims: tuple[SimServer, SimServer], gateway: Callable[..., ServerThread]
) -> None:
    rx = receiver[0]
    spec, std = sims
    gw = gateway(rules_for([spec.url], [std.url]), tracing=True)
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    headers, text, _ = stream(gw, {"traceparent": traceparent, "tracestate": "vendor=abc"})
    assert headers["x-specgate-trace-id"] == CLIENT_TRACE  # the client's trace, continued
    assert len(text) > 20

    spans = rx.wait_for(CLIENT_TRACE, lambda s: any(x.name == "llm_request" for x in s) and len(s) >= 5)
    server = one(spans, "POST /v1/chat/completions")
    assert server.parent_id == CLIENT_SPAN
    assert server.kind == 2
    assert server.service == "specgate"
    a = server.attrs
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.request.temperature"] == pytest.approx(0.1)
    assert a["gen_ai.request.max_tokens"] == 64
    assert a["gen_ai.response.finish_reasons"] == ["length"] or a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.usage.output_tokens"] > 0  # the usage chunk asked of the speculative pool
    assert a["gen_ai.usage.input_tokens"] > 0
    assert a["specgate.class"] == "precise"
    assert a["specgate.pool"] == "spec"
    assert a["specgate.outcome"] == "ok"
    assert a["specgate.fallback"] is False
    assert a["specgate.committed"] is True
    assert a["specgate.commit_s"] > 0
    assert 0.0 <= a["specgate.acceptance"] <= 1.0
    assert a["specgate.spec.drafted"] > 0
    assert a["http.response.status_code"] == 200

    route = one(spans, "specgate.route")
    assert route.parent_id == server.span_id
    assert route.attrs["specgate.plan"] == ["spec", "std"]
    assert route.attrs["specgate.route.reason"]
    assert route.attrs["specgate.task_type"] == "code"
    admission = one(spans, "specgate.admission")
    assert admission.parent_id == server.span_id

    (attempt,) = attempts_of(spans)
    assert attempt.parent_id == server.span_id
    assert attempt.name == f"chat {MODEL}"
    assert attempt.attrs["specgate.pool"] == "spec"
    assert attempt.attrs["specgate.endpoint"] == "spec-0"
    assert attempt.attrs["server.address"] == "127.0.0.1"
    assert attempt.attrs["server.port"] == spec.port
    assert attempt.attrs["http.response.status_code"] == 200
    assert attempt.attrs["specgate.committed"] is True
    assert attempt.attrs["specgate.ttft_s"] > 0

    llm = one(spans, "llm_request")
    assert llm.parent_id == attempt.span_id  # vLLM's span joins below the attempt that reached it
    assert llm.service == "vllm"
    for key in (
        "gen_ai.latency.time_in_queue",
        "gen_ai.latency.time_to_first_token",
        "gen_ai.latency.e2e",
        "gen_ai.latency.time_in_model_prefill",
        "gen_ai.latency.time_in_model_decode",
        "gen_ai.usage.prompt_tokens",
        "gen_ai.usage.completion_tokens",
    ):
        assert key in llm.attrs, key
    assert llm.attrs["gen_ai.request.id"] == server.attrs["specgate.request_id"]

    exported = b"".join(rx.raw)
    assert PROMPT_MARK.encode() not in exported
    assert text.encode() not in exported
    assert text[:40].encode() not in exported


def test_fallback_shows_two_attempts(
    receiver: tuple[Receiver, str], sims: tuple[SimServer, SimServer], gateway: Callable[..., ServerThread]
) -> None:
    rx = receiver[0]
    spec, std = sims
    spec.update_faults(Faults(error_rate=1.0, error_status=500).to_json())
    gw = gateway(rules_for([spec.url], [std.url]), tracing=True)
    headers, _text, _ = stream(gw)
    trace_id = headers["x-specgate-trace-id"]
    assert headers["x-specgate-pool"] == "std"

    spans = rx.wait_for(trace_id, lambda s: len(attempts_of(s)) == 2 and any(x.name == "llm_request" for x in s))
    first, second = attempts_of(spans)
    assert first.attrs["specgate.pool"] == "spec"
    assert first.attrs["http.response.status_code"] == 500
    assert first.attrs["error.type"]
    assert first.attrs["specgate.committed"] is False
    assert first.status_code == 2  # ERROR
    assert second.attrs["specgate.pool"] == "std"
    assert second.attrs["specgate.committed"] is True
    server = one(spans, "POST /v1/chat/completions")
    assert server.attrs["specgate.fallback"] is True
    assert server.attrs["specgate.attempts"] == 2
    llm = one(spans, "llm_request")  # the injected failure is answered before generation: only std generated
    assert llm.parent_id == second.span_id
    tree = render_tree(spans)
    assert tree.splitlines()[0].startswith("POST /v1/chat/completions")
    assert len(tree.splitlines()) == len(spans)  # every span in one tree under the server span
    if os.environ.get("SPECGATE_TRACE_PICTURE"):  # where to write the picture (docs/tracing.md's one trace)
        Path(os.environ["SPECGATE_TRACE_PICTURE"]).write_text(tree + "\n")
    assert PROMPT_MARK.encode() not in b"".join(rx.raw)


def test_head_sample_zero_keeps_only_the_fallback(
    receiver: tuple[Receiver, str],
    sims: tuple[SimServer, SimServer],
    gateway: Callable[..., ServerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rx = receiver[0]
    spec, std = sims
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    gw = gateway(rules_for([spec.url], [std.url]), tracing=True)
    plain, _, _ = stream(gw)
    spec.update_faults(Faults(error_rate=1.0, error_status=503).to_json())
    fell_back, _, _ = stream(gw)
    assert fell_back["x-specgate-pool"] == "std"

    # The first attempt went out unsampled; from the fallback on the trace is kept, so the attempt that answered
    # said sampled to its pool, whose own span joins below it.
    spans = rx.wait_for(
        fell_back["x-specgate-trace-id"],
        lambda s: len(attempts_of(s)) == 2 and any(x.name == "llm_request" for x in s),
    )
    first, second = attempts_of(spans)
    assert (first.attrs["specgate.pool"], first.attrs["http.response.status_code"]) == ("spec", 503)
    assert first.attrs["error.type"]
    assert first.status_code == 2
    assert first.end_ns > first.start_ns
    assert second.attrs["specgate.pool"] == "std"
    llm = one(spans, "llm_request")
    assert llm.parent_id == second.span_id
    assert one(spans, "POST /v1/chat/completions").attrs["specgate.fallback"] is True
    route = one(spans, "specgate.route")  # the decision's facts, put off while unsampled, written when kept
    assert route.attrs["specgate.class"] == "precise"
    time.sleep(0.3)  # a span exported after the fallback's would be a bug: nothing more may come
    assert rx.trace(plain["x-specgate-trace-id"]) == []
    assert [s.name for s in rx.spans if s.name == "llm_request"] == ["llm_request"]  # the kept attempt's only


def test_env_sampler_is_checked_at_start(gateway: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER"):
        gateway(rules_for([closed_port_url()], [closed_port_url()]), tracing=True)
