"""The records a gateway hands to its trace export process: a finished trace's values survive ``marshal`` and are
read back into exactly the spans the gateway would have written itself, and nothing of a prompt goes in them."""

from __future__ import annotations

import asyncio
import marshal
import os
import random
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")

from gateway.observability import trace_pipe, trace_spans
from gateway.observability.trace_child import Writer
from tests.unit.test_tracing import _request, _tracing


class _Keep:
    """An exporter that keeps what is submitted (the traces as the request path hands them over)."""

    def __init__(self) -> None:
        self.traces: list[tuple[Any, int]] = []

    def submit(self, t: Any, spans: int) -> None:
        self.traces.append((t, spans))


@pytest.mark.parametrize(("fallback", "fail", "traceparent"), [
    (False, False, None),
    (True, False, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    (False, True, None),
])  # fmt: skip
def test_a_record_reads_back_into_the_same_spans(fallback: bool, fail: bool, traceparent: str | None) -> None:
    tracing, _ = _tracing("1")
    tracing.exporter.shutdown()
    keep = _Keep()
    tracing.exporter = keep  # type: ignore[assignment]
    _request(tracing, fallback=fallback, fail=fail, traceparent=traceparent)
    ((t, spans),) = keep.traces
    row = trace_pipe.Row(marshal.loads(marshal.dumps([trace_pipe.record(t)]))[0], Writer())
    assert trace_pipe.spans_of(row) == spans
    tracing.random = random.Random(7)  # the ids the writer draws (server, admission, route spans): the same
    row.trace.random = random.Random(7)
    assert trace_spans.encode(row) == trace_spans.encode(t)


def test_a_record_holds_no_prompt_and_only_plain_values() -> None:
    tracing, _ = _tracing("1")
    tracing.exporter.shutdown()
    keep = _Keep()
    tracing.exporter = keep  # type: ignore[assignment]
    trace = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
    trace.request({"secret": "prompt words"}, "hot", ["x"], True)  # ill-typed parameters are not carried
    trace.route(0, traffic_class="c", task_type=None, plan=["a"], reason="preferred", expected=(("a", 1),))
    trace.finish(status=200, outcome="ok", pool="a", endpoint=None, attempts=0, commit_s=None, accepted=None,
                 drafted=None, idempotency=None)  # fmt: skip
    data = marshal.dumps(trace_pipe.record(keep.traces[0][0]))
    assert b"prompt words" not in data
    assert b"hot" not in data


def test_a_batch_is_one_frame_and_a_bad_trace_is_dropped_alone() -> None:
    """What the pipe carries: one frame per batch (length, spans, marshalled records); a trace that cannot be put
    in a record is counted as dropped and the batch's others still go."""
    tracing, _ = _tracing("1")
    tracing.exporter.shutdown()
    pipe = trace_pipe.SpanPipe({}, 1.0)
    r, w = os.pipe()
    os.set_blocking(w, False)
    pipe._fd, pipe._ever = w, True  # a pipe with no process behind it: this test reads it
    tracing.exporter = pipe
    try:

        async def requests() -> None:  # on an event loop: the records wait for the batch
            _request(tracing)
            broken = tracing.start("POST", "/v1/chat/completions", "rid", None, None)
            broken.route(0, traffic_class="c", task_type=None, plan=("a",), reason="preferred", choice=object())
            broken.finish(status=200, outcome="ok", pool="a", endpoint=None, attempts=0, commit_s=None,
                          accepted=None, drafted=None, idempotency=None)  # fmt: skip
            _request(tracing, fallback=True)
            assert pipe.queued == 4 + 3 + 5
            pipe.flush()

        asyncio.run(requests())
        size, spans = trace_pipe.FRAME.unpack(os.read(r, trace_pipe.FRAME.size))
        records = marshal.loads(os.read(r, size))
        assert len(records) == 2
        assert spans == 12
        assert pipe.dropped == 3
        assert [trace_pipe.spans_of(trace_pipe.Row(rec, Writer())) for rec in records] == [4, 5]
    finally:
        os.close(r)
        os.close(w)


def test_the_export_process_reports_its_totals_and_the_gateway_reads_the_latest() -> None:
    """The export process writes a line of totals when they change (never blocking: a full pipe skips the line); the
    gateway's end takes the last whole line, keeps a partial one for later, ignores what is not a report, and adds
    the totals of an export process that ended to those of the next."""
    from gateway.observability.trace_child import Reporter

    class _Exp:
        def __init__(self) -> None:
            self.values = {"exported": 0, "queue_full": 0, "export_failed": 0, "unwritable": 0}

        def counts(self) -> dict[str, int]:
            return dict(self.values)

    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    exp = _Exp()
    report = Reporter(w)
    report(exp)  # type: ignore[arg-type]
    report(exp)  # type: ignore[arg-type]  # unchanged: no second line
    assert os.read(r, 100) == b"0 0 0 0\n"
    exp.values["exported"] = 7
    report(exp)  # type: ignore[arg-type]
    exp.values["export_failed"] = 2
    report(exp)  # type: ignore[arg-type]

    pipe = trace_pipe.SpanPipe({}, 1.0)
    pipe._out_fd = r
    assert pipe.counts()["exported"] == 7
    assert pipe.counts()["export_failed"] == 2
    os.write(w, b"garbage\n9 0 1")  # not a report, then a line not ended yet
    assert pipe.counts()["exported"] == 7
    os.write(w, b" 0\n")
    assert (pipe.counts()["exported"], pipe.counts()["export_failed"]) == (9, 1)
    pipe.lost["pipe_full"] = 3
    assert pipe.counts()["pipe_full"] == 3
    pipe._child_before = {"exported": 100, "export_failed": 5}  # an earlier export process's last totals
    assert (pipe.counts()["exported"], pipe.counts()["export_failed"]) == (109, 6)
    while True:  # a full pipe: the reporter skips lines and never blocks
        try:
            os.write(w, b"x" * 4096)
        except BlockingIOError:
            break
    exp.values["exported"] = 8
    report(exp)  # type: ignore[arg-type]
    os.close(w)
    os.close(r)
