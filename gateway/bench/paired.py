"""How sure a sweep's comparison is: a paired bootstrap interval of adaptive / best homogeneous at one load point.

Every policy of a sweep is sent the same requests at the same times (one seed), so request i of one policy's point
is request i of every other's. The interval resamples requests, not policies: one draw of request indices is
applied to every policy's latencies, and the ratio of the adaptive fleet's percentile to the best homogeneous
fleet's (the best picked again in every draw) is computed on it. Pairing cancels what the requests themselves
contribute (a long answer is slow under every policy), so the interval is narrower than resampling each policy on
its own, and a verdict needs fewer requests. Requests are drawn one by one as if independent; a burst slows its
requests together, so the interval is, if anything, too narrow near saturation.

A failed request counts as slower than any answered one (``math.inf``): a policy does not gain by failing its
slowest requests.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.bench.load import percentile
from gateway.bench.mix import Target

RESAMPLES = 1000
LEVEL = 0.95


@dataclass(frozen=True, slots=True)
class Ratio:
    """adaptive / best homogeneous at one percentile: the measured ratio and its bootstrap interval."""

    value: float
    lo: float
    hi: float

    @property
    def known(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi) or math.isnan(self.value))


UNKNOWN = Ratio(math.nan, math.nan, math.nan)


def _ratios(adaptive: Sequence[float], baselines: Sequence[Sequence[float]], qs: Sequence[float]) -> list[float]:
    mine = sorted(adaptive)  # sorted once: ``percentile`` sorts a sorted list in one pass
    bases = [sorted(b) for b in baselines]
    out = []
    for q in qs:
        best = min(percentile(b, q) for b in bases)
        out.append(math.nan if best <= 0 or math.isinf(best) else percentile(mine, q) / best)
    return out


def paired_ratios(
    adaptive: Sequence[float],
    baselines: Sequence[Sequence[float]],
    qs: Sequence[float] = (0.5, 0.99),
    *,
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> list[Ratio]:
    """For each percentile q of ``qs``: percentile_q(adaptive) / min over ``baselines`` of percentile_q, with the
    central ``level`` interval of a paired bootstrap (each sequence holds the same requests in the same order; one
    draw of indices serves every q). UNKNOWN where a side is empty or the sequences differ in length (they are
    then not the same requests)."""
    n = len(adaptive)
    if n == 0 or not baselines or any(len(b) != n for b in baselines):
        return [UNKNOWN for _ in qs]
    values = _ratios(adaptive, baselines, qs)
    rng = random.Random(seed)
    draws: list[list[float]] = [[] for _ in qs]
    for _ in range(resamples):
        idx = [int(rng.random() * n) for _ in range(n)]
        got = _ratios([adaptive[i] for i in idx], [[b[i] for i in idx] for b in baselines], qs)
        for k, r in enumerate(got):
            draws[k].append(math.inf if math.isnan(r) else r)
    tail = (1.0 - level) / 2
    out = []
    for value, d in zip(values, draws, strict=True):
        d.sort()
        out.append(Ratio(value, d[int(tail * resamples)], d[max(0, math.ceil((1.0 - tail) * resamples) - 1)]))
    return out


def verdict(ratio: Ratio, limit: float) -> str:
    """Whether "ratio at most ``limit``" holds: ``met`` (the whole interval at or under it), ``missed`` (the whole
    interval over it), ``undecided`` (the interval straddles it), ``unknown`` (no interval)."""
    if not ratio.known:
        return "unknown"
    if ratio.hi <= limit:
        return "met"
    if ratio.lo > limit:
        return "missed"
    return "undecided"


def limits_at(load: float, target: Target) -> list[tuple[str, float]]:
    """The p99 ratio limits a mix's target sets at ``load``: at most ``target.within`` everywhere, and at most
    1 - ``target.below_by`` at the loads ``target.below_at``; each with how the report names it."""
    out = [(f"<= x{target.within:.2f}", target.within)]
    if target.below_by > 0 and any(abs(load - x) < 1e-9 for x in target.below_at):
        out.append((f">= {target.below_by:.0%} below", 1.0 - target.below_by))
    return out
