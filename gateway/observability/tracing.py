"""OpenTelemetry traces of the proxied requests (``specgate serve --tracing``; the ``tracing`` extra).

Off by default, and then nothing of this runs: the request path checks one ``None`` (``RequestRecord.trace``) and
neither the exporter nor gRPC is imported. On, ``Tracing`` (one per process, built by the runtime) starts a
``RequestTrace`` per proxied request, which the request path calls at a few points; the trace it becomes::

    POST /v1/chat/completions   SERVER    the client's traceparent/tracestate continued, or a new trace
    ├── specgate.admission      INTERNAL  arrival → the first attempt: body read, decision, Idempotency-Key,
    │                                     admission control (the pools that admitted no more)
    ├── specgate.route          INTERNAL  the routing decision: class, task type, plan, reason, controller
    │                                     state/share/why, expected completion time per pool (explain's facts)
    ├── chat <model>            CLIENT    one per upstream attempt: pool, endpoint, status, error.type, TTFT,
    │   └── llm_request                   committed; vLLM's own span joins below it (the attempt's traceparent)
    └── chat <model>            CLIENT    the next attempt after a failure before the commit point

How it stays cheap: while the request runs, ``RequestTrace`` keeps timestamps and references in its slots (the ids
are drawn at once, so a pool's ``traceparent`` names the attempt span written later). When the request ends and
its trace is exported (head sample or tail decision, ``trace_export``), its values are copied into a record of
plain data and handed in batches through a pipe to the gateway process's export process (``trace_pipe``,
``trace_child``), which writes the spans as OTLP protobuf (``trace_spans``, ``otlp_wire``) and sends them, on
another core and under another interpreter lock.

Most requests are neither sampled nor kept, and theirs is the path that matters. An unsampled trace is *quiet*
(``RequestRecord.quiet``): it keeps the decision's facts unread (``decided``), sends its planned attempt's
``traceparent`` and notes where it went in one tuple (``quiet_attempt``), never reads the answer, and is dropped at
the end. The tail decision keeps it (``keep``) the moment it falls back (before the next attempt leaves: that
attempt and its pool's spans are then recorded and sampled like a head-sampled request's) or when it ends failed
(its one attempt then made from what the request's record says of it; its answer was not read, so such a trace has
no finish reasons or token usage).

No prompt or completion text is ever put in a span: finish reasons and token counts are read from the pool's answer
by a pattern that only matches the JSON keys, and error messages (which may quote a pool's answer) stay in the
access log; spans carry ``error.type``.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gateway.observability import otlp_wire as wire

if TYPE_CHECKING:
    from gateway.observability.trace_export import Exporter, HeadSampler
    from gateway.observability.trace_pipe import SpanPipe

TRACE_ID_HEADER = "x-specgate-trace-id"
# gen_ai.operation.name of each proxied path (the GenAI conventions have no name of their own for the Responses API).
OPERATIONS: Mapping[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/embeddings": "embeddings",
}
# Outcomes that mark the server span as failed (and so are kept by the tail decision); a client's own error or its
# going away is not the gateway's failure.
_FAILED = frozenset({"upstream_error", "no_capacity", "overloaded", "stream_error", "client_stalled", "gateway_error"})
# Read from the pool's JSON: only the keys match (a quote inside a JSON string is escaped, so text cannot fake them).
_FINISH_KEY = b'"finish_reason":'
_FINISH = re.compile(rb'"finish_reason":\s*"([A-Za-z_]{1,32})"')
_USAGE_KEYS = (
    ("gen_ai.usage.input_tokens", (b'"prompt_tokens":', b'"input_tokens":')),
    ("gen_ai.usage.output_tokens", (b'"completion_tokens":', b'"output_tokens":')),
)
_COUNT = re.compile(rb"\s*(\d{1,12})[,}\s]")
_MAX_FINISH_REASONS = 16
_USAGE_WINDOW = 512  # bytes after the "usage" key that hold its token counts
# The W3C traceparent, as the OpenTelemetry propagator reads it (a future version may add fields after the flags).
_TRACEPARENT = re.compile(r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$")
_TRACESTATE = re.compile(r"^[\x20-\x7e]{1,512}$")  # bounded and printable; passed on as it came
_MAX_ATTEMPTS_KEPT = 64


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the packages it needs (gRPC, the ``tracing`` extra) are not installed."""


