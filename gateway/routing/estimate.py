"""Expected completion time of one request of a traffic class on one pool: what the class controllers compare.

Pure: numbers in, numbers out. Per fresh endpoint of the pool, with ``r`` running and ``q`` waiting::

    queue_s       = q x (pool_output_tokens x tpot) / max(r, 1)     a batch slot frees every decode / r seconds
    first_token_s = tpot                                             prefill and the first step
    decode_s      = output_tokens x class_tpot
    expected_s    = queue_s + first_token_s + decode_s

``tpot`` is the pool's measured mean time per output token (it already reflects its batch size);
``pool_output_tokens`` the output tokens of the requests the pool finished in the scrape window (vLLM's
per-request histogram; ``DEFAULT_OUTPUT_TOKENS`` before a few finished): the requests ahead in its queue are the
pool's own traffic, not this class's. On a standard
pool every request of the class decodes at that speed. On a speculative pool one engine step emits ``1 + rate x K``
tokens per request on average (``rate``: vLLM's acceptance rate, accepted / draft tokens; ``K``: draft tokens per
step), so the pool's TPOT, measured on its own traffic at the pool's acceptance, is rescaled to the class's::

    class_tpot = tpot x (1 + pool_rate x K) / (1 + class_rate x K)

A class whose acceptance was never measured uses a prior from its temperature band (``prior_rate``); a pool whose
acceptance is unknown (its TPOT borrowed from another pool, or no drafts seen) is not rescaled. Prefill is
folded into one step: both pools prefill the same prompt, so it does not move the comparison much.

What the controllers compare is the request's **cost** on the pool: its own expected time plus the time it adds to
the requests already running there (``impact_s``). One more sequence in a batch makes every step longer, by far
more on a speculative pool (each sequence verifies ``1 + K`` tokens a step and is drafted for) than on a standard
one (measured in the simulated 70B preset: 2.9 ms against 0.6 ms a step per added sequence)::

    impact_s = r x steps x slope      r requests beside it at every one of its steps, each step longer by slope

``steps`` is the steps the request stays in the batch (its output tokens over the tokens it gets per step: 1 on a
standard pool, ``1 + class_rate x K`` on a speculative one) and ``slope`` the pool's measured rise of its step time
per added running request (``gateway.routing.batch_slope``). In a steady state the batch beside it stays at ``r``
while it runs, those who finish replaced by newcomers, so this is the whole delay it causes.
Comparing own times alone is selfish routing: it moves a class onto the speculative pool until the class's own
times are equal, and the requests already there pay for it (measured on a chat-heavy mix at 30% load: the best
fixed split sends 12% of the chat there, the own-time balance 42%, p99 +24% against the all-speculative fleet).
Comparing costs is what minimises the time of all requests together.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

from gateway.config.schema import Range
from gateway.fleet.vllm_metrics import PoolLoadView

DEFAULT_OUTPUT_TOKENS = 256.0
# Per-token draft acceptance by temperature (the published shape: 0.81 / 0.71 / 0.52 / 0.38 at T 0 / 0.4 / 0.8 / 1.0).
ACCEPTANCE_BY_TEMPERATURE: tuple[tuple[float, float], ...] = (
    (0.0, 0.81),
    (0.4, 0.71),
    (0.8, 0.52),
    (1.0, 0.38),
    (1.5, 0.2),
    (2.0, 0.1),
)
AcceptanceSource = Literal["measured", "last measured", "prior", "none"]


MAX_QUEUED_TOKENS = 16 * DEFAULT_OUTPUT_TOKENS  # a mean beyond this is not trusted (a cluster snapshot is input)


def queued_tokens(view: PoolLoadView) -> float:
    """Output tokens of one request in the pool's queue: the pool's measured mean (at most ``MAX_QUEUED_TOKENS``),
    else ``DEFAULT_OUTPUT_TOKENS``."""
    mean = view.output_tokens_mean
    if mean is None or not math.isfinite(mean) or mean < 1.0:
        return DEFAULT_OUTPUT_TOKENS
    return min(mean, MAX_QUEUED_TOKENS)


def per_token_acceptance(temperature: float) -> float:
    """The per-token acceptance at ``temperature``, linear between the published points."""
    pts = ACCEPTANCE_BY_TEMPERATURE
    if temperature <= pts[0][0]:
        return pts[0][1]
    for (t0, a0), (t1, a1) in itertools.pairwise(pts):
        if temperature <= t1:
            return a0 + (a1 - a0) * (temperature - t0) / (t1 - t0)
    return pts[-1][1]


def rate_from_per_token(a: float, k: int) -> float:
    """vLLM's acceptance rate (E[accepted] / K) for per-token acceptance ``a`` under the truncated geometric."""
    if k <= 0:
        return 0.0
    if a >= 1.0:
        return 1.0
    return a * (1.0 - a**k) / (1.0 - a) / k


