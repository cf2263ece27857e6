"""Pools and endpoints at run time: weights, health, in-flight counts, and the endpoint pick.

The pick first follows prefix affinity (``gateway.fleet.affinity``: the endpoint whose prefix cache holds the longest
start of the prompt, within a load bound), when the pool has it on and the request's prompt chunks are given;
otherwise, and for a cold prompt, it is weighted power-of-two-choices: draw two routable endpoints with probability
proportional to their weight, keep the one with fewer in-flight requests per unit of weight. Weight 0 means
drained: the endpoint gets no new requests, and the ones it has run to completion. ``weight`` is the effective
weight; the YAML's is ``configured_weight`` (on-call overrides recompute ``weight`` from it:
``gateway.overrides.manager``).

An endpoint is routable while it is healthy (its last active health check passed, and no connect failure since),
has a weight, and is not ejected. Ejection (passive outlier detection, ``gateway.routing.attempts``) takes an endpoint
out
after consecutive failed attempts for base x 2^(k-1) seconds (the k-th ejection in a row, capped); it comes back
only through a passing health check once that time is over. Times are ``time.monotonic()`` seconds, passed in.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.config.affinity import PrefixAffinity
from gateway.config.pool import Pool as PoolSpec
from gateway.fleet.affinity import min_chunks, warm_pick
from gateway.fleet.prefix_index import TOKENS_PER_CHUNK, PrefixIndex


@dataclass(slots=True)
class EndpointState:
    """One vLLM endpoint at run time: its effective and configured weight, health (active checks), in-flight
    count, consecutive failures and ejection (passive outlier detection). Mutated in place by the attempt loop,
    the health checker and overrides; kept across reloads while its pool, id and URL stay the same."""

    id: str
    url: str
    pool: str
    weight: float  # effective: the YAML weight unless an on-call override (gateway.overrides.manager) sets another
    configured_weight: float = -1.0  # the YAML's weight (< 0 when not given: then ``weight`` at creation)
    healthy: bool = True
    in_flight: int = 0
    remote_in_flight: int = 0  # the other replicas' requests in flight on it (a cluster's shared counts)
    consecutive_failures: int = 0
    last_checked: float = 0.0
    last_error: str | None = None
    ejected: bool = False
    ejected_until: float = 0.0  # monotonic; the ejection may end (on a passing health check) from then on
    ejections: int = 0  # k: ejections in a row, for the growing ejection time
    last_ejected: float | None = None  # monotonic time of the last ejection
    ejected_here: bool = False  # the ejection came from this process's failures (not another replica's)
    queue_waiting: float = 0.0  # vLLM's waiting requests at the last good scrape (gateway.fleet.scraper)
    queue_fresh_until: float = 0.0  # monotonic; after this the scraped queue is unknown (stale), never read as 0
    # The prompt prefixes sent here (gateway.fleet.prefix_index): what its prefix cache probably holds.
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    kv_events: str | None = None  # the server's KV event publisher (gateway.fleet.kv_events), from the YAML

    def __post_init__(self) -> None:
        if self.configured_weight < 0:
            self.configured_weight = self.weight

    @property
    def routable(self) -> bool:
        return self.healthy and self.weight > 0 and not self.ejected

    def mark_failure(self, reason: str) -> None:
        """A connect-level failure: out of rotation until the next successful health check."""
        self.count_failure(reason)
        self.healthy = False

    def count_failure(self, reason: str) -> int:
        """A failed attempt (the endpoint stays in rotation); the consecutive failures so far."""
        self.consecutive_failures += 1
        self.last_error = reason
        return self.consecutive_failures

    def note_queue(self, waiting: float, fresh_until: float) -> None:
        """A good scrape: vLLM's queue on this endpoint, valid until ``fresh_until``."""
        self.queue_waiting = waiting
        self.queue_fresh_until = fresh_until

    def queueing(self, now: float) -> bool:
        """The last fresh scrape saw requests waiting in vLLM's queue."""
        return self.queue_waiting > 0 and now < self.queue_fresh_until

    def mark_success(self) -> None:
        self.consecutive_failures = 0

    def eject(self, now: float, base_s: float, max_s: float) -> float:
        """Take the endpoint out of rotation; returns the ejection time, base_s x 2^(k-1) for the k-th ejection
        in a row, at most max_s. k starts again once the last ejection has been over for max_s."""
        if self.last_ejected is not None and now - self.ejected_until >= max_s:
            self.ejections = 0
        self.ejections += 1
        duration = min(max_s, base_s * 2.0 ** min(self.ejections - 1, 62))
        self.ejected = True
        self.ejected_here = True
        self.ejected_until = now + duration
        self.last_ejected = now
        self.consecutive_failures = 0
        return duration

    def set_health(self, healthy: bool, error: str | None = None, now: float | None = None) -> bool:
        """The result of an active health check; True when it ended an ejection (expired, and the check passed)."""
        now = time.monotonic() if now is None else now
        self.healthy = healthy
        self.last_checked = now
        self.last_error = error
        if not healthy:
            return False
        if self.ejected and now >= self.ejected_until:
            self.ejected = False
            self.ejected_here = False
            return True
        return False


