"""The live config snapshot: everything that depends on the routing YAML, built once per load and swapped whole.

A reload builds a new ``LiveConfig`` and replaces the reference in one assignment, so a request sees either the
old config or the new one, never a mix. Endpoint state (health, in-flight counts) is carried over by endpoint id,
and a pool whose spec did not change keeps its HTTP client (its open connections).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from gateway.config.schema import RoutingRules
from gateway.fleet.pools import PoolState
from gateway.fleet.upstream import PoolClient
from gateway.routing.classify import Classifier
from gateway.routing.plan import PoolView


def config_digest(text: str) -> str:
    """The hash of a routing YAML text, as ``LiveConfig.digest`` and ``specgate_config_info{hash}`` show it."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class LiveConfig:
    """Everything built from one routing YAML: the validated rules, the compiled classifier, the run-time pool
    and endpoint state, the upstream clients, the models served, and the YAML's text and digest.

    Immutable as a whole: a reload builds a new one (``build(previous=...)`` keeps the state objects of endpoints
    that remain, so in-flight counts and health survive) and swaps ``Runtime.live`` in one assignment."""

    rules: RoutingRules
    source: str
    text: str  # the YAML in force, as read (GET /admin/config)
    digest: str
    loaded_at: float
    classifier: Classifier
    pools: dict[str, PoolState]
    clients: dict[str, PoolClient]
    models: tuple[str, ...]
    model_set: frozenset[str]
    # The last view of each pool (``views``): immutable, handed out again while the pool's numbers are the same.
    _views: dict[str, PoolView] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, rules: RoutingRules, source: str, text: str, previous: LiveConfig | None = None) -> LiveConfig:
        pools = {p.name: PoolState.from_spec(p, rules.affinity_of(p)) for p in rules.pools}
        classifier = Classifier(rules)  # can fail (RE2 set compile): before anything touches the live endpoints
        clients = _clients(rules, previous)
        if previous is not None:
            # An endpoint that still exists keeps its state object: requests in flight on it decrement the same
            # counters after the swap, and what health checks learnt stays.
            old = {(e.pool, e.id, e.url): e for p in previous.pools.values() for e in p.endpoints}
            for pool in pools.values():
                for i, ep in enumerate(pool.endpoints):
                    prev = old.get((ep.pool, ep.id, ep.url))
                    if prev is not None:
                        prev.weight = ep.weight
                        prev.configured_weight = ep.configured_weight
                        prev.kv_events = ep.kv_events
                        pool.endpoints[i] = prev
                pool.size_indexes()  # the reloaded affinity block's sizes apply to the carried-over indexes too
        models = tuple(dict.fromkeys(m for p in rules.pools for m in p.models))
        return cls(
            rules=rules,
            source=source,
            text=text,
            digest=config_digest(text),
            loaded_at=time.time(),
            classifier=classifier,
            pools=pools,
            clients=clients,
            models=models,
            model_set=frozenset(models),
        )

    @property
    def version(self) -> int:
        return self.rules.version

    def views(self) -> dict[str, PoolView]:
        """Every pool as the decision sees it now (read on every request: endpoint state changes all the time)."""
        last = self._views
        out: dict[str, PoolView] = {}
        for name, p in self.pools.items():
            out[name] = last[name] = _view(p, last.get(name))
        return out

    def healthy_endpoints(self) -> int:
        return sum(p.healthy_count() for p in self.pools.values())


def _view(pool: PoolState, last: PoolView | None) -> PoolView:
    """The pool as the decision sees it now, in one pass over its endpoints; ``last`` again when its numbers are
    the same (a frozen dataclass costs more to build than to compare)."""
    routable = in_flight = 0
    drained = True
    for e in pool.endpoints:
        if e.weight > 0:
            drained = False
            if e.healthy and not e.ejected:  # EndpointState.routable
                routable += 1
                in_flight += e.in_flight + e.remote_in_flight
        elif not e.weight <= 0:  # NaN: neither routable nor drained
            drained = False
    if (
        last is not None
        and last.routable_endpoints == routable
        and last.in_flight == in_flight
        and last.drained is drained
    ):
        return last
    return PoolView(pool.name, pool.spec.kind, pool.models, routable, in_flight, drained)


def _clients(rules: RoutingRules, previous: LiveConfig | None) -> dict[str, PoolClient]:
    """One client per pool; a pool whose spec did not change keeps its client (its open connections)."""
    old = previous.clients if previous is not None else {}
    out: dict[str, PoolClient] = {}
    for p in rules.pools:
        client = old.get(p.name)
        out[p.name] = client if client is not None and client.spec == p else PoolClient(p)
    return out
