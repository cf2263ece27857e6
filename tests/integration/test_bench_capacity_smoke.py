"""``bench capacity`` end to end on a tiny ladder: conversations through the gateway, every step measured and
judged, the report and steps.json; and a multi-turn sweep with its policies side by side."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from gateway.bench.capacity import Plan, bench_capacity
from gateway.bench.conversations import spec_of
from gateway.bench.mix import parse_mix
from gateway.bench.multiturn import bench_multiturn
from gateway.bench.points import Setup
from tests.integration.test_bench_peer_smoke import MIX

ROOT = Path(__file__).resolve().parents[2]


def _mix() -> dict[str, object]:
    raw = copy.deepcopy(MIX)
    raw["rules"] = "routing_rules/default.yaml"
    return raw


def test_a_tiny_capacity_run_measures_a_ceiling_and_a_hold(tmp_path: Path) -> None:
    mix = parse_mix(_mix())
    spec = spec_of(mix)
    assert spec is not None
    setup = Setup(time_scale=0.5, max_num_seqs=8, scale=8)
    plan = Plan(overload=1.5, settle_s=2.0, ceiling_s=4.0, holds=(0.5,), warmup_s=1.0, hold_s=3.0)
    lines: list[str] = []
    (result,) = bench_capacity(mix, spec, setup, plan, tmp_path, policies=("adaptive",), root=ROOT, log=lines.append)
    assert result.ceiling.answered > 0  # turns were answered inside the window
    assert result.ceiling.throughput > 0
    ((hold, _, why),) = result.holds
    assert hold.turns_rate == pytest.approx(0.5 * result.ceiling.throughput)
    assert hold.answered > 0
    assert why
    rows = json.loads((tmp_path / "steps.json").read_text())
    assert [(r["policy"], r["phase"]) for r in rows] == [("adaptive", "ceiling"), ("adaptive", "hold")]
    assert {"mean_backlog", "rise", "throughput", "throughput_se", "sustained", "why"} <= set(rows[0])
    report = (tmp_path / "report.md").read_text()
    assert "| specgate adaptive |" in report
    assert any("ceiling" in line for line in lines)
    assert any("hold 50% of the ceiling" in line for line in lines)
    assert any("drained in" in line for line in lines)  # the servers emptied before the hold


def test_multiturn_policies_side_by_side_give_one_jsonl(tmp_path: Path) -> None:
    mix = parse_mix(_mix())
    spec = spec_of(mix)
    assert spec is not None
    setup = Setup(time_scale=0.5, duration_s=3.0, warmup_s=1.0, max_num_seqs=8, scale=8)
    points = bench_multiturn(
        mix, spec, [0.3], setup, tmp_path, policies=("adaptive", "adaptive-no-affinity"), root=ROOT,
        log=lambda _: None, jobs=2,
    )  # fmt: skip
    assert [p.policy for p in points] == ["adaptive", "adaptive-no-affinity"]
    assert all(p.turns for p in points)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == sum(len(p.turns) for p in points)
    assert sorted(tmp_path.glob("results*.jsonl")) == [tmp_path / "results.jsonl"]
    assert "2 policies ran at once" in (tmp_path / "report.md").read_text()
