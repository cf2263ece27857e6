"""The tracing module on its own: the sampler the OTEL_* variables ask for (agreeing with the SDK's), the tail
decision (failed and fallen-back requests exported whatever the head sample said, the others not even encoded), the
OTLP bytes (read back with the protobuf classes), the bounded export queue, what is read from a pool's answer (never
text), and that a gateway with tracing off imports nothing of OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("grpc")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

from gateway.config.settings import Settings, SettingsError
from gateway.observability import otlp_wire
from gateway.observability.metrics import TRACE_DROP_REASONS, GatewayMetrics
from gateway.observability.trace_export import ExportConfig, TracingConfigError, head_sampler
from gateway.observability.tracing import Tracing
from gateway.routing.class_track import RouteChoice
from tests.conftest import closed_port_url


def test_default_sampler_is_parent_based_ratio_one() -> None:
    s = head_sampler({})
    assert (s.name, s.ratio, s.parent_based) == ("parentbased_traceidratio", 1.0, True)
    assert head_sampler({"OTEL_TRACES_SAMPLER_ARG": "0.1"}).ratio == 0.1
    off = head_sampler({"OTEL_TRACES_SAMPLER": "always_off"})
    assert not off.parent_based
    assert not off.sampled(2**128 - 1, True)
    assert not off.sampled(0, None)


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_TRACES_SAMPLER": "sometimes"},
        {"OTEL_TRACES_SAMPLER_ARG": "half"},
        {"OTEL_TRACES_SAMPLER_ARG": "1.5"},
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "-0.1"},
    ],
)
def test_bad_sampler_variables_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(TracingConfigError, match="OTEL_TRACES_SAMPLER"):
        head_sampler(env)


def test_bad_exporter_variables_are_refused() -> None:
    with pytest.raises(TracingConfigError, match="OTEL_BSP_SCHEDULE_DELAY"):
        ExportConfig.from_env({"OTEL_BSP_SCHEDULE_DELAY": "soon"})
    with pytest.raises(TracingConfigError, match="COMPRESSION"):
        ExportConfig.from_env({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"})
    cfg = ExportConfig.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_HEADERS": "X-Key=a%20b"}
    )
    assert (cfg.target, cfg.secure, cfg.headers) == ("collector:4318", False, (("x-key", "a b"),))


def test_ratio_decision_agrees_with_the_sdk() -> None:
    """The same trace ids are sampled as by the SDK's TraceIdRatioBased, so services sampling by ratio agree;
    a parent's flag is followed by the parent-based samplers only."""
    import random

    rng = random.Random(7)
    for ratio in (0.0, 0.1, 0.5, 1.0):
        ours = head_sampler({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio)})
        sdk = TraceIdRatioBased(ratio)
        for _ in range(500):
            tid = rng.getrandbits(128) or 1
            expect = sdk.should_sample(None, tid, "x").decision is Decision.RECORD_AND_SAMPLE
            assert ours.sampled(tid, None) is expect
            assert ours.sampled(tid, not expect) is expect  # not parent-based: the parent's flag is not read
    parent = head_sampler({"OTEL_TRACES_SAMPLER_ARG": "0"})
    assert parent.sampled(5, True)
    assert not parent.sampled(5, False)
    assert not parent.sampled(5, None)


def _tracing(ratio: str, **env: str) -> tuple[Tracing, list[bytes]]:
    sent: list[bytes] = []
    return Tracing({"OTEL_TRACES_SAMPLER_ARG": ratio, **env}, send=sent.append), sent


def _exported(tracing: Tracing, sent: list[bytes]) -> list[Any]:
    tracing.flush()
    spans = []
    for data in sent:
        req = ExportTraceServiceRequest.FromString(data)
        for rs in req.resource_spans:
            assert any(a.key == "service.name" and a.value.string_value == "specgate" for a in rs.resource.attributes)
            for ss in rs.scope_spans:
                assert ss.scope.name == "specgate"
                spans.extend(ss.spans)
    return spans


