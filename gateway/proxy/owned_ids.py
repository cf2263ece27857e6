"""The ids a pool keeps things under are the gateway's, never a client's (the body rewrites of a forwarded POST).

vLLM 0.33 names a Responses API response by the request body's ``request_id`` (``resp_<uuid hex>`` when the body
has none) and keeps it in one store per server, shared by every caller: whoever knows an id reads that response,
and whoever posts the same id again replaces it. A client that chose the id could read or overwrite another API
key's responses. So the gateway writes its own ``request_id`` into every ``POST /v1/responses`` it forwards: a fresh
random id in vLLM's own shape (``mint_response_id``), whatever the client sent. Rewritten, not dropped: the gateway
then knows the id before the pool answers, and records an answer only when it carries that id (``recorder`` in
``gateway.proxy.responses``), so no id the gateway hands out was chosen by anyone but itself.

Chat completions, completions and embeddings also accept a body ``request_id`` (a vLLM extra field): vLLM names its
engine request after the ``X-Request-Id`` header when there is one, else after that field. The gateway always sends
the header (its request id), so the field is dropped from those bodies (``without_request_id``): the body never
names an engine request. The body is serialised again only when it carries the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.proxy.headers import request_id

RESPONSE_ID_PREFIX = "resp_"


def mint_response_id() -> str:
    """A new response id: ``resp_`` and 32 random hex digits (a version-4 UUID), as vLLM makes its own."""
    return RESPONSE_ID_PREFIX + request_id(None)


Dumps = Callable[[Mapping[str, Any]], bytes]  # how a body is written (a large body's view writes its own)


def with_response_id(
    body: Mapping[str, Any], response_id: str, dumps: Dumps = orjson.dumps
) -> tuple[bytes, dict[str, Any]]:
    """A ``POST /v1/responses`` body as forwarded: the client's, with the gateway's ``request_id``."""
    owned = {**body, "request_id": response_id}
    return dumps(owned), owned


def without_request_id(raw: bytes, body: dict[str, Any], dumps: Dumps = orjson.dumps) -> tuple[bytes, dict[str, Any]]:
    """A body as forwarded without any ``request_id`` of the client's (unchanged, and not copied, when it has none)."""
    if "request_id" not in body:
        return raw, body
    owned = {k: v for k, v in body.items() if k != "request_id"}
    return dumps(owned), owned
