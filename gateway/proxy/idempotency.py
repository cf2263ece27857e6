"""Idempotency-Key: claim, replay, complete or release (IETF httpapi idempotency-key draft; Stripe where it is silent).

A request with the header claims its key in the store (``gateway.store``) before anything is forwarded:

================================  =============================================================================
store answers                     the request gets
================================  =============================================================================
``Claimed``                       forwarded; its response is recorded as it is sent and stored (or released)
``Completed``, same fingerprint   the stored response, replayed with ``Idempotent-Replayed: true``; no upstream
``Running``, same fingerprint     409 ``idempotency_key_in_use`` + Retry-After; or, with ``on_running: wait``,
                                  polls until it completes (replay), disappears (claims it) or times out (409)
either, another fingerprint       422 ``idempotency_key_mismatch``
``StoreUnavailable``              503 + Retry-After (``store_unavailable: refuse``), or runs without a key
``Completed``, invalid record     the same as ``StoreUnavailable``, counted in
                                  ``specgate_store_rejected_records_total{kind="idempotency"}`` (``decode``)
================================  =============================================================================

**Key syntax.** The draft makes the header a Structured Field sf-string (``Idempotency-Key: "8e03978e"``); SDKs send
a bare token (``Idempotency-Key: 8e03978e``). Both are accepted and name the same key: a quoted string of 1..255
printable ASCII characters (``\\"`` and ``\\\\`` escapes), or a bare run of 1..255 visible ASCII characters
without ``"`` or ``\\``. Anything else, or the header sent twice, is 400 ``invalid_idempotency_key``.

**Scope.** Keys are per caller: the store key is a hash of the caller's bearer token and the key, so one tenant
can never read another's response. Without client authentication the bearer token the client sends still scopes
its keys (no token: one shared ``anonymous`` scope); that separates well-behaved clients, it is no security
boundary. Each record counts to its owner (``store_owner``: the tenant, else the key's scope), and the store caps
what one owner keeps (``gateway.store.memory``), so one tenant's records never push out another's.

**Fingerprint.** sha256 of the method, the path and the body re-serialised with sorted keys (orjson): the same JSON
with other whitespace or key order is the same request; any changed value is another (422).

**What is stored.** Only a response that was generated for the client: a 2xx, an upstream 4xx relayed, or a
stream that started, even one that broke after the commit point (replayed as it was sent, error event and all:
generating again could give a second, different answer). A response larger than the YAML's
``idempotency.max_response_bytes`` is not kept (the recording stops there, so memory stays bounded while it runs):
the key stays *used* with a small marker, and its replays get 410 ``idempotency_response_not_stored``, never a
second generation. The key being spent matters more than the bytes: a retry that generated again could act twice.
A gateway error before the commit point (503 no capacity, every attempt failed, an upstream 5xx) releases the key,
so the client's retry runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from starlette.types import Message, Send

from gateway.config.schema import Idempotency as IdempotencyConfig
from gateway.errors import BadRequest, IdempotencyKeyInUse, IdempotencyKeyMismatch, IdempotencyStoreUnavailable
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.record import RequestRecord
from gateway.proxy.stored_response import Recorder, StoredResponse, record_cap
from gateway.store.base import Claimed, Completed, Store, StoreUnavailable

logger = logging.getLogger("specgate.idempotency")

KEY_HEADER = "idempotency-key"
MAX_KEY_LENGTH = 255
SETTLE_TIMEOUT_S = 2.0  # one try at completing or releasing a claim after the response went out
SETTLE_RETRY_S = 15.0  # how long completing is retried (with backoff) before the response is given up

Result = Literal[
    "claimed",  # this request owns the key and runs
    "stored",  # its response was stored for replay
    "released",  # nothing was generated: the key is free again
    "lost",  # the claim was gone when the request finished (lease ran out, claimed again): nothing stored
    "replayed",  # a completed response was replayed
    "waited_replayed",  # on_running wait: replayed once the first request completed
    "conflict",  # 409: the first request still runs
    "mismatch",  # 422: the key was used with another request
    "store_unavailable",  # the store could not be reached (503, or ran without a key)
    "too_large",  # the response was larger than max_response_bytes: a marker stored, replays get 410
]

_BARE_KEY = re.compile(r"[!#-\[\]-~]{1,255}")  # visible ASCII except '"' and '\'
_SF_STRING_BODY = re.compile(r'(?:[ !#-\[\]-~]|\\["\\])*')
_SF_ESCAPE = re.compile(r'\\(["\\])')


def _invalid(message: str) -> BadRequest:
    return BadRequest(message, code="invalid_idempotency_key")


def parse_key(values: list[str]) -> str | None:
    """The key from the request's ``Idempotency-Key`` header values; None without one. Raises 400 when malformed."""
    if not values:
        return None
    if len(values) > 1:
        raise _invalid(f"send one Idempotency-Key header, not {len(values)}")
    raw = values[0].strip(" \t")
    if raw.startswith('"'):
        body = raw[1:-1]
        if len(raw) < 2 or not raw.endswith('"') or not _SF_STRING_BODY.fullmatch(body):
            raise _invalid("Idempotency-Key must be a quoted string of printable ASCII or a bare token")
        key = _SF_ESCAPE.sub(r"\1", body)
    elif _BARE_KEY.fullmatch(raw):
        key = raw
    else:
        raise _invalid(
            f"Idempotency-Key must be 1..{MAX_KEY_LENGTH} visible ASCII characters (or a quoted string), got "
            f"{len(raw)} characters"
        )
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise _invalid(f"Idempotency-Key must be 1..{MAX_KEY_LENGTH} characters, got {len(key)}")
    return key