def _attrs(span: Any) -> dict[str, Any]:
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


def _request(tracing: Tracing, *, fail: bool = False, fallback: bool = False, traceparent: str | None = None) -> str:
    trace = tracing.start("POST", "/v1/chat/completions", "rid", traceparent, "vendor=1" if traceparent else None)
    trace.request("m", 0.2, 10, True)
    choice = RouteChoice(state="split", pick="speculative", share=0.25, why="probe")
    trace.route(
        0,
        traffic_class="c",
        task_type="chat",
        plan=("a", "b"),
        reason="preferred",
        choice=choice,
        expected=lambda cls: ((f"{cls}-a", 1.5), ("b", 2.0)),
    )
    headers: dict[str, str] = {"tracestate": "client=1"}
    span = trace.send_attempt(headers, [], "a", "speculative", "a-0", "http://10.0.0.1:8000", None)
    assert headers["traceparent"].startswith(f"00-{trace.trace_id}-")
    assert headers["traceparent"].endswith("-01" if trace.sampled else "-00")
    if traceparent is None:
        assert "tracestate" not in headers  # the client's state is not the attempt's
    else:
        assert headers["tracestate"] == "vendor=1"  # the state of the client's trace, carried on
    pool = "a"
    if fallback:
        trace.attempt_failed(span, 503, "status_5xx")
        span = trace.send_attempt(headers, [], "b", "standard", "b-0", "http://10.0.0.2:8000", None)
        pool = "b"
    trace.attempt_answered(span, 200, 0.01)
    trace.observe(
        b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}'
    )
    trace.finish(
        status=500 if fail else 200,
        outcome="upstream_error" if fail else "ok",
        pool=pool,
        endpoint=f"{pool}-0",
        attempts=2 if fallback else 1,
        commit_s=0.02,
        accepted=3,
        drafted=4,
        idempotency=None,
    )
    return trace.trace_id


def test_tail_decision_keeps_failures_and_fallbacks_only() -> None:
    tracing, sent = _tracing("0")
    plain = _request(tracing)
    failed = _request(tracing, fail=True)
    fell_back = _request(tracing, fallback=True)
    by_trace: dict[str, list[str]] = {}
    for s in _exported(tracing, sent):
        assert s.flags & 0xFF == 1  # exported as sampled
        by_trace.setdefault(s.trace_id.hex(), []).append(s.name)
    assert plain not in by_trace
    assert sorted(by_trace[failed]) == sorted(
        ["specgate.route", "specgate.admission", "chat m", "POST /v1/chat/completions"]
    )
    assert len(by_trace[fell_back]) == 5  # two attempts
    assert tracing.exporter.queued == 0  # nothing left waiting


