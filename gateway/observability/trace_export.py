"""Where the gateway's spans go, and which ones: the head sampler and the OTLP/gRPC exporter, set up from the
standard ``OTEL_*`` variables, with a tail decision that keeps failed and fallen-back requests whatever the head
sample said.

Imported only when tracing is on (``gateway.observability.tracing.Tracing``): ``grpc_sender`` imports grpc.

Sampling. ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` choose the head sampler with the SDK's names and
meaning (``always_on``, ``always_off``, ``traceidratio``, ``parentbased_always_on``, ``parentbased_always_off``,
``parentbased_traceidratio``); unset, it is ``parentbased_traceidratio`` with the ratio ``OTEL_TRACES_SAMPLER_ARG``
(default 1.0): a client's sampled flag is followed, a new trace is kept with that chance (decided on the trace id's
low 64 bits, as the SDK's ``TraceIdRatioBased`` does, so every service sampling by ratio agrees).

The tail decision. A request records plain timestamps and values while it runs (``RequestTrace``), and its spans
are written only after it ends: for a sampled request, or for one the head sampler dropped but that failed or fell
back. Any other request builds no span at all; its ``traceparent`` to the pools says ``-00`` (not sampled), so the
gateway's spans of a trace kept by the tail decision have no vLLM span below them.

Export. ``Exporter`` runs in the gateway's export process (``trace_child``; in the gateway's own process only in
tests): it queues the finished traces; a thread writes their spans (``trace_spans``) and sends them
in batches (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans, or whatever is queued every ``OTEL_BSP_SCHEDULE_DELAY`` ms)
as OTLP/gRPC ``TraceService/Export`` to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``;
past ``OTEL_BSP_MAX_QUEUE_SIZE`` queued spans a request's trace is dropped (counted, logged). The thread wakes only
for a full batch or the schedule.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from gateway.observability import otlp_wire

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "specgate"
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED"})
# Why spans are dropped in the exporter: its queue was full (or it was stopping), the collector refused or could not be
# reached within the timeout, a trace could not be written (a bug; logged with its traceback).
LOST = ("queue_full", "export_failed", "unwritable")
_LOG_EVERY_S = 60.0  # at most one warning a minute about failed or dropped exports
_PACE = 16  # traces written between two chances for the event loop to take the GIL


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable the gateway cannot use; the message names it."""


@dataclass(frozen=True, slots=True)
class HeadSampler:
    """The head decision: ``parent_based`` follows a client's sampled flag; a new trace (or any trace, when not
    parent-based) is sampled when its id's low 64 bits are below ``bound`` (``ratio`` × 2^64)."""

    name: str
    ratio: float
    parent_based: bool
    bound: int

    def sampled(self, trace_id: int, parent_sampled: bool | None) -> bool:
        if self.parent_based and parent_sampled is not None:
            return parent_sampled
        return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < self.bound

    def description(self) -> str:
        return f"{self.name}{{{self.ratio}}}"


def head_sampler(env: Mapping[str, str]) -> HeadSampler:
    """The head sampler the ``OTEL_TRACES_SAMPLER*`` variables ask for (default: parent-based, ratio 1.0)."""
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_traceidratio").strip().lower()
    raw = (env.get("OTEL_TRACES_SAMPLER_ARG") or "").strip()
    if name not in _SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={name!r}: expected one of {', '.join(_SAMPLERS)}")
    ratio = 1.0
    if raw and name.endswith("traceidratio"):
        try:
            ratio = float(raw)
        except ValueError:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: expected a ratio in 0..1") from None
        if not 0.0 <= ratio <= 1.0:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={raw!r}: expected a ratio in 0..1")
    if name.endswith("always_on"):
        ratio = 1.0
    elif name.endswith("always_off"):
        ratio = 0.0
    return HeadSampler(name, ratio, name.startswith("parentbased_"), round(ratio * (1 << 64)))


def _env(env: Mapping[str, str], name: str) -> str | None:
    """``OTEL_EXPORTER_OTLP_TRACES_<name>``, else ``OTEL_EXPORTER_OTLP_<name>``."""
    return env.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}") or env.get(f"OTEL_EXPORTER_OTLP_{name}") or None


def _number(env: Mapping[str, str], name: str, default: float, least: float, most: float) -> float:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise TracingConfigError(f"{name}={raw!r}: expected a number") from None
    if not least <= value <= most:
        raise TracingConfigError(f"{name}={raw!r}: expected {least:g}..{most:g}")
    return value


