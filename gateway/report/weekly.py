"""``specgate report weekly``: the weekly speculative-decoding check, from Prometheus, on current vLLM names.

Queries (all instant queries at one time, over ``--range``, default 7d; ``--window`` is the width of the windows
the min/max are taken over, default ``min(5m, range/10)``):

- acceptance per pool: Σrate(``vllm:spec_decode_num_accepted_tokens_total``) / Σrate(
  ``vllm:spec_decode_num_draft_tokens_total``) by the ``pool`` target label (the scrape config sets it: see
  docker/prometheus/prometheus.yml). Older setups read ``vllm:spec_decode_draft_acceptance_rate``, a V0 gauge that is
  gone; ``avg`` is now the token-weighted rate over the whole range, ``min``/``max`` the lowest/highest rate of any
  window in it (a subquery). A window without drafts has no value, never 0.
- acceptance per traffic class: the same from the gateway's ``specgate_class_accepted_draft_tokens_total`` /
  ``specgate_class_draft_tokens_total`` (vLLM's per-request spec-decode metrics, summed by the gateway).
- E2E speedup: the baseline file's ``e2e_p50_ms`` / ``e2e_p95_ms`` (``specgate bench baseline``) over the p50 /
  p95 of ``specgate_request_duration_seconds`` (histogram_quantile; as fine as its buckets), overall and per class
  (a class's own baseline when the file has ``by_class``). A typical setup used vLLM's E2E histogram; the gateway's is
  what a client sees, and it has the class.
- fallbacks: a fallback guard's switches to standard decoding are counted. Here that is
  ``specgate_controller_transitions_total`` with a guard reason (``acceptance_floor``, ``latency_regression``,
  ``locked``): ``fallback_count``. Every transition is listed by class/from/to/reason, and the gateway's pool
  fallbacks (``specgate_fallbacks_total``: retries on another pool before the first byte) separately.

Recommendations quote common speculative-decoding thresholds (``Thresholds``). Missing data is ``null`` in JSON and
"no data" in markdown, and never triggers a recommendation.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gateway.report.promql import (
    PromClient,
    Sample,
    by_label,
    counter_increase,
    format_duration,
    ratio_stats,
)

VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
CLASS_ACCEPTED = "specgate_class_accepted_draft_tokens_total"
CLASS_DRAFTED = "specgate_class_draft_tokens_total"
DURATION_BUCKETS = 'specgate_request_duration_seconds_bucket{pool!="none"}'
GUARD_REASONS = ("acceptance_floor", "latency_regression", "locked")


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


def load_baseline(path: Path) -> dict[str, Any]:
    """The baseline file (``specgate bench baseline``, or a compatible script); ValueError when unusable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the baseline {path}: {exc}") from exc
    if not isinstance(data, dict) or not _positive(data.get("e2e_p50_ms")):
        raise ValueError(f"{path}: not a baseline file (no positive e2e_p50_ms)")
    return data


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _stats(client: PromClient, num: str, den: str, by: str, range_: str, window: str) -> dict[str, dict[str, float]]:
    """key → {avg, min, max} (only those with data)."""
    out: dict[str, dict[str, float]] = {}
    for stat, expr in ratio_stats(num, den, by, range_, window).items():
        for key, value in by_label(client.query(expr), by).items():
            out.setdefault(key, {})[stat] = value
    for values in out.values():
        last = values.pop("last", None)
        if last is not None:
            values["min"] = min(values.get("min", last), last)
            values["max"] = max(values.get("max", last), last)
    return out


