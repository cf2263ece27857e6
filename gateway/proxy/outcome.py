"""The ``outcome`` label of a request (``gateway.observability.metrics.Outcome``), worked out in one place: from the
gateway's error that ended it, or from the status a pool answered with."""

from __future__ import annotations

from gateway.errors import GatewayError, NoCapacity, Overloaded, UpstreamError
from gateway.observability.metrics import Outcome


def outcome_of(exc: GatewayError) -> Outcome:
    """A request ended by the gateway's ``exc``: refused before a pool was asked, or failed before the commit point."""
    if isinstance(exc, Overloaded):  # shed: admission control, every pool busy, the body parsers full
        return "overloaded"
    if isinstance(exc, NoCapacity):
        return "no_capacity"
    if isinstance(exc, UpstreamError):
        return "upstream_error"
    return "gateway_error" if exc.status >= 500 else "client_error"


def relayed(status: int) -> Outcome:
    """A request answered with a pool's ``status``, relayed as it came."""
    if status < 400:
        return "ok"
    return "client_error" if status < 500 else "upstream_error"
