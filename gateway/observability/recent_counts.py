"""Counts of the last few minutes (the console's "shed and limited in the last 5 minutes" per tenant): a small
ring of per-interval counts, fixed in size, advanced by the clock when it is read or added to. Totals since start
are Prometheus counters; this is what an operator looking at the console now wants: is it happening now?

Bounded: ``buckets`` slots of ``interval_s`` seconds per ring, whatever the traffic. The window read is the last
``buckets - 1`` whole intervals and the current one (so between ``(buckets - 1) x interval_s`` and
``buckets x interval_s`` seconds back).
"""

from __future__ import annotations

import time
from collections.abc import Callable

WINDOW_S = 300.0
_BUCKETS = 10


class RecentCounts:
    """Named counts (``kinds``) over the last ``window_s`` seconds, in ``buckets`` intervals."""

    __slots__ = ("_clock", "_counts", "_head", "_interval", "kinds")

    def __init__(
        self,
        kinds: tuple[str, ...],
        window_s: float = WINDOW_S,
        buckets: int = _BUCKETS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kinds = kinds
        self._interval = window_s / buckets
        self._clock = clock
        self._counts = [[0] * len(kinds) for _ in range(buckets)]
        self._head = int(clock() // self._interval)  # the interval the last slot written belongs to

    @property
    def window_s(self) -> float:
        return self._interval * len(self._counts)

    def _advance(self) -> int:
        """Move the ring to the current interval (zeroing the intervals passed) and return its slot."""
        now = int(self._clock() // self._interval)
        n = len(self._counts)
        if now > self._head:
            for i in range(self._head + 1, min(now, self._head + n) + 1):
                self._counts[i % n] = [0] * len(self.kinds)
            self._head = now
        return now % n

    def add(self, kind: str, n: int = 1) -> None:
        self._counts[self._advance()][self.kinds.index(kind)] += n

    def totals(self) -> dict[str, int]:
        self._advance()
        return {k: sum(slot[i] for slot in self._counts) for i, k in enumerate(self.kinds)}