@dataclass(slots=True)
class PoolState:
    """One pool at run time: its YAML spec, the models it serves, and its endpoints' state; ``pick`` chooses
    an endpoint for an attempt (prefix affinity within a load bound, else weighted power of two choices, least
    in-flight per weight)."""

    name: str
    spec: PoolSpec
    endpoints: list[EndpointState]
    models: frozenset[str] = field(default_factory=frozenset)
    affinity: PrefixAffinity = field(default_factory=PrefixAffinity)

    @classmethod
    def from_spec(cls, spec: PoolSpec, affinity: PrefixAffinity | None = None) -> PoolState:
        eps = [EndpointState(e.endpoint_id, e.url, spec.name, e.weight, kv_events=e.kv_events) for e in spec.endpoints]
        pool = cls(spec.name, spec, eps, frozenset(spec.models), affinity or PrefixAffinity())
        pool.size_indexes()
        return pool

    def size_indexes(self) -> None:
        """Apply the affinity block's index sizes to every endpoint (at creation, and to the endpoints a reload
        carries over)."""
        default = self.affinity.default_capacity_tokens // TOKENS_PER_CHUNK
        ceiling = self.affinity.max_index_tokens // TOKENS_PER_CHUNK
        for e in self.endpoints:
            e.prefixes.configure(default, ceiling)

    def routable(self) -> list[EndpointState]:
        return [e for e in self.endpoints if e.routable]

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.endpoints)

    def healthy_count(self) -> int:
        return sum(1 for e in self.endpoints if e.healthy)

    def indexed(self) -> bool:
        """Affinity is on and some endpoint's prefix index holds something (else no prompt can be warm here)."""
        return self.affinity.enabled and any(len(e.prefixes) for e in self.endpoints)

    def warm_tokens(self, prompt: Sequence[int]) -> int:
        """The longest start of the prompt (its chunk hashes) that a routable endpoint's index holds, in approximate
        tokens; 0 when shorter than ``min_prefix_tokens`` or affinity is off (the pool's warmth for its warm home,
        ``gateway.routing.warm_home``)."""
        if not self.affinity.enabled:
            return 0
        need = min_chunks(self.affinity)
        if len(prompt) < need:
            return 0
        best = max((e.prefixes.match(prompt) for e in self.endpoints if e.routable), default=0)
        return best * TOKENS_PER_CHUNK if best >= need else 0

    def pick(self, rng: random.Random, exclude: Iterable[str] = (), prompt: Sequence[int] = ()) -> EndpointState | None:
        """The endpoint for one attempt among the routable ones not in ``exclude``: the warm one within the load
        bound when ``prompt`` (its chunk hashes) is warm somewhere and the pool has affinity on, else weighted
        power of two choices, least in-flight per weight."""
        skip = set(exclude)
        cands = [e for e in self.endpoints if e.routable and e.id not in skip]
        if not cands:
            return None
        if len(cands) == 1:
            return cands[0]
        if prompt and self.affinity.enabled:
            warm = warm_pick(cands, prompt, self.affinity)
            if warm is not None:
                return warm
        weights = [e.weight for e in cands]
        a, b = rng.choices(cands, weights=weights, k=2)
        if a is b:
            return a
        return a if (a.in_flight + 1) / a.weight <= (b.in_flight + 1) / b.weight else b
