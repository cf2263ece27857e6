"""``specgate report weekly`` against canned Prometheus API answers, and ``bench baseline``'s arithmetic."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest

from gateway.bench.baseline import Result, percentile, summarise
from gateway.report.markdown import render_markdown
from gateway.report.promql import PromClient, PromError, format_duration, parse_duration, parse_vector
from gateway.report.recommend import Thresholds, recommend
from gateway.report.weekly import collect, load_baseline

Series = list[tuple[dict[str, str], float | str]]
BASELINE = {"e2e_p50_ms": 500.0, "e2e_p95_ms": 1000.0}


def vector(series: Series) -> dict[str, Any]:
    result = [{"metric": labels, "value": [1.0, str(value)]} for labels, value in series]
    return {"status": "success", "data": {"resultType": "vector", "result": result}}


def client_for(answer: Callable[[str], Series]) -> PromClient:
    def handler(request: httpx.Request) -> httpx.Response:
        query = parse_qs(request.content.decode())["query"][0]
        return httpx.Response(200, json=vector(answer(query)))

    return PromClient("http://prom:9090", at=1_700_000_000, http=httpx.Client(transport=httpx.MockTransport(handler)))


def stat(query: str) -> str:
    for name in ("min", "max"):
        if query.startswith(f"{name}_over_time"):
            return name
    return "last" if "[10s]" in query or "[5m]" in query else "avg"


def busy_week(query: str) -> Series:
    """A week with two speculative pools, two classes and some controller moves."""
    kind = stat(query)
    if query.startswith("count by (pool)"):
        return [({"pool": "spec"}, 1), ({"pool": "ngram"}, 1), ({"pool": "idle-spec"}, 1)]
    if "specgate_config_reload_total" in query:
        return [({}, 4)]
    if "vllm:spec_decode" in query:
        if "by (pool)" in query:
            values = {"avg": (0.62, 0.25), "min": (0.35, 0.1), "max": (0.8, 0.4), "last": (0.6, 0.2)}[kind]
            return [({"pool": "spec"}, values[0]), ({"pool": "ngram"}, values[1])]
        return [({}, {"avg": 0.5, "min": 0.1, "max": 0.8, "last": 0.5}[kind])]
    if "specgate_class_accepted" in query:
        return [({"class": "precise"}, {"avg": 0.45, "min": 0.3, "max": 0.6, "last": 0.5}[kind])]
    if query.startswith("histogram_quantile"):
        q50 = query.startswith("histogram_quantile(0.5,")
        if "class, le" in query:
            return [({"class": "precise"}, 0.2 if q50 else 0.5), ({"class": "default"}, 0.8 if q50 else "NaN")]
        return [({}, 0.4 if q50 else 1.5)]
    if "specgate_requests_total" in query:
        return [({"class": "precise"}, 100.4), ({"class": "default"}, 50)]
    if "specgate_controller_transitions_total" in query:
        move = {"class": "precise", "from": "speculative", "to": "standard"}
        return [({**move, "reason": "acceptance_floor"}, 3.2), ({**move, "reason": "load"}, 2)]
    if "specgate_fallbacks_total" in query:
        return [({"class": "default", "from_pool": "std", "to_pool": "spec", "reason": "timeout"}, 7)]
    raise AssertionError(f"unexpected query {query}")


def report_for(answer: Callable[[str], Series], baseline: dict[str, Any] | None = None) -> dict[str, Any]:
    return collect(client_for(answer), baseline or BASELINE, range_s=7 * 86400, window_s=300)


def recs_of(report: dict[str, Any]) -> dict[tuple[str, str], list[str]]:
    out: dict[tuple[str, str], list[str]] = {}
    for r in report["recommendations"]:
        out.setdefault((r["scope"], r["target"]), []).append(f"{r['severity']}: {r['message']}")
    return out


def test_the_numbers_of_a_busy_week() -> None:
    report = report_for(busy_week)
    assert report["period"] == "last_7d"  # the seed's own key and value
    assert report["window"] == "5m"
    pools = {p["pool"]: p["accept_ratio"] for p in report["pools"]}
    assert pools["spec"] == {"current_avg": 0.62, "min": 0.35, "max": 0.8}
    assert pools["ngram"] == {"current_avg": 0.25, "min": 0.1, "max": 0.4}
    assert pools["idle-spec"] == {"current_avg": None, "min": None, "max": None}  # scraped, never drafted
    assert report["accept_ratio"] == {"current_avg": 0.5, "min": 0.1, "max": 0.8}
    classes = {c["class"]: c for c in report["classes"]}
    precise, default = classes["precise"], classes["default"]
    assert precise["requests"] == 100
    assert precise["accept_ratio"] == {"current_avg": 0.45, "min": 0.3, "max": 0.6}
    assert (precise["current_e2e_p50_ms"], precise["e2e_p50_speedup"]) == (200.0, 2.5)
    assert (precise["current_e2e_p95_ms"], precise["e2e_p95_speedup"]) == (500.0, 2.0)
    assert precise["fallback_count"] == 3  # the guard's moves only, not the load-driven one
    assert default["accept_ratio"]["current_avg"] is None
    assert default["current_e2e_p95_ms"] is None  # NaN from histogram_quantile: no data, not 0
    assert default["e2e_p95_speedup"] is None
    sp = report["speedup"]
    assert (sp["current_e2e_p50_ms"], sp["e2e_p50_speedup"]) == (400.0, 1.25)
    assert (sp["e2e_p95_speedup"], sp["e2e_p95_regression_pct"]) == (0.67, 50.0)
    assert report["fallback_count"] == 3
    assert report["controller_transition_total"] == 5
    assert [t["reason"] for t in report["controller_transitions"]] == ["acceptance_floor", "load"]
    assert report["pool_fallback_total"] == 7
    assert all(q in report["queries"] for q in report["queries"][:3])


def test_recommendations_quote_the_playbook_thresholds() -> None:
    recs = recs_of(report_for(busy_week))
    assert ("pool", "spec") in recs  # 0.62 is fine, but it fell to 0.35 < 0.4 in some window
    assert recs[("pool", "spec")] == [recs[("pool", "spec")][0]]
    assert recs[("pool", "spec")][0].startswith("info:")
    assert "0.4" in recs[("pool", "spec")][0]
    assert recs[("pool", "ngram")][0].startswith("critical:")  # 0.25 < 0.3: CriticalAcceptRatio
    assert "< 0.3" in recs[("pool", "ngram")][0]
    precise = recs[("class", "precise")]
    assert any(r.startswith("warning:") and "< 0.5" in r for r in precise)  # LowAcceptRatio
    assert not any("automatic fallbacks" in r for r in precise)  # 3 is not more than 5
    assert not any("speedup" in r for r in precise)  # 2.5x is above 1.3x
    assert ("class", "default") not in recs  # no acceptance data: never judged on it
    overall = recs[("overall", "all")]
    assert any("1.25x < 1.3x" in r for r in overall)
    assert any(r.startswith("critical:") and "50% worse" in r for r in overall)  # Phase 6: > 20%
    assert any("7 requests fell back" in r for r in recs[("pool", "std")])  # > 5


@pytest.mark.parametrize(
    ("avg", "low", "expected"),
    [
        (0.29, 0.2, ["critical"]),
        (0.3, 0.2, ["warning"]),  # not below 0.3; below 0.5
        (0.5, 0.45, ["warning"]),  # below 0.55 (Phase 7)
        (0.55, 0.45, []),
        (0.7, 0.39, ["info"]),  # a window below 0.4 (Phase 6)
        (0.7, None, []),
    ],
)
def test_acceptance_thresholds(avg: float, low: float | None, expected: list[str]) -> None:
    report = {
        "window": "5m",
        "pools": [{"pool": "spec", "accept_ratio": {"current_avg": avg, "min": low, "max": 0.9}}],
        "classes": [],
        "speedup": {"e2e_p50_speedup": 1.5, "e2e_p95_regression_pct": 0.0, "current_e2e_p50_ms": 100.0},
        "pool_fallbacks": [],
    }
    recs = [r["severity"] for r in recommend(report, Thresholds()) if r["scope"] == "pool"]
    assert recs == expected


def test_missing_data_is_no_data_never_zero() -> None:
    report = report_for(lambda query: [])
    assert report["accept_ratio"] == {"current_avg": None, "min": None, "max": None}
    assert report["pools"] == []
    assert report["classes"] == []
    assert all(v is None for k, v in report["speedup"].items() if not k.startswith("baseline"))
    for key in ("fallback_count", "controller_transitions", "controller_transition_total", "pool_fallback_total"):
        assert report[key] is None, key  # the gateway was never scraped: unknown, not 0
    assert {r["severity"] for r in report["recommendations"]} == {"info"}
    text = render_markdown(report)
    assert "no data" in text
    assert " 0.00" not in text
    assert "no pool acceptance data" in text


def test_a_scraped_gateway_without_transitions_counts_zero() -> None:
    def answer(query: str) -> Series:
        return [({}, 2)] if "specgate_config_reload_total" in query else []

    report = report_for(answer)
    assert (report["controller_transition_total"], report["fallback_count"], report["pool_fallback_total"]) == (0, 0, 0)


def test_a_class_baseline_is_used_when_the_file_has_one() -> None:
    baseline = {**BASELINE, "by_class": {"precise": {"e2e_p50_ms": 300.0, "e2e_p95_ms": 600.0}}}
    classes = {c["class"]: c for c in report_for(busy_week, baseline)["classes"]}
    assert (classes["precise"]["baseline"], classes["precise"]["e2e_p50_speedup"]) == ("class", 1.5)
    assert (classes["default"]["baseline"], classes["default"]["e2e_p50_speedup"]) == ("overall", 0.62)


def test_markdown_has_every_section() -> None:
    text = render_markdown(report_for(busy_week))
    assert "| spec | 0.620 | 0.350 | 0.800 |" in text
    assert "| idle-spec | no data | no data | no data |" in text
    for heading in ("Acceptance per pool", "Per traffic class", "E2E speedup", "Controller transitions: 5",
                    "Pool fallbacks", "Recommendations"):  # fmt: skip
        assert heading in text
    assert "| precise | speculative | standard | acceptance_floor | 3 |" in text


def test_prometheus_errors_and_nan() -> None:
    with pytest.raises(PromError, match="bad_data"):
        parse_vector({"status": "error", "errorType": "bad_data", "error": "bad_data: parse error"})
    samples = parse_vector(vector([({"a": "1"}, "NaN"), ({"a": "2"}, "+Inf"), ({"a": "3"}, "0.5")]))
    assert [(s.labels, s.value) for s in samples] == [({"a": "3"}, 0.5)]

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    client = PromClient("http://prom:9090", at=0, http=httpx.Client(transport=httpx.MockTransport(refuse)))
    with pytest.raises(PromError, match="cannot reach"):
        client.query("up")


def test_durations() -> None:
    assert parse_duration("7d") == 604800
    assert parse_duration("1h30m") == 5400
    assert format_duration(604800) == "7d"
    assert format_duration(300) == "5m"
    assert format_duration(90) == "90s"
    for bad in ("", "7", "d7", "5m x", "0s"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


def test_baseline_file_checks(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"ttft_p50_ms": 1}))
    with pytest.raises(ValueError, match="e2e_p50_ms"):
        load_baseline(path)
    path.write_text(json.dumps(BASELINE))
    assert load_baseline(path) == BASELINE


def test_baseline_summary_keeps_the_seed_fields() -> None:
    results = [Result(True, ttft_s=0.1 * i, e2e_s=1.0 * i, tpot_s=0.01 * i, tokens=10, traffic_class="c") for i in
               range(1, 21)] + [Result(False, error="503: busy")]  # fmt: skip
    out = summarise(results, wall_s=10.0, url="http://x", model="m", concurrency=2)
    seed_fields = ["ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms", "e2e_p50_ms", "e2e_p95_ms",
                   "total_tokens", "avg_tokens_per_sec"]  # fmt: skip
    assert list(out)[:8] == seed_fields
    assert out["e2e_p50_ms"] == 10500.0  # the median of 1..20 s
    assert out["e2e_p95_ms"] == 20000.0  # sorted[int(20 * 0.95)] = the 20th, the seed's rule
    assert out["total_tokens"] == 200
    assert out["avg_tokens_per_sec"] == round(200 / 210, 1)
    assert out["throughput_tokens_per_sec"] == 20.0
    assert (out["requests"], out["errors"]) == (21, 1)
    assert out["by_class"]["c"]["requests"] == 20
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
