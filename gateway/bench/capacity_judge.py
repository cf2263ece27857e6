"""How ``specgate bench capacity`` measures a fleet's sustainable rate, and how two fleets compare. Pure.

Multi-turn load is only half open: conversations arrive at their own pace, but each sends its next turn only after
the answer to the last (and a think time). Offered more than it can answer, a fleet slows every turn; the
conversations live longer and pile up, and the turn backlog (turns sent and not yet answered) grows only as fast
as conversations accumulate: by the excess turn rate divided by the turns per conversation. Ten percent over
capacity on this bench's mix grows the backlog by a dozen turns a minute against a backlog of dozens; a ladder of
short steps judged by the backlog's trend cannot tell 90% from 110% of capacity. Two measurements that can:

- the **ceiling**: offered well above capacity, the fleet answers turns as fast as it can. Once the backlog has
  built up (``settle``), the turns it answers per second over a window are its capacity on this traffic (the
  window's sub-windows give a standard error: batch means). Only if it was saturated: a mean backlog of at least
  every server's full batch (``saturated``), else the conversations had not built up yet and the rate is only
  what was offered;
- the **hold**: a new set of conversations offered at a share of the ceiling (0.9, then 0.8 if that fails) for a
  long window, after a warm-up that brings the open conversations to their steady state; sustained when the
  backlog shows no growth (the least-squares line through samples taken every fraction of a second rises by at
  most ``Rules.rise_share`` of the window's mean backlog, a bound never below ``Rules.rise_floor`` turns per
  server) and at most ``Rules.max_failed`` of the turns answered in the window failed (a front that sheds its
  excess keeps its backlog flat without sustaining the rate).

The sustainable rate lies between the rate of the hold that sustained it and the ceiling. Two fleets compare by
their ceilings, with an interval from the two standard errors, and by their sustained holds, with the bounds their
holds and ceilings allow (``sustained_bounds``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LIMIT = 0.9  # the cache-aware-router comparison's bar: specgate's sustainable rate at least this x the peer's
Z95 = 1.96


@dataclass(frozen=True, slots=True)
class Rules:
    # growth over the window, as a share of its mean backlog, that counts as a trend: a hold's backlog wanders by
    # about a third of its mean over two simulated minutes; 10% over capacity adds about half of it
    rise_share: float = 0.5
    rise_floor: float = 4.0  # ... and at least this many turns per server
    max_failed: float = 0.01  # share of the window's answered turns that may fail


@dataclass(frozen=True, slots=True)
class Step:
    """One phase of a fleet's run as measured: its offered rate and what the fleet did in the judged window."""

    fraction: float  # offered load, fraction of the computed capacity
    turns_rate: float  # offered turns per simulated second (fraction x capacity)
    window_s: float  # the judged window, simulated seconds
    mean_backlog: float  # turns in flight, mean over the window
    rise: float  # turns: the fitted line's growth over the window
    answered: int  # turns answered in the window (ok or not)
    failed: int  # of which failed
    throughput_se: float = math.nan  # standard error of ``throughput`` (batch means over sub-windows)
    lag: float = math.nan  # the worst simulated server's late steps, share of the window's simulated time

    @property
    def failed_share(self) -> float:
        return self.failed / self.answered if self.answered else 0.0

    @property
    def throughput(self) -> float:
        """Turns answered (and not failed) per simulated second in the window."""
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


def rate_and_error(times: Sequence[float], w0: float, w1: float, parts: int = 6) -> tuple[float, float]:
    """Events per second in ``[w0, w1)`` from their ``times``, and its standard error from the counts of ``parts``
    equal sub-windows (batch means: the sub-windows' rates vary as much as the fleet's pace did)."""
    span = w1 - w0
    if span <= 0 or parts < 2:
        return math.nan, math.nan
    counts = [0] * parts
    for t in times:
        if w0 <= t < w1:
            counts[min(parts - 1, int((t - w0) / span * parts))] += 1
    rates = [c * parts / span for c in counts]
    mean = sum(rates) / parts
    var = sum((r - mean) ** 2 for r in rates) / (parts - 1)
    return mean, math.sqrt(var / parts)


def saturated(step: Step, slots: int) -> bool:
    """Whether a ceiling phase kept the fleet busy: on average at least ``slots`` (every server's full running batch)
    turns in flight, so the turns it answered are its pace, not the offered rate."""
    return step.mean_backlog >= slots


def verdict(step: Step, servers: int, rules: Rules | None = None) -> tuple[bool, str]:
    """Whether a hold sustained its rate, and why in a few words."""
    rules = rules or Rules()
    if step.failed_share > rules.max_failed:
        return False, f"{step.failed_share:.1%} of the answered turns failed (shed)"
    bound = max(rules.rise_share * step.mean_backlog, rules.rise_floor * servers)
    if step.rise > bound:
        return False, f"backlog grew {step.rise:.0f} turns (bound {bound:.0f}, mean {step.mean_backlog:.0f})"
    return True, f"backlog flat: {step.rise:+.0f} turns (bound {bound:.0f}, mean {step.mean_backlog:.0f})"


@dataclass(frozen=True, slots=True)
class Comparison:
    """One fleet's ceiling over another's, with a 95% interval from their standard errors (delta method)."""

    value: float
    lo: float
    hi: float

    def reading(self, limit: float = LIMIT) -> str:
        """``met`` (the whole interval at or above ``limit``), ``missed`` (below), ``undecided`` or ``unknown``."""
        if math.isnan(self.value):
            return "unknown"
        if self.lo >= limit:
            return "met"
        if self.hi < limit:
            return "missed"
        return "undecided"


def compare(mine: Step, peer: Step) -> Comparison:
    """``mine``'s ceiling (turns answered per second) over ``peer``'s."""
    a, b = mine.throughput, peer.throughput
    if not (a > 0 and b > 0):
        return Comparison(math.nan, math.nan, math.nan)
    r = a / b
    sa = mine.throughput_se if not math.isnan(mine.throughput_se) else 0.0
    sb = peer.throughput_se if not math.isnan(peer.throughput_se) else 0.0
    se = r * math.sqrt((sa / a) ** 2 + (sb / b) ** 2)
    return Comparison(r, r - Z95 * se, r + Z95 * se)


def sustained_bounds(mine_hold: float, mine_ceiling: float, peer_hold: float, peer_ceiling: float) -> Comparison:
    """The ratio of two sustainable rates, each known to lie between its sustained hold's rate and its ceiling: the
    ratio of the holds, at least ``mine_hold / peer_ceiling`` and at most ``mine_ceiling / peer_hold``."""
    if not (mine_hold > 0 and peer_hold > 0 and peer_ceiling > 0):
        return Comparison(math.nan, math.nan, math.nan)
    return Comparison(
        mine_hold / peer_hold, mine_hold / max(peer_ceiling, peer_hold), max(mine_ceiling, mine_hold) / peer_hold
    )
