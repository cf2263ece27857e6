"""The tracing module on its own: the sampler the OTEL_* variables ask for, the tail decision (failed and
fallen-back requests exported whatever the head sample said, the others dropped, the held spans bounded), what is
read from a pool's answer (never text), and that a gateway with tracing off imports nothing of OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision

from gateway.config.settings import Settings, SettingsError
from gateway.observability.trace_export import (
    KeepFailed,
    TailProcessor,
    TracingConfigError,
    build_provider,
    head_sampler,
)
from gateway.observability.tracing import Tracing


def test_default_sampler_is_parent_based_ratio_one() -> None:
    s = head_sampler({})
    assert s.get_description().startswith("ParentBased{root:TraceIdRatioBased{1.0},remoteParentSampled:AlwaysOn")
    assert "0.1" in head_sampler({"OTEL_TRACES_SAMPLER_ARG": "0.1"}).get_description()
    assert head_sampler({"OTEL_TRACES_SAMPLER": "always_off"}).get_description() == "AlwaysOffSampler"


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


def test_a_dropped_span_is_recorded_with_its_attributes() -> None:
    sampler = KeepFailed(head_sampler({"OTEL_TRACES_SAMPLER_ARG": "0"}))
    result = sampler.should_sample(None, 1234, "x", attributes={"a": 1})
    assert result.decision is Decision.RECORD_ONLY
    assert dict(result.attributes or {}) == {"a": 1}
    kept = KeepFailed(head_sampler({})).should_sample(None, 1234, "x")
    assert kept.decision is Decision.RECORD_AND_SAMPLE


def _tracing(ratio: str) -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing = Tracing({"OTEL_TRACES_SAMPLER_ARG": ratio}, exporter=exporter)
    # build_provider batches; swap in a synchronous processor with the same tail decision for the test
    processor = tracing.provider._active_span_processor._span_processors[0]
    assert isinstance(processor, TailProcessor)
    processor.inner = SimpleSpanProcessor(exporter)
    return tracing, exporter


def _request(tracing: Tracing, *, fail: bool = False, fallback: bool = False) -> str:
    trace = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    trace.request("m", 0.2, 10, True)
    trace.route(0, traffic_class="c", task_type="chat", plan=("a", "b"), reason="preferred")
    headers: dict[str, str] = {"tracestate": "client=1"}
    span = trace.send_attempt(headers, [], "a", "speculative", "a-0", "http://10.0.0.1:8000", None)
    assert headers["traceparent"].startswith(f"00-{trace.trace_id}-")
    assert "tracestate" not in headers  # the client's state is not the attempt's
    pool = "a"
    if fallback:
        trace.attempt_failed(span, 503, "status_5xx")
        span = trace.send_attempt(headers, [], "b", "standard", "b-0", "http://10.0.0.2:8000", None)
        pool = "b"
    trace.attempt_answered(span, 200, 0.01)
    trace.finish(
        status=500 if fail else 200,
        outcome="upstream_error" if fail else "ok",
        pool=pool,
        endpoint=f"{pool}-0",
        attempts=2 if fallback else 1,
        commit_s=0.02,
        accepted=None,
        drafted=None,
        idempotency=None,
    )
    return trace.trace_id


def test_tail_decision_keeps_failures_and_fallbacks_only() -> None:
    tracing, exporter = _tracing("0")
    plain = _request(tracing)
    failed = _request(tracing, fail=True)
    fell_back = _request(tracing, fallback=True)
    by_trace: dict[str, list[str]] = {}
    for s in exporter.get_finished_spans():
        assert s.context is not None
        assert s.context.trace_flags.sampled
        by_trace.setdefault(f"{s.context.trace_id:032x}", []).append(s.name)
    assert plain not in by_trace
    assert sorted(by_trace[failed]) == sorted(
        ["specgate.route", "specgate.admission", "chat m", "POST /v1/chat/completions"]
    )
    assert len(by_trace[fell_back]) == 5  # two attempts
    processor = tracing.provider._active_span_processor._span_processors[0]
    assert processor.held == 0  # nothing left waiting


def test_sampled_requests_are_all_exported() -> None:
    tracing, exporter = _tracing("1")
    plain = _request(tracing)
    names = [s.name for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == plain]  # type: ignore[union-attr]
    assert len(names) == 4


def test_held_traces_are_bounded() -> None:
    exporter = InMemorySpanExporter()
    provider = build_provider({"OTEL_TRACES_SAMPLER_ARG": "0"}, exporter)
    processor = provider._active_span_processor._span_processors[0]
    processor.max_held = 3
    tracer = provider.get_tracer("t")
    roots = [tracer.start_span("root") for _ in range(5)]
    from opentelemetry import trace

    for root in roots:  # children end, roots stay open: their traces wait
        tracer.start_span("child", trace.set_span_in_context(root)).end()
    assert processor.held == 3


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
    assert trace._finish_reasons == ["stop"]
    assert trace._usage == {"gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 34}


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