def tenant_scope(authorization: str | None) -> bytes:
    """Whose keys these are: a digest of the caller's bearer token, or the one shared anonymous scope."""
    if authorization and authorization[:7].lower() == "bearer ":
        token = authorization[7:].strip()
        if token:
            return hashlib.sha256(b"bearer\0" + token.encode()).digest()
    return b"anonymous"


def store_owner(tenant: str | None, scope: bytes) -> str:
    """Whose records these are, for the store's per-owner caps: the tenant when tenants are configured (all its API
    keys share one allowance), else the key's scope; "" for the anonymous scope, which then has only the store's
    overall caps (as a single-user gateway always had). Short and fixed in form; reveals no key."""
    if tenant is not None:
        return "t:" + tenant
    if scope == b"anonymous":  # no token (a gateway without client keys): no one in particular, no share of its own
        return ""
    return "k:" + hashlib.sha256(scope).hexdigest()[:32]


def store_key(scope: bytes, key: str) -> str:
    """The store's key for one caller's Idempotency-Key (fixed length; reveals neither)."""
    return "idem:" + hashlib.sha256(scope + b"\0" + key.encode()).hexdigest()


def fingerprint(method: str, path: str, body: Mapping[str, Any]) -> str:
    """The request as the key's owner sent it: method, path and the body in canonical JSON (sorted keys)."""
    h = hashlib.sha256(f"{method.upper()} {path}\0".encode())
    h.update(orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
    return h.hexdigest()


class KeyClaim:
    """A key this request owns: the lease is renewed while it runs; at the end the response is stored or released."""

    def __init__(
        self,
        store: Store,
        key: str,
        token: str,
        cfg: IdempotencyConfig,
        metrics: GatewayMetrics,
        request_id: str,
        fingerprint: str = "",
        owner: str = "",
    ) -> None:
        self.store = store
        self.owner = owner
        self.key = key
        self.token = token
        self.fingerprint = fingerprint
        self.lease_ms = max(1, int(cfg.lease_s * 1000))
        self.ttl_ms = max(1, int(cfg.ttl_s * 1000))
        self.metrics = metrics
        self.request_id = request_id
        self.recorder = Recorder(limit=cfg.max_response_bytes)
        self.generated = False  # set by the relay once the response is one the client may act on (module doc)
        self._renewal: asyncio.Task[None] | None = None
        self._settled = False

    def start_renewal(self) -> None:
        if self._renewal is None:
            self._renewal = asyncio.create_task(self._renew(), name=f"specgate-idempotency-lease-{self.request_id}")

    async def _renew(self) -> None:
        interval = self.lease_ms / 3000
        while True:
            await asyncio.sleep(interval)
            try:
                owned = await self.store.extend(self.key, self.token, lease_ms=self.lease_ms)
            except Exception as exc:  # never end the renewal silently: the lease would run out mid-request
                logger.warning("cannot renew the idempotency lease of %s: %s", self.request_id, exc)
                continue
            if not owned:
                logger.warning("request %s lost its Idempotency-Key claim (lease ran out)", self.request_id)
                return

    def recording(self, send: Send, client_gone: Callable[[], bool]) -> Send:
        """``send`` that records every message; once the client is gone it records only (the run goes on)."""

        async def record_and_send(message: Message) -> None:
            self.recorder.record(message)
            if client_gone():
                return
            try:
                await send(message)
            except OSError:  # the client went away between two sends; the response is still recorded
                logger.debug("client of %s gone while sending", self.request_id)

        return record_and_send

    def outcome(self) -> tuple[Result, StoredResponse | None]:
        """What ``settle`` will do: store the recorded response when one was generated, else release the key."""
        stored = self.recorder.response() if self.generated else None
        if stored is None:
            return "released", None
        return ("too_large" if self.recorder.overflow else "stored"), stored

    async def settle(self, stored: StoredResponse | None) -> None:
        """Complete the claim with ``stored`` (None: release it). Bounded in time; never raises but cancellation."""
        if self._settled:
            return
        self._settled = True
        if self._renewal is not None:
            self._renewal.cancel()
            self._renewal = None  # the cancelled task's frame holds this claim: no cycle left for the GC to find
        result: Result = "released" if stored is None else "too_large" if self.recorder.overflow else "stored"
        blob = None if stored is None else stored.encode()
        # A generated response must not be lost to a store blip: once the lease ran out, a repeat would generate a
        # second, different answer. So completing is retried with backoff for up to SETTLE_RETRY_S, the lease
        # renewed in between (the client already has its last byte; only this task waits). Releasing is tried
        # once: if it fails the lease runs out by itself and the key is free again after lease_s.
        delay = 0.25
        deadline = time.monotonic() + (SETTLE_RETRY_S if blob is not None else 0.0)
        while True:
            try:
                async with asyncio.timeout(SETTLE_TIMEOUT_S):
                    if blob is None:
                        owned = await self.store.release(self.key, self.token)
                    else:
                        owned = await self._complete(blob)
                break
            except (StoreUnavailable, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    logger.error("cannot %s the Idempotency-Key of %s: %s", result, self.request_id, exc or "timeout")
                    _count(self.metrics, "store_unavailable")
                    return
                logger.warning("retrying to %s the Idempotency-Key of %s: %s", result, self.request_id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 4.0)
                with contextlib.suppress(Exception):
                    await self.store.extend(self.key, self.token, lease_ms=self.lease_ms)
            except Exception:
                logger.exception("error settling the Idempotency-Key of %s", self.request_id)
                return
        if not owned and stored is not None:
            logger.warning("request %s finished after losing its Idempotency-Key claim: not stored", self.request_id)
            result = "lost"
        _count(self.metrics, result)

    async def _complete(self, blob: bytes) -> bool:
        """Store ``blob`` under the claim. A claim lost while the request ran (its record evicted, or Redis
        restarted without persistence) is taken again when the key is free, so the answer the client got is
        what a repeat replays, instead of a new generation."""
        if await self.store.complete(self.key, self.token, blob, ttl_ms=self.ttl_ms):
            return True
        if await self.store.get(self.key) is not None:
            return False  # another request holds or completed it: never overwrite
        got = await self.store.claim(self.key, self.fingerprint, lease_ms=self.lease_ms, owner=self.owner)
        if not isinstance(got, Claimed):
            return False
        self.token = got.token
        return await self.store.complete(self.key, self.token, blob, ttl_ms=self.ttl_ms)


@dataclass(frozen=True, slots=True)
class Replay:
    """A request whose Idempotency-Key already has a stored response: that response, sent again."""

    response: StoredResponse
    result: Result  # replayed | waited_replayed


def _count(metrics: GatewayMetrics, result: Result, record: RequestRecord | None = None) -> None:
    metrics.idempotency.labels(result).inc()
    if record is not None:
        record.idempotency = result


async def begin(
    store: Store,
    cfg: IdempotencyConfig,
    metrics: GatewayMetrics,
    *,
    key: str,
    fingerprint: str,
    record: RequestRecord,
    owner: str = "",
) -> KeyClaim | Replay | None:
    """Claim ``key`` (a ``store_key``) for this request, or say why not (the module's table).

    ``owner`` (``store_owner``): whose record the claim is, for the store's per-owner caps.
    Returns the claim to run under, a stored response to replay, or None (store unreachable, and the YAML says
    to proceed without idempotency). Raises the 409 / 422 / 503 ``GatewayError``\\ s.
    """
    request_id = record.request_id
    lease_ms = max(1, int(cfg.lease_s * 1000))
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    delay = 0.02
    try:
        while True:
            got = await store.claim(key, fingerprint, lease_ms=lease_ms, max_bytes=record_cap(cfg), owner=owner)
            if isinstance(got, Claimed):
                _count(metrics, "claimed", record)
                return KeyClaim(store, key, got.token, cfg, metrics, request_id, fingerprint, owner)
            if got.fingerprint != fingerprint:
                _count(metrics, "mismatch", record)
                raise IdempotencyKeyMismatch(
                    "this Idempotency-Key was already used with a different request (method, path or body)"
                )
            if isinstance(got, Completed):
                result: Result = "replayed" if deadline is None else "waited_replayed"
                try:
                    if got.oversize:
                        raise ValueError(f"larger than {record_cap(cfg)} bytes (not read)")
                    stored = StoredResponse.decode(got.response, max_bytes=record_cap(cfg))
                except ValueError as exc:  # not a record this gateway wrote: ignored, as an unreachable store
                    metrics.store_rejected.labels("idempotency").inc()
                    logger.warning("request %s: ignoring an invalid Idempotency-Key record: %s", request_id, exc)
                    raise StoreUnavailable(f"invalid stored response: {exc}") from exc
                _count(metrics, result, record)
                return Replay(stored, result)
            if cfg.on_running == "wait":
                now = loop.time()
                if deadline is None:
                    deadline = now + cfg.wait_timeout_s
                if now < deadline:
                    await asyncio.sleep(min(delay, deadline - now))
                    delay = min(delay * 1.5, 0.5)
                    continue
            _count(metrics, "conflict", record)
            raise IdempotencyKeyInUse(
                "a request with this Idempotency-Key is still in progress; retry later", retry_after_s=1
            )
    except StoreUnavailable as exc:
        _count(metrics, "store_unavailable", record)
        if cfg.store_unavailable == "proceed":
            logger.warning("idempotency store unavailable, %s runs without its key: %s", request_id, exc)
            return None
        raise IdempotencyStoreUnavailable(
            "the idempotency store is unavailable; a request with an Idempotency-Key is refused rather than risk "
            "running it twice",
            retry_after_s=2,
        ) from exc
