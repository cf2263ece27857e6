"""The weekly report (``gateway.report.weekly.collect``) as Markdown: tables per pool and class, the speedup,
transitions, fallbacks and the recommendations; missing data shows as "no data"."""

from __future__ import annotations

from typing import Any


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
