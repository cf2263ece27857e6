"""``bench policies``' comparison of ``adaptive`` with its variant ``adaptive-no-affinity`` (prefix affinity and warm
homes off): whether the prefix work made the single-turn sweeps worse. Pure.

Both policies get the same requests at the same times (one seed), so the comparison is paired as in
``bench.paired``: per load, the ratio adaptive / variant of the E2E p50 and p99 with its bootstrap interval. The
reading per percentile: ``worse`` when the whole interval is above 1 + ``tolerance``, ``better`` when it is below
1, ``no worse`` otherwise (the interval reaches down to 1 + ``tolerance``: no slowdown beyond the tolerance is
shown).
"""

from __future__ import annotations

import math

from gateway.bench.paired import LEVEL, Ratio, paired_ratios
from gateway.bench.points import Point

VARIANT = "adaptive-no-affinity"


def reading(ratio: Ratio, tolerance: float = 0.0) -> str:
    """``worse``, ``better``, ``no worse`` or ``unknown`` for one paired ratio adaptive / variant."""
    if not ratio.known:
        return "unknown"
    if ratio.lo > 1.0 + tolerance:
        return "worse"
    if ratio.hi < 1.0:
        return "better"
    return "no worse"


def _span(r: Ratio) -> str:
    return f"{r.value:.2f} ({r.lo:.2f}-{r.hi:.2f})" if r.known else "-"


def variant_table(points: list[Point], lag_ok: float, tolerance: float = 0.0) -> list[str]:
    """The report's section: adaptive against the variant at every load both ran; [] where they did not. A point
    whose worst server started late by more than ``lag_ok`` of its time is marked not valid."""
    by = {(p.policy, p.load): p for p in points}
    loads = sorted(x for (policy, x) in by if policy == "adaptive" and (VARIANT, x) in by)
    if not loads:
        return []
    lines = [
        f"## adaptive against adaptive without prefix affinity (paired, {LEVEL:.0%} bootstrap interval)",
        "",
        "The same requests under both; ratio adaptive / no-affinity of E2E (a failed request counts as the slowest). "
        "worse: the whole interval above 1"
        + (f" + {tolerance:g}" if tolerance else "")
        + "; better: the whole interval below 1; no worse: otherwise. A point whose late steps passed "
        f"{lag_ok:.0%} measured the machine: marked not valid.",
        "",
        "| offered load | p50 ratio (interval) | p50 | p99 ratio (interval) | p99 | late steps |",
        "|---:|---:|---|---:|---|---:|",
    ]
    tally: dict[str, list[str]] = {}
    for load in loads:
        a, v = by[("adaptive", load)], by[(VARIANT, load)]
        p50, p99 = paired_ratios(a.e2e_s, [v.e2e_s], (0.5, 0.99), seed=round(load * 1000))
        lag = max((p.lag for p in (a, v) if not math.isnan(p.lag)), default=math.nan)
        marks = [reading(r, tolerance) for r in (p50, p99)]
        if lag > lag_ok:
            marks = [f"{m} (not valid)" for m in marks]
        for q, m in zip(("p50", "p99"), marks, strict=True):
            tally.setdefault(m, []).append(f"{q} at {load:.0%}")
        late = "-" if math.isnan(lag) else f"{lag:.1%}"
        lines.append(f"| {load:.0%} | {_span(p50)} | {marks[0]} | {_span(p99)} | {marks[1]} | {late} |")
    summary = "; ".join(f"{m}: {', '.join(at)}" for m, at in sorted(tally.items()))
    return [*lines, "", f"- {summary}", ""]
