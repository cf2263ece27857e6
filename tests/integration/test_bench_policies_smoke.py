"""`specgate bench policies` end to end on a tiny sweep: simulated servers, the gateway, report, plots, JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.bench.mix import load_mix
from gateway.bench.points import Setup
from gateway.bench.policies import bench_policies

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_policy_sweep_writes_report_plots_and_jsonl(tmp_path: Path) -> None:
    mix = load_mix("default", ROOT / "bench" / "mixes")
    setup = Setup(time_scale=0.5, duration_s=1.5, output_median=40.0, repeats=2, warmup_s=1.0, min_requests=0)
    lines: list[str] = []
    points = bench_policies(
        mix, [0.2, 0.8], setup, tmp_path, policies=("nginx", "adaptive"), root=ROOT, log=lines.append
    )
    assert "planned" in lines[0]
    assert {(p.policy, p.load) for p in points} == {(a, b) for a in ("nginx", "adaptive") for b in (0.2, 0.8)}
    assert all(p.summary.requests > 0 for p in points)
    assert sum(p.summary.errors for p in points) == 0
    report = (tmp_path / "report.md").read_text()
    assert "## p99 E2E (s)" in report
    assert "NGINX temperature rule" in report
    assert "beats the NGINX rule" in report
    assert "## Harness CPU" in report
    for name in ("policies.png", "e2e_p50.png", "e2e_p99.png", "tpot_p50.png", "goodput.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == sum(p.summary.requests for p in points)
    assert {r["policy"] for r in rows} == {"nginx", "adaptive"}
    assert {r["repeat"] for r in rows} == {0, 1}  # two runs per point, pooled; the warm-up is not in them
    assert "2 runs per point" in report
    nginx = [r for r in rows if r["policy"] == "nginx" and r["status"] == 200]
    assert {r["pool"] for r in nginx} == {"speculative"}  # the NGINX rule sends this whole mix to speculation
    streamed = [r for r in rows if r["stream"] and r["status"] == 200]
    assert streamed
    assert all(r["ttft_s"] is not None and r["completion_tokens"] > 0 for r in streamed)


def test_policies_side_by_side_give_the_same_report_and_one_jsonl(tmp_path: Path) -> None:
    mix = load_mix("default", ROOT / "bench" / "mixes")
    setup = Setup(time_scale=0.5, duration_s=1.5, output_median=40.0, repeats=1, warmup_s=0.5, min_requests=0)
    points = bench_policies(
        mix, [0.3], setup, tmp_path, policies=("standard", "adaptive"), root=ROOT, log=lambda _: None, jobs=2
    )
    assert [p.policy for p in points] == ["standard", "adaptive"]  # in the order asked, whichever finished first
    assert all(p.e2e_s and len(p.e2e_s) == p.summary.requests - p.summary.errors for p in points)
    assert all(0.0 <= p.lag < 1.0 for p in points)  # every server's /sim/stats was read before and after
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["policy"] for r in rows] == sorted((r["policy"] for r in rows), key=("standard", "adaptive").index)
    assert len(rows) == sum(p.summary.requests for p in points)
    assert sorted(tmp_path.glob("results*.jsonl")) == [tmp_path / "results.jsonl"]  # the parts are joined, gone
    report = (tmp_path / "report.md").read_text()
    assert "2 policies ran at once" in report
    assert "late steps of the worst server" in report
    assert "bootstrap interval" in report
    assert "| 30% | all standard |" in report


def test_low_loads_get_more_runs_until_the_minimum_request_count() -> None:
    from gateway.bench.policies import runs_for

    setup = Setup(time_scale=0.5, duration_s=10.0, repeats=3, min_requests=200)
    assert runs_for(20.0, setup) == 3  # 400 requests a run: the repeats
    assert runs_for(2.0, setup) == 5  # 40 a run: 5 runs for 200
    assert runs_for(0.0, setup) == 3
    assert runs_for(2.0, Setup(time_scale=0.5, duration_s=10.0, repeats=3, min_requests=0)) == 3
