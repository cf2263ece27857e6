"""A small client of the Prometheus HTTP API (``/api/v1/query``) and PromQL helpers for the reports.

Values Prometheus answers as ``NaN`` or ``±Inf`` (0/0 of an idle window, ``histogram_quantile`` without
observations) are dropped, never read as 0: a series without a number is "no data".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import httpx

_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


class PromError(RuntimeError):
    """Prometheus could not be reached or refused a query."""


@dataclass(frozen=True, slots=True)
class Sample:
    labels: dict[str, str]
    value: float


def parse_duration(text: str) -> float:
    """A Prometheus duration (``7d``, ``5m``, ``1h30m``) in seconds; ValueError when it is not one."""
    text = text.strip()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += int(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(text) or total <= 0:
        raise ValueError(f"not a Prometheus duration: {text!r} (e.g. 7d, 24h, 5m, 30s)")
    return total


def format_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration in the largest exact unit up to days (``604800`` → ``7d``, ``90`` → ``90s``)."""
    whole = round(seconds)
    if whole <= 0:
        return f"{max(1, round(seconds * 1000))}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def parse_vector(body: Any) -> list[Sample]:
    """The samples of an instant query's JSON answer (``resultType`` vector or scalar); NaN / Inf dropped."""
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        raise PromError(f"query failed: {error or body!r}")
    data = body.get("data") or {}
    kind, result = data.get("resultType"), data.get("result")
    if kind == "scalar" and isinstance(result, list):
        result = [{"metric": {}, "value": result}]
    elif kind != "vector" or not isinstance(result, list):
        raise PromError(f"unexpected result type {kind!r}")
    out: list[Sample] = []
    for item in result:
        try:
            value = float(item["value"][1])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PromError(f"malformed sample {item!r}") from exc
        if math.isfinite(value):
            out.append(Sample({str(k): str(v) for k, v in (item.get("metric") or {}).items()}, value))
    return out


class PromClient:
    """Instant queries against one Prometheus server, all evaluated at the same time ``at`` (Unix seconds)."""

    def __init__(self, url: str, *, at: float, timeout_s: float = 30.0, http: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.at = at
        self._http = http or httpx.Client(timeout=timeout_s)
        self.queries: list[str] = []  # every expression sent, in order (shown with --verbose, kept in the JSON)

    def close(self) -> None:
        self._http.close()

    def query(self, expr: str) -> list[Sample]:
        self.queries.append(expr)
        try:
            r = self._http.post(f"{self.url}/api/v1/query", data={"query": expr, "time": f"{self.at:.3f}"})
        except httpx.HTTPError as exc:
            raise PromError(f"cannot reach Prometheus at {self.url}: {exc}") from exc
        try:
            body = r.json()
        except ValueError as exc:
            raise PromError(f"Prometheus answered {r.status_code} without JSON: {r.text[:200]}") from exc
        return parse_vector(body)


def by_label(samples: list[Sample], label: str, default: str = "all") -> dict[str, float]:
    """Samples keyed by one label's value (``default`` when the series lacks it)."""
    return {s.labels.get(label) or default: s.value for s in samples}


def counter_increase(metric: str, by: str, range_: str) -> str:
    """PromQL for how much a counter grew over ``range_``, summed by ``by`` (comma-separated labels; may be empty).

    ``increase()`` cannot see the first increments of a series that appeared inside the range (a label set first
    incremented then: its first scraped value is already above 0); for those series their smallest value in the
    range is added back (series absent ``range_`` ago). Counter resets are handled by ``increase()``."""
    grown = f"sum by ({by}) (increase({metric}[{range_}]))"
    born = f"sum by ({by}) (min_over_time({metric}[{range_}]) unless {metric} offset {range_})"
    return f"(({grown}) + ({born})) or ({grown}) or ({born})"


def ratio_over(num: str, den: str, by: str, window: str) -> str:
    """PromQL for Σrate(num)/Σrate(den) by ``by`` over ``window``; windows where ``den`` did not grow give nothing
    (not 0/0 = NaN, never 0)."""
    return f"(sum by ({by}) (rate({num}[{window}])) / (sum by ({by}) (rate({den}[{window}])) > 0))"


def ratio_stats(num: str, den: str, by: str, range_: str, window: str) -> dict[str, str]:
    """PromQL for the ratio over the whole range (``avg``: Δnum / Δden, token-weighted, series born inside the range
    included, see ``counter_increase``) and the lowest / highest ratio of any
    ``window`` inside it: a subquery stepped by ``window`` (its steps are aligned to multiples of ``window``, so its
    last one can be up to a window before now) and ``last``, the window ending now, for the caller to fold in."""
    inner = ratio_over(num, den, by, window)
    grown_num, grown_den = counter_increase(num, by, range_), counter_increase(den, by, range_)
    return {
        "avg": f"(({grown_num}) / (({grown_den}) > 0))",
        "min": f"min_over_time({inner}[{range_}:{window}])",
        "max": f"max_over_time({inner}[{range_}:{window}])",
        "last": inner,
    }
