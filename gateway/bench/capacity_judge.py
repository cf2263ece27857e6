"""How ``specgate bench capacity`` decides a fleet's sustainable rate, and its report. Pure.

One long run per policy climbs a ladder of offered rates (fractions of the computed capacity) and then bisects:
each step holds its rate for a settling time and a judged window. A rate is sustained when, over the window,

- the turn backlog (turns sent and not yet answered, sampled every fraction of a second) shows no growth: the
  least-squares line through the samples rises by at most ``Rules.rise_share`` of the window's mean backlog (and at
  most ``Rules.rise_floor`` turns per server, so that an almost empty fleet's few turns do not decide), and
- at most ``Rules.max_failed`` of the turns answered in the window failed (shed with 429/503, or errors): a front
  that sheds its excess keeps its backlog flat without sustaining the rate.

Below capacity the backlog is flat (it falls after a higher step); above it, it grows by the excess rate for as
long as the step lasts. The run need not drain between steps: a rate below capacity drains the backlog a higher
step left (falling: sustained), a rate above it grows it whatever it started from.

The next step: up by ``step`` while every step was sustained, down by ``step`` while none was, then the midpoint of
the highest sustained rate below the lowest unsustained one and that one, until they are ``resolution`` apart or
the steps run out. The sustainable rate is then bracketed: the highest sustained rate (the value reported) and the
lowest unsustained one above it. At an unsustained step the fleet answers as fast as it can: its answered turns
per second there is a second estimate of its capacity on this traffic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LIMIT = 0.9  # the cache-aware-router comparison's bar: specgate's sustainable rate at least this x the peer's


@dataclass(frozen=True, slots=True)
class Rules:
    rise_share: float = 0.25  # growth over the window, as a share of its mean backlog, that counts as a trend
    rise_floor: float = 2.0  # ... and at least this many turns per server
    max_failed: float = 0.01  # share of the window's answered turns that may fail


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the ladder as measured and judged."""

    fraction: float  # offered load, fraction of the computed capacity
    turns_rate: float  # offered turns per simulated second (fraction x capacity)
    window_s: float  # the judged window, simulated seconds
    mean_backlog: float  # turns in flight, mean over the window
    rise: float  # turns: the fitted line's growth over the window
    answered: int  # turns answered in the window (ok or not)
    failed: int  # of which failed
    lag: float = math.nan  # the worst simulated server's late steps, share of the window's simulated time

    @property
    def failed_share(self) -> float:
        return self.failed / self.answered if self.answered else 0.0

    @property
    def throughput(self) -> float:
        """Turns answered per simulated second in the window."""
        return (self.answered - self.failed) / self.window_s if self.window_s > 0 else math.nan


def slope(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t, value)`` samples; 0 with fewer than two distinct times."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var


def backlog_trend(samples: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(mean, rise over the samples' span) of a window's backlog samples ``(t, turns in flight)``."""
    if not samples:
        return 0.0, 0.0
    mean = sum(v for _, v in samples) / len(samples)
    span = samples[-1][0] - samples[0][0]
    return mean, slope(samples) * span


def verdict(step: Step, servers: int, rules: Rules | None = None) -> tuple[bool, str]:
    """Whether ``step`` sustained its rate, and why in a few words."""
    rules = rules or Rules()
    if step.failed_share > rules.max_failed:
        return False, f"{step.failed_share:.1%} of the answered turns failed (shed)"
    bound = max(rules.rise_share * step.mean_backlog, rules.rise_floor * servers)
    if step.rise > bound:
        return False, f"backlog grew {step.rise:.0f} turns (bound {bound:.0f}, mean {step.mean_backlog:.0f})"
    return True, f"backlog flat: {step.rise:+.0f} turns (bound {bound:.0f}, mean {step.mean_backlog:.0f})"


def bracket(history: Sequence[tuple[float, bool]]) -> tuple[float | None, float | None]:
    """(highest sustained fraction below the lowest unsustained one, that unsustained one); None where none."""
    bad = [f for f, ok in history if not ok]
    hi = min(bad) if bad else None
    good = [f for f, ok in history if ok and (hi is None or f < hi)]
    return (max(good) if good else None), hi


def next_fraction(
    history: Sequence[tuple[float, bool]], start: float, step: float, resolution: float, floor: float = 0.05
) -> float | None:
    """The next step's fraction after ``history`` (fraction, sustained): ``start`` first; up or down by ``step``
    until a step of each kind is seen; then the midpoint of the bracket; None once the bracket is ``resolution``
    narrow (or nothing lower than ``floor`` is left to try)."""
    if not history:
        return start
    lo, hi = bracket(history)
    if hi is None:
        return max(f for f, _ in history) + step
    if lo is None:
        below = hi - step
        return below if below >= floor else None
    if hi - lo <= resolution + 1e-9:
        return None
    return round((lo + hi) / 2, 6)


@dataclass(frozen=True, slots=True)
class Comparison:
    """specgate's sustainable rate over the peer's: the value from the highest sustained fractions, the bounds from
    the brackets (lowest: specgate's sustained / peer's unsustained; highest: the other way round)."""

    value: float
    lo: float
    hi: float

    def reading(self, limit: float = LIMIT) -> str:
        if math.isnan(self.value):
            return "unknown"
        if self.lo >= limit:
            return "met"
        if self.hi < limit:
            return "missed"
        return "undecided"


def compare(mine: tuple[float | None, float | None], peer: tuple[float | None, float | None]) -> Comparison:
    """The ratio of two brackets (sustained, unsustained fractions of the same computed capacity)."""
    (m_lo, m_hi), (p_lo, p_hi) = mine, peer
    if m_lo is None or p_lo is None:
        return Comparison(math.nan, math.nan, math.nan)
    lo = m_lo / p_hi if p_hi else 0.0
    hi = (m_hi / p_lo) if m_hi is not None else math.inf
    return Comparison(m_lo / p_lo, lo, hi)
