"""The gateway's end of span export: finished traces handed, as compact records, to an export process of its own
(``trace_child``), which writes their spans and sends them over OTLP/gRPC on another core.

Why a process. Writing spans and sending them in a thread of the gateway's process costs the event loop more than
the thread's own work: the two share one interpreter lock, so the loop waits while the thread writes spans. Here
the event loop only keeps each exported trace, and for each batch copies the traces' values into tuples
(``record``: ints, strings and tuples of them, never a prompt or completion text; the same facts the spans say),
marshals them in one piece and writes them to the child's stdin, a pipe whose write end never blocks:

- a batch goes out when ``FLUSH_RECORDS`` records are waiting, else ``FLUSH_S`` after the first of them (a timer
  on the running event loop; without one, at once);
- what the pipe does not take now waits (at most ``PENDING_BYTES``) and goes with the next write; a batch that does
  not fit behind it is dropped, and its spans counted (``dropped``), like the export queue's bound;
- the child gone (it died, or was killed): the write fails, its records are counted as dropped, and a new child is
  started on a later batch (at most one start per ``RESTART_S``); a request never waits for it or fails for it;
- the child dies with the gateway: it exits when its stdin closes, which the kernel does when the gateway's
  process ends, however it ends; each worker process (``--workers``) has a child of its own;
- shutdown (``shutdown``) writes what is waiting, closes the pipe and waits for the child to send its last batch
  (bounded by the exporter's timeout), then kills it if it has not exited.

A frame on the pipe: its payload length and span count (two little-endian uint32), then ``marshal.dumps`` of the
list of records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import marshal
import os
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from gateway.observability.trace_spans import request_params

log = logging.getLogger(__name__)

FRAME = struct.Struct("<II")  # payload bytes, spans
FLUSH_RECORDS = 256
FLUSH_S = 0.05
PENDING_BYTES = 8 << 20  # written frames the pipe has not taken yet, at most
PIPE_BYTES = 1 << 20  # asked of the kernel for the pipe (Linux: F_SETPIPE_SZ; the default is 64 KiB)
RESTART_S = 10.0
_LOG_EVERY_S = 60.0
_F_SETPIPE_SZ = 1031


def record(t: Any) -> tuple[Any, ...]:
    """A finished ``tracing.RequestTrace``'s values, as plain data that ``marshal`` writes (``Row`` reads them)."""
    e = t.ending
    rf = t.route_facts
    if rf is not None:
        c = rf[5]
        facts = None if c is None else (str(c.state), float(c.share), str(c.pick), str(c.why))
        rf = (rf[0], rf[1], rf[2], tuple(rf[3]), rf[4], facts)
    expected = t.expected
    if type(expected) is not tuple:
        expected = () if callable(expected) else tuple(expected)
    admission = t.admission
    if admission is not None and type(admission[1]) is not tuple:
        admission = (admission[0], tuple(admission[1]), admission[2])
    attempts = [
        (a.span_id, a.number, a.pool, a.kind, a.endpoint, a.url, a.model, a.start_ns, a.end_ns, a.status,
         a.error_type, a.ttft_s, a.committed)
        for a in t.attempts
    ]  # fmt: skip
    return (t.tid, t.parent_id, t.state, t.method, t.path, t.request_id, t.operation, t.start_ns,
            request_params(t), t.traffic_class, admission, rf, expected, attempts, t.answered is not None,
            (e.end_ns, e.status, e.outcome, e.pool, e.endpoint, e.attempts, e.failed, e.fallback, e.commit_s,
             e.accepted, e.drafted, e.idempotency, e.finish_reasons, e.usage))  # fmt: skip


class _Attempt:
    """An attempt read back (what ``trace_spans.encode`` reads of ``tracing.Attempt``)."""

    __slots__ = ("committed", "end_ns", "endpoint", "error_type", "kind", "model", "number", "pool", "span_id",
                 "start_ns", "status", "ttft_s", "url")  # fmt: skip

    def __init__(self, a: Any) -> None:
        (self.span_id, self.number, self.pool, self.kind, self.endpoint, self.url, self.model, self.start_ns,
         self.end_ns, self.status, self.error_type, self.ttft_s, self.committed) = a  # fmt: skip