@dataclass(frozen=True, slots=True)
class ExportConfig:
    """The exporter's settings, read from the environment the way the SDK's OTLP/gRPC exporter reads them."""

    target: str  # host:port
    secure: bool
    certificate: str | None
    headers: tuple[tuple[str, str], ...]
    timeout_s: float
    gzip: bool
    schedule_delay_s: float
    batch_spans: int
    queue_spans: int
    resource: tuple[tuple[str, str], ...]

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ExportConfig:
        endpoint = _env(env, "ENDPOINT") or "http://localhost:4317"
        parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
        if not parts.hostname:
            raise TracingConfigError(f"OTEL_EXPORTER_OTLP_ENDPOINT={endpoint!r}: expected http(s)://host:port")
        insecure = (_env(env, "INSECURE") or "").strip().lower() == "true"
        secure = parts.scheme == "https" or (parts.scheme not in ("http", "https") and not insecure)
        headers = []
        for item in (_env(env, "HEADERS") or "").split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                headers.append((unquote(key.strip()).lower(), unquote(value.strip())))
        compression = (_env(env, "COMPRESSION") or "none").strip().lower()
        if compression not in ("none", "gzip"):
            raise TracingConfigError(f"OTEL_EXPORTER_OTLP_COMPRESSION={compression!r}: expected none or gzip")
        timeout = _number(env, "OTEL_EXPORTER_OTLP_TIMEOUT", 10.0, 0.001, 600.0)  # seconds, as the SDK reads it
        if env.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"):
            timeout = _number(env, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", 10.0, 0.001, 600.0)
        batch = int(_number(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 2048, 1, 65536))
        queue = int(_number(env, "OTEL_BSP_MAX_QUEUE_SIZE", 16384, 1, 1_048_576))
        resource: dict[str, str] = {}
        for item in (env.get("OTEL_RESOURCE_ATTRIBUTES") or "").split(","):
            key, sep, value = item.partition("=")
            if sep and key.strip():
                resource[unquote(key.strip())] = unquote(value.strip())
        resource["service.name"] = env.get("OTEL_SERVICE_NAME") or resource.get("service.name", DEFAULT_SERVICE_NAME)
        resource.update({"telemetry.sdk.language": "python", "telemetry.sdk.name": "specgate"})
        return cls(
            target=f"{parts.hostname}:{parts.port or 4317}",
            secure=secure,
            certificate=_env(env, "CERTIFICATE"),
            headers=tuple(headers),
            timeout_s=timeout,
            gzip=compression == "gzip",
            schedule_delay_s=_number(env, "OTEL_BSP_SCHEDULE_DELAY", 5000, 1, 3_600_000) / 1000,
            batch_spans=min(batch, queue),
            queue_spans=queue,
            resource=tuple(resource.items()),
        )


def grpc_sender(cfg: ExportConfig) -> tuple[Callable[[bytes], None], Callable[[], None]]:
    """(send one encoded ExportTraceServiceRequest, close the channel): a plain gRPC unary call that carries
    bytes as they are; failures the receiver may recover from are tried again within the timeout."""
    import grpc

    if cfg.secure:
        root = None
        if cfg.certificate:
            with open(cfg.certificate, "rb") as f:
                root = f.read()
        channel = grpc.secure_channel(cfg.target, grpc.ssl_channel_credentials(root))
    else:
        channel = grpc.insecure_channel(cfg.target)
    call = channel.unary_unary(EXPORT_METHOD)
    compression = grpc.Compression.Gzip if cfg.gzip else None

    def send(data: bytes) -> None:
        deadline = time.monotonic() + cfg.timeout_s
        backoff = 0.5
        while True:
            left = deadline - time.monotonic()
            try:
                call(data, timeout=max(left, 0.001), metadata=cfg.headers or None, compression=compression)
                return
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if getattr(code, "name", "") not in _RETRYABLE or left <= backoff:
                    raise
            time.sleep(backoff)
            backoff *= 2

    return send, channel.close


class Exporter:
    """The queue of finished traces and the thread that writes their spans and sends them (module docstring).
    ``encode`` writes one queued item's spans, joined (``trace_spans.encode``); ``send`` replaces gRPC (tests);
    ``pace``: give the GIL back every few traces (an event loop shares the process); ``on_export``: called (from the
    thread) after each export, sent or not (the export process reports its counts). ``submit`` never blocks on the
    network and does no encoding."""

    def __init__(
        self,
        cfg: ExportConfig,
        send: Callable[[bytes], None] | None = None,
        encode: Callable[[Any], bytes] = b"".join,
        *,
        pace: bool = True,
        on_export: Callable[[Exporter], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self._pace = pace
        self._on_export = on_export
        self._close: Callable[[], None] = lambda: None
        if send is None:
            send, self._close = grpc_sender(cfg)
        self._send = send
        self._encode = encode
        self._fixed = otlp_wire.resource_fields(cfg.resource, "specgate", "1")
        self._queue: deque[tuple[Any, int]] = deque()
        self._queued = 0  # spans in the queue
        self._cond = threading.Condition(threading.Lock())
        self._stopping = False
        # spans dropped, by why: the queue was full, an export failed, a trace could not be written (``LOST``)
        self.lost: dict[str, int] = dict.fromkeys(LOST, 0)
        self.exported = 0
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="specgate-trace-export", daemon=True)
        self._thread.start()

    def submit(self, item: Any, spans: int) -> None:
        """One request's finished trace, which ``encode`` turns into ``spans`` spans."""
        with self._cond:
            if self._queued + spans > self.cfg.queue_spans or self._stopping:
                self.lost["queue_full"] += spans
                return
            self._queue.append((item, spans))
            self._queued += spans
            if self._queued >= self.cfg.batch_spans and self._queued - spans < self.cfg.batch_spans:
                self._cond.notify()

    def _take(self) -> list[tuple[Any, int]]:
        """Up to one batch of traces off the queue, the lock held."""
        out: list[tuple[Any, int]] = []
        n = 0
        queue = self._queue
        while queue and (not out or n + queue[0][1] <= self.cfg.batch_spans):
            item = queue.popleft()
            out.append(item)
            n += item[1]
        self._queued -= n
        return out

    def _run(self) -> None:
        cfg = self.cfg
        while True:
            with self._cond:
                if self._queued < cfg.batch_spans and not self._stopping:
                    self._cond.wait(cfg.schedule_delay_s)
                batch = self._take()
                stopping = self._stopping and not self._queue
            if batch:
                self._export(batch, pace=self._pace)
            if stopping:
                return

    def _export(self, batch: list[tuple[Any, int]], pace: bool = False) -> None:
        """Write the batch's spans and send them. ``pace``: give the GIL back every few traces, so the event loop
        waits at most a few hundred microseconds for it (not the interpreter's switch interval)."""
        spans: list[bytes] = []
        written = failed = 0
        for i, (item, n) in enumerate(batch):
            try:
                spans.append(self._encode(item))
                written += n
            except Exception:  # a bug in writing one trace: that trace is lost, not the batch
                log.exception("a trace could not be written")
                failed += n
            if pace and i % _PACE == _PACE - 1:
                time.sleep(0)
        self.lost["unwritable"] += failed
        if not spans:
            self._reported()
            return
        try:
            self._send(otlp_wire.request(self._fixed, spans))
            self.exported += written
        except Exception as exc:  # a collector away or refusing: the batch is lost, the gateway goes on
            self.lost["export_failed"] += written
            now = time.monotonic()
            if now - self._last_warning >= _LOG_EVERY_S:
                self._last_warning = now
                target, dropped = self.cfg.target, self.dropped
                log.warning("trace export to %s failed (%d spans dropped so far): %s", target, dropped, exc)
        self._reported()

    def _reported(self) -> None:
        if self._on_export is not None:
            self._on_export(self)

    @property
    def dropped(self) -> int:
        """Spans dropped so far, whatever the reason."""
        return sum(self.lost.values())

    def counts(self) -> dict[str, int]:
        """Spans exported and dropped so far (``exported``, then each reason of ``LOST``)."""
        return {"exported": self.exported, **self.lost}

    def flush(self, timeout_s: float = 10.0) -> None:
        """Send everything queued now (tests, shutdown), from the calling thread."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                batch = self._take()
            if not batch:
                return
            self._export(batch)

    def shutdown(self) -> None:
        """Send what is queued (bounded by the exporter's timeout per batch), stop the thread, close the channel."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(self.cfg.timeout_s + 1)
        self._close()

    @property
    def queued(self) -> int:
        return self._queued
