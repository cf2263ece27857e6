"""Header hygiene between client and upstream (RFC 9110 §7.6.1).

Hop-by-hop headers, and every header named in ``Connection``, stop at the gateway in both directions.
Toward a pool, client headers pass by an allow-list: what a request to vLLM needs is set by the gateway itself
(``Content-Type``, ``Accept-Encoding: identity``, ``X-Request-Id`` (the gateway's id, which vLLM logs),
``Authorization`` with the pool's own key, never the client's), and only the headers of ``PASS_THROUGH`` are copied
from the client: ``Accept``, the W3C trace context (``traceparent``, ``tracestate``: vLLM reads them when its
tracing is on), and the control headers of the bundled test upstreams (``X-Sim-Task``, ``X-Fake-Behavior``; vLLM
ignores them). Everything else stops here: cookies, other credentials (``X-Api-Key``), ``X-Forwarded-Host``,
``x-vllm-*``, ``X-data-parallel-rank`` (vLLM's choice of rank), ``x-specgate-*``. A pass-through header named in
``Connection`` is hop-by-hop and stops too.

``X-Forwarded-For`` is built from the socket peer (``forwarded_for``): the client's own values are kept, and the
peer appended, only when the peer is one of ``--trusted-proxies``; any other client sends its address alone.
``Forwarded`` and ``X-Real-IP`` never pass.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Sequence

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
# The client headers a pool gets as they were sent (module docstring); the rest of what vLLM reads is the gateway's.
PASS_THROUGH = frozenset({"accept", "traceparent", "tracestate", "x-sim-task", "x-fake-behavior"})
_RESPONSE_DROP = HOP_BY_HOP | {"content-length", "content-encoding", "server", "date", "x-request-id"}
_RESPONSE_DROP_B = frozenset(h.encode() for h in _RESPONSE_DROP)
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# A random (version 4, RFC 9562 variant) UUID as 32 hex digits, as uuid.uuid4().hex, without building a UUID object.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def request_id(incoming: str | None, draw: Callable[[int], int] | None = None) -> str:
    """The client's X-Request-Id when it is sane, else a new one: from ``draw`` (a ``random.Random``'s
    ``getrandbits``, seeded from the system's randomness: a correlation id needs to be unique, not secret, and a
    system call per request is dear in a sandboxed kernel), else from ``os.urandom`` (ids a client must not guess)."""
    if incoming and _REQUEST_ID_RE.fullmatch(incoming):
        return incoming
    bits = int.from_bytes(os.urandom(16), "big") if draw is None else draw(128)
    return (bits & _UUID4_CLEAR | _UUID4_SET).to_bytes(16, "big").hex()


def upstream_request_headers(
    client_headers: Iterable[tuple[str, str]],
    *,
    request_id: str,
    api_key: str | None,
    forwarded_for: str | None = None,
) -> dict[str, str]:
    """Headers to send to a pool: the client's ``PASS_THROUGH`` headers (less any named in ``Connection``), then the
    gateway's own: ``X-Forwarded-For`` (``forwarded_for``), the request id, content type, the pool key."""
    out: dict[str, str] = {}
    named: list[str] = []  # the values of Connection headers
    for k, v in client_headers:
        lk = k.lower()
        if lk in PASS_THROUGH:
            out[lk] = v
        elif lk == "connection":
            named.append(v)
    for v in named:  # a header named in Connection is hop-by-hop, wherever it stood
        for t in v.split(","):
            if t.strip():
                out.pop(t.strip().lower(), None)
    if forwarded_for:
        out["x-forwarded-for"] = forwarded_for
    out["x-request-id"] = request_id
    out["content-type"] = "application/json"
    out["accept-encoding"] = "identity"
    if api_key:
        out["authorization"] = f"Bearer {api_key}"
    return out


Networks = Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network]


def is_trusted(peer: str, trusted: Networks) -> bool:
    """True when the socket peer ``peer`` lies in one of the ``trusted`` networks (an IPv4-mapped IPv6 address
    counts as its IPv4 address); a peer that is not an IP address (a Unix socket) is not trusted."""
    try:
        addr = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in trusted)


def forwarded_for(peer: str | None, client_headers: Iterable[tuple[str, str]], trusted: Networks) -> str | None:
    """The ``X-Forwarded-For`` a pool gets: the peer's address; when the peer is a trusted proxy, the values it
    sent (each ``X-Forwarded-For`` line, in order) with the peer appended."""
    if not peer:
        return None
    if trusted and is_trusted(peer, trusted):
        sent = [v.strip() for k, v in client_headers if k.lower() == "x-forwarded-for" and v.strip()]
        if sent:
            return ", ".join([*sent, peer])
    return peer


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
