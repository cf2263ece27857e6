"""Logging: one JSON object per line on stderr, for the gateway's own lines and for uvicorn's.

The per-request access lines bypass the ``logging`` module: building a LogRecord and flushing stderr once per
request cost about 15% of the gateway's throughput. ``AccessLog`` appends the already-serialised line to a
buffer that a lifespan task writes out every ``flush_interval_s`` (and at shutdown, and when it grows large).
"""

from __future__ import annotations

import asyncio
import logging
import select
import sys
import time
from typing import Any, BinaryIO

import orjson


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)


_PIPE_BUF = select.PIPE_BUF


class AccessLog:
    """Buffered JSON lines, one per request, written by a background task."""

    def __init__(
        self,
        stream: BinaryIO | None = None,
        *,
        enabled: bool = True,
        flush_interval_s: float = 0.2,
        max_buffer_bytes: int = 256 * 1024,
    ) -> None:
        if stream is None:  # unbuffered, so that each batch is one write(2)
            buffered = sys.stderr.buffer
            stream = getattr(buffered, "raw", buffered)
        self._stream = stream
        self.enabled = enabled
        self._interval = flush_interval_s
        self._max = max_buffer_bytes
        self._buf: list[bytes] = []
        self._size = 0

    def write(self, line: dict[str, Any]) -> None:
        if not self.enabled:
            return
        data = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
        self._buf.append(data)
        self._size += len(data)
        if self._size >= self._max:
            self.flush()

    def flush(self) -> None:
        """Write whole lines in writes of at most PIPE_BUF bytes: atomic on a pipe shared by several workers."""
        if not self._buf:
            return
        lines, self._buf, self._size = self._buf, [], 0
        batch: list[bytes] = []
        size = 0
        try:
            for line in lines:
                if batch and size + len(line) > _PIPE_BUF:
                    self._stream.write(b"".join(batch))
                    batch, size = [], 0
                batch.append(line)
                size += len(line)
            if batch:
                self._stream.write(b"".join(batch))
            self._stream.flush()
        except (OSError, ValueError):  # stderr closed: drop, never break a request for a log line
            pass

    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval)
                self.flush()
        finally:
            self.flush()