def _accept(values: dict[str, float] | None) -> dict[str, float | None]:
    values = values or {}
    return {
        "current_avg": _round(values.get("avg"), 4),
        "min": _round(values.get("min"), 4),
        "max": _round(values.get("max"), 4),
    }


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _counts(samples: list[Sample], labels: tuple[str, ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = [
        {**{k: s.labels.get(k, "") for k in labels}, "count": round(s.value)} for s in samples
    ]
    return sorted((r for r in rows if r["count"] > 0), key=lambda r: tuple(str(r[k]) for k in labels))


def _quantile_ms(client: PromClient, q: float, by: str, range_: str) -> dict[str, float]:
    expr = f"histogram_quantile({q}, {counter_increase(DURATION_BUCKETS, by, range_)})"
    return {k: v * 1000 for k, v in by_label(client.query(expr), "class" if "class" in by else "").items()}


def _speedup(baseline_ms: Any, current_ms: float | None) -> float | None:
    if not _positive(baseline_ms) or current_ms is None or current_ms <= 0:
        return None
    return round(float(baseline_ms) / current_ms, 2)


def _regression_pct(baseline_ms: Any, current_ms: float | None) -> float | None:
    if not _positive(baseline_ms) or current_ms is None:
        return None
    return round((current_ms - float(baseline_ms)) / float(baseline_ms) * 100, 1)


def collect(
    client: PromClient,
    baseline: dict[str, Any],
    *,
    range_s: float,
    window_s: float,
    pool_label: str = "pool",
    thresholds: Thresholds | None = None,
) -> dict[str, Any]:
    """Query Prometheus and build the report (a JSON-ready dict, recommendations included)."""
    th = thresholds or Thresholds()
    rng, win = format_duration(range_s), format_duration(window_s)
    seen_pools = by_label(client.query(f"count by ({pool_label}) (last_over_time({VLLM_DRAFTED}[{rng}]))"), pool_label)
    gateway_seen = bool(client.query(f"count(last_over_time(specgate_config_reload_total[{rng}]))"))
    pool_stats = _stats(client, VLLM_ACCEPTED, VLLM_DRAFTED, pool_label, rng, win)
    overall = _stats(client, VLLM_ACCEPTED, VLLM_DRAFTED, "", rng, win)
    class_stats = _stats(client, CLASS_ACCEPTED, CLASS_DRAFTED, "class", rng, win)
    p50 = _quantile_ms(client, 0.5, "class, le", rng)
    p95 = _quantile_ms(client, 0.95, "class, le", rng)
    all_p50 = _quantile_ms(client, 0.5, "le", rng).get("all")
    all_p95 = _quantile_ms(client, 0.95, "le", rng).get("all")
    requests = by_label(client.query(counter_increase("specgate_requests_total", "class", rng)), "class")
    transitions = _counts(
        client.query(counter_increase("specgate_controller_transitions_total", "class, from, to, reason", rng)),
        ("class", "from", "to", "reason"),
    )
    pool_fallbacks = _counts(
        client.query(counter_increase("specgate_fallbacks_total", "class, from_pool, to_pool, reason", rng)),
        ("class", "from_pool", "to_pool", "reason"),
    )

    raw_by_class = baseline.get("by_class")
    by_class_baseline: dict[str, Any] = raw_by_class if isinstance(raw_by_class, dict) else {}
    class_names = sorted(set(class_stats) | set(p50) | set(requests) | {t["class"] for t in transitions})
    classes: list[dict[str, Any]] = []
    for name in class_names:
        own = by_class_baseline.get(name) if isinstance(by_class_baseline.get(name), dict) else None
        base = own or baseline
        guard = sum(t["count"] for t in transitions if t["class"] == name and t["reason"] in GUARD_REASONS)
        classes.append(
            {
                "class": name,
                "requests": round(requests[name]) if name in requests else (0 if gateway_seen else None),
                "accept_ratio": _accept(class_stats.get(name)),
                "current_e2e_p50_ms": _round(p50.get(name), 1),
                "current_e2e_p95_ms": _round(p95.get(name), 1),
                "baseline": "class" if own else "overall",
                "e2e_p50_speedup": _speedup(base.get("e2e_p50_ms"), p50.get(name)),
                "e2e_p95_speedup": _speedup(base.get("e2e_p95_ms"), p95.get(name)),
                "e2e_p95_regression_pct": _regression_pct(base.get("e2e_p95_ms"), p95.get(name)),
                "fallback_count": guard if gateway_seen else None,
            }
        )
    fallback_count = sum(t["count"] for t in transitions if t["reason"] in GUARD_REASONS) if gateway_seen else None
    now = dt.datetime.fromtimestamp(client.at, tz=dt.UTC)
    report: dict[str, Any] = {
        "report_date": now.date().isoformat(),
        "generated_at": now.isoformat(timespec="seconds"),
        "period": f"last_{rng}",
        "window": win,
        "prometheus": client.url,
        "accept_ratio": _accept(overall.get("all")),
        "pools": [
            {"pool": name, "accept_ratio": _accept(pool_stats.get(name))}
            for name in sorted(set(seen_pools) | set(pool_stats))
        ],
        "classes": classes,
        "speedup": {
            "e2e_p50_speedup": _speedup(baseline.get("e2e_p50_ms"), all_p50),
            "e2e_p95_speedup": _speedup(baseline.get("e2e_p95_ms"), all_p95),
            "e2e_p95_regression_pct": _regression_pct(baseline.get("e2e_p95_ms"), all_p95),
            "baseline_e2e_p50_ms": baseline.get("e2e_p50_ms"),
            "baseline_e2e_p95_ms": baseline.get("e2e_p95_ms"),
            "current_e2e_p50_ms": _round(all_p50, 1),
            "current_e2e_p95_ms": _round(all_p95, 1),
        },
        "fallback_count": fallback_count,
        "controller_transitions": transitions if gateway_seen else None,
        "controller_transition_total": sum(t["count"] for t in transitions) if gateway_seen else None,
        "pool_fallbacks": pool_fallbacks if gateway_seen else None,
        "pool_fallback_total": sum(f["count"] for f in pool_fallbacks) if gateway_seen else None,
        "thresholds": asdict(th),
    }
    report["recommendations"] = recommend(report, th)
    report["queries"] = list(client.queries)
    return report


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


def _fmt(value: Any, suffix: str = "", digits: int = 2) -> str:
    if value is None:
        return "no data"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(report: dict[str, Any]) -> str:
    sp = report["speedup"]
    lines = [
        f"# Speculative decoding weekly report — {report['report_date']}",
        "",
        f"Range: {report['period']} (min/max over {report['window']} windows), Prometheus {report['prometheus']}.",
        "",
        "## Acceptance per pool (accepted / draft tokens)",
        "",
    ]
    acc = report["accept_ratio"]
    rows = [
        [p["pool"]] + [_fmt(p["accept_ratio"][k], digits=3) for k in ("current_avg", "min", "max")]
        for p in report["pools"]
    ]
    rows.append(["**all**"] + [_fmt(acc[k], digits=3) for k in ("current_avg", "min", "max")])
    lines += _table(["pool", "avg", "min", "max"], rows)
    lines += ["", "## Per traffic class", ""]
    rows = [
        [
            c["class"],
            _fmt(c["requests"]),
            *(_fmt(c["accept_ratio"][k], digits=3) for k in ("current_avg", "min", "max")),
            _fmt(c["current_e2e_p50_ms"], " ms", 1),
            _fmt(c["current_e2e_p95_ms"], " ms", 1),
            _fmt(c["e2e_p50_speedup"], "x"),
            _fmt(c["e2e_p95_speedup"], "x"),
            _fmt(c["fallback_count"]),
        ]
        for c in report["classes"]
    ]
    lines += _table(
        [
            "class",
            "requests",
            "accept avg",
            "min",
            "max",
            "E2E p50",
            "E2E p95",
            "speedup p50",
            "speedup p95",
            "fallbacks",
        ],
        rows or [["no data"] + [""] * 9],
    )
    lines += [
        "",
        "## E2E speedup against the baseline (all classes)",
        "",
        *_table(
            ["", "baseline", "current", "speedup"],
            [
                [
                    "p50",
                    _fmt(sp["baseline_e2e_p50_ms"], " ms", 1),
                    _fmt(sp["current_e2e_p50_ms"], " ms", 1),
                    _fmt(sp["e2e_p50_speedup"], "x"),
                ],
                [
                    "p95",
                    _fmt(sp["baseline_e2e_p95_ms"], " ms", 1),
                    _fmt(sp["current_e2e_p95_ms"], " ms", 1),
                    _fmt(sp["e2e_p95_speedup"], "x"),
                ],
            ],
        ),
        "",
        f"## Controller transitions: {_fmt(report['controller_transition_total'])} "
        f"(automatic fallbacks: {_fmt(report['fallback_count'])})",
        "",
    ]
    trans = report["controller_transitions"] or []
    if trans:
        lines += _table(
            ["class", "from", "to", "reason", "count"],
            [[t["class"], t["from"], t["to"], t["reason"], str(t["count"])] for t in trans],
        )
        lines.append("")
    lines += [f"## Pool fallbacks (before the first byte): {_fmt(report['pool_fallback_total'])}", ""]
    fbs = report["pool_fallbacks"] or []
    if fbs:
        lines += _table(
            ["class", "from", "to", "reason", "count"],
            [[f["class"], f["from_pool"], f["to_pool"], f["reason"], str(f["count"])] for f in fbs],
        )
        lines.append("")
    lines += ["## Recommendations", ""]
    recs = report["recommendations"]
    lines += [f"- **{r['severity']}** {r['scope']} `{r['target']}`: {r['message']}" for r in recs] or ["- none"]
    return "\n".join(lines) + "\n"


def default_window_s(range_s: float) -> float:
    """min(5m, range/10), at least 10 s."""
    return max(10.0, min(300.0, range_s / 10))