def band_temperature(band: Range | None, default: float) -> float:
    """The temperature a class stands for: the middle of its ``when.temperature`` range, its open side closed at
    ``default`` (what a request without a temperature samples at) or 0; no range: ``default``."""
    if band is None:
        return default
    low = max((b for b in (band.gt, band.gte) if b is not None), default=0.0)
    high = min((b for b in (band.lt, band.lte) if b is not None), default=max(default, low))
    return (low + high) / 2


def prior_rate(band: Range | None, default_temperature: float, k: int) -> float:
    """The acceptance rate assumed for a class of this temperature band until its own is measured."""
    return rate_from_per_token(per_token_acceptance(band_temperature(band, default_temperature)), k)


def tokens_per_step(rate: float | None, k: int) -> float:
    """Tokens one request gets per engine step: 1 + rate x K (1 without speculation or a known rate)."""
    return 1.0 if rate is None or not math.isfinite(rate) else 1.0 + max(0.0, rate) * k


@dataclass(frozen=True, slots=True)
class Estimate:
    """The expected completion time of one request of a class on one pool, with its inputs (explain shows them)."""

    pool: str
    kind: str
    running: float  # per fresh endpoint
    waiting: float  # per fresh endpoint
    tpot_s: float  # the pool's time per output token (measured, else borrowed)
    class_tpot_s: float  # this class's on the pool
    output_tokens: float
    queue_s: float
    first_token_s: float
    decode_s: float
    acceptance: float | None = None  # the class's rate used (speculative pools)
    acceptance_source: AcceptanceSource = "none"
    pool_acceptance: float | None = None  # the rate the pool's TPOT was measured at
    impact_s: float = 0.0  # the time this request adds to the pool's running requests (0: slope unknown)

    @property
    def expected_s(self) -> float:
        return self.queue_s + self.first_token_s + self.decode_s

    @property
    def cost_s(self) -> float:
        """What the controllers compare: the request's own expected time and what it costs the others."""
        return self.expected_s + self.impact_s


def estimate(
    view: PoolLoadView,
    kind: str,
    tpot_s: float,
    *,
    output_tokens: float = DEFAULT_OUTPUT_TOKENS,
    k: int = 0,
    class_rate: float | None = None,
    acceptance_source: AcceptanceSource = "none",
    pool_rate: float | None = None,
    slope_s: float | None = None,
    impact_weight: float = 1.0,
) -> Estimate | None:
    """The class's expected completion time on the pool (module docstring); None when the pool is stale or the
    TPOT unusable: unknown, never 0. ``k`` 0: a standard pool (no rescaling). ``slope_s``: the seconds one more
    running request adds to each of the pool's steps (None: unknown, no impact); ``impact_weight`` scales it."""
    if view.stale or view.running is None or view.waiting is None or not (tpot_s > 0 and math.isfinite(tpot_s)):
        return None
    endpoints = max(view.fresh_endpoints, 1)
    running, waiting = view.running / endpoints, view.waiting / endpoints
    class_tpot = tpot_s
    if k > 0 and pool_rate is not None:  # without the rate the pool's TPOT was measured at, nothing to rescale
        class_tpot = tpot_s * tokens_per_step(pool_rate, k) / tokens_per_step(class_rate, k)
    queue = waiting * queued_tokens(view) * tpot_s / max(running, 1.0)
    impact = 0.0
    if slope_s is not None and slope_s > 0 and math.isfinite(slope_s) and impact_weight > 0:
        steps = output_tokens / (tokens_per_step(class_rate, k) if k > 0 else 1.0)  # the steps it is in the batch
        impact = impact_weight * running * steps * slope_s
    return Estimate(
        view.pool,
        kind,
        running,
        waiting,
        tpot_s,
        class_tpot,
        output_tokens,
        queue,
        tpot_s,
        output_tokens * class_tpot,
        class_rate if k > 0 else None,
        acceptance_source if k > 0 else "none",
        pool_rate if k > 0 else None,
        impact,
    )


@dataclass(frozen=True, slots=True)
class Observation:
    """One window's measurements for a class's two pools (speculative and standard). None = not measured (never
    read as 0)."""

    samples: int  # the class's requests measured in the window
    spec_cost_s: float | None  # the class's cost on its speculative pool (Estimate.cost_s: own time + impact)
    std_cost_s: float | None  # the class's cost on its standard pool
    spec_queue: float | None = None  # waiting per fresh endpoint of the speculative pool
    spec_batch: float | None = None  # running per fresh endpoint of the speculative pool
    acceptance: float | None = None  # the class's acceptance rate (Δaccepted / Δdraft_tokens) in the window
    p95_s: float | None = None  # the class's p95 latency in the window
    stale: bool = False
    # A class with clearly more acceptance on the same speculative pool is partly off it (gateway.routing.ownership):
    # this class takes no share onto that pool and hands back what it has there first.
    outranked_by: str | None = None
