"""How much one more running request slows a pool: the rise of its step time per added sequence, measured from the
scrape rounds (the controllers' cost adds it; ``gateway.routing.estimate``).

A round gives, per pool, the TPOT over the scrape window (the requests that finished in it) and the running batch
right now. The pair that goes into the fit is the step time (TPOT x the tokens a request gets per step: 1 on a
standard pool, ``Acceptance.mean_length`` on a speculative one, so that a change in the acceptance of its traffic
is not taken for one of its batch) against the batch averaged over the same window. ``BatchSlope`` fits step time
against batch by exponentially weighted least squares, so that it follows a pool whose traffic changes and one
odd round moves it little; it says nothing until the batch has varied enough to fit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gateway.fleet.vllm_metrics import PoolLoadView

DECAY = 0.95  # per round: the fit remembers about the last 20 rounds
MIN_WEIGHT = 5.0  # rounds (decayed) before a slope is given
MIN_BATCH_VARIANCE = 0.25  # the batch must have varied by about half a request (standard deviation) to fit


@dataclass(slots=True)
class BatchSlope:
    """Step time against batch, by exponentially weighted least squares. ``slope_s``: seconds a step grows per added
    sequence, never negative, at most the mean step time over the mean batch (the batch's part of a step cannot
    exceed the step); kept while the batch does not vary enough to fit again. None until measured."""

    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    slope_s: float | None = None

    def add(self, batch: float, step_s: float) -> float | None:
        if not (batch >= 0 and math.isfinite(batch) and step_s > 0 and math.isfinite(step_s)):
            return self.slope_s
        d = DECAY
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + batch
        self.sy = self.sy * d + step_s
        self.sxx = self.sxx * d + batch * batch
        self.sxy = self.sxy * d + batch * step_s
        if self.w < MIN_WEIGHT:
            return self.slope_s
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < MIN_BATCH_VARIANCE:
            return self.slope_s
        slope = (self.sxy / self.w - mx * my) / var
        self.slope_s = min(max(slope, 0.0), my / max(mx, 1.0))
        return self.slope_s


class PoolSpeeds:
    """Per pool, across scrape rounds: its last measured TPOT with the acceptance rate it ran at, and its
    ``BatchSlope``. Owned by the routing state; one per process."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, float | None]] = {}
        self._slopes: dict[str, BatchSlope] = {}
        self._lengths: dict[str, float] = {}  # a speculative pool's tokens per step, last measured
        self._batches: dict[str, deque[tuple[float, float]]] = {}  # (time, running per endpoint) in the window

    def round(
        self, now: float, views: Mapping[str, PoolLoadView], *, speculative: Collection[str], window_s: float
    ) -> None:
        """Feed one scrape round to every pool's slope: (the batch averaged over the last ``window_s``, the step
        time). A speculative pool (named in ``speculative``) whose acceptance is missing this round uses its last
        measured tokens per step, or is skipped until it has one."""
        for view in views.values():
            if view.running is None or view.fresh_endpoints == 0:
                continue
            batches = self._batches.setdefault(view.pool, deque())
            batches.append((now, view.running / view.fresh_endpoints))
            while batches and batches[0][0] < now - window_s:
                batches.popleft()
            t = view.tpot_mean_s
            if t is None or not (t > 0 and math.isfinite(t)):
                continue
            length = 1.0
            if view.pool in speculative:
                if view.acceptance is not None and view.acceptance.mean_length >= 1.0:
                    self._lengths[view.pool] = view.acceptance.mean_length
                if view.pool not in self._lengths:
                    continue
                length = self._lengths[view.pool]
            batch = sum(b for _, b in batches) / len(batches)
            self._slopes.setdefault(view.pool, BatchSlope()).add(batch, t * length)

    def slope(self, pool: str) -> float | None:
        """Seconds one more running request adds to each step of the pool; None: not measured."""
        track = self._slopes.get(pool)
        return None if track is None else track.slope_s

    def slopes(self, spec: str, std: str, k: int) -> tuple[float | None, float | None]:
        """The speculative and the standard pool's slopes. One not measured yet (an idle pool's batch does not
        vary: at low load the standard one, which the controllers have emptied) comes from the other's by the
        work one sequence adds to a step: ``1 + k`` tokens verified on a speculative server (``k`` draft tokens
        a step) against one token computed on a standard one (the draft model's own work makes the real ratio
        larger still; the simulated 70B preset measures 2.9 ms against 0.6 ms with k = 4). An impact on one side
        only would tilt the comparison toward the pool that has not been measured. Neither measured: neither."""
        a, b = self.slope(spec), self.slope(std)
        ratio = 1.0 + max(0, k)
        if a is None and b is not None:
            a = b * ratio
        elif b is None and a is not None:
            b = a / ratio
        return a, b

    def tpot(self, view: PoolLoadView) -> tuple[float, float | None] | None:
        """The pool's TPOT over the scrape window and the acceptance rate it ran at, else the last ones measured."""
        t = view.tpot_mean_s
        if t is not None and t > 0 and math.isfinite(t):
            rate = None if view.acceptance is None else view.acceptance.rate
            if rate is None and view.pool in self._last:
                rate = self._last[view.pool][1]
            self._last[view.pool] = (t, rate)
            return t, rate
        return self._last.get(view.pool)
