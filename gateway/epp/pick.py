"""One request's answer in EPP mode: the endpoints Envoy should use, in fallback order, or a refusal.

The decision is the proxy mode's (``gateway.routing.decision.decide`` on the same live config and controllers);
what differs is the output: instead of running attempts, the plan is laid out as a list of ``ip:port`` addresses
(pools in plan order, one endpoint of each per round, as the attempt loop would try them), cut to the route's
``max_attempts``. Pools whose admission bound is reached are left out; when none is left the request is shed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gateway.errors import MethodNotAllowed, NoCapacity, PayloadTooLarge
from gateway.fleet.pools import EndpointState, PoolState
from gateway.observability.acceptance import temperature_band
from gateway.proxy.app import PROXY_ROUTES
from gateway.proxy.http import parse_object
from gateway.proxy.json_depth import bracket_count, check_json_containers, check_json_depth
from gateway.proxy.record import RequestRecord
from gateway.routing.attempts import AttemptPolicy, attempt_order
from gateway.routing.classify import TASK_HEADER
from gateway.routing.decision import decide
from gateway.routing.plan import Plan
from gateway.runtime.container import Runtime

# The header (and the ``envoy.lb`` metadata key) that names the endpoints, as the endpoint picker protocol says.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
ROUTES = {route.path: route for route in PROXY_ROUTES}


@dataclass(slots=True)
class Pick:
    """Where a request goes: ``endpoints`` in fallback order (the first is the choice), with their pools; the
    decision headers for the response; what the record needs (class, task type, route reason)."""

    endpoints: list[EndpointState]
    pools: dict[str, PoolState]  # endpoint address -> its pool
    addrs: list[str]  # ``endpoints``' addresses, in the same order (computed once)
    traffic_class: str = "none"
    task_type: str | None = None
    route_reason: str | None = None
    stream: bool = False
    headers: list[tuple[str, str]] = field(default_factory=list)
    usage: bool = False  # the answer carries usage and spec-decode metrics the picker can read (``_carries_usage``)

    def addresses(self) -> list[str]:
        return self.addrs

    def served(self, addr: str) -> tuple[PoolState, EndpointState] | None:
        """The pool and endpoint of the list at ``addr`` (the address Envoy reports it used), if it is one."""
        pool = self.pools.get(addr)
        if pool is None:
            return None
        for a, ep in zip(self.addrs, self.endpoints, strict=True):
            if a == addr:
                return pool, ep
        return None


def address(url: str) -> str:
    """``http://10.0.0.5:8000/`` -> ``10.0.0.5:8000`` (an IPv6 host in brackets), as Envoy expects it."""
    # The common form (scheme, plain host, explicit port) without urlsplit: it runs for every listed endpoint.
    scheme, sep, rest = url.partition("://")
    if sep and scheme in ("http", "https"):
        netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
        name, colon, digits = netloc.rpartition(":")
        if colon and digits.isdigit() and name and not any(c in name for c in "[]@:"):
            return f"{name.lower()}:{int(digits)}"
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _lay_out(
    pools: Mapping[str, PoolState], plan_pools: tuple[str, ...], policy: AttemptPolicy, rng: random.Random, limit: int
) -> tuple[list[EndpointState], list[str], dict[str, PoolState], list[str]]:
    """The plan's endpoints in attempt order (admitting pools only), at most ``limit``; and the pools left out."""
    full = [name for name in plan_pools if name in pools and not policy.admits(pools[name])]
    order = tuple(name for name in plan_pools if name not in full)
    chosen: list[EndpointState] = []
    addrs: list[str] = []
    owner: dict[str, PoolState] = {}
    for pool, ep in attempt_order(Plan(order, ""), pools, rng):  # the attempt loop's order
        if len(chosen) >= limit:
            break
        addr = address(ep.url)
        chosen.append(ep)
        addrs.append(addr)
        owner[addr] = pool
    return chosen, addrs, owner, full


def pick_any(rt: Runtime) -> Pick:
    """A request that is not classified (a GET such as ``/v1/models``): every pool, in YAML order."""
    live = rt.live
    limit = max(1, live.rules.defaults.max_attempts)
    chosen, addrs, owner, _ = _lay_out(live.pools, tuple(live.pools), rt.attempts, rt.rng, limit)
    if not chosen:
        raise _no_endpoint()
    return Pick(chosen, owner, addrs, route_reason="unclassified")


# The APIs whose answers carry vLLM's per-request spec-decode metrics (the Responses API's do not).
_USAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


def _carries_usage(path: str, body: Mapping[str, Any], stream: bool) -> bool:
    """Whether the answer has usage to read: a whole body does; a stream only when its client asked for the usage
    chunk (``stream_options.include_usage``): unlike proxy mode, the picker does not ask for it on the client's
    behalf (it would have to rewrite the request and strip the chunk from the answer)."""
    if path not in _USAGE_PATHS:
        return False
    if not stream:
        return True
    opts = body.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def _no_endpoint() -> NoCapacity:
    return NoCapacity("no endpoint can take this request now", retry_after_s=5)


def pick(
    rt: Runtime, method: str, path: str, headers: Mapping[str, str], raw: bytes, rec: RequestRecord | None = None
) -> Pick:
    """The answer for one request (``headers``: lower-case names, first value). Raises the ``GatewayError`` Envoy
    should answer itself: 401, 400, 404 (unknown model), 413, 405, 503 (no endpoint; ``overloaded``: shed).
    ``rec`` learns the class, task type and route reason as soon as they are known (a refusal is recorded with
    them)."""
    route = ROUTES.get(path)
    if route is None:
        return pick_any(rt)
    if method != "POST":
        raise MethodNotAllowed(f"{method} is not allowed on {path}; use POST", headers={"allow": "POST"})
    rt.authenticate(headers.get("authorization"))
    if len(raw) > rt.settings.max_body_bytes:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {rt.settings.max_body_bytes}")
    brackets = bracket_count(raw)  # one count decides both checks for most bodies, as in proxy mode
    if brackets > rt.settings.max_json_containers:  # before parsing: a flood of tiny containers is slow to parse
        check_json_containers(raw, rt.settings.max_json_containers)
    body = parse_object(raw)
    if brackets > rt.settings.max_json_depth:
        check_json_depth(raw, rt.settings.max_json_depth)
    live = rt.live
    d = decide(live, rt.routing, route.api, body, headers.get(TASK_HEADER), rt.rng)
    extra: list[tuple[str, str]] = []
    task_type = None
    if d.features is not None:
        task_type = d.features.task_type
        extra += [("x-specgate-class", d.traffic_class), ("x-specgate-task-type", task_type)]
    if rec is not None:
        rec.traffic_class, rec.task_type, rec.route_reason = d.traffic_class, task_type, d.plan.reason
        rec.stream = d.stream
        rec.temperature_band = temperature_band(body.get("temperature"))
    d.check_model()
    plan = d.plan
    extra.append(("x-specgate-route", plan.reason))
    if plan.empty:
        raise plan.unavailable()
    chosen, addrs, owner, full = _lay_out(live.pools, plan.pools, rt.attempts, rt.rng, max(1, d.max_attempts))
    if not chosen:
        if full:
            raise rt.attempts.overloaded(
                f"every pool that can serve this request is full ({', '.join(full)})", "admission"
            )
        raise _no_endpoint()
    usage = _carries_usage(path, body, d.stream)
    return Pick(chosen, owner, addrs, d.traffic_class, task_type, plan.reason, d.stream, extra, usage)
