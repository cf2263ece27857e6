"""The one exception tree of the gateway. Every error renders as the OpenAI envelope.

::

    GatewayError                      500 internal_error
    ├── BadRequest                    400 invalid_request_error
    │   ├── InvalidJSON               400 (code invalid_json)
    │   └── InvalidParameter          400 (param names the field)
    ├── Unauthorized                  401 authentication_error
    ├── NotFound                      404 not_found_error
    │   ├── RouteNotFound             404 (code unknown_route)
    │   └── ModelNotFound             404 (param "model", code model_not_found)
    ├── MethodNotAllowed              405
    ├── Conflict                      409 conflict_error
    │   └── IdempotencyKeyInUse       409 (code idempotency_key_in_use, Retry-After)
    ├── Unprocessable                 422 invalid_request_error
    │   └── IdempotencyKeyMismatch    422 (code idempotency_key_mismatch)
    ├── PayloadTooLarge               413 (code request_too_large)
    ├── RateLimited                   429 (a tenant's limit: type requests|tokens, code rate_limit_exceeded)
    ├── NoCapacity                    503 service_unavailable (Retry-After)
    │   ├── Overloaded                503 (code overloaded: shed, or every pool busy; Retry-After)
    │   ├── IdempotencyStoreUnavailable   503 (code idempotency_store_unavailable)
    │   └── OverrideStoreUnavailable      503 (code override_store_unavailable: an admin change not stored)
    └── UpstreamError                 502 upstream_error (an attempt failed before the commit point)
        ├── UpstreamConnectError      502 (the connection broke; retryable)
        │   └── UpstreamUnreachable   502 (connect refused / connect timeout; the endpoint leaves rotation)
        ├── UpstreamResponseTooLarge  502 (the response went past a limit; not retried)
        ├── UpstreamPoolFull          503 (no free pooled connection in time: back-pressure, never a health mark)
        └── UpstreamTimeout           504 (no first byte in time; retryable)

Errors from the upstream that carry their own status (vLLM's 400 for a prompt too long, say) are not raised:
they are relayed with their status, and only their envelope is normalised (``gateway.proxy.wire.normalise_error``).

What a client reads is not always ``message``. An error whose message names an endpoint or quotes what a pool sent
(a parser error, the pool's own error text) carries a ``public`` text for the client, and the upstream errors say
only their kind (``UpstreamError.brief``); ``message`` goes to the log line, which the request id ties to the answer
(``envelope(request_id)`` adds it to the client's text).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar


class GatewayError(Exception):
    """An error the gateway answers itself, before any response started: ``status``, the OpenAI ``type`` and
    ``code``, and ``headers`` (Retry-After, ...). The module docstring shows the tree."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        public: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message  # the whole story, for the log line
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers: dict[str, str] = dict(headers or {})
        self.public = public  # what the client reads when ``message`` holds what only the log may show

    @property
    def client_message(self) -> str:
        """The text of the client's envelope: ``public`` when set, else ``message``."""
        return self.message if self.public is None else self.public

    def envelope(self, request_id: str | None = None) -> dict[str, Any]:
        """The OpenAI envelope the client gets; ``request_id`` (the one in the log line) ends its message."""
        message = self.client_message if request_id is None else f"{self.client_message} (request id {request_id})"
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class InvalidJSON(BadRequest):
    default_code = "invalid_json"


class InvalidParameter(BadRequest):
    default_code = "invalid_value"


def finite_number(value: str | float, param: str, message: str) -> float:
    """``value`` as a finite float, else ``InvalidParameter(message)`` naming ``param``: a string that is not a
    number, an int too large for a float, NaN and the infinities are all refused alike."""
    try:
        f = float(value)
    except (ValueError, OverflowError):
        f = math.nan
    if not math.isfinite(f):
        raise InvalidParameter(message, param=param)
    return f


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class RouteNotFound(NotFound):
    default_code = "unknown_route"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class Conflict(GatewayError):
    status = 409
    type = "conflict_error"
    default_code = "conflict"


class IdempotencyKeyInUse(Conflict):
    """A request with the same Idempotency-Key is still running (the OpenAI SDK retries 409 by itself)."""

    default_code = "idempotency_key_in_use"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("retry-after", str(retry_after_s))


class Unprocessable(GatewayError):
    status = 422
    type = "invalid_request_error"
    default_code = "unprocessable_entity"


