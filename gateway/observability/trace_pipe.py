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

from gateway.observability.trace_export import LOST
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
# Why spans are dropped before the export process has them: the pipe's bound was reached, no export process took
# them (it died or is being replaced, or the gateway is stopping), a trace could not be recorded (a bug; logged).
PIPE_LOST = ("pipe_full", "export_process_down", "unwritable")
REPORT_FIELDS = ("exported", *LOST)  # the totals on a line of the export process's stdout, in order
_REPORT_BYTES = 1 << 16  # the most read of the child's report lines at once


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
        self._lock = threading.RLock()  # ``_stop`` runs under it from ``_write``, or alone at shutdown
        self._closed = False
        self._pending_spans = 0  # spans of the frames in ``_pending`` (an upper bound)
        # spans dropped here, by why: the pipe was full, no export process took them, a trace could not be put in
        # a record (``PIPE_LOST``); the export process's own counts come on its stdout (``counts``)
        self.lost: dict[str, int] = dict.fromkeys(PIPE_LOST, 0)
        self._out_fd = -1  # the child's stdout: its report lines (``trace_child.Reporter``)
        self._out_buf = b""
        self._child_now: dict[str, int] = {}  # the running child's latest totals
        self._child_before: dict[str, int] = {}  # the totals of the children that ended
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
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env, close_fds=True)
        assert proc.stdin is not None
        assert proc.stdout is not None
        fd = proc.stdin.fileno()
        self._out_fd, self._out_buf = proc.stdout.fileno(), b""
        os.set_blocking(self._out_fd, False)
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
            self.lost["export_process_down"] += spans
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
                self.lost["pipe_full"] += spans
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
                    self.lost["unwritable"] += spans_of(t)
                    self._warn("a trace could not be recorded for export", exc_info=True)
            return marshal.dumps(good)

    def _write(self, data: bytes, spans: int) -> None:
        """``data``: what was pending, then a new frame of ``spans`` spans (or none)."""
        waiting, self._pending, self._pending_spans = self._pending_spans, b"", 0
        if not data:
            return
        if self._fd < 0:
            if self._closed or (self._ever and time.monotonic() - self._started < self._restart_s):
                self.lost["export_process_down"] += spans
                return
            self._restart()
            if self._fd < 0:
                self.lost["export_process_down"] += spans
                return
        try:
            n = os.write(self._fd, data)
        except BlockingIOError:
            n = 0
        except OSError as exc:  # the child is gone: what was waiting is lost; a new child on a later batch
            self.lost["export_process_down"] += waiting + spans
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
        deadline = time.monotonic() + (0.0 if kill else self._timeout_s + 2)
        while proc.poll() is None and time.monotonic() < deadline:  # its last report lines read meanwhile
            with self._lock:
                self._read_reports()
            time.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        with self._lock:
            self._read_reports()
            for k, v in self._child_now.items():
                self._child_before[k] = self._child_before.get(k, 0) + v
            self._child_now, self._out_fd, self._out_buf = {}, -1, b""
            if proc.stdout is not None:
                proc.stdout.close()

    def _read_reports(self) -> None:
        """Take the export process's latest totals from what its stdout holds (never waiting)."""
        if self._out_fd < 0:
            return
        data = self._out_buf
        try:
            while chunk := os.read(self._out_fd, _REPORT_BYTES):
                data += chunk
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._out_fd = -1
        *lines, self._out_buf = data.split(b"\n")
        for line in reversed(lines):
            fields = line.split()
            if len(fields) == len(REPORT_FIELDS) and all(f.isdigit() for f in fields):
                self._child_now = dict(zip(REPORT_FIELDS, map(int, fields), strict=True))
                break
        if len(self._out_buf) > _REPORT_BYTES:  # not a report: forget it
            self._out_buf = b""

    def counts(self) -> dict[str, int]:
        """Spans exported and dropped so far: the export processes' reports (``REPORT_FIELDS``), plus the spans
        dropped here (``PIPE_LOST``); ``unwritable`` is both sides'."""
        with self._lock:
            self._read_reports()
            out = dict.fromkeys(("exported", *LOST, *PIPE_LOST), 0)
            for counts in (self._child_before, self._child_now, self.lost):
                for k, v in counts.items():
                    out[k] += v
            return out

    @property
    def dropped(self) -> int:
        """Spans dropped here, before an export process had them."""
        return sum(self.lost.values())

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
                self.lost["export_process_down"] += spans
                self._warn(f"the last spans could not be handed to the trace export process: {exc}")
