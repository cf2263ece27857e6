"""``explain``: what the gateway would do with one request, and why, without sending anything anywhere.

The decision is the proxy's own (``gateway.routing.decision.decide`` with ``count=False``: the request does not count
toward its class controller's samples), so explain cannot drift from what the handler does. The answer is one
JSON-able dict::

    request         path, endpoint, model
    features        every routing feature (max_tokens null when the client set no limit); null for embeddings
    task_type       and task_source (header | rule | default)
    traffic_class   name, description, route (preferred / saturated / fallback / saturation), controlled
    controller      the class controller's snapshot (gateway.routing.routing_state), or null for a static route
    choice          the controller's answer for this request (state, pick, share, why: home | spill | probe | guard |
                    forced | stale, probe_share), or null
    expected_completion  per candidate pool: the class's expected completion time in the last scrape round and its
                    inputs (queue, first step, decode = output tokens x the class's time per token, acceptance used
                    and where it came from); null for a class without a controller
    live            per candidate pool of the class: kind, endpoints, in-flight, scraped load (null = unknown), and
                    admission: this process's bound (null: none), whether it admits one more, busy endpoints
                    (``gateway.routing.overload``: a back-pressure failure moves a request only to one not busy)
    plan            reason, steps (the attempts in order, within max_attempts), skipped pools, max_attempts, and
                    shed: true when no planned pool admits the request now (the proxy would answer 503 overloaded)
    prefix_affinity per planned pool: whether it is on, its bounds, and per routable endpoint the warm prefix of this
                    prompt (approximate tokens), whether it counts, its load and whether that is over the bound, and
                    its index's size; then the endpoint the affinity rule picks and why (warm | cold | over_bound:
                    cold and over_bound leave the pick to the least-loaded choice); null for embeddings
    warm_home       for a class with a controller whose pools keep prefix indexes: the longest counted warm prefix
                    of this prompt per controller pool (tokens, 0: cold), the pool the controller drew, the warm pool
                    and the verdict (won | not_eligible | cold | not_longer | full | saturated,
                    ``gateway.routing.warm_home``) with a sentence; null when not weighed
    config          source and digest of the routing YAML in force

While a class is split, ``choice.pick`` and the plan show one draw; ``choice.share`` is the chance of the other.
Bad input raises the same ``GatewayError`` the proxy would answer with.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict
from types import MappingProxyType
from typing import Any

from gateway.admin.protocol import EXPLAIN_DEFAULT_PATH
from gateway.config.schema import Route, TrafficClass
from gateway.config.tenants import NO_TENANT
from gateway.errors import InvalidParameter
from gateway.fleet.affinity import assess
from gateway.fleet.pools import PoolState
from gateway.fleet.prefix_index import TOKENS_PER_CHUNK
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.proxy.app import PROXY_ROUTES
from gateway.routing import overload
from gateway.routing.classify import TASK_HEADER, ApiKind
from gateway.routing.decision import Decision, decide
from gateway.routing.fairshare import share_of
from gateway.routing.ownership import is_saturated
from gateway.routing.plan import STICKY, Plan
from gateway.routing.prompt_key import prompt_chunks
from gateway.runtime.container import Runtime
from gateway.runtime.live import LiveConfig

# The client paths explain covers, the proxy's classified POSTs, and the request shape the classifier reads for
# each (None: embeddings, not classified).
APIS: Mapping[str, ApiKind | None] = MappingProxyType({r.path: r.api for r in PROXY_ROUTES})
DEFAULT_PATH = EXPLAIN_DEFAULT_PATH
TENANT_HEADER = "x-specgate-tenant"  # explain only: the tenant to explain for (the admin request has no client key)


def api_for(path: str) -> ApiKind | None:
    if path not in APIS:
        raise InvalidParameter(f"explain covers the paths {', '.join(APIS)}; got {path!r}", param="path")
    return APIS[path]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def load_numbers(view: PoolLoadView | None) -> dict[str, Any]:
    """A pool's scraped load for JSON: null for every unknown number (never 0); ``scraped`` false before any."""
    acc = None if view is None else view.acceptance
    return {
        "scraped": view is not None,
        "stale": True if view is None else view.stale,
        "fresh_endpoints": None if view is None else view.fresh_endpoints,
        "running": None if view is None else _finite(view.running),
        "waiting": None if view is None else _finite(view.waiting),
        "kv_usage": None if view is None else _finite(view.kv_usage),
        "tpot_mean_s": None if view is None else _finite(view.tpot_mean_s),
        "generation_tokens_per_s": None if view is None else _finite(view.generation_tokens_per_s),
        "acceptance_rate": None if acc is None else _finite(acc.rate),
        "mean_acceptance_length": None if acc is None else _finite(acc.mean_length),
        "acceptance_drafts": None if acc is None else acc.drafts,
    }


def route_dict(route: Route) -> dict[str, Any]:
    return {
        "preferred": route.preferred,
        "saturated": route.saturated,
        "fallback": list(route.fallback),
        "saturation": {"max_inflight_per_endpoint": route.saturation.max_inflight_per_endpoint},
        "pin": route.pin,
    }


