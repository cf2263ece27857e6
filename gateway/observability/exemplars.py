"""Which latency observations carry a trace exemplar: at most one per histogram bucket per second.

An exemplar links a latency bucket to one trace that landed in it. Prometheus keeps one exemplar per bucket (the
latest) and reads it once per scrape, so setting it on every traced request only costs time (prometheus_client
checks the labels and builds an ``Exemplar`` with a timestamp each call) without showing anything more. A bucket's
exemplar here is at most a second old, far fresher than any scrape interval. A bucket whose exemplar was set less
than a second ago keeps it, whichever trace comes next; a rare slow request still gets its own bucket's exemplar.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

MIN_INTERVAL_S = 1.0


class ExemplarGate:
    """Per histogram child (by key) and bucket: the time its exemplar was last set."""

    __slots__ = ("_bounds", "_interval", "_last")

    def __init__(self, bounds: Sequence[float], interval_s: float = MIN_INTERVAL_S) -> None:
        self._bounds = tuple(bounds)
        self._interval = interval_s
        self._last: dict[object, list[float]] = {}

    def due(self, key: object, value: float, now: float) -> bool:
        """Whether an observation of ``value`` into the child ``key`` at ``now`` (monotonic) sets the exemplar of its
        bucket; True records it as set."""
        last = self._last.get(key)
        if last is None:
            last = self._last[key] = [-self._interval] * (len(self._bounds) + 1)  # +Inf bucket last
        i = bisect_left(self._bounds, value)  # the first bucket whose upper bound holds the value (le)
        if now - last[i] < self._interval:
            return False
        last[i] = now
        return True
