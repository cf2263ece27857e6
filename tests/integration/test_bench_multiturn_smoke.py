"""A multi-turn sweep through the gateway: Responses API conversations (the whole history as input items each
turn) on the mixed fleet, the prefix hit rate from the simulated servers' counters, the report."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from gateway.bench.conversations import spec_of
from gateway.bench.mix import parse_mix
from gateway.bench.multiturn import bench_multiturn
from gateway.bench.points import Setup
from tests.integration.test_bench_peer_smoke import MIX

ROOT = Path(__file__).resolve().parents[2]


def test_responses_conversations_through_the_gateway(tmp_path: Path) -> None:
    raw = copy.deepcopy(MIX)
    raw["rules"] = "routing_rules/default.yaml"
    raw["conversations"]["kinds"][0]["api"] = "responses"
    mix = parse_mix(raw)
    spec = spec_of(mix)
    assert spec is not None
    setup = Setup(time_scale=0.5, duration_s=4.0, warmup_s=1.0, max_num_seqs=8, scale=8)
    (point,) = bench_multiturn(mix, spec, [0.3], setup, tmp_path, policies=("adaptive",), root=ROOT, log=lambda _: None)
    assert point.turns
    assert len(point.ok) == len(point.turns)
    assert max(t.turn for t in point.turns) >= 1
    assert point.queries > 0
    assert point.hits > 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["pool"] for r in rows} <= {"speculative", "standard"}  # answered through the gateway
    assert all(r["completion_tokens"] > 0 for r in rows)
    later = [r for r in rows if r["turn"] > 0]
    assert later
    assert all(0 <= r["cached_tokens"] <= r["prompt_tokens"] for r in rows)  # reported by every server
    assert sum(r["cached_tokens"] for r in later) > 0  # the history and the system prompt hit
    report = (tmp_path / "report.md").read_text()
    assert "specgate in front of 1+1" in report
    assert "## cached share of prompt tokens" in report
    # the gateway's predicted prefix hits against each server's counters, one row per endpoint
    assert [r.endpoint for r in point.precision] == ["speculative-sim-0", "standard-sim-0"]
    assert all(r.predicted >= 0 and r.measured >= 0 for r in point.precision)
    assert all(r["endpoint"] in ("speculative-sim-0", "standard-sim-0") for r in rows)
