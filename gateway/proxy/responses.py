"""The Responses API's state on the pools: who owns a response, which endpoint holds it, and sending its follow-ups
there.

vLLM keeps a stored response (and the conversation behind it) in the memory of the one server that made it, under
the id the request named, in one store shared by all of that server's callers. So:

- Every id is the gateway's: ``POST /v1/responses`` goes out with a ``request_id`` the gateway minted
  (``gateway.proxy.owned_ids``), whatever the client sent, so no client can name, read or overwrite another's.
- When that request is answered 200 and did not say ``store: false``, the gateway records response id → pool,
  endpoint and URL in the store (``remember``: memory, or Redis shared by every replica), for ``idempotency.ttl_s``,
  before the client sees the answer (a stream: once its ``response.created`` event arrived), and only when the
  answer carries the minted id.
- A request with ``previous_response_id``, and ``GET /v1/responses/{id}`` / ``POST /v1/responses/{id}/cancel``, go
  to that endpoint and only there: one attempt, no fallback to another endpoint or pool (which would not know the
  conversation). It is tried while it passes its health checks, drained or not: a drain stops new conversations,
  not the ones it holds.
- ``DELETE /v1/responses/{id}`` drops the caller's record and answers OpenAI's deletion object; vLLM 0.33 has no
  route to delete a stored response, so nothing is sent to the pool, and the id resolves no more.
- No record (an unknown id, one older than the TTL, one of another API key, one created with ``store: false``, one
  deleted): 404 ``response_not_found``, the same answer whichever it is. The endpoint left the config: 409
  ``response_endpoint_gone``. It fails its health checks: 503 ``response_endpoint_unavailable`` with
  ``Retry-After`` (it may come back). The store cannot be read: 503 ``response_store_unavailable``. None of these
  ever sends the request elsewhere.

Records are scoped like Idempotency-Keys: the store key is a hash of the caller's bearer token and the response id,
so one API key can neither see, read, continue, cancel nor delete another's responses through the gateway.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import (
    ResponseEndpointGone,
    ResponseEndpointUnavailable,
    ResponseNotFound,
    ResponseStoreUnavailable,
)
from gateway.fleet.pools import EndpointState, PoolState
from gateway.proxy.dialect import response_id_of
from gateway.proxy.idempotency import store_owner, tenant_scope
from gateway.proxy.owned_ids import mint_response_id
from gateway.routing.plan import STICKY, Plan
from gateway.routing.responses_features import valid_response_id
from gateway.store.base import Store, StoreUnavailable

logger = logging.getLogger("specgate.responses")

OnAnswer = Callable[[PoolState, EndpointState, bytes], Awaitable[None]]


# The records' key prefix. Records written before the gateway minted every id (under "resp:") may name ids a client
# chose, which another client may have overwritten on the pool since: they are never read, and expire on their own.
RECORD_PREFIX = "resp-owned:"


def record_key(scope: bytes, response_id: str) -> str:
    """The store key of one caller's response id (fixed length; reveals neither)."""
    return RECORD_PREFIX + hashlib.sha256(scope + b"\0" + response_id.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Holder:
    """Where a response lives: pool, endpoint id and URL (the URL guards against an id reused for another server)."""

    pool: str
    endpoint: str
    url: str

    def encode(self) -> bytes:
        return orjson.dumps({"pool": self.pool, "endpoint": self.endpoint, "url": self.url})

    @classmethod
    def decode(cls, raw: bytes) -> Holder | None:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("pool", "endpoint", "url")):
            return None
        return cls(data["pool"], data["endpoint"], data["url"])


def _no_retry() -> dict[str, str]:
    return {"x-should-retry": "false"}


def _not_found(response_id: str, param: str) -> ResponseNotFound:
    """The one answer for every id the caller has no record of, whatever the reason (another API key's included:
    an id's existence is never revealed to anyone but its owner)."""
    return ResponseNotFound(
        f"Response with id '{response_id[:256]}' not found: this gateway has no record of it for this API key "
        "(unknown, deleted, older than the record's TTL, created with store: false, or by another API key).",
        param=param,
        headers=_no_retry(),
    )


