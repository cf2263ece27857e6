"""What the routing state keeps per controlled traffic class, and the values it hands out: one request's
``RouteChoice``, a ``ProbeChange``, the window bookkeeping (``ClassTrack``), a class's observation of its two pools
in one round (``observe_pools``, with its acceptance rate: ``class_rate``, and its draft counters:
``class_draft_counts``) and the window mean of its observations (``windowed``). Used by
``gateway.routing.routing_state``."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from prometheus_client import CollectorRegistry

from gateway.config.schema import PoolKind
from gateway.fleet.vllm_metrics import PoolLoadView
from gateway.routing.batch_slope import PoolSpeeds
from gateway.routing.controller import Controller
from gateway.routing.controller_rules import ControllerState
from gateway.routing.estimate import AcceptanceSource, Estimate, Observation, estimate, rate_from_per_token

DRAFT_TOKENS = "specgate_class_draft_tokens"
ACCEPTED_TOKENS = "specgate_class_accepted_draft_tokens"
DEFAULT_TPOT_S = 0.03  # a 70B model's time per output token when neither pool has a measurement


# Built on every request: not ``frozen`` (a frozen dataclass sets each field through ``object.__setattr__``, five
# times slower to build); never changed once built, and hashed by its fields as a frozen one is.
@dataclass(slots=True, unsafe_hash=True)
class RouteChoice:
    """The controller's answer for one request of a class."""

    state: ControllerState  # the class's route state: speculative | split | standard
    pick: PoolKind  # this request's first pool kind (drawn with probability ``share`` while split)
    share: float  # the class's share of requests sent to the speculative pool first
    forced: bool = False  # an on-call class route (``set_forced``) decided: ``pick`` is the forced kind
    why: Why = "home"  # why this request drew ``pick`` (explain, the route header)
    pools: tuple[tuple[str, str], ...] = ()  # (kind, pool) of the controller's two pools
    speeds: Mapping[str, float] | None = None  # pool → the class's seconds per output token there, last round
    # a draw away from home by load (why "spill"): the in-flight per endpoint at which that pool sends visitors
    # home (gateway.routing.ownership.visitor_limit; None: not a visitor, or no limit)
    visitor_limit: int | None = None
    # the visitor limit of the class's pool away from home, whatever it drew (a warm home there stops at it)
    away_limit: int | None = None


Why = Literal["home", "spill", "probe", "guard", "forced", "stale"]


@dataclass(frozen=True, slots=True)
class ProbeChange:
    """A class starts or stops probing the speculative pool: one log line, one audit record."""

    class_name: str
    share: float  # the probe share now (0: stopped)
    at: float
    detail: str


@dataclass(slots=True)
class ClassTrack:
    """One controlled class: its controller, its two pools and its window counters."""

    controller: Controller
    spec_pool: str
    std_pool: str
    since: float  # when this controller was made: the first window's base
    k: int = 0  # draft tokens per step of the speculative pool
    prior: float = 0.0  # acceptance rate assumed until measured
    prior_fixed: bool = False  # prior_acceptance set in the YAML: the requests' temperatures do not move it
    # mean per-token acceptance the class's requests' temperatures stand for (an EWMA; None: no request seen)
    seen_acceptance: float | None = None
    probe: float = 0.0  # the probe share in force (set each round)
    estimates: tuple[Estimate | None, Estimate | None] = (None, None)  # (speculative, standard) of the last round
    speeds: Mapping[str, float] | None = None  # pool → class_tpot_s of those estimates (built once a round)
    requests: int = 0  # cumulative, bumped per routed request
    start_requests: int = 0  # ``requests`` when this controller was made
    # the class's requests (cluster-wide) when its share last changed: a sparse class gathers min_samples over
    # several windows instead of never reaching it in one
    moved_at_requests: float | None = None
    # (time, requests, draft tokens, accepted tokens) at each round, oldest first; the first one is the window base
    history: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    # (time, observation) of the fresh rounds in the window: the controller sees their mean, not one noisy scrape
    fresh: deque[tuple[float, Observation]] = field(default_factory=deque)
    # visitors of this class on its pool away from home go home from this many in flight per endpoint there
    visitor_limit: int | None = None

    @property
    def away_pool(self) -> str:
        """The class's pool away from home."""
        return self.std_pool if self.controller.home == "speculative" else self.spec_pool