def test_sampled_request_spans_read_back() -> None:
    """Every span of a sampled request, decoded by the protobuf classes: names, kinds, parents, times, attributes
    of each value type, status."""
    tracing, sent = _tracing("1")
    client_span = "00f067aa0ba902b7"
    plain = _request(tracing, fallback=True, traceparent=f"00-4bf92f3577b34da6a3ce929d0e0e4736-{client_span}-01")
    assert plain == "4bf92f3577b34da6a3ce929d0e0e4736"
    spans = {s.name if s.kind != 3 else f"attempt {_attrs(s)['specgate.attempt']}": s for s in _exported(tracing, sent)}
    assert len(spans) == 5
    server = spans["POST /v1/chat/completions"]
    assert server.kind == 2
    assert server.parent_span_id.hex() == client_span
    assert server.trace_state == "vendor=1"
    assert server.flags & 0x300 == 0x300  # the parent is remote
    a = _attrs(server)
    assert a["gen_ai.request.model"] == "m"
    assert a["gen_ai.request.temperature"] == pytest.approx(0.2)
    assert a["gen_ai.request.max_tokens"] == 10
    assert a["specgate.stream"] is True
    assert a["specgate.class"] == "c"
    assert a["specgate.fallback"] is True
    assert a["specgate.attempts"] == 2
    assert a["specgate.pool"] == "b"
    assert a["specgate.acceptance"] == pytest.approx(0.75)
    assert a["specgate.commit_s"] == pytest.approx(0.02)
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert a["gen_ai.usage.input_tokens"] == 3
    assert a["gen_ai.usage.output_tokens"] == 4
    assert a["specgate.request_id"] == "rid"
    assert a["http.response.status_code"] == 200
    assert server.status.code == 0
    assert server.end_time_unix_nano >= server.start_time_unix_nano > 0
    route = _attrs(spans["specgate.route"])
    assert route["specgate.plan"] == ["a", "b"]
    assert route["specgate.route.reason"] == "preferred"
    assert route["specgate.controller.share"] == pytest.approx(0.25)
    assert route["specgate.controller.why"] == "probe"
    assert route["specgate.expected.pools"] == ["c-a", "b"]
    assert route["specgate.expected.seconds"] == [1.5, 2.0]
    first, second = spans["attempt 1"], spans["attempt 2"]
    for child in (spans["specgate.admission"], spans["specgate.route"], first, second):
        assert child.parent_span_id == server.span_id
        assert child.trace_id == server.trace_id
        assert child.span_id != server.span_id
    assert first.status.code == 2
    assert _attrs(first)["error.type"] == "status_5xx"
    assert _attrs(first)["specgate.committed"] is False
    assert _attrs(first)["http.response.status_code"] == 503
    b = _attrs(second)
    assert b["specgate.committed"] is True
    assert b["server.address"] == "10.0.0.2"
    assert b["server.port"] == 8000
    assert b["specgate.ttft_s"] == pytest.approx(0.01)
    assert second.status.code == 0
    assert second.name == "chat m"


def test_a_bad_traceparent_starts_a_new_trace() -> None:
    tracing, _ = _tracing("1")
    for bad in (
        "garbage",
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ):
        trace = tracing.start("POST", "/v1/chat/completions", "rid", bad, "vendor=1")
        assert trace.trace_id != "4bf92f3577b34da6a3ce929d0e0e4736"
        assert int(trace.trace_id, 16) != 0
    unsampled = tracing.start(
        "POST", "/v1/chat/completions", "rid", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", None
    )
    assert unsampled.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert not unsampled.sampled


def test_export_queue_is_bounded() -> None:
    """Past OTEL_BSP_MAX_QUEUE_SIZE spans, a request's spans are dropped and counted, not queued."""
    tracing, sent = _tracing("1", OTEL_BSP_MAX_QUEUE_SIZE="10", OTEL_BSP_SCHEDULE_DELAY="3600000")
    _request(tracing)
    _request(tracing)  # 4 + 4 spans queued
    _request(tracing)  # 12 > 10: dropped
    assert tracing.exporter.queued == 8
    assert tracing.exporter.dropped == 4
    assert len(_exported(tracing, sent)) == 8
    assert tracing.span_counts() == {"exported": 8, "queue_full": 4, "export_failed": 0, "unwritable": 0}
    tracing.shutdown()


