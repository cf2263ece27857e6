"""Pools and endpoints at run time: weights, health, in-flight counts, and the endpoint pick.

The pick is weighted power-of-two-choices: draw two routable endpoints with probability proportional to their
weight, keep the one with fewer in-flight requests per unit of weight. Weight 0 means drained: the endpoint
gets no new requests, and the ones it has run to completion.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gateway.rules.schema import Pool as PoolSpec


@dataclass(slots=True)
class EndpointState:
    id: str
    url: str
    pool: str
    weight: float
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    last_checked: float = 0.0
    last_error: str | None = None

    @property
    def routable(self) -> bool:
        return self.healthy and self.weight > 0

    def mark_failure(self, reason: str) -> None:
        """A connect-level failure: out of rotation until the next successful health check."""
        self.consecutive_failures += 1
        self.healthy = False
        self.last_error = reason

    def mark_success(self) -> None:
        self.consecutive_failures = 0

    def set_health(self, healthy: bool, error: str | None = None) -> None:
        self.healthy = healthy
        self.last_checked = time.monotonic()
        self.last_error = error
        if healthy:
            self.consecutive_failures = 0


@dataclass(slots=True)
class PoolState:
    name: str
    spec: PoolSpec
    endpoints: list[EndpointState]
    models: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_spec(cls, spec: PoolSpec) -> PoolState:
        eps = [EndpointState(e.endpoint_id, e.url, spec.name, e.weight) for e in spec.endpoints]
        return cls(spec.name, spec, eps, frozenset(spec.models))

    def routable(self) -> list[EndpointState]:
        return [e for e in self.endpoints if e.routable]

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    def healthy_count(self) -> int:
        return sum(1 for e in self.endpoints if e.healthy)

    def pick(self, rng: random.Random, exclude: Iterable[str] = ()) -> EndpointState | None:
        """Weighted power of two choices among routable endpoints, least in-flight per weight wins."""
        skip = set(exclude)
        cands = [e for e in self.endpoints if e.routable and e.id not in skip]
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        weights = [e.weight for e in cands]
        a, b = rng.choices(cands, weights=weights, k=2)
        if a is b:
            return a
        return a if (a.in_flight + 1) / a.weight <= (b.in_flight + 1) / b.weight else b


@contextmanager
def in_flight(ep: EndpointState) -> Iterator[None]:
    ep.in_flight += 1
    try:
        yield
    finally:
        ep.in_flight -= 1
