"""Operators' reports from Prometheus (``specgate report …``): the weekly speculative-decoding check.

- ``promql``: the Prometheus client and query helpers.
- ``weekly``: the queries and the report they make (``collect``).
- ``recommend``: the report's recommendations against the thresholds (``Thresholds``).
- ``markdown``: the report as Markdown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gateway.report.promql import PromClient, parse_duration
from gateway.report.recommend import Thresholds
from gateway.report.weekly import collect, default_window_s, load_baseline


def weekly_report(
    prometheus: str,
    baseline_path: Path,
    *,
    range_: str = "7d",
    window: str | None = None,
    pool_label: str = "pool",
    at: float | None = None,
    thresholds: Thresholds | None = None,
) -> dict[str, Any]:
    """The weekly report as a JSON-ready dict. ValueError: bad arguments or baseline; PromError: Prometheus."""
    range_s = parse_duration(range_)
    window_s = parse_duration(window) if window else default_window_s(range_s)
    if window_s > range_s:
        raise ValueError(f"--window {window} is longer than --range {range_}")
    baseline = load_baseline(baseline_path)
    client = PromClient(prometheus, at=time.time() if at is None else at)
    try:
        return collect(
            client, baseline, range_s=range_s, window_s=window_s, pool_label=pool_label, thresholds=thresholds
        )
    finally:
        client.close()
