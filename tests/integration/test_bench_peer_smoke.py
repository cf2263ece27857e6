"""The vllm-router peer policies end to end: the real Rust binary in front of simulated servers, single requests
and multi-turn conversations routed through it, the prefix hit rate read from the servers' counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench.conversations import spec_of
from gateway.bench.mix import load_mix, parse_mix
from gateway.bench.multiturn import bench_multiturn
from gateway.bench.peer import router_binary
from gateway.bench.points import Setup
from gateway.bench.policies import bench_policies

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    router_binary() is None,
    reason="the vllm-router binary is not installed (pip install vllm-router, or the bench extra)",
)

# short conversations with little think time, so that a few seconds see several turns of each
MIX = {
    "name": "tiny-multiturn",
    "output_len_median": 24,
    "classes": [
        {"name": "tool", "task": "tool_use", "tools": True, "temperature": 0.0, "max_tokens": 32},
        {"name": "chat", "task": "chat", "temperature": 0.8, "max_tokens": 48, "stream": 1.0},
    ],
    "conversations": {
        "system_prompts": {"count": 2, "tokens": 400},
        "turns": {"uniform": [3, 4]},
        "think_s": {"uniform": [0.2, 0.6]},
        "kinds": [{"name": "assistant", "first": "tool", "next": {"chat": 0.7, "tool": 0.3}}],
    },
}


def test_conversations_through_vllm_router_are_measured_with_their_hit_rate(tmp_path: Path) -> None:
    mix = parse_mix(MIX)
    spec = spec_of(mix)
    assert spec is not None
    setup = Setup(time_scale=0.5, duration_s=4.0, warmup_s=1.0, max_num_seqs=8, scale=8)
    lines: list[str] = []
    points = bench_multiturn(
        mix, spec, [0.3], setup, tmp_path, policies=("peer-cache-aware", "peer-round-robin"), root=ROOT,
        log=lines.append,
    )  # fmt: skip
    assert [p.policy for p in points] == ["peer-cache-aware", "peer-round-robin"]
    for p in points:
        assert p.turns
        assert len(p.ok) == len(p.turns)
        assert p.queries > 0
        assert 0.0 < p.hit_rate <= 1.0
        assert max(t.turn for t in p.turns) >= 1  # later turns carried the history back
        assert "vllm-router" in p.cpu  # the router's CPU is measured with the rest
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len(rows) == sum(len(p.turns) for p in points)
    assert {r["policy"] for r in rows} == {"peer-cache-aware", "peer-round-robin"}
    streamed = [r for r in rows if r["stream"]]
    assert streamed
    assert all(r["ttft_s"] is not None for r in streamed)
    report = (tmp_path / "report.md").read_text()
    assert "vllm-router --policy cache_aware" in report
    assert "vllm-router --policy round_robin" in report
    assert "## prefix-cache hit rate" in report
    assert "## Harness CPU" in report
    assert "prefix hits" in lines[-1]


def test_single_requests_through_vllm_router_on_the_mixed_fleet(tmp_path: Path) -> None:
    mix = load_mix("default", ROOT / "bench" / "mixes")
    setup = Setup(time_scale=0.5, duration_s=1.5, output_median=30.0, repeats=1, warmup_s=0.0, min_requests=0)
    points = bench_policies(
        mix, [0.3], setup, tmp_path, policies=("peer-cache-aware-mixed",), root=ROOT, log=lambda _: None
    )
    assert len(points) == 1
    assert points[0].summary.requests > 0
    assert points[0].summary.errors == 0
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert all(r["pool"] == "" for r in rows)  # answered through the router: no gateway headers
