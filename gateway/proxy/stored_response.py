"""What a keyed request's response is stored as for its replays (``StoredResponse``: the status, the headers worth
repeating, the body or SSE transcript, in a small checked binary format), and the ``Recorder`` that keeps what was
sent to the client while it runs. The Idempotency-Key guard that stores and replays them is
``gateway.proxy.idempotency``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import orjson
from starlette.responses import Response
from starlette.types import Message

from gateway.config.schema import Idempotency as IdempotencyConfig
from gateway.proxy.wire import sse_error

REPLAYED_HEADER = b"idempotent-replayed"
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
_MAGIC = b"SGI1"
# A stored record is the response body (at most max_response_bytes, plus an error event when a stream was cut
# short) and a small head; a record larger than that allowance, or a head larger than MAX_HEAD_BYTES, was not
# written by the gateway.
RECORD_OVERHEAD_BYTES = 64 * 1024
MAX_HEAD_BYTES = 16 * 1024
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters (a tab is allowed) in a header value
NOT_STORED_CODE = "idempotency_response_not_stored"


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


def record_cap(cfg: IdempotencyConfig) -> int:
    """The largest record read back from the store: the configured response cap and the head's allowance."""
    return cfg.max_response_bytes + RECORD_OVERHEAD_BYTES
