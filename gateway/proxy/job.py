"""What one proxied request carries from the front half (``gateway.proxy.front``) to the exchange
(``gateway.proxy.forward``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.fleet.pools import EndpointState, PoolState
from gateway.proxy.dialect import CHAT, ChatDialect
from gateway.proxy.idempotency import KeyClaim
from gateway.proxy.record import RequestRecord
from gateway.routing.plan import Plan
from gateway.runtime.detached import DetachedBudget
from gateway.runtime.tenants import Ticket


@dataclass(slots=True)
class ProxyJob:
    """What the front half (``gateway.proxy.front``) hands to the exchange: the raw body and client headers to
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