class _Ending:
    """How the request ended, read back (what ``trace_spans.encode`` reads of ``tracing.Ending``)."""

    __slots__ = ("accepted", "attempts", "commit_s", "drafted", "end_ns", "endpoint", "failed", "fallback",
                 "finish_reasons", "idempotency", "outcome", "pool", "status", "usage")  # fmt: skip

    def __init__(self, e: Any) -> None:
        (self.end_ns, self.status, self.outcome, self.pool, self.endpoint, self.attempts, self.failed,
         self.fallback, self.commit_s, self.accepted, self.drafted, self.idempotency, self.finish_reasons,
         self.usage) = e  # fmt: skip


class _Choice:
    __slots__ = ("pick", "share", "state", "why")

    def __init__(self, facts: tuple[str, float, str, str]) -> None:
        self.state, self.share, self.pick, self.why = facts


class Row:
    """A record read back, with the attributes ``trace_spans.encode`` reads of a ``RequestTrace``; ``trace``: the
    writer's state (``encoder``, ``random``)."""

    __slots__ = ("admission", "answered", "attempts", "ending", "expected", "method", "operation", "params",
                 "parent_id", "path", "request_id", "route_facts", "start_ns", "state", "tid", "trace",
                 "traffic_class")  # fmt: skip

    def __init__(self, rec: tuple[Any, ...], trace: Any) -> None:
        (self.tid, self.parent_id, self.state, self.method, self.path, self.request_id, self.operation,
         self.start_ns, self.params, self.traffic_class, self.admission, route, self.expected, attempts,
         answered, e) = rec  # fmt: skip
        self.trace = trace
        if route is not None and route[5] is not None:
            route = (*route[:5], _Choice(route[5]))
        self.route_facts = route
        self.attempts = [_Attempt(a) for a in attempts]
        self.answered = True if answered else None
        self.ending = _Ending(e)


def spans_of(t: Any) -> int:
    """How many spans ``trace_spans.encode`` writes of the trace: server, admission, route (when decided), one per
    attempt."""
    return 2 + (t.route_facts is not None) + len(t.attempts)


