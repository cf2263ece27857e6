"""The trace export process (``python -m gateway.observability.trace_child``), one per gateway process, started by
``trace_pipe.SpanPipe``: it reads the finished traces' records from its stdin, writes their spans as OTLP protobuf
(``trace_spans``) and sends them with ``trace_export.Exporter`` (batches, schedule, queue bound and gRPC as set by
the same ``OTEL_*`` variables the gateway read), on a core of its own.

It ends when its stdin ends (the gateway closed the pipe, or its process ended, however): what is queued is sent
first (bounded by the exporter's timeout). Ctrl-C in a terminal reaches the whole process group: it is ignored
here, so the gateway's own shutdown decides when the last spans go. Its warnings (an export failed, spans dropped)
go to stderr, shared with the gateway, as the gateway's JSON lines.
"""

from __future__ import annotations

import logging
import marshal
import os
import random
import signal
import sys
from typing import BinaryIO

from gateway.observability import otlp_wire
from gateway.observability.trace_export import ExportConfig, Exporter
from gateway.observability.trace_pipe import FRAME, Row, spans_of

log = logging.getLogger("specgate.trace_export")


class Writer:
    """What ``trace_spans.encode`` uses of the gateway's ``Tracing``: the attribute cache and the id source."""

    __slots__ = ("encoder", "random")

    def __init__(self) -> None:
        self.encoder = otlp_wire.Encoder()
        self.random = random.Random()


def pump(stream: BinaryIO, exporter: Exporter) -> int:
    """Read frames until the stream ends, queueing each record for export; returns the records read."""
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
            exporter.dropped += spans
            log.exception("a batch of trace records could not be read")
            continue
        for rec in records:
            try:
                row = Row(rec, writer)
            except (ValueError, TypeError):
                log.exception("a trace record could not be read")
                continue
            exporter.submit(row, spans_of(row))
            read += 1


def main() -> None:
    from gateway.observability.logs import configure_logging
    from gateway.observability.trace_spans import encode

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging("warning")
    exporter = Exporter(ExportConfig.from_env(os.environ), encode=encode, pace=False)
    try:
        pump(sys.stdin.buffer, exporter)
    finally:
        exporter.shutdown()
        if exporter.dropped:
            log.warning("trace export ends: %d spans sent, %d dropped", exporter.exported, exporter.dropped)


if __name__ == "__main__":
    main()
