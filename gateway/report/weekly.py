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

Recommendations (``gateway.report.recommend``) quote common speculative-decoding thresholds (``Thresholds``). Missing
data is ``null`` in JSON and "no data" in markdown (``gateway.report.markdown``), and never triggers a
recommendation.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict
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
from gateway.report.recommend import Thresholds, recommend

VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
CLASS_ACCEPTED = "specgate_class_accepted_draft_tokens_total"
CLASS_DRAFTED = "specgate_class_draft_tokens_total"
DURATION_BUCKETS = 'specgate_request_duration_seconds_bucket{pool!="none"}'
GUARD_REASONS = ("acceptance_floor", "latency_regression", "locked")


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


def default_window_s(range_s: float) -> float:
    """min(5m, range/10), at least 10 s."""
    return max(10.0, min(300.0, range_s / 10))
