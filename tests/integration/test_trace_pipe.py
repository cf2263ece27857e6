"""The trace export process (``gateway.observability.trace_pipe``, ``trace_child``) for real: it sends what the
gateway hands it to an OTLP receiver in this process, flushes at shutdown, dies with the gateway's process, and a
dead or stuck one costs the gateway dropped spans (counted), never a blocked or failed request."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import closed_port_url, poll

pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")

from gateway.observability.trace_pipe import SpanPipe
from gateway.observability.tracing import Tracing
from tests.integration import test_tracing
from tests.integration.test_tracing import WAIT_S, Receiver
from tests.unit.test_tracing import _request

pytestmark = pytest.mark.integration
receiver = test_tracing.receiver  # the OTLP receiver in this process (a fixture)


def _gone(pid: int) -> bool:
    """The process ended (a zombie nobody reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _eventually(check: Callable[[], bool]) -> bool:
    return poll(check, WAIT_S)


def test_shutdown_sends_what_is_waiting(receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch) -> None:
    rx = receiver[0]
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")  # nothing would go before the shutdown
    tracing = Tracing()
    assert isinstance(tracing.exporter, SpanPipe)
    assert tracing.exporter.pid is None  # started by the gateway's startup, not when built
    tracing.start_export()
    pid = tracing.exporter.pid
    assert pid is not None
    ids = [_request(tracing), _request(tracing, fallback=True)]
    tracing.shutdown()
    assert _gone(pid)
    assert sorted({s.trace_id for s in rx.spans}) == sorted(ids)
    assert len(rx.trace(ids[1])) == 5
    counts = tracing.span_counts()  # the export process's last report, read when it ended
    assert counts["exported"] == 9
    assert sum(counts.values()) == 9


def test_spans_a_collector_never_took_are_counted_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", closed_port_url())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    tracing = Tracing()
    tracing.start_export()
    _request(tracing)
    try:
        assert _eventually(lambda: tracing.span_counts()["export_failed"] == 4)
        assert tracing.span_counts()["exported"] == 0
    finally:
        tracing.shutdown()


def test_the_export_process_dies_with_the_gateway(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from gateway.observability.tracing import Tracing\n"
        "t = Tracing({'OTEL_EXPORTER_OTLP_ENDPOINT': sys.argv[1]})\n"
        "t.start_export()\n"
        "print(t.exporter.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    gateway = subprocess.Popen(
        [sys.executable, "-c", script, closed_port_url()], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert gateway.stdout is not None
        child = int(gateway.stdout.readline())
        assert not _gone(child)
    finally:
        gateway.kill()  # no shutdown at all: the kernel closes the pipe
        gateway.wait()
    assert _eventually(lambda: _gone(child))


def test_a_dead_export_process_drops_spans_and_is_replaced(
    receiver: tuple[Receiver, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rx = receiver[0]
    tracing = Tracing()
    tracing.exporter.shutdown()
    pipe = tracing.exporter = SpanPipe(dict(os.environ), 5.0, restart_s=3600.0)
    pipe.start()
    first = pipe.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert _eventually(lambda: _gone(first))
    _request(tracing)  # not on an event loop: written at once, into a closed pipe
    assert pipe.dropped == 4
    assert pipe.pid is None
    _request(tracing)  # too soon for another start: dropped too, at once
    assert pipe.dropped == 8
    pipe._restart_s = 0.0
    kept = _request(tracing)
    second = pipe.pid
    assert second is not None
    assert second != first
    assert pipe.dropped == 8
    assert _eventually(lambda: len(rx.trace(kept)) == 4)
    assert _eventually(lambda: tracing.span_counts()["exported"] == 4)
    assert tracing.span_counts()["export_process_down"] == 8
    tracing.shutdown()


def test_a_stuck_export_process_never_blocks(receiver: tuple[Receiver, str]) -> None:
    rx = receiver[0]
    tracing = Tracing()
    tracing.exporter.shutdown()
    pipe = tracing.exporter = SpanPipe(dict(os.environ), 5.0, pending_bytes=64 << 10)
    pipe.start()
    pid = pipe.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(6000):  # far more than the pipe and the pending bytes hold: each call returns at once
            _request(tracing)
        assert pipe.dropped > 0
        assert pipe.counts()["pipe_full"] == pipe.dropped
    finally:
        os.kill(pid, signal.SIGCONT)

    def drained() -> bool:
        pipe.flush()
        return pipe.queued == 0 and not pipe._pending

    assert _eventually(drained)  # running again: it takes what waited
    kept = _request(tracing)
    tracing.shutdown()
    assert rx.trace(kept)
