"""How sure a multi-turn sweep's comparison is: an unpaired bootstrap interval of the ratio of two percentiles.

The single-turn sweep pairs its requests across policies (``bench.paired``); the multi-turn report does not match
turns across policies, so it resamples each policy's requests on its own.

A p99 over a few hundred requests is decided by its few slowest ones, so two runs of one configuration can differ by
as much as a target's margin. The report gives each adaptive/best-homogeneous ratio with the interval that
resampling the measured requests gives it (each policy's requests resampled on their own, the best homogeneous
fleet picked again in every resample), so a reader sees which verdicts the measurement settles and which it does
not. The requests are resampled one by one, as if independent; a burst makes its requests slow together, so the
interval is, if anything, too narrow: read "not settled" as certain and "settled" as likely.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from gateway.bench.load import percentile

RESAMPLES = 400
LEVEL = 0.90


def _resampled_p99(values: Sequence[float], rng: random.Random, q: float = 0.99) -> float:
    n = len(values)
    draw = [values[int(rng.random() * n)] for _ in range(n)]
    return percentile(draw, q)


def ratio_interval(
    adaptive: Sequence[float],
    baselines: Sequence[Sequence[float]],
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
    q: float = 0.99,
) -> tuple[float, float]:
    """The central ``level`` interval of p99(adaptive) / min(p99(baseline)) over bootstrap resamples (``q``: another
    percentile than the 99th); (NaN, NaN) when a side has no requests."""
    if not adaptive or not baselines or any(not b for b in baselines):
        return math.nan, math.nan
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        best = min(_resampled_p99(b, rng, q) for b in baselines)
        ratios.append(_resampled_p99(adaptive, rng, q) / best if best > 0 else math.inf)
    ratios.sort()
    tail = (1.0 - level) / 2
    lo = ratios[int(tail * resamples)]
    hi = ratios[max(0, math.ceil((1.0 - tail) * resamples) - 1)]
    return lo, hi
