"""Header hygiene between client and upstream (RFC 9110 §7.6.1).

Hop-by-hop headers, and every header named in ``Connection``, stop at the gateway in both directions.
The client's ``Authorization`` never reaches a pool: it is replaced by the pool's own key, or dropped.
``X-Request-Id`` is kept (or generated) and forwarded, so vLLM logs the same id as the gateway.

Other client headers are forwarded, except this deny-list (``CLIENT_DENIED``): headers that let a client steer
vLLM itself (``X-data-parallel-rank`` picks the data-parallel rank that serves the request), that claim to be the
gateway's (``x-specgate-*``), or that speak for the client's address (``Forwarded``, ``X-Real-IP``). The
client's address is appended to ``X-Forwarded-For`` (after any values the client sent), as proxies do.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Set again by the HTTP client or server on each leg, or meaningless across it.
_REQUEST_DROP = HOP_BY_HOP | {"host", "content-length", "authorization", "accept-encoding", "expect"}
# Client headers that must not reach a pool (module docstring); x-specgate-* is dropped by prefix.
CLIENT_DENIED = frozenset({"x-data-parallel-rank", "forwarded", "x-real-ip"})
_REQUEST_DROP_ID = _REQUEST_DROP | CLIENT_DENIED | {"x-request-id", "x-forwarded-for"}  # set by the gateway
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date", "x-request-id"}
_RESPONSE_DROP_B = frozenset(h.encode() for h in _RESPONSE_DROP)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# A random (version 4, RFC 9562 variant) UUID as 32 hex digits, as uuid.uuid4().hex, without building a UUID object.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def request_id(incoming: str | None) -> str:
    """The client's X-Request-Id when it is sane, else a new one."""
    if incoming and _REQUEST_ID_RE.fullmatch(incoming):
        return incoming
    return f"{int.from_bytes(os.urandom(16), 'big') & _UUID4_CLEAR | _UUID4_SET:032x}"


def upstream_request_headers(
    client_headers: Iterable[tuple[str, str]],
    *,
    request_id: str,
    api_key: str | None,
    client_addr: str | None = None,
) -> dict[str, str]:
    """Headers to send to a pool: client headers minus hop-by-hop, credentials and the deny-list, plus id, pool key
    and ``X-Forwarded-For``."""
    out: dict[str, str] = {}
    named: list[str] = []  # the values of Connection headers
    forwarded: list[str] = []  # the client's X-Forwarded-For values
    for k, v in client_headers:
        lk = k.lower()
        if lk in _REQUEST_DROP_ID or lk.startswith("x-specgate-"):
            if lk == "connection":
                named.append(v)
            elif lk == "x-forwarded-for":
                forwarded.append(v)
            continue
        out[lk] = v
    for v in named:  # a header named in Connection is dropped too, wherever it stood
        for t in v.split(","):
            if t.strip():
                out.pop(t.strip().lower(), None)
    if client_addr:
        forwarded.append(client_addr)
    if forwarded:
        out["x-forwarded-for"] = ", ".join(forwarded)
    out["x-request-id"] = request_id
    out["content-type"] = "application/json"
    out["accept-encoding"] = "identity"
    if api_key:
        out["authorization"] = f"Bearer {api_key}"
    return out


def client_response_headers(upstream_headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Headers from a pool's response worth passing to the client: raw bytes, lower-case names.

    Values are never decoded: HTTP allows obs-text bytes that are neither UTF-8 nor ours to judge.
    """
    out: list[tuple[bytes, bytes]] = []
    named: set[bytes] = set()  # the headers named in Connection
    for k, v in upstream_headers:
        k = k.lower()
        if k in _RESPONSE_DROP_B:
            if k == b"connection":
                named.update(t.strip().lower().encode("latin-1") for t in v.decode("latin-1").split(","))
            continue
        if not k.startswith(b"x-specgate-"):
            out.append((k, v))
    if named:
        out = [(k, v) for k, v in out if k not in named]
    return out