def windowed(fresh: deque[tuple[float, Observation]], now: float, window_s: float, obs: Observation) -> Observation:
    """``obs`` with its delays, queue and batch averaged over the fresh rounds of the last ``window_s``: one
    scrape of a queue under Poisson arrivals is noise, and a decision on it flaps. A stale or incomplete round
    passes as it is (the controller reacts to missing data at once) and empties the window."""
    if obs.stale or obs.spec_cost_s is None or obs.std_cost_s is None:
        fresh.clear()
        return obs
    fresh.append((now, obs))
    while fresh and fresh[0][0] <= now - window_s:
        fresh.popleft()
    rounds = [o for _, o in fresh]

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    return replace(
        obs,
        spec_cost_s=mean([o.spec_cost_s for o in rounds]),
        std_cost_s=mean([o.std_cost_s for o in rounds]),
        spec_queue=mean([o.spec_queue for o in rounds]) if obs.spec_queue is not None else None,
        spec_batch=mean([o.spec_batch for o in rounds]) if obs.spec_batch is not None else None,
    )


def observe_pools(
    c: ClassTrack,
    speeds: PoolSpeeds,
    spec: PoolLoadView | None,
    std: PoolLoadView | None,
    *,
    samples: int,
    acceptance: float | None,
    p95_s: float | None,
    outranked_by: str | None = None,
) -> Observation:
    """The class's observation of its two pools this round (``None`` measurements while a pool is not scraped);
    sets the class's estimates and speeds for the round."""
    if spec is None or std is None:  # not scraped yet: unknown, never 0
        c.estimates, c.speeds = (None, None), None
        return Observation(
            samples=samples, spec_cost_s=None, std_cost_s=None, acceptance=acceptance, p95_s=p95_s, stale=True
        )
    spec_m, std_m = speeds.tpot(spec), speeds.tpot(std)
    # An idle pool has no TPOT in the scrape window: its last measured one (an idle pool is not slower than it
    # was under load), else the other candidate's (not rescaled: its acceptance is not this pool's), else the
    # default.
    spec_tpot, pool_rate = spec_m if spec_m is not None else (std_m[0] if std_m else DEFAULT_TPOT_S, None)
    std_tpot = std_m[0] if std_m is not None else (spec_m[0] if spec_m else DEFAULT_TPOT_S)
    rate, source = class_rate(c, acceptance)
    cfg = c.controller.config
    out, weight = cfg.output_tokens, cfg.load_impact
    spec_slope, std_slope = speeds.slopes(spec.pool, std.pool, c.k)
    spec_est = estimate(
        spec, "speculative", spec_tpot, output_tokens=out, k=c.k, class_rate=rate, acceptance_source=source,
        pool_rate=pool_rate, slope_s=spec_slope, impact_weight=weight,
    )  # fmt: skip
    std_est = estimate(std, "standard", std_tpot, output_tokens=out, slope_s=std_slope, impact_weight=weight)
    c.estimates = (spec_est, std_est)
    # built once a round and shared by every choice until the next
    c.speeds = {e.pool: e.class_tpot_s for e in c.estimates if e is not None}
    n = spec.fresh_endpoints
    return Observation(
        samples=samples,
        spec_cost_s=None if spec_est is None else spec_est.cost_s,
        std_cost_s=None if std_est is None else std_est.cost_s,
        spec_queue=None if spec.waiting is None or n == 0 else spec.waiting / n,
        spec_batch=None if spec.running is None or n == 0 else spec.running / n,
        acceptance=acceptance,
        p95_s=p95_s,
        stale=spec.stale or std.stale,
        outranked_by=outranked_by,
    )


def class_rate(c: ClassTrack, acceptance: float | None) -> tuple[float, AcceptanceSource]:
    """The class's acceptance rate for its estimate: this window's, else its last measured, else the prior:
    ``prior_acceptance`` when the YAML sets it, else that of the temperatures its requests actually carry
    (a catch-all class of temperature-0.8 chat is not temperature-1.0 traffic), else its temperature band's."""
    if acceptance is not None and math.isfinite(acceptance):
        return acceptance, "measured"
    last = c.controller.acceptance
    if last is not None:
        return last, "last measured"
    if not c.prior_fixed and c.seen_acceptance is not None:
        c.prior = rate_from_per_token(c.seen_acceptance, c.k)
    return c.prior, "prior"


def class_draft_counts(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, float]]:
    """Cumulative draft and accepted tokens per class, from the gateway's per-class counters (this process)."""
    drafted: dict[str, float] = {}
    accepted: dict[str, float] = {}
    targets = {DRAFT_TOKENS + "_total": drafted, ACCEPTED_TOKENS + "_total": accepted}
    for family in registry.restricted_registry(list(targets)).collect():
        for sample in family.samples:
            into = targets.get(sample.name)
            cls = sample.labels.get("class")
            if into is not None and cls is not None:
                into[cls] = into.get(cls, 0.0) + sample.value
    return drafted, accepted
