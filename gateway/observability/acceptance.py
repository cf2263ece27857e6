"""Speculative-decoding acceptance per traffic class, measured from what the speculative pools report per request.

A ``SpecSample`` is one request's counts (vLLM's per-request ``metrics.speculative_decoding``); an
``AcceptanceWindow`` pools the most recent samples of one class (sums of counts, not a mean of ratios), which the
metrics expose and the class controllers read.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Per-request acceptance rates: P10/P50/P90 are read from these buckets.
ACCEPTANCE_BUCKETS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 … 0.95
TEMPERATURE_BANDS = ("0-0.3", "0.3-0.7", "0.7+", "unset")
DEFAULT_WINDOW = 200  # requests per class in the sliding window


def temperature_band(value: object) -> str:
    """The bounded label for a request's ``temperature`` as the client sent it ("unset" when absent)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return "unset"
    if value < 0.3:
        return "0-0.3"
    if value < 0.7:
        return "0.3-0.7"
    return "0.7+"


@dataclass(frozen=True, slots=True)
class SpecSample:
    """One request's speculative decoding, as its pool reported it."""

    drafted: int  # num_draft_tokens
    accepted: int  # num_accepted_draft_tokens
    steps: int | None  # num_spec_steps (number of drafts)
    mean_acceptance_length: float | None

    @property
    def rate(self) -> float | None:
        """Δaccepted / Δdraft_tokens of this request; None when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted > 0 else None


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def sample_from_metrics(metrics: object) -> SpecSample | None:
    """Read ``{"speculative_decoding": {...}}`` (the response's top-level ``metrics``); None when absent or bad."""
    if not isinstance(metrics, dict):
        return None
    sd = metrics.get("speculative_decoding")
    if not isinstance(sd, dict):
        return None
    drafted = _count(sd.get("num_draft_tokens"))
    accepted = _count(sd.get("num_accepted_draft_tokens"))
    if drafted is None or accepted is None or accepted > drafted:
        return None
    steps = _count(sd.get("num_spec_steps", sd.get("num_drafts")))
    mal = sd.get("mean_acceptance_length")
    if isinstance(mal, bool) or not isinstance(mal, int | float) or not math.isfinite(mal):
        mal = 1.0 + accepted / steps if steps else None
    return SpecSample(drafted, accepted, steps, float(mal) if mal is not None else None)


class AcceptanceWindow:
    """Pooled acceptance of one traffic class over its most recent requests (sums of counts, not mean of ratios)."""

    __slots__ = ("_accepted", "_drafted", "_samples", "_step_accepted", "_steps")

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        self._samples: deque[SpecSample] = deque(maxlen=size)
        self._drafted = 0
        self._accepted = 0
        self._steps = 0
        self._step_accepted = 0  # accepted tokens of the samples that reported their steps

    def add(self, sample: SpecSample) -> None:
        samples = self._samples
        if samples.maxlen is not None and len(samples) == samples.maxlen:
            self._remove(samples[0])
        samples.append(sample)
        self._drafted += sample.drafted
        self._accepted += sample.accepted
        if sample.steps:
            self._steps += sample.steps
            self._step_accepted += sample.accepted

    def _remove(self, sample: SpecSample) -> None:
        self._drafted -= sample.drafted
        self._accepted -= sample.accepted
        if sample.steps:
            self._steps -= sample.steps
            self._step_accepted -= sample.accepted

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def ratio(self) -> float:
        """Σaccepted / Σdraft tokens over the window; NaN when nothing was drafted."""
        return self._accepted / self._drafted if self._drafted else math.nan

    @property
    def mean_acceptance_length(self) -> float:
        """1 + Σaccepted / Σsteps over the window (tokens per verification step); NaN when unknown."""
        return 1.0 + self._step_accepted / self._steps if self._steps else math.nan