class SpanPipe:
    """The export process and the pipe to it (module docstring). ``submit`` is called on the event loop."""

    def __init__(
        self,
        env: Mapping[str, str],
        timeout_s: float,
        *,
        pending_bytes: int = PENDING_BYTES,
        restart_s: float = RESTART_S,
    ) -> None:
        self._env = {**os.environ, **env}
        self._timeout_s = timeout_s
        self._pending_bytes, self._restart_s = pending_bytes, restart_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._started = 0.0
        self._batch: list[Any] = []  # finished traces (``tracing.RequestTrace``), recorded when written
        self._batch_spans = 0
        self._pending = b""  # the part of written frames the pipe has not taken yet
        self._timer: asyncio.TimerHandle | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pending_spans = 0  # spans of the frames in ``_pending`` (an upper bound)
        self.dropped = 0  # spans: the pipe was full, the child gone, or a trace could not be put in a record
        self._last_warning = 0.0
        self._ever = False  # a child was started once (the first one starts without waiting ``restart_s``)

    def start(self) -> None:
        """Start the export process now (the gateway's startup), rather than at the first batch."""
        if not self._ever and not self._closed:
            self._restart()

    def _start(self) -> None:
        self._ever = True
        self._started = time.monotonic()
        self._pending, self._pending_spans = b"", 0
        cmd = [sys.executable, "-m", "gateway.observability.trace_child"]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=self._env, close_fds=True)
        assert proc.stdin is not None
        fd = proc.stdin.fileno()
        with contextlib.suppress(OSError):  # the kernel's limit may be lower: the default size then
            import fcntl

            fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
        os.set_blocking(fd, False)
        self._proc, self._fd = proc, fd

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def queued(self) -> int:
        return self._batch_spans

    def submit(self, t: Any, spans: int) -> None:
        """One request's finished trace (``spans`` spans): it joins the next batch (its record is made then, with
        the batch's others: one tight loop costs the event loop less than the same work spread over requests)."""
        if self._closed:
            self.dropped += spans
            return
        batch = self._batch
        batch.append(t)
        self._batch_spans += spans
        if len(batch) >= FLUSH_RECORDS:
            self.flush()
        elif len(batch) == 1 and self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # not on an event loop (tests, scripts): no timer to wait for
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if not self._closed:
            self.flush()

    def flush(self) -> None:
        """Write the waiting records now, never blocking: what the pipe does not take waits for the next write."""
        with self._lock:  # the event loop's, against a shutdown from another thread (the runtime's)
            self._flush()

    def _flush(self) -> None:
        batch, spans = self._batch, self._batch_spans
        self._batch, self._batch_spans = [], 0
        data = b""
        if batch:
            payload = self._dumps(batch)
            if len(self._pending) + len(payload) > self._pending_bytes:
                self.dropped += spans
                self._warn("trace export cannot keep up: spans dropped")
                spans = 0
            else:
                data = FRAME.pack(len(payload), spans) + payload
        self._write(self._pending + data if self._pending else data, spans)
        if self._pending and self._timer is None:  # try again soon, whether or not more records come
            with contextlib.suppress(RuntimeError):
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._tick)

    def _dumps(self, batch: list[Any]) -> bytes:
        """The batch's traces as one marshalled list of records; a trace that cannot be put in one (a bug) is
        dropped alone, counted."""
        try:
            return marshal.dumps([record(t) for t in batch])
        except Exception:
            good = []
            for t in batch:
                try:
                    rec = record(t)
                    marshal.dumps(rec)
                    good.append(rec)
                except Exception:
                    self.dropped += spans_of(t)
                    self._warn("a trace could not be recorded for export", exc_info=True)
            return marshal.dumps(good)

    def _write(self, data: bytes, spans: int) -> None:
        """``data``: what was pending, then a new frame of ``spans`` spans (or none)."""
        waiting, self._pending, self._pending_spans = self._pending_spans, b"", 0
        if not data:
            return
        if self._fd < 0:
            if self._closed or (self._ever and time.monotonic() - self._started < self._restart_s):
                self.dropped += spans
                return
            self._restart()
            if self._fd < 0:
                self.dropped += spans
                return
        try:
            n = os.write(self._fd, data)
        except BlockingIOError:
            n = 0
        except OSError as exc:  # the child is gone: what was waiting is lost; a new child on a later batch
            self.dropped += waiting + spans
            self._warn(f"the trace export process is gone ({exc}): spans dropped until another one starts")
            self._stop(kill=True)
            return
        if n < len(data):
            self._pending, self._pending_spans = data[n:], waiting + spans

    def _restart(self) -> None:
        try:
            self._start()
        except OSError as exc:
            self._proc, self._fd = None, -1
            self._warn(f"the trace export process could not start: {exc}")

    def _warn(self, message: str, exc_info: bool = False) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _LOG_EVERY_S:
            self._last_warning = now
            log.warning("%s (%d spans dropped so far)", message, self.dropped, exc_info=exc_info)

    def _stop(self, kill: bool) -> None:
        proc, self._proc, self._fd = self._proc, None, -1
        if proc is None:
            return
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        if kill:
            proc.kill()
        try:
            proc.wait(timeout=None if kill else self._timeout_s + 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def shutdown(self) -> None:
        """Write what is waiting (bounded by the exporter's timeout), close the pipe: the child sends its last batch
        and exits (waited for; killed past the timeout)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True  # a timer still set does nothing
            self._hand_over()
        self._stop(kill=False)  # not holding the lock: the event loop never waits for the child to exit

    def _hand_over(self) -> None:
        batch, spans = self._batch, self._batch_spans
        self._batch, self._batch_spans = [], 0
        data = self._pending
        if batch:
            payload = self._dumps(batch)
            data += FRAME.pack(len(payload), spans) + payload
        spans += self._pending_spans
        if data and self._fd >= 0:
            deadline = time.monotonic() + self._timeout_s
            view = memoryview(data)
            try:
                while view:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [self._fd], [], left)[1]:
                        raise TimeoutError("the trace export process takes nothing")
                    view = view[os.write(self._fd, view) :]
            except OSError as exc:
                self.dropped += spans
                self._warn(f"the last spans could not be handed to the trace export process: {exc}")
