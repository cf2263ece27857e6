"""The multi-turn report's unpaired p99 interval and the fixed-split reference model (virtual clock)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from gateway.bench.interval import ratio_interval
from gateway.bench.mix import load_mix
from gateway.bench.points import Setup
from gateway.bench.reference import fleet_e2e, plan, render, search, sweep_ratios

ROOT = Path(__file__).resolve().parents[2]
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4})


def _lognormal(n: int, scale: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [scale * rng.lognormvariate(0.0, 0.5) for _ in range(n)]


def test_the_interval_holds_the_ratio_and_narrows_with_more_requests() -> None:
    small = ratio_interval(_lognormal(200, 1.0, 1), [_lognormal(200, 1.0, 2)])
    large = ratio_interval(_lognormal(5000, 1.0, 1), [_lognormal(5000, 1.0, 2)])
    assert small[0] < 1.0 < small[1]
    assert large[0] < 1.0 < large[1]
    assert large[1] - large[0] < small[1] - small[0]
    # twice as slow, measured on enough requests: the interval says so
    lo, hi = ratio_interval(_lognormal(3000, 2.0, 3), [_lognormal(3000, 1.0, 4), _lognormal(3000, 1.5, 5)])
    assert 1.7 < lo < 2.0 < hi < 2.3


def test_an_empty_side_gives_no_interval() -> None:
    lo, hi = ratio_interval([], [[1.0]])
    assert lo != lo
    assert hi != hi


def test_the_model_replays_the_sweeps_requests_with_the_simulators_lengths() -> None:
    mix = load_mix("summarization-rag", ROOT / "bench" / "mixes")
    reqs = plan(mix, Setup(), 2.0, 60.0, "ngram", 7)
    assert 80 < len(reqs) < 170  # ~120 Poisson arrivals in 60 simulated seconds
    assert all(0 < r.output_tokens <= 512 and r.prompt_tokens > 0 for r in reqs)
    assert reqs == plan(mix, Setup(), 2.0, 60.0, "ngram", 7)  # deterministic: common random numbers
    copy = [r.acceptance for r in reqs if mix.classes[r.cls].name != "chat"]
    chat = [r.acceptance for r in reqs if mix.classes[r.cls].name == "chat"]
    assert sum(copy) / len(copy) > sum(chat) / len(chat)  # ngram accepts copied text, not open chat


def test_a_speculative_fleet_is_faster_for_copy_heavy_work_at_low_load() -> None:
    mix = load_mix("summarization-rag", ROOT / "bench" / "mixes")
    setup = Setup()
    reqs = plan(mix, setup, 0.7, 60.0, "ngram", 3)
    n = len(mix.classes)
    std = fleet_e2e(reqs, (0.0,) * n, setup, None, 1, 2)
    spec = fleet_e2e(reqs, (1.0,) * n, setup, NGRAM, 2, 1)
    assert len(std) == len(spec) == len(reqs)
    assert sorted(spec)[len(spec) // 2] < 0.8 * sorted(std)[len(std) // 2]


def test_the_search_is_never_worse_than_the_simple_rules(tmp_path: Path) -> None:
    mix = load_mix("summarization-rag", ROOT / "bench" / "mixes")
    f = search(mix, Setup(), 0.3, 7.17, NGRAM, duration_s=40.0, seed=5, log=lambda _: None)
    assert all(0.0 <= s <= 1.0 for s in f.best_shares)
    assert f.best_p99 <= min(f.rules.values()) + 1e-9
    assert f.evaluated > 2**3
    rows = [
        {"policy": "standard", "load": 0.3, "status": 200, "error": "", "e2e_s": 2.0},
        {"policy": "speculative", "load": 0.3, "status": 200, "error": "", "e2e_s": 1.0},
        {"policy": "adaptive", "load": 0.3, "status": 200, "error": "", "e2e_s": 1.2},
    ]
    jsonl = tmp_path / "results.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = sweep_ratios(jsonl)
    assert measured == {0.3: pytest.approx(1.2)}
    text = render(mix, Setup(), [f], 1.1, measured)
    assert "| 30% |" in text
    assert "1.20 |" in text
    assert "only chat speculative" in text