class IdempotencyKeyMismatch(Unprocessable):
    default_code = "idempotency_key_mismatch"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimited(GatewayError):
    """A tenant past one of its limits, answered as OpenAI answers one: 429, type ``requests`` or ``tokens``
    (the limit that refused), code ``rate_limit_exceeded``, with ``Retry-After`` and the ``x-ratelimit-*``
    headers (set by the caller)."""

    status = 429
    type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str = "requests", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.limit = limit  # requests, tokens or concurrent (the metric's label)

    def envelope(self, request_id: str | None = None) -> dict[str, Any]:
        out = super().envelope(request_id)
        out["error"]["type"] = "tokens" if self.limit == "tokens" else "requests"
        return out


class NoCapacity(GatewayError):
    status = 503
    type = "service_unavailable"
    default_code = "no_capacity"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("retry-after", str(retry_after_s))


class Overloaded(NoCapacity):
    """Back-pressure answered to the client: a request shed by admission control, or every pool it could go to
    busy (queueing, full, or saying so with 429/503). Not a failure of the fleet: the client may retry later."""

    default_code = "overloaded"

    def __init__(self, message: str, *, reason: str = "admission", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.reason = reason  # admission (never sent) or busy (every attempt met back-pressure)


class IdempotencyStoreUnavailable(NoCapacity):
    default_code = "idempotency_store_unavailable"


class OverrideStoreUnavailable(NoCapacity):
    default_code = "override_store_unavailable"


# A stored Responses API response (gateway.proxy.responses): no record of it for the caller, its endpoint left the
# config, that endpoint fails its health checks, or the store of records cannot be read.
class ResponseNotFound(NotFound):
    default_code = "response_not_found"


class ResponseEndpointGone(Conflict):
    default_code = "response_endpoint_gone"


class ResponseEndpointUnavailable(NoCapacity):
    default_code = "response_endpoint_unavailable"


class ResponseStoreUnavailable(NoCapacity):
    default_code = "response_store_unavailable"


class UpstreamError(GatewayError):
    """The upstream failed before the commit point and no other pool could take the request.

    ``message`` names the endpoint and quotes what went wrong (a parser error, the pool's own words): the log's.
    The client reads only the kind of failure, ``brief``."""

    status = 502
    type = "upstream_error"
    default_code = "upstream_error"
    retryable: ClassVar[bool] = False
    kind: ClassVar[str] = "the pool's answer was not usable"  # ``brief`` unless ``public`` says more

    @property
    def brief(self) -> str:
        """The failure in a few words a client may read: no endpoint, URL or upstream text in it."""
        return self.public if self.public is not None else self.kind

    @property
    def client_message(self) -> str:
        return f"the upstream attempt failed: {self.brief}"


class UpstreamConnectError(UpstreamError):
    default_code = "upstream_connect_error"
    retryable = True
    kind = "the connection to the pool broke"


class UpstreamUnreachable(UpstreamConnectError):
    default_code = "upstream_unreachable"
    kind = "the pool could not be reached"


class UpstreamResponseTooLarge(UpstreamError):
    """The pool's response went past one of the gateway's limits (head, body, decoded body, one SSE event): not
    retried on another pool (the same request would most likely get as large an answer, generated again)."""

    default_code = "upstream_response_too_large"

    def __init__(self, message: str, *, limit: str, public: str | None = None) -> None:
        super().__init__(message, public=public)
        self.limit = limit  # the limit's name in specgate_limit_refusals_total

    @property
    def brief(self) -> str:
        return self.public if self.public is not None else f"the pool's response went past the {self.limit} limit"


class UpstreamInvalidResponse(UpstreamError):
    """The pool answered something the gateway does not relay (a status outside 200–599, or 101 Switching
    Protocols): 502, not retried (the pool is misbehaving, not busy)."""

    default_code = "upstream_invalid_response"
    kind = "the pool answered with a status or head the gateway does not relay"


class UpstreamPoolFull(UpstreamError):
    """Every pooled connection to the endpoint stayed busy until the first-byte deadline: the endpoint is busy,
    not broken (back-pressure; ``gateway.routing.attempts``)."""

    status = 503
    default_code = "upstream_busy"
    retryable = True
    kind = "no free connection to the pool in time"


class UpstreamTimeout(UpstreamError):
    status = 504
    default_code = "upstream_timeout"
    retryable = True
    kind = "the pool did not answer in time"
