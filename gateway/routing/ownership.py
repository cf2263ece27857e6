"""Who owns the speculative pool: the order of the classes on it, where visitors stop, when its home classes spill.

Each class's controller compares its own costs on the two pools (``gateway.routing.estimate``). Left alone, two
classes can swap places under load: the standard pool queues, so a low-acceptance class (open chat) finds the
speculative pool cheaper and moves a share there; the speculative pool's batch grows, so a high-acceptance class
(JSON, code) finds the standard pool cheaper and spills a share there. Each step is right for the class that takes
it and the pair is wrong for all: the speculative pool now serves the traffic it speeds up least, and the
traffic it speeds up most waits on the standard pool. Three rules, all here, fill a pool as the best fixed splits
do:

- **Order** (``outranked``): a class is *outranked* on its speculative pool while a speculative-home class there
  with a clearly higher acceptance rate (``MARGIN``) is off it by more than ``MIN_OFF`` of its requests and decides
  by load (its guard not tripped, not forced, enough samples). An outranked class takes no share onto that pool and
  hands back what it has there first (the controller's ``order`` rule); once the better class is back, the others
  may follow it again.
- **Visitors** (``visitor_limit``, ``full_for_visitors``): a request drawn onto a pool away from its class's home
  by load goes home instead while that pool has as many requests in flight per endpoint as the home classes there
  that carry traffic take before they spill (the lowest ``route.saturation`` limit among them). A class at home
  there with no request in the last window is no one to protect: counting it (the strictest limit in the YAML, say
  a mid-temperature class nobody sends) kept visitors off a pool its busy classes left room on.
- **Spill** (``should_spill``): a class at home spills to ``route.saturated`` while its pool is over its in-flight
  limit and the other pool is the less loaded one.

Pure: numbers in, answers out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gateway.config.schema import PoolKind, Route, RoutingRules
from gateway.routing.controller import Controller
from gateway.routing.controller_rules import LOAD_REASONS
from gateway.routing.estimate import Estimate

MARGIN = 0.1  # acceptance rates closer than this are not ordered: one noisy window must not reorder classes
# A share this close to home is the balance steps' noise (they go down to an eighth of share_step), not a class
# pushed off the pool: it does not make the others yield.
MIN_OFF = 0.1


class PoolLoad(Protocol):
    """What the pool rules read of a pool (``gateway.routing.plan.PoolView`` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def routable_endpoints(self) -> int: ...
    @property
    def in_flight(self) -> int: ...


# -- order ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Standing:
    """One controlled class as the order sees it (from its last round)."""

    name: str
    spec_pool: str
    rate: float | None  # the acceptance rate of its estimate there (measured, last measured or prior)
    share: float  # on the speculative pool
    home: PoolKind
    deciding: bool  # its own load decisions move it: not forced, guard neither tripped nor locked, enough samples


def outranked(standings: Iterable[Standing]) -> dict[str, str]:
    """Class -> the class with the highest rate that outranks it on its speculative pool (absent: none does)."""
    items = list(standings)
    out: dict[str, str] = {}
    for c in items:
        if c.rate is None:
            continue
        best: Standing | None = None
        for h in items:
            if (
                h.name == c.name
                or h.spec_pool != c.spec_pool
                or h.home != "speculative"
                or not h.deciding
                or h.share > 1.0 - MIN_OFF - 1e-9  # off by more than MIN_OFF: a share of 0.9 is not
                or h.rate is None
                or h.rate < c.rate + MARGIN
            ):
                continue
            if best is None or (best.rate is not None and h.rate > best.rate):
                best = h
        if best is not None:
            out[c.name] = best.name
    return out


def standing_of(name: str, spec_pool: str, controller: Controller, spec_estimate: Estimate | None) -> Standing:
    """The class as the order sees it, from its controller's last round and its last speculative estimate: it
    decides by load unless forced, held by its guard, moved last by a safety move, stale or short of samples."""
    snap = controller.snapshot()
    obs = snap.last_observation
    deciding = (
        snap.forced_until is None
        and not snap.guard_tripped
        and not snap.locked
        and snap.last_reason in LOAD_REASONS
        and obs is not None
        and not obs.stale
        and obs.samples >= controller.config.min_samples
    )
    rate = None if spec_estimate is None else spec_estimate.acceptance
    return Standing(name, spec_pool, rate, controller.share, controller.home, deciding)


# -- visitors ------------------------------------------------------------------------------------------------


def visitor_limit(rules: RoutingRules, pool: str, carries: Callable[[str], bool] | None = None) -> int | None:
    """In-flight requests per endpoint of ``pool`` at which visitors go home: the lowest
    ``route.saturation.max_inflight_per_endpoint`` of the classes at home there that spill (have a ``saturated``
    pool) and carry traffic (``carries(class)``; None: all of them, as before any traffic was counted). None:
    no limit."""
    limits = [
        c.route.saturation.max_inflight_per_endpoint
        for c in rules.classes
        if c.route.preferred == pool and c.route.saturated is not None and (carries is None or carries(c.name))
    ]
    return min((n for n in limits if n is not None), default=None)


def visitor_limits(rules: RoutingRules, carries: Callable[[str], bool] | None = None) -> dict[str, int | None]:
    """``visitor_limit`` of every pool."""
    return {p.name: visitor_limit(rules, p.name, carries) for p in rules.pools}


def full_for_visitors(pool: PoolLoad | None, limit: int | None) -> bool:
    """The pool has as many requests in flight per endpoint as ``limit`` (its ``visitor_limit``): a share of
    another class drawn onto it goes home instead, so that visitors never push the pool's own traffic off it."""
    if pool is None or limit is None or pool.routable_endpoints == 0:
        return False
    return pool.in_flight >= limit * pool.routable_endpoints


# -- spill ---------------------------------------------------------------------------------------------------


def is_saturated(route: Route, pool: PoolLoad) -> bool:
    limit = route.saturation.max_inflight_per_endpoint
    if limit is None or pool.routable_endpoints == 0:
        return False
    return pool.in_flight >= limit * pool.routable_endpoints


def _per_endpoint(pool: PoolLoad) -> float:
    return pool.in_flight / pool.routable_endpoints if pool.routable_endpoints else float("inf")


def should_spill(
    route: Route, preferred: PoolLoad, saturated: PoolLoad | None, speeds: Mapping[str, float] | None = None
) -> bool:
    """Spill to ``route.saturated``: the preferred pool is over its in-flight limit AND the saturated pool is the
    less loaded one. Without the second condition a burst moves the whole class onto a pool that may be busier
    still (measured: a class spilling 71% of its requests onto an already saturated standard pool, whose p50 went
    from 4 s to 19 s, while the speculative pool had room).

    "Less loaded" counts requests per endpoint, each weighted by the class's time per output token on that pool
    when its controller knows both (``speeds``: pool → seconds, from its last round): a pool where this class
    decodes three times slower is not less loaded with half the requests (measured: a copy-heavy class spilling a
    fifth of its requests at 30% load onto a standard pool that decoded it 3x slower, p99 +30%)."""
    if saturated is None or saturated.routable_endpoints == 0 or not is_saturated(route, preferred):
        return False
    here, there = _per_endpoint(preferred), _per_endpoint(saturated)
    if speeds:
        slow_here, slow_there = speeds.get(preferred.name), speeds.get(saturated.name)
        if slow_here and slow_there and slow_here > 0 and slow_there > 0:
            return (there + 1.0) * slow_there < (here + 1.0) * slow_here
    return there < here
