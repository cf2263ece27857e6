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
from collections.abc import Mapping
from typing import Any, BinaryIO

import orjson


def timestamp(epoch_s: float) -> str:
    """A log line's ``ts``: UTC, milliseconds, ``2026-01-31T12:00:00.123Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch_s)) + f".{int(epoch_s * 1000) % 1000:03d}Z"


def log_event(logger: logging.Logger, event: str, fields: Mapping[str, Any], level: int = logging.INFO) -> None:
    """One structured line: ``event`` and its ``fields``, which ``JsonFormatter`` writes as fields of the line
    (not a JSON string inside a message)."""
    logger.log(level, event, extra={"fields": fields})


# The asyncio task names of the listeners (gateway.cli.serve): a line logged while one runs names it.
LISTENER_TASKS = ("client", "admin")


def _listener() -> str | None:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        return None
    name = None if task is None else task.get_name()
    return name if name in LISTENER_TASKS else None


class JsonFormatter(logging.Formatter):
    """Every line one JSON object of one shape: ``ts``, ``level``, ``logger``, ``event``, then the event's fields
    (``log_event``); a plain message (uvicorn's, a library's) is the event ``log`` with a ``message`` field.
    ``listener``: the listener (``client`` / ``admin``) whose task logged it, when one did."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        line: dict[str, object] = {
            "ts": timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": str(record.msg) if isinstance(fields, Mapping) else "log",
        }
        listener = _listener()
        if listener is not None:
            line["listener"] = listener
        if isinstance(fields, Mapping):
            line.update((k, v) for k, v in fields.items() if k not in line)
        else:
            line["message"] = record.getMessage()
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, option=orjson.OPT_NON_STR_KEYS, default=str).decode()


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
_ACCESS_HEAD = b'Z","level":"info","logger":"specgate.access",'  # an access line after its ``ts``'s milliseconds


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
        self._second = -1  # the whole second of the last line's ``ts``, and that ``ts`` up to its seconds
        self._second_text = b""

    def write(self, line: dict[str, Any]) -> None:
        """One request's line, in the shape of every other line: ``ts``, ``level``, ``logger``, then ``line``
        (its ``event`` first). The head is written as bytes in front of the serialised ``line`` (no merged dict,
        the date formatted once a second): the same text as ``timestamp`` and one ``orjson.dumps`` of both."""
        if not self.enabled:
            return
        now = time.time()
        if not line or "ts" in line or "level" in line or "logger" in line:  # not a request's line: merged
            head = {"ts": timestamp(now), "level": "info", "logger": "specgate.access"}
            data = orjson.dumps({**head, **line}, option=orjson.OPT_APPEND_NEWLINE)
        else:
            second = int(now)
            if second != self._second:
                self._second = second
                self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)).encode()
            ms = b"%03d" % (int(now * 1000) % 1000)
            body = orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)
            data = b"".join((b'{"ts":"', self._second_text, b".", ms, _ACCESS_HEAD, memoryview(body)[1:]))
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
