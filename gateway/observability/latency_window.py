"""Recent request latencies with their times, for quantiles over a time window (the latency guard)."""

from __future__ import annotations

import math
from collections import deque


class LatencyWindow:
    """The last ``size`` latencies with their (monotonic) times; quantiles over a time window, exact (not bucketed:
    the latency guard compares with a baseline within a few per cent, finer than the histogram's buckets)."""

    __slots__ = ("_samples",)

    def __init__(self, size: int = 2048) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=size)

    def add(self, at: float, seconds: float) -> None:
        self._samples.append((at, seconds))

    def quantile(self, q: float, since: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the samples taken at or after ``since``; None without one."""
        values = sorted(v for t, v in self._samples if t >= since)
        if not values:
            return None
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]
