"""What one proxied request carries from the front half (``gateway.proxy.intake``) to the exchange
(``gateway.proxy.forward``), what a successful attempt opened, and the headers every answer carries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.fleet.pools import EndpointState, PoolState
from gateway.fleet.upstream import UpstreamResponse
from gateway.proxy.dialect import CHAT, ChatDialect
from gateway.proxy.idempotency import KeyClaim
from gateway.proxy.record import RequestRecord
from gateway.proxy.stream_tap import StreamTap
from gateway.proxy.wire import SSESplitter
from gateway.routing.plan import Plan
from gateway.runtime.detached import DetachedBudget
from gateway.runtime.tenants import Ticket


@dataclass(slots=True)
class ProxyJob:
    """What the front half (``gateway.proxy.intake``) hands to the exchange: the raw body and client headers to
    forward, the plan and attempt limit, the request's record, the headers every answer carries, and its
    Idempotency-Key claim."""

    path: str
    body: bytes
    client_headers: list[tuple[str, str]]
    stream: bool
    plan: Plan
    max_attempts: int
    record: RequestRecord
    extra_headers: list[tuple[str, str]]
    parsed: Mapping[str, Any] | None = None  # the request body as parsed (to ask a speculative pool for usage)
    # How ``parsed`` is written again (a fallback model, the usage option); None: orjson. A large body's ``parsed``
    # holds stand-ins for its bulk, and its view writes them back as sent (gateway.proxy.body_view).
    serialize: Callable[[Mapping[str, Any]], bytes] | None = None
    idempotency: KeyClaim | None = None  # the request's claim on its Idempotency-Key (records what is sent)
    dialect: ChatDialect = CHAT  # how its stream ends and fails (gateway.proxy.dialect)
    pinned: tuple[PoolState, EndpointState] | None = None  # the one endpoint to try (it holds the request's state)
    method: str = "POST"
    # Called with a 200 answer's body (a stream: its first event) before the client sees it (Responses API ids).
    on_answer: Callable[[PoolState, EndpointState, bytes], Awaitable[None]] | None = None
    forwarded_for: str | None = None  # the X-Forwarded-For a pool gets (gateway.proxy.headers.forwarded_for)
    detached: DetachedBudget | None = None  # keyed: may it run on after its client left (None: always)
    tenant: bytes = b"anonymous"  # the client's scope in ``detached``
    prompt: tuple[int, ...] = ()  # the prompt's chunk hashes (gateway.routing.prompt_key), for prefix affinity
    ticket: Ticket | None = None  # the tenant's admission (tenants configured only): fair share, priority, usage


@dataclass(slots=True)
class Opened:
    """A successful attempt: headers received, and for a stream its first event."""

    pool: PoolState
    endpoint: EndpointState
    response: UpstreamResponse
    first_events: list[bytes] | None
    splitter: SSESplitter | None
    buffered_body: bytes | None
    tap: StreamTap | None = None  # streams from a speculative pool
    model: str | None = None  # the model asked for instead of the requested one (route.fallback_model)


def response_headers(
    job: ProxyJob, opened: Opened | None, content_type: str, upstream: list[tuple[bytes, bytes]] | None = None
) -> list[tuple[bytes, bytes]]:
    """Upstream headers as raw bytes (never decoded and re-encoded), then ours: the content type, the job's extra
    headers, and where the answer came from (pool, endpoint, a fallback model, the attempts made)."""
    out = [(k, v) for k, v in upstream if k != b"content-type"] if upstream else []
    pairs = [("content-type", content_type), *job.extra_headers]
    if opened is not None:
        pairs.append(("x-specgate-pool", opened.pool.name))
        pairs.append(("x-specgate-endpoint", opened.endpoint.id))
        if opened.model is not None:
            pairs.append(("x-specgate-model", opened.model))
    pairs.append(("x-specgate-attempts", str(len(job.record.attempts))))
    out += [(k.encode("latin-1"), v.encode("latin-1", "replace")) for k, v in pairs]
    return out