def test_a_failed_export_is_counted_by_its_reason() -> None:
    def refuse(data: bytes) -> None:
        raise ConnectionError("collector away")

    tracing = Tracing({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_BSP_SCHEDULE_DELAY": "3600000"}, send=refuse)
    _request(tracing)
    tracing.flush()
    assert tracing.span_counts() == {"exported": 0, "queue_full": 0, "export_failed": 4, "unwritable": 0}
    tracing.shutdown()


def test_span_counters_move_by_what_is_new() -> None:
    """``GatewayMetrics.trace_spans`` is given running totals (each scrape round): the counters add the difference."""
    m = GatewayMetrics()
    m.trace_spans({"exported": 10, "pipe_full": 0, "export_failed": 2})
    m.trace_spans({"exported": 25, "pipe_full": 3, "export_failed": 2})
    m.trace_spans({"exported": 25, "pipe_full": 3, "export_failed": 2})
    text = m.render().decode()
    assert "specgate_trace_spans_exported_total 25.0" in text
    assert 'specgate_trace_spans_dropped_total{reason="pipe_full"} 3.0' in text
    assert 'specgate_trace_spans_dropped_total{reason="export_failed"} 2.0' in text
    assert 'specgate_trace_spans_dropped_total{reason="queue_full"} 0.0' in text  # every reason, from the start


def test_every_drop_reason_has_its_series() -> None:
    from gateway.observability.trace_pipe import PIPE_LOST, REPORT_FIELDS

    assert set(TRACE_DROP_REASONS) == set(PIPE_LOST) | set(REPORT_FIELDS[1:])


def test_encoder_writes_what_protobuf_reads() -> None:
    enc = otlp_wire.Encoder()
    items = [("s", "x" * 300), ("b", False), ("i", -5), ("f", 1.5), ("l", ["a", "b"]), ("d", [0.5])]
    attrs = enc.block(("k",), lambda: items) + enc.number("n", 7) + enc.string("id", "y" * 200)
    assert enc.block(("k",), list) == enc.block(("k",), lambda: items)  # cached under its key
    data = otlp_wire.request(
        otlp_wire.resource_fields([("service.name", "svc")], "specgate", "1"),
        [otlp_wire.span(b"\x01" * 16, b"\x02" * 8, None, enc.name("n"), otlp_wire.INTERNAL, 1, 2**63, attrs)],
    )
    (span,) = ExportTraceServiceRequest.FromString(data).resource_spans[0].scope_spans[0].spans
    assert span.name == "n"
    assert span.end_time_unix_nano == 2**63
    assert not span.parent_span_id
    expect = {"s": "x" * 300, "b": False, "i": -5, "f": 1.5, "l": ["a", "b"], "d": [0.5], "n": 7, "id": "y" * 200}
    assert _attrs(span) == expect


def test_observe_reads_keys_never_text() -> None:
    tracing, _ = _tracing("1")
    trace = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    # text that looks like the keys is escaped inside a JSON string, so it cannot match
    trace.observe(
        b'data: {"choices":[{"delta":{"content":"say \\"finish_reason\\":\\"evil\\", prompt_tokens\\": 9"},'
        b'"finish_reason":null}]}'
    )
    trace.observe(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}')
    trace.observe(b'data: {"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}')
    assert trace.finish_reasons == ["stop"]
    assert trace.usage == {"gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 34}


def test_tracing_setting_from_env(tmp_path: Path) -> None:
    rules = str(tmp_path / "r.yaml")
    assert Settings.from_env({"SPECGATE_RULES": rules}).tracing is False
    assert Settings.from_env({"SPECGATE_RULES": rules, "SPECGATE_TRACING": "1"}).tracing is True
    with pytest.raises(SettingsError, match="SPECGATE_TRACING"):
        Settings.from_env({"SPECGATE_RULES": rules, "SPECGATE_TRACING": "maybe"})


def test_tracing_off_imports_no_opentelemetry(tmp_path: Path) -> None:
    """A gateway without --tracing builds and serves a request with OpenTelemetry not importable (as where the
    extra is not installed): nothing of the gateway needs it. (redis-py imports it by itself when installed.)"""
    code = """
import sys, asyncio, importlib.abc
class NoOtel(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(name)
        return None
sys.meta_path.insert(0, NoOtel())
import httpx
from pathlib import Path
from gateway.config.settings import Settings
from gateway.proxy.app import create_app
from gateway.config.loader import load_rules_file
rules = Path(sys.argv[1])
rules.write_text(open(sys.argv[2]).read())
app = create_app(Settings(rules=rules))
async def main():
    t = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=t, base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": []},
                         headers={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
        assert r.status_code in (400, 404, 502, 503), r.status_code
        assert "x-specgate-trace-id" not in r.headers
asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry") or m.endswith("trace_export"))
assert not loaded, loaded
"""
    example = Path(__file__).resolve().parents[2] / "routing_rules" / "default.yaml"
    if not example.exists():
        pytest.skip("no routing_rules/default.yaml")
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "rules.yaml"), str(example)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_gateway_process_leaves_grpc_to_its_export_process() -> None:
    """With tracing on, the gateway's own process only checks that gRPC is installed: the export process is the
    one that imports it (about 10 MB of memory per gateway process otherwise)."""
    code = """
import sys
from gateway.observability.tracing import Tracing
t = Tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": sys.argv[1]})
t.shutdown()
assert "grpc" not in sys.modules, "grpc imported"
"""
    out = subprocess.run([sys.executable, "-c", code, closed_port_url()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_tracing_without_grpc_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from gateway.observability import tracing as tracing_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "grpc" else real(name, *a))
    with pytest.raises(tracing_module.TracingUnavailable, match=r"specgate\[tracing\]"):
        Tracing({})


@pytest.mark.parametrize("ratio", ["0", "1"])
def test_exemplars_name_exported_traces_only(ratio: str) -> None:
    """A finished request's trace id is in its access log line either way, and an exemplar on the latency
    histogram only when its trace is exported (a sampled request here; an unsampled ok one is not)."""
    import io

    import orjson

    from gateway.observability.logs import AccessLog
    from gateway.observability.metrics import GatewayMetrics
    from gateway.proxy.record import RequestRecord

    tracing, _ = _tracing(ratio)
    metrics, out = GatewayMetrics(), io.BytesIO()
    log = AccessLog(out)
    rec = RequestRecord("rid", "/v1/chat/completions")
    trace = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    if trace.sampled:  # as the request path holds it: recording, or quiet until the tail decision keeps it
        rec.trace = trace
    else:
        rec.quiet = trace
    rec.traffic_class, rec.pool, rec.status = "c", "a", 200
    rec.finish("ok", metrics, log)
    log.flush()
    assert orjson.loads(out.getvalue().splitlines()[0])["trace_id"] == trace.trace_id
    exposition = metrics.render(openmetrics=True).decode()
    assert (f'trace_id="{trace.trace_id}"' in exposition) is (ratio == "1")


def _quiet(tracing: Tracing, calls: list[Any]) -> Any:
    """A request whose trace the head sample did not keep, as the request path holds it (``RequestRecord.quiet``),
    classified and planned for pool "a"."""
    from gateway.proxy.record import RequestRecord

    rec = RequestRecord("rid", "/v1/chat/completions")
    rec.quiet = quiet = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    assert not quiet.sampled
    rec.traffic_class, rec.task_type = "c", "chat"
    quiet.decided("a", _decision(calls, 10, 20))
    return rec


def _finish(rec: Any, outcome: str, pool: str, status: int = 200) -> None:
    import io

    from gateway.observability.logs import AccessLog
    from gateway.observability.metrics import GatewayMetrics

    rec.pool, rec.status, rec.endpoint = pool, status, f"{pool}-0"
    rec.finish(outcome, GatewayMetrics(), AccessLog(io.BytesIO()))


_ANSWER = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":4}}'


def test_a_quiet_request_records_nothing_and_sends_an_unsampled_traceparent() -> None:
    """The path of most requests: the planned attempt's traceparent says unsampled (so the pool records nothing),
    the decision's facts are never read, no Attempt is made, nothing is exported."""
    tracing, sent = _tracing("0")
    calls: list[Any] = []
    rec = _quiet(tracing, calls)
    quiet = rec.quiet
    assert not quiet.fell_back(1, "a")
    headers = {"tracestate": "client=1"}
    quiet.quiet_attempt(headers, [], "a", "speculative", "a-0", "http://10.0.0.1:8000", None)
    assert headers["traceparent"].startswith(f"00-{quiet.trace_id}-")
    assert headers["traceparent"].endswith("-00")
    assert "tracestate" not in headers  # the client's state is not the attempt's
    rec.attempt("a", "a-0", rec.arrived, 200, None)
    _finish(rec, "ok", "a")
    assert rec.trace is None
    assert calls == []
    assert quiet.attempts == []
    assert _exported(tracing, sent) == []


def test_a_quiet_request_that_falls_back_is_recorded_from_then_on() -> None:
    """Kept by the tail decision before its second attempt leaves: the first attempt's span has the id its pool
    was sent, with the failure the record says; the second says sampled to its pool (the pool's spans join it) and
    its answer is read."""
    tracing, sent = _tracing("0")
    calls: list[Any] = []
    rec = _quiet(tracing, calls)
    first_headers: dict[str, str] = {}
    rec.quiet.quiet_attempt(first_headers, [], "a", "speculative", "a-0", "http://10.0.0.1:8000", None)
    rec.attempt("a", "a-0", rec.arrived, 503, "HTTP 503", "status_5xx")
    assert rec.quiet.fell_back(2, "b")
    trace = rec.keep_trace()
    assert rec.quiet is None
    assert rec.trace is trace
    assert trace.sampled
    assert calls == [trace]  # the decision's facts, written now
    headers: dict[str, str] = {}
    span = trace.send_attempt(headers, [], "b", "standard", "b-0", "http://10.0.0.2:8000", None)
    assert headers["traceparent"].endswith("-01")
    trace.attempt_answered(span, 200, 0.01)
    trace.observe(_ANSWER)
    rec.attempt("b", "b-0", rec.arrived, 200, None)
    _finish(rec, "ok", "b")
    spans = _exported(tracing, sent)
    attempts = sorted((s for s in spans if s.kind == 3), key=lambda s: s.start_time_unix_nano)
    assert [_attrs(s)["specgate.pool"] for s in attempts] == ["a", "b"]
    one, two = attempts
    assert f"00-{trace.trace_id}-{one.span_id.hex()}-00" == first_headers["traceparent"]
    assert _attrs(one)["http.response.status_code"] == 503
    assert _attrs(one)["error.type"] == "status_5xx"
    assert one.start_time_unix_nano < one.end_time_unix_nano <= two.start_time_unix_nano
    assert _attrs(two)["specgate.committed"] is True
    (server,) = [s for s in spans if s.kind == 2]
    a = _attrs(server)
    assert a["specgate.fallback"] is True
    assert a["gen_ai.response.finish_reasons"] == ["stop"]
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (3, 4)


def test_a_quiet_request_that_fails_is_kept_from_its_record() -> None:
    """Failed with its one attempt answered (a stream cut after the commit point): kept when it ends, its attempt
    made from the record, committed, with the id its pool was sent; its answer was never read."""
    tracing, sent = _tracing("0")
    calls: list[Any] = []
    rec = _quiet(tracing, calls)
    headers: dict[str, str] = {}
    rec.quiet.quiet_attempt(headers, [], "a", "speculative", "a-0", "http://10.0.0.1:8000", None)
    rec.upstream_start = rec.arrived
    rec.upstream_first = rec.arrived + 0.005
    rec.attempt("a", "a-0", rec.arrived, 200, None)
    _finish(rec, "stream_error", "a")
    assert len(calls) == 1
    spans = _exported(tracing, sent)
    (attempt,) = [s for s in spans if s.kind == 3]
    assert headers["traceparent"] == f"00-{attempt.trace_id.hex()}-{attempt.span_id.hex()}-00"
    a = _attrs(attempt)
    assert a["specgate.committed"] is True
    assert a["error.type"] == "stream_error"
    assert a["specgate.ttft_s"] == pytest.approx(0.005)
    (server,) = [s for s in spans if s.kind == 2]
    assert "gen_ai.response.finish_reasons" not in _attrs(server)
    assert _attrs(server)["error.type"] == "stream_error"


def test_a_quiet_request_refused_before_any_attempt_is_kept() -> None:
    tracing, sent = _tracing("0")
    rec = _quiet(tracing, [])
    _finish(rec, "no_capacity", "none", status=503)
    names = sorted(s.name for s in _exported(tracing, sent))
    assert names == ["POST /v1/chat/completions", "specgate.admission", "specgate.route"]


def test_a_trace_that_cannot_be_written_is_dropped_alone() -> None:
    """The export thread writes the spans; a trace it fails to write is counted as dropped, the batch still goes."""
    tracing, sent = _tracing("1", OTEL_BSP_SCHEDULE_DELAY="3600000")
    good = _request(tracing)
    broken = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    broken.route(0, traffic_class="c", task_type=None, plan=("a",), reason="preferred", choice=object())
    broken.finish(status=200, outcome="ok", pool="a", endpoint=None, attempts=0, commit_s=None, accepted=None,
                  drafted=None, idempotency=None)  # fmt: skip
    spans = _exported(tracing, sent)
    assert {s.trace_id.hex() for s in spans} == {good}
    assert tracing.exporter.dropped == 3  # server, admission, route of the broken one
    tracing.shutdown()


def _decision(calls: list[Any], start_ns: int, end_ns: int) -> Any:
    """What the request path hands ``RequestTrace.decided``: a writer of the decision's facts onto a given trace."""

    def write(trace: Any) -> None:
        calls.append(trace)
        trace.request("m", 0.5, 7, False)
        trace.route(start_ns, traffic_class="c", task_type="chat", plan=("a", "b"), reason="preferred",
                    end_ns=end_ns)  # fmt: skip

    return write


def _end(trace: Any, pool: str, outcome: str = "ok") -> bool:
    headers: dict[str, str] = {}
    span = trace.send_attempt(headers, [], pool, "speculative", f"{pool}-0", "http://10.0.0.1:8000", None)
    trace.attempt_answered(span, 200, 0.01)
    kept = trace.kept(outcome, 1, pool)
    exported = trace.finish(status=200, outcome=outcome, pool=pool, endpoint=f"{pool}-0", attempts=1, commit_s=None,
                            accepted=None, drafted=None, idempotency=None)  # fmt: skip
    assert kept is exported  # the cheap check the request path makes first agrees with the decision itself
    return exported


def test_an_unsampled_trace_writes_its_decision_only_when_kept() -> None:
    """Most requests are neither sampled nor kept: their decision's facts are never read. One the tail decision keeps
    (here its one attempt went to another pool than planned) gets them, with the decision's own timestamps."""
    tracing, sent = _tracing("0")
    calls: list[Any] = []
    quiet = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    quiet.decided("a", _decision(calls, 10, 20))
    assert not _end(quiet, "a")
    assert calls == []
    moved = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    moved.decided("a", _decision(calls, 1_000, 2_000))
    assert _end(moved, "b")  # planned "a", answered by "b": a fallback
    assert calls == [moved]
    (route,) = [s for s in _exported(tracing, sent) if s.name == "specgate.route"]
    assert (route.start_time_unix_nano, route.end_time_unix_nano) == (1_000, 2_000)
    assert route.trace_id.hex() == moved.trace_id
    failed = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    failed.decided("a", _decision(calls, 1, 2))
    assert _end(failed, "a", outcome="upstream_error")
    assert calls[-1] is failed


def test_a_sampled_trace_writes_its_decision_at_once() -> None:
    tracing, _ = _tracing("1")
    calls: list[Any] = []
    trace = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    trace.decided("a", _decision(calls, 5, 6))
    assert calls == [trace]
    assert trace.params == ("m", 0.5, 7, False)
    assert _end(trace, "a")
    assert calls == [trace]  # once