class Tracing:
    """The process's tracing: the head sampler and the exporter set up from the ``OTEL_*`` variables
    (``trace_export``): the export process (``trace_pipe``, started by ``start_export``). ``send`` replaces it with
    an export thread in this process that hands each encoded ``ExportTraceServiceRequest`` to ``send`` (tests)."""

    def __init__(self, env: Mapping[str, str] | None = None, send: Callable[[bytes], None] | None = None) -> None:
        try:
            from gateway.observability import trace_export

            # the export process imports gRPC, not this one (10 MB less per gateway process): only look for it
            if send is None and importlib.util.find_spec("grpc") is None:
                raise ImportError("No module named 'grpc'")
        except ImportError as exc:
            raise TracingUnavailable(f"tracing needs gRPC: pip install 'specgate[tracing]' ({exc})") from exc
        environ = os.environ if env is None else env
        self.sampler: HeadSampler = trace_export.head_sampler(environ)
        cfg = trace_export.ExportConfig.from_env(environ)
        self.exporter: Exporter | SpanPipe
        if send is None:  # the export process (``trace_pipe``, ``trace_child``)
            from gateway.observability.trace_pipe import SpanPipe

            self.exporter = SpanPipe(environ, cfg.timeout_s)
        else:  # in this process: a thread writes the spans and hands them to ``send``
            from gateway.observability.trace_spans import encode

            self.exporter = trace_export.Exporter(cfg, send, encode)
        self.encoder = wire.Encoder()  # used by the export thread only (``trace_spans``)
        self.random = random.Random()
        self._bound = self.sampler.bound
        self._follow_parent = self.sampler.parent_based

    def start(
        self, method: str, path: str, request_id: str, traceparent: str | None, tracestate: str | None
    ) -> RequestTrace:
        """The trace of a request that arrived now, continuing the client's trace when it sent a valid one."""
        if traceparent is None:  # the common case: a new trace, sampled by its id
            trace_id = self.random.getrandbits(128) or 1
            return RequestTrace(
                self, method, path, request_id, trace_id, None, "", (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < self._bound
            )
        parent_id: bytes | None = None
        parent_sampled: bool | None = None
        state = ""
        trace_id = 0
        m = _TRACEPARENT.match(traceparent)
        if m is not None and m.group(1) != "ff" and not (m.group(1) == "00" and m.group(5)):
            tid, sid = int(m.group(2), 16), int(m.group(3), 16)
            if tid and sid:
                trace_id, parent_id = tid, sid.to_bytes(8, "big")
                parent_sampled = bool(int(m.group(4), 16) & 1)
                if tracestate is not None and _TRACESTATE.match(tracestate):
                    state = tracestate.strip()
        if not trace_id:
            trace_id = self.random.getrandbits(128) or 1
        if self._follow_parent and parent_sampled is not None:
            sampled = parent_sampled
        else:
            sampled = (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < self._bound
        return RequestTrace(self, method, path, request_id, trace_id, parent_id, state, sampled)

    def span_id(self) -> int:
        return self.random.getrandbits(64) or 1

    def start_export(self) -> None:
        """Start the export process (the gateway's startup; a process that never serves starts none)."""
        start = getattr(self.exporter, "start", None)
        if start is not None:
            start()

    def span_counts(self) -> dict[str, int]:
        """Spans exported and dropped so far, by reason (``specgate_trace_spans_*``)."""
        return self.exporter.counts()

    def flush(self) -> None:
        """Send what is queued now (tests)."""
        self.exporter.flush()

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout), then stop."""
        self.exporter.shutdown()


class Attempt:
    """One upstream attempt, recorded; its CLIENT span is written when the request ends."""

    __slots__ = ("committed", "end_ns", "endpoint", "error_type", "kind", "model", "number", "pool", "span_id",
                 "start_ns", "status", "ttft_s", "url")  # fmt: skip

    def __init__(
        self,
        span_id: int,
        number: int,
        pool: str,
        kind: str,
        endpoint: str,
        url: str,
        model: str | None,
        start_ns: int | None = None,
    ) -> None:
        self.span_id = span_id
        self.number = number
        self.pool, self.kind, self.endpoint, self.url, self.model = pool, kind, endpoint, url, model
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.end_ns = 0
        self.status: int | None = None
        self.error_type: str | None = None
        self.ttft_s: float | None = None
        self.committed = False


class Ending:
    """How the request ended (``RequestTrace.finish``): the server span's facts from the end of the request."""

    __slots__ = ("accepted", "attempts", "commit_s", "drafted", "end_ns", "endpoint", "failed", "fallback",
                 "finish_reasons", "idempotency", "outcome", "pool", "status", "usage")  # fmt: skip

    def __init__(self, end_ns: int, status: int, outcome: str, pool: str, endpoint: str | None, attempts: int,
                 failed: bool, fallback: bool) -> None:  # fmt: skip
        self.end_ns, self.status, self.outcome, self.pool, self.endpoint = end_ns, status, outcome, pool, endpoint
        self.attempts, self.failed, self.fallback = attempts, failed, fallback
        self.commit_s: float | None = None
        self.accepted: int | None = None
        self.drafted: int | None = None
        self.idempotency: str | None = None
        self.finish_reasons: tuple[str, ...] = ()
        self.usage: dict[str, int] | None = None


class RequestTrace:
    """What one request's spans will say (module docstring). Not thread-safe: one request's task calls it, until
    ``finish`` hands it to the export thread (which only reads it)."""

    __slots__ = ("admission", "answered", "attempts", "decision", "ending", "expected", "finish_reasons", "first",
                 "method", "operation", "params", "parent_id", "path", "planned", "request_id", "route_facts",
                 "sampled", "start_ns", "state", "tid", "trace", "trace_id", "traffic_class", "usage")  # fmt: skip

    def __init__(self, t: Tracing, method: str, path: str, request_id: str, trace_id: int, parent_id: bytes | None,
                 state: str, sampled: bool) -> None:  # fmt: skip
        self.trace = t
        self.start_ns = time.time_ns()
        self.method, self.path, self.request_id = method, path, request_id
        self.operation = OPERATIONS.get(path, "chat")
        self.tid = trace_id
        self.trace_id = trace_id.to_bytes(16, "big").hex()  # twice as fast as f"{trace_id:032x}"
        self.parent_id = parent_id
        self.state = state
        self.sampled = sampled
        self.admission: tuple[int, Sequence[str], str | None] | None = None
        self.route_facts: tuple[Any, ...] | None = None
        self.expected: Sequence[tuple[str, float]] | Callable[[str], Sequence[tuple[str, float]]] = ()
        self.attempts: list[Attempt] = []
        self.answered: Attempt | None = None  # the attempt that answered (ended with the request)
        self.planned: str | None = None
        self.finish_reasons: list[str] | None = None
        self.usage: dict[str, int] | None = None
        self.params: tuple[Any, Any, Any, bool] | None = None
        self.traffic_class: str | None = None
        self.ending: Ending | None = None
        self.decision: Callable[[RequestTrace], None] | None = None  # unsampled: the decision's facts (``decided``)
        self.first: tuple[Any, ...] | None = None  # unsampled: where its planned attempt went (``quiet_attempt``)

    def request(self, model: Any, temperature: Any, max_tokens: Any, stream: bool) -> None:
        """The client's sampling parameters that the conventions name (never its messages); checked when the
        spans are written."""
        self.params = (model, temperature, max_tokens, stream)

    def route(
        self,
        start_ns: int,
        *,
        traffic_class: str,
        task_type: str | None,
        plan: Sequence[str],
        reason: str,
        choice: Any = None,
        expected: Sequence[tuple[str, float]] | Callable[[str], Sequence[tuple[str, float]]] = (),
        end_ns: int | None = None,
    ) -> None:
        """The routing decision, timed from ``start_ns`` to ``end_ns`` (None: now). ``choice``: the class
        controller's answer (``RouteChoice``) or None; ``expected``: (pool, expected completion seconds) of the last
        scrape round, or what gives them for the class (asked now only when the head sample keeps the trace, else
        at its end)."""
        self.expected = expected(traffic_class) if self.sampled and callable(expected) else expected
        self.route_facts = (start_ns, time.time_ns() if end_ns is None else end_ns, task_type, plan, reason, choice)
        self.planned = plan[0] if plan else None
        self.traffic_class = traffic_class

    def decided(self, planned: str | None, write: Callable[[RequestTrace], None]) -> None:
        """The request was classified and its pools planned (``planned``: the first of them). ``write`` puts the
        client's sampling parameters and the decision on the trace it is given (``request``, ``route``, with the
        decision's own timestamps); it holds no reference to the trace, which would make a cycle that only the
        garbage collector frees. A sampled trace calls it now; an unsampled one keeps it and calls it only when the
        tail decision keeps the trace (``finish``), so most requests never read those facts (what ``write`` reads,
        the decision and the parsed body, does not change after the decision)."""
        self.planned = planned
        if self.sampled:
            write(self)
        else:
            self.decision = write

    def _link(self, headers: dict[str, str]) -> int:
        """A new attempt span's id, and its ``traceparent`` (sampled or not, as the trace) in place of the client's
        in ``headers`` (to the pool), with the client's ``tracestate`` carried on."""
        span_id = self.trace.random.getrandbits(64) or 1
        sid = span_id.to_bytes(8, "big").hex()  # faster than formatting the int
        headers["traceparent"] = f"00-{self.trace_id}-{sid}-01" if self.sampled else f"00-{self.trace_id}-{sid}-00"
        if self.state:
            headers["tracestate"] = self.state
        else:
            headers.pop("tracestate", None)
        return span_id

    def send_attempt(
        self,
        headers: dict[str, str],
        full: Sequence[str],
        pool: str,
        kind: str,
        endpoint: str,
        url: str,
        model: str | None,
    ) -> Attempt:
        """An attempt leaves now: the admission span ends at the first one, the attempt's span starts, and its
        ``traceparent`` replaces the client's in ``headers`` (to the pool), so the pool's spans join below it.
        ``model``: the one asked of this pool when not the requested one (a class's fallback model)."""
        now = time.time_ns()
        if self.admission is None:
            self.admission = (now, tuple(full) if full else (), None)
        attempts = self.attempts
        attempt = Attempt(self._link(headers), len(attempts) + 1, pool, kind, endpoint, url, model, now)
        if len(attempts) < _MAX_ATTEMPTS_KEPT:
            attempts.append(attempt)
        return attempt

    def quiet_attempt(self, headers: dict[str, str], full: Sequence[str], *where: Any) -> None:
        """An unsampled trace's attempt to its planned pool (``fell_back`` says no), the one attempt most requests
        make: its ``traceparent`` to the pool (flag 00: the pool records nothing of it, where without one it would
        start a trace of its own) and a tuple of where it went (``where``: ``send_attempt``'s pool, kind, endpoint,
        url, model); the Attempt is made of them only if the tail decision keeps the trace (``keep``)."""
        self.first = (self._link(headers), *where, time.time_ns(), full)

    def keep(self, first: tuple[int | None, str | None, float, float | None] | None = None) -> None:
        """The tail decision keeps this unsampled trace (it fell back, or failed): from now on it records like a
        sampled one (its next attempts' ``traceparent`` say sampled, so the pool's spans join it), and what it put
        off is done now: its decision's facts, and the Attempt of its quiet attempt. ``first``: how that attempt
        ended, as the request's record has it (status, error type (None: it answered), seconds until its answer or
        failure, time to first token), or None (no end recorded: it was cancelled)."""
        self.sampled = True
        write, self.decision = self.decision, None
        if write is not None:
            write(self)
        if callable(self.expected):
            self.expected = self.expected(self.traffic_class or "")
        f, self.first = self.first, None
        if f is None:
            return
        span_id, pool, kind, endpoint, url, model, start_ns, full = f
        if self.admission is None:
            self.admission = (start_ns, tuple(full), None)
        attempt = Attempt(span_id, len(self.attempts) + 1, pool, kind, endpoint, url, model, start_ns)
        self.attempts.append(attempt)
        if first is None:
            attempt.end_ns, attempt.error_type = time.time_ns(), "cancelled"
            return
        status, error_type, took_s, ttft_s = first
        attempt.status = status
        if error_type is None:
            attempt.ttft_s = ttft_s
            self.answered = attempt
        else:
            attempt.end_ns, attempt.error_type = start_ns + int(took_s * 1e9), error_type

    def attempt_failed(self, attempt: Attempt, status: int | None, error_type: str) -> None:
        attempt.end_ns = time.time_ns()
        attempt.status = status
        attempt.error_type = error_type

    def attempt_answered(self, attempt: Attempt, status: int, ttft_s: float | None) -> None:
        """The attempt the client's answer comes from: it stays open until the request ends."""
        attempt.status = status
        attempt.ttft_s = ttft_s
        self.answered = attempt

    def observe(self, data: bytes) -> None:
        """Finish reasons and token usage from a piece of the pool's answer (a whole body, or stream events; the
        request path hands them to a recording trace only, never a quiet one): each key found by ``bytes.find`` and
        its value matched right there (no pattern scans the whole piece)."""
        at = data.find(_FINISH_KEY)
        while at >= 0:
            # most stream events say "finish_reason":null: only a string is matched
            m = None if data.startswith(b"null", at + len(_FINISH_KEY)) else _FINISH.match(data, at)
            if m is not None:
                reasons = self.finish_reasons
                if reasons is None:
                    reasons = self.finish_reasons = []
                if len(reasons) < _MAX_FINISH_REASONS:
                    reasons.append(m.group(1).decode())
            at = data.find(_FINISH_KEY, at + len(_FINISH_KEY))
        at = data.rfind(b'"usage"')  # a quote inside a JSON string is escaped: only the key matches
        if at >= 0:  # each count under its first key found ("usage":null has none)
            end = at + _USAGE_WINDOW
            for name, keys in _USAGE_KEYS:
                for key in keys:
                    i = data.find(key, at, end)
                    if i >= 0:
                        m = _COUNT.match(data, i + len(key))
                        if m is not None:
                            if self.usage is None:
                                self.usage = {}
                            self.usage[name] = int(m.group(1))
                            break

    def kept(self, outcome: str, attempts: int, pool: str) -> bool:
        """Whether the trace is exported when the request ends so (``finish`` with the same values): the head
        sample kept it, or the tail decision does (the request failed, or fell back: more than one attempt, or its
        one attempt went to another pool than planned first)."""
        return self.sampled or outcome in _FAILED or self.fell_back(attempts, pool)

    def fell_back(self, attempts: int, pool: str) -> bool:
        """More than one attempt, or its one attempt went to another pool than planned first."""
        return attempts > 1 or (attempts == 1 and self.planned is not None and pool != self.planned)

    def finish(
        self,
        *,
        status: int,
        outcome: str,
        pool: str,
        endpoint: str | None,
        attempts: int,
        commit_s: float | None,
        accepted: int | None,
        drafted: int | None,
        idempotency: str | None,
    ) -> bool:
        """The request ended (once, from ``RequestRecord.finish``): when the head sample or the tail decision keeps
        it, the trace is handed to the exporter, which writes its spans (True); otherwise nothing more happens."""
        end_ns = time.time_ns()
        failed = outcome in _FAILED
        fallback = self.fell_back(attempts, pool)
        if not (self.sampled or failed or fallback):
            return False
        if not self.sampled:  # kept by the tail decision now: what it put off (``RequestRecord.keep_trace`` first)
            self.keep()
        if self.admission is None:  # refused before any attempt (or an idempotent replay: ok)
            self.admission = (end_ns, (), outcome if attempts == 0 and outcome != "ok" else None)
        opened = self.answered
        if opened is not None:
            opened.end_ns = end_ns
            opened.committed = True
            if outcome != "ok":
                opened.error_type = outcome
        e = self.ending = Ending(end_ns, status, outcome, pool, endpoint, attempts, failed, fallback)
        e.commit_s, e.accepted, e.drafted, e.idempotency = commit_s, accepted, drafted, idempotency
        if self.finish_reasons:
            e.finish_reasons = tuple(dict.fromkeys(self.finish_reasons))
        e.usage = self.usage
        # server, admission, route (when decided), one per attempt: the queue counts spans
        self.trace.exporter.submit(self, 2 + (self.route_facts is not None) + len(self.attempts))
        return True