async def locate(
    store: Store, pools: Mapping[str, PoolState], scope: bytes, response_id: str, *, param: str
) -> tuple[PoolState, EndpointState]:
    """The pool and endpoint holding ``response_id`` for this caller, or the error that says why there is none."""
    if not valid_response_id(response_id):
        raise _not_found(response_id, param)
    try:
        raw = await store.recall(record_key(scope, response_id))
    except StoreUnavailable as exc:
        raise ResponseStoreUnavailable(
            f"where response '{response_id}' lives cannot be looked up now ({exc})",
            param=param,
            public=f"where response '{response_id}' lives cannot be looked up now",
        ) from exc
    holder = Holder.decode(raw) if raw is not None else None
    if holder is None:
        raise _not_found(response_id, param)
    pool = pools.get(holder.pool)
    ep = next((e for e in pool.endpoints if e.id == holder.endpoint and e.url == holder.url), None) if pool else None
    if pool is None or ep is None:
        raise ResponseEndpointGone(
            f"response '{response_id}' is held by endpoint {holder.pool}/{holder.endpoint}, which is no longer part of "
            "this gateway's config; no other server holds its state, so it is not sent anywhere else",
            param=param,
            public=f"response '{response_id}' is held by a server that is no longer part of this gateway's config; "
            "no other server holds its state, so it is not sent anywhere else",
            headers=_no_retry(),
        )
    if not ep.healthy:
        raise ResponseEndpointUnavailable(
            f"response '{response_id}' is held by endpoint {pool.name}/{ep.id}, which is failing its health checks; "
            "no other server holds its state, retry once it is back",
            param=param,
            public=f"response '{response_id}' is held by a server of pool {pool.name} that is failing its health "
            "checks; no other server holds its state, retry once it is back",
            retry_after_s=5,
        )
    return pool, ep


def recorder(store: Store, scope: bytes, ttl_ms: int, minted: str, owner: str = "") -> OnAnswer:
    """What records a 200 answer's response id (``ProxyJob.on_answer``): only ``minted``, the id the gateway sent.
    An answer under another id (a pool that did not take the request's ``request_id``) is logged and not recorded:
    its follow-ups get 404 rather than an id the gateway did not choose. A store failure is logged, never raised:
    the answer still goes out, and only its follow-ups will find no record."""

    async def on_answer(pool: PoolState, ep: EndpointState, payload: bytes) -> None:
        rid = response_id_of(payload)
        if rid != minted:
            logger.warning(
                "a Responses API answer from %s/%s carried the id %r instead of the gateway's %s: not recorded",
                pool.name,
                ep.id,
                None if rid is None else rid[:64],
                minted,
            )
            return
        try:
            await store.remember(
                record_key(scope, rid), Holder(pool.name, ep.id, ep.url).encode(), ttl_ms=ttl_ms, owner=owner
            )
        except StoreUnavailable as exc:
            logger.warning("response %s from %s/%s was not recorded: %s", rid, pool.name, ep.id, exc)

    return on_answer


def stores_state(body: Mapping[str, Any]) -> bool:
    """The pool keeps this request's response (``store`` defaults to true in the Responses API)."""
    return body.get("store") is not False


# --- creating a response ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sticky:
    """What ``POST /v1/responses`` adds to its plan: the endpoint it must go to, the recorder of its answer, and the
    response id the gateway minted for it (sent as the body's ``request_id``)."""

    pinned: tuple[PoolState, EndpointState] | None
    on_answer: OnAnswer | None
    response_id: str = ""

    @property
    def plan(self) -> Plan | None:
        return None if self.pinned is None else Plan((self.pinned[0].name,), STICKY)


async def for_create(
    store: Store,
    pools: Mapping[str, PoolState],
    body: Mapping[str, Any],
    authorization: str | None,
    ttl_s: float,
    tenant: str | None = None,
) -> Sticky:
    """The stickiness of one ``POST /v1/responses`` (its body already classified, so its fields are valid): the
    caller's own ``previous_response_id`` only, and a new id of the gateway's for the response. Its record counts
    to ``tenant`` (when tenants are configured) or to the key's scope (``store_owner``)."""
    scope = tenant_scope(authorization)
    previous = body.get("previous_response_id")
    pinned = None
    if isinstance(previous, str):
        pinned = await locate(store, pools, scope, previous, param="previous_response_id")
    minted = mint_response_id()
    on_answer = None
    if stores_state(body):
        on_answer = recorder(store, scope, int(ttl_s * 1000), minted, store_owner(tenant, scope))
    return Sticky(pinned, on_answer, minted)


async def forget(store: Store, scope: bytes, response_id: str) -> None:
    """Drop this caller's record of ``response_id``; 404 as ``locate`` answers when it has none."""
    try:
        dropped = valid_response_id(response_id) and await store.forget(record_key(scope, response_id))
    except StoreUnavailable as exc:
        raise ResponseStoreUnavailable(
            f"response '{response_id}' cannot be deleted now: the store is unavailable ({exc})",
            param="response_id",
            public=f"response '{response_id}' cannot be deleted now: the store is unavailable",
        ) from exc
    if not dropped:
        raise _not_found(response_id, "response_id")