def candidate_pools(klass: TrafficClass | None, plan: Plan, live: LiveConfig) -> list[str]:
    """The class's pools in route order (preferred, saturated, fallbacks), then any other pool in the plan
    (without a class: the embeddings pool)."""
    names: list[str] = []
    if klass is None and live.rules.embeddings_pool is not None:
        names.append(live.rules.embeddings_pool)
    if klass is not None:
        r = klass.route
        names += [r.preferred] + ([r.saturated] if r.saturated is not None else []) + list(r.fallback)
    names += list(plan.pools)
    return list(dict.fromkeys(names))


def _live(rt: Runtime, live: LiveConfig, names: list[str], klass: TrafficClass | None) -> dict[str, Any]:
    views = live.views()
    loads = rt.scraper.views()
    out: dict[str, Any] = {}
    for name in names:
        pool, view = live.pools.get(name), views.get(name)
        if pool is None or view is None:
            out[name] = {"kind": None, "known": False}
            continue
        entry: dict[str, Any] = {
            "kind": view.kind,
            "known": True,
            "endpoints": len(pool.endpoints),
            "routable_endpoints": view.routable_endpoints,
            "in_flight": view.in_flight,
        }
        if klass is not None and name == klass.route.preferred:
            entry["saturated"] = is_saturated(klass.route, view)
        entry.update(load_numbers(loads.get(name)))
        entry["admission"] = _admission(rt, pool)
        out[name] = entry
    return out


def _admission(rt: Runtime, pool: PoolState) -> dict[str, Any]:
    workers, now = rt.attempts.workers, time.monotonic()
    limit = overload.admission_limit(pool.spec, sum(1 for e in pool.endpoints if e.routable), workers)
    return {
        "limit": limit,
        "admits": rt.attempts.admits(pool),
        "busy_endpoints": [e.id for e in pool.endpoints if overload.endpoint_busy(e, pool.spec, now, workers=workers)],
    }


def _step_reason(i: int, name: str, plan: Plan, klass: TrafficClass | None, round_: int) -> str:
    if round_ > 0:
        return "retry: another endpoint"
    if i == 0:
        return plan.reason
    if klass is not None and name in (klass.route.preferred, klass.route.saturated):
        return "alternate"
    return "fallback"


def plan_steps(plan: Plan, live: LiveConfig, klass: TrafficClass | None, max_attempts: int) -> list[dict[str, Any]]:
    """The attempts in the order the proxy makes them (``attempts.attempt_order``): each pool of the plan once, then
    again with endpoints not yet tried, up to ``max_attempts``. Each attempt only happens if the one before failed
    before the first byte reached the client."""
    views = live.views()
    left = {name: views[name].routable_endpoints if name in views else 0 for name in plan.pools}
    steps: list[dict[str, Any]] = []
    round_ = 0
    while len(steps) < max_attempts:
        progressed = False
        for i, name in enumerate(plan.pools):
            if len(steps) >= max_attempts or left[name] <= 0:
                continue
            left[name] -= 1
            progressed = True
            kind = views[name].kind if name in views else None
            reason = _step_reason(i, name, plan, klass, round_)
            steps.append({"attempt": len(steps) + 1, "pool": name, "kind": kind, "reason": reason})
        if not progressed:
            break
        round_ += 1
    return steps


def _features(d: Decision) -> dict[str, Any] | None:
    if d.features is None:
        return None
    f = asdict(d.features)
    f["max_tokens"] = _finite(d.features.max_tokens)
    return f


def _choice(d: Decision, controller: Mapping[str, Any] | None) -> dict[str, Any]:
    c = d.choice
    assert c is not None
    return {
        "state": c.state,
        "pick": c.pick,
        "share": c.share,
        "forced": c.forced,
        "why": c.why,
        "probe_share": None if controller is None else controller.get("probe_share"),
    }


