"""The trace export process (``python -m gateway.observability.trace_child``), one per gateway process, started by
``trace_pipe.SpanPipe``: it reads the finished traces' records from its stdin, writes their spans as OTLP protobuf
(``trace_spans``) and sends them with ``trace_export.Exporter`` (batches, schedule, queue bound and gRPC as set by
the same ``OTEL_*`` variables the gateway read), on a core of its own.

It ends when its stdin ends (the gateway closed the pipe, or its process ended, however): what is queued is sent
first (bounded by the exporter's timeout). Ctrl-C in a terminal reaches the whole process group: it is ignored
here, so the gateway's own shutdown decides when the last spans go. Its warnings (an export failed, spans dropped)
go to stderr, shared with the gateway, as the gateway's JSON lines.

Its stdout tells the gateway how many spans it has sent and dropped (``Reporter``): after each batch read and each
export, when a count changed, one line of totals (``REPORT_FIELDS``, space-separated). The pipe is written without
ever blocking: a line the gateway has not made room for is skipped (the next one carries the totals).
"""

from __future__ import annotations

import logging
import marshal
import os
import random
import signal
import sys
from collections.abc import Callable
from typing import BinaryIO

from gateway.observability import otlp_wire
from gateway.observability.trace_export import ExportConfig, Exporter
from gateway.observability.trace_pipe import FRAME, REPORT_FIELDS, Row, spans_of

log = logging.getLogger("specgate.trace_export")


class Reporter:
    """Writes the exporter's totals to ``fd`` (a pipe set non-blocking) when they changed (module docstring). Called
    from the reading loop and the export thread: a line is shorter than ``PIPE_BUF``, so two never interleave."""

    __slots__ = ("_fd", "_last")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._last: tuple[int, ...] = ()

    def __call__(self, exporter: Exporter) -> None:
        counts = exporter.counts()
        now = tuple(counts[k] for k in REPORT_FIELDS)
        if now == self._last:
            return
        try:
            os.write(self._fd, " ".join(map(str, now)).encode() + b"\n")
            self._last = now
        except OSError:  # full (the gateway reads it at its own pace) or closed: the next line says it all
            pass


class Writer:
    """What ``trace_spans.encode`` uses of the gateway's ``Tracing``: the attribute cache and the id source."""

    __slots__ = ("encoder", "random")

    def __init__(self) -> None:
        self.encoder = otlp_wire.Encoder()
        self.random = random.Random()


def pump(stream: BinaryIO, exporter: Exporter, report: Callable[[Exporter], None] = lambda e: None) -> int:
    """Read frames until the stream ends, queueing each record for export (``report`` after each frame); returns
    the records read."""
    writer = Writer()
    read = 0
    while True:
        head = stream.read(FRAME.size)
        if len(head) < FRAME.size:
            return read
        size, spans = FRAME.unpack(head)
        payload = stream.read(size)
        if len(payload) < size:
            return read
        try:
            records = marshal.loads(payload)
        except (ValueError, EOFError, TypeError):
            exporter.lost["unwritable"] += spans
            log.exception("a batch of trace records could not be read")
            report(exporter)
            continue
        for rec in records:
            try:
                row = Row(rec, writer)
            except (ValueError, TypeError):
                log.exception("a trace record could not be read")
                continue
            exporter.submit(row, spans_of(row))
            read += 1
        report(exporter)


def main() -> None:
    from gateway.observability.logs import configure_logging
    from gateway.observability.trace_spans import encode

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging("warning")
    os.set_blocking(sys.stdout.fileno(), False)
    reporter = Reporter(sys.stdout.fileno())
    exporter = Exporter(ExportConfig.from_env(os.environ), encode=encode, pace=False, on_export=reporter)
    try:
        pump(sys.stdin.buffer, exporter, reporter)
    finally:
        exporter.shutdown()
        reporter(exporter)
        if exporter.dropped:
            log.warning("trace export ends: %d spans sent, %d dropped", exporter.exported, exporter.dropped)


if __name__ == "__main__":
    main()
