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
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from starlette.responses import Response
from starlette.types import Message, Send

from gateway.config.schema import Idempotency as IdempotencyConfig
from gateway.errors import BadRequest, IdempotencyKeyInUse, IdempotencyKeyMismatch, IdempotencyStoreUnavailable
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.record import RequestRecord
from gateway.proxy.wire import sse_error
from gateway.store.base import Claimed, Completed, Store, StoreUnavailable

logger = logging.getLogger("specgate.idempotency")

KEY_HEADER = "idempotency-key"
REPLAYED_HEADER = b"idempotent-replayed"
MAX_KEY_LENGTH = 255
# The response headers a replay repeats (the original request's id included); the rest describe one exchange.
STORED_HEADERS = frozenset(
    {
        b"content-type",
        b"x-request-id",
        b"x-specgate-class",
        b"x-specgate-pool",
        b"x-specgate-route",
        b"x-specgate-task-type",
    }
)
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
_MAGIC = b"SGI1"
# A stored record is the response body (at most max_response_bytes, plus an error event when a stream was cut
# short) and a small head; a record larger than that allowance, or a head larger than MAX_HEAD_BYTES, was not
# written by the gateway.
RECORD_OVERHEAD_BYTES = 64 * 1024
MAX_HEAD_BYTES = 16 * 1024
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters (a tab is allowed) in a header value
NOT_STORED_CODE = "idempotency_response_not_stored"


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


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as the client received it: status, the headers worth repeating, the body or SSE transcript."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def encode(self) -> bytes:
        """``SGI1``, a 4-byte length, a small JSON header (status, headers), then the body bytes unchanged."""
        head = orjson.dumps(
            {"status": self.status, "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in self.headers]}
        )
        return _MAGIC + len(head).to_bytes(4, "big") + head + self.body

    @classmethod
    def decode(cls, blob: bytes, *, max_bytes: int = 0) -> StoredResponse:
        """A record as ``encode`` wrote it, or ValueError: what a store gives back is checked, never trusted (the
        size, the status 200–599, the headers: only ``STORED_HEADERS``, each once, no control characters)."""
        if 0 < max_bytes < len(blob):
            raise ValueError(f"larger than {max_bytes} bytes")
        if blob[:4] != _MAGIC or len(blob) < 8:
            raise ValueError("not a stored response (bad magic)")
        n = int.from_bytes(blob[4:8], "big")
        if n > MAX_HEAD_BYTES or 8 + n > len(blob):
            raise ValueError(f"a head of {n} bytes")
        head = orjson.loads(blob[8 : 8 + n])  # orjson.JSONDecodeError is a ValueError
        if not isinstance(head, dict):
            raise ValueError("the head is not an object")
        status = head.get("status")
        if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
            raise ValueError(f"status {str(status)[:20]!r} is not 200..599")
        raw = head.get("headers")
        if not isinstance(raw, list) or len(raw) > len(STORED_HEADERS):
            raise ValueError("headers: not a list of at most the stored headers")
        headers: list[tuple[bytes, bytes]] = []
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                raise ValueError("headers: each must be a [name, value] pair of strings")
            name, value = item[0].encode("latin-1"), item[1]  # UnicodeEncodeError is a ValueError
            if name not in STORED_HEADERS or any(k == name for k, _ in headers):
                raise ValueError(f"header {item[0][:40]!r} is not one the gateway stores (or is repeated)")
            if len(value) > 1024 or _BAD_VALUE.search(value):
                raise ValueError(f"header {item[0]!r} has a value the gateway never stores")
            headers.append((name, value.encode("latin-1")))
        return cls(status, tuple(headers), blob[8 + n :])

    def replay(self) -> Response:
        """The stored response again, marked ``Idempotent-Replayed: true`` (a stream as its exact transcript)."""
        response = Response(self.body, self.status)
        response.raw_headers = [
            *self.headers,
            (b"content-length", str(len(self.body)).encode()),
            (REPLAYED_HEADER, b"true"),
        ]
        return response


def not_stored(size: int, limit: int, headers: tuple[tuple[bytes, bytes], ...]) -> StoredResponse:
    """What a key whose response was too large to keep replays: 410, saying so (the key stays used)."""
    message = (
        f"the response to this Idempotency-Key was larger than the {limit} bytes the gateway keeps for replay "
        f"(at least {size} bytes); it was sent once and is not generated again: use a new key for a new request"
    )
    body = orjson.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": NOT_STORED_CODE}}
    )
    kept = tuple((k, v) for k, v in headers if k != b"content-type")
    return StoredResponse(410, ((b"content-type", b"application/json"), *kept), body)


@dataclass(slots=True)
class Recorder:
    """What was sent to the client: the ``http.response.*`` messages of one ASGI response, up to ``limit`` body
    bytes (past it the chunks are dropped and only the size is kept)."""

    limit: int = 4 * 1024 * 1024
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    chunks: list[bytes] = field(default_factory=list)
    ended: bool = False
    size: int = 0
    overflow: bool = False

    def record(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
        elif message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                self.size += len(body)
                if self.size > self.limit:
                    self.overflow = True
                    self.chunks.clear()
                elif not self.overflow:
                    self.chunks.append(bytes(body))
            if not message.get("more_body", False):
                self.ended = True

    def response(self) -> StoredResponse | None:
        """The response to store; None when none started, or a non-stream one did not end; the 410 marker
        (``not_stored``) when it was too large to keep."""
        if self.status is None:
            return None
        if self.overflow:
            return not_stored(self.size, self.limit, tuple((k, v) for k, v in self.headers if k in STORED_HEADERS))
        body = b"".join(self.chunks)
        ctype = next((v for k, v in self.headers if k == b"content-type"), b"")
        if not self.ended:
            if not ctype.startswith(b"text/event-stream"):
                return None
            if not body.rstrip().endswith(b"data: [DONE]"):  # cut short (shutdown): replay it as a broken stream
                body += sse_error("the original response was interrupted")
        headers = tuple((k, v) for k, v in self.headers if k in STORED_HEADERS)
        return StoredResponse(self.status, headers, body)


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


def record_cap(cfg: IdempotencyConfig) -> int:
    """The largest record read back from the store: the configured response cap and the head's allowance."""
    return cfg.max_response_bytes + RECORD_OVERHEAD_BYTES


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