def explain(rt: Runtime, path: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """Why a request with this body and these headers, sent to ``path``, would go where it goes now."""
    api = api_for(path)
    task_header = next((v for k, v in headers.items() if k.lower() == TASK_HEADER), None)
    live = rt.live
    d = decide(live, rt.routing, api, body, task_header, rt.rng, count=False, weigh_all=True)
    d.check_model()
    klass = d.klass
    controller = rt.routing.snapshot().get(d.traffic_class) if klass is not None else None
    model = body.get("model")
    return {
        "request": {"path": path, "endpoint": api, "model": model if isinstance(model, str) else None},
        "features": _features(d),
        "task_type": None if d.features is None else d.features.task_type,
        "task_source": None if d.features is None else d.features.task_source,
        "traffic_class": {
            "name": d.traffic_class,
            "description": None if klass is None else klass.description,
            "route": None if klass is None else route_dict(klass.route),
            "controlled": controller is not None,
        },
        "controller": controller,
        "choice": None if d.choice is None else _choice(d, controller),
        "expected_completion": None if controller is None else controller.get("estimates"),
        "live": _live(rt, live, candidate_pools(klass, d.plan, live), klass),
        "plan": {
            # a follow-up goes only where its conversation is (see "stateful"), under the proxy's reason for it
            "reason": STICKY if _follow_up(api, body) else d.plan.reason,
            "empty": d.plan.empty,  # the proxy would answer 503 no_capacity
            "steps": plan_steps(d.plan, live, klass, d.max_attempts),
            "skipped": [{"pool": p, "reason": why} for p, why in d.plan.skipped],
            "max_attempts": d.max_attempts,
            "shed": bool(d.plan.pools)
            and not any(rt.attempts.admits(live.pools[p]) for p in d.plan.pools if p in live.pools),
        },
        "prefix_affinity": None if api is None else _affinity(live, d.plan, prompt_chunks(api, body)),
        "warm_home": _warm_home(d),
        "config": {"source": live.source, "digest": live.digest},
        "stateful": _stateful(api, body),
        "tenant": _tenant(rt, headers, d.plan.pools),
    }


def _tenant(rt: Runtime, headers: Mapping[str, str], pools: tuple[str, ...]) -> dict[str, Any] | None:
    """The tenant named by ``x-specgate-tenant`` (default: keys without a tenant): its settings, its requests in
    flight, and in each planned pool the requests per tenant against its fair share of the bound (tenants only)."""
    tenancy = rt.tenancy
    if tenancy is None:
        return None
    name = next((v.strip() for k, v in headers.items() if k.lower() == TENANT_HEADER), NO_TENANT)
    state = tenancy.tenants.get(name)
    if state is None:
        return {"name": name, "known": False, "tenants": sorted(tenancy.tenants)}
    spec = state.spec
    weight = tenancy.weights[name]
    shares: dict[str, Any] = {}
    for pool_name in pools:
        pool = rt.live.pools.get(pool_name)
        if pool is None:
            continue
        in_flight, bound = rt.attempts.admission(pool)
        counts = dict(tenancy.pool_counts.get(pool_name, {}))
        share = None if bound is None else share_of(name, counts, tenancy.weights, bound)
        shares[pool_name] = {"in_flight": in_flight, "bound": bound, "by_tenant": counts, "share": share}
    return {
        "name": name,
        "known": True,
        "priority": weight.priority,
        "weight": weight.weight,
        "allow_priority_header": spec is not None and spec.allow_priority_header,
        "limits": None if spec is None else spec.limits.model_dump(),
        "in_flight": state.in_flight,
        "pools": shares,
    }


def _affinity(live: LiveConfig, plan: Plan, chunks: tuple[int, ...]) -> dict[str, Any]:
    """Per planned pool: each routable endpoint's warm prefix of this prompt and load, and whom the rule picks."""
    out: dict[str, Any] = {"prompt_tokens": len(chunks) * TOKENS_PER_CHUNK, "pools": {}}
    for name in plan.pools:
        pool = live.pools.get(name)
        if pool is None:
            continue
        cfg = pool.affinity
        rows, chosen, why = assess(pool.routable(), chunks, cfg)
        out["pools"][name] = {
            "enabled": cfg.enabled,
            "min_prefix_tokens": cfg.min_prefix_tokens,
            "load_slack": cfg.load_slack,
            "load_margin": cfg.load_margin,
            "endpoints": [asdict(r) for r in rows],
            "pick": chosen if cfg.enabled else None,
            "why": why if cfg.enabled else "disabled",
        }
    return out


WARM_NOTES = {
    "won": "the conversation's prefix is longer on {pool}: it goes there first",
    "not_eligible": "not weighed: a new conversation (no earlier answer in the prompt), or the controller did not "
    "draw by load or hold its safe state (probe, guard)",
    "cold": "no controller pool holds a counted prefix of this prompt",
    "not_longer": "the drawn pool holds at least as long a prefix",
    "full": "{pool} is warm but full for visitors (its home classes' in-flight limit): the class's draw stands",
    "saturated": "{pool} is warm but over its in-flight limit with the other pool less loaded: the spill stands",
}


def _warm_home(d: Decision) -> dict[str, Any] | None:
    """The warm-home decision of this request (``gateway.routing.warm_home``); None when it was not weighed."""
    w = d.plan.warm
    if d.warmth is None:
        return None
    out: dict[str, Any] = {"warmth": dict(d.warmth)}
    if w is None:
        return {**out, "verdict": None, "note": "not weighed for this plan"}
    note = WARM_NOTES[w.verdict].format(pool=w.pool)
    return {**out, "drawn_pool": w.drawn_pool, "pool": w.pool, "verdict": w.verdict, "note": note}


def _follow_up(api: ApiKind | None, body: Mapping[str, Any]) -> bool:
    return api == "responses" and isinstance(body.get("previous_response_id"), str)


def _stateful(api: ApiKind | None, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Responses API request's state on the pools: where its answer is recorded, and a follow-up's pin."""
    if api != "responses":
        return None
    previous = body.get("previous_response_id")
    return {
        "previous_response_id": previous,
        "recorded": body.get("store") is not False,
        "note": (
            "pinned: the request goes only to the endpoint that holds the previous response (no fallback); the plan "
            "above applies to a new conversation"
            if previous
            else "a new conversation: planned as above"
        ),
    }
