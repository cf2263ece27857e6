"""The weekly report's recommendations: what its numbers call for, against common speculative-decoding thresholds.

Each recommendation names its severity, scope (pool, class, overall), target and the threshold it crossed. Missing
data (``None``) never triggers one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The thresholds of the recommendations (the same as the alert rules' where they overlap)."""

    accept_critical: float = 0.3  # CriticalAcceptRatio: < 0.3 → switch to standard decoding now
    accept_low: float = 0.5  # LowAcceptRatio, troubleshooting 1: < 0.5 → replace the draft or disable SD
    accept_review: float = 0.55  # rule of thumb: < 0.55 → replace the draft model or train an EAGLE-3 head
    accept_guard: float = 0.4  # FallbackConfig.accept_ratio_threshold: the automatic fallback's floor
    min_speedup: float = 1.3  # rule of thumb: E2E p50 speedup < 1.3x → reconsider cost-effectiveness
    latency_regression_pct: float = 20.0  # p95 > 20% worse than the baseline → fall back
    max_fallbacks: int = 5  # more than 5 fallbacks a week → check the draft model's quality


def _rec(severity: str, scope: str, target: str, message: str) -> dict[str, str]:
    return {"severity": severity, "scope": scope, "target": target, "message": message}


def _acceptance_recs(scope: str, target: str, accept: dict[str, Any], th: Thresholds, win: str) -> list[dict[str, str]]:
    avg, low = accept.get("current_avg"), accept.get("min")
    where = f"{scope} {target}"
    fix = "route the class to the standard pool" if scope == "class" else "disable speculative decoding on it"
    if avg is None:
        return []
    if avg < th.accept_critical:
        return [
            _rec(
                "critical",
                scope,
                target,
                f"acceptance {avg:.2f} < {th.accept_critical} ("
                f"CriticalAcceptRatio): switch {where} to standard decoding now ({fix})",
            )
        ]
    if avg < th.accept_low:
        return [
            _rec(
                "warning",
                scope,
                target,
                f"acceptance {avg:.2f} < {th.accept_low} (LowAcceptRatio: "
                f"speculation costs more than it saves): replace the draft model or {fix}",
            )
        ]
    out = []
    if avg < th.accept_review:
        out.append(
            _rec(
                "warning",
                scope,
                target,
                f"acceptance {avg:.2f} < {th.accept_review}: replace the draft model or train an EAGLE-3 head",
            )
        )
    if low is not None and low < th.accept_guard:
        out.append(
            _rec(
                "info",
                scope,
                target,
                f"acceptance fell to {low:.2f} in a {win} window, below the automatic "
                f"fallback floor {th.accept_guard}: check which traffic drove it down",
            )
        )
    return out


def _speed_recs(scope: str, target: str, p50: Any, p95_reg: Any, th: Thresholds) -> list[dict[str, str]]:
    out = []
    if p50 is not None and p50 < th.min_speedup:
        out.append(
            _rec(
                "warning",
                scope,
                target,
                f"E2E p50 speedup {p50:.2f}x < {th.min_speedup}x against the baseline "
                ": reconsider whether speculative decoding pays for itself here",
            )
        )
    if p95_reg is not None and p95_reg > th.latency_regression_pct:
        out.append(
            _rec(
                "critical",
                scope,
                target,
                f"E2E p95 is {p95_reg:.0f}% worse than the baseline (> "
                f"{th.latency_regression_pct:.0f}%): the fallback criterion is met; move it to standard",
            )
        )
    return out


def recommend(report: dict[str, Any], th: Thresholds) -> list[dict[str, str]]:
    """The rules of thumb applied to a report; a number that is missing never triggers one."""
    win = str(report.get("window", ""))
    recs: list[dict[str, str]] = []
    for pool in report["pools"]:
        recs += _acceptance_recs("pool", pool["pool"], pool["accept_ratio"], th, win)
    for cls in report["classes"]:
        recs += _acceptance_recs("class", cls["class"], cls["accept_ratio"], th, win)
        if cls["accept_ratio"]["current_avg"] is not None:  # only classes that ran on a speculative pool
            recs += _speed_recs("class", cls["class"], cls["e2e_p50_speedup"], cls["e2e_p95_regression_pct"], th)
        if (cls["fallback_count"] or 0) > th.max_fallbacks:
            recs.append(
                _rec(
                    "warning",
                    "class",
                    cls["class"],
                    f"{cls['fallback_count']} automatic fallbacks (> "
                    f"{th.max_fallbacks} a week): check the draft model's quality for this traffic",
                )
            )
    sp = report["speedup"]
    recs += _speed_recs("overall", "all", sp["e2e_p50_speedup"], sp["e2e_p95_regression_pct"], th)
    failed: dict[str, int] = {}
    for f in report["pool_fallbacks"] or []:
        failed[f["from_pool"]] = failed.get(f["from_pool"], 0) + int(f["count"])
    for pool, n in sorted(failed.items()):
        if n > th.max_fallbacks:
            recs.append(
                _rec(
                    "warning",
                    "pool",
                    pool,
                    f"{n} requests fell back to another pool before the first byte "
                    f"(> {th.max_fallbacks}): check the pool's health and timeouts",
                )
            )
    if not any(p["accept_ratio"]["current_avg"] is not None for p in report["pools"]):
        recs.append(
            _rec(
                "info",
                "overall",
                "all",
                "no pool acceptance data: are the speculative vLLM servers scraped, "
                "with a `pool` target label, and did they draft in the range?",
            )
        )
    if sp["current_e2e_p50_ms"] is None:
        recs.append(_rec("info", "overall", "all", "no gateway latency data: is the gateway scraped?"))
    return recs
