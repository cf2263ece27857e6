"""The sweep's paired bootstrap interval of adaptive / best homogeneous, its verdicts and its report table."""

from __future__ import annotations

import math
import random

from gateway.bench.load import Summary
from gateway.bench.mix import Target
from gateway.bench.paired import Ratio, limits_at, paired_ratios, verdict
from gateway.bench.plots import ratio_table
from gateway.bench.points import Point


def _requests(n: int, seed: int) -> list[float]:
    """Per-request work, shared by every policy: what pairing cancels."""
    rng = random.Random(seed)
    return [rng.lognormvariate(0.0, 0.6) for _ in range(n)]


def _policy(work: list[float], factor: float, noise: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [w * factor * rng.lognormvariate(0.0, noise) for w in work]


def test_the_interval_holds_the_true_ratio() -> None:
    work = _requests(2000, 1)
    base = _policy(work, 1.0, 0.0, 2)
    fast = _policy(work, 1.25, 0.0, 3)  # every request exactly 1.25x: the true ratio at any percentile
    p50, p99 = paired_ratios(fast, [base], seed=4)
    for r in (p50, p99):
        assert math.isclose(r.value, 1.25)
        assert r.lo <= 1.25 <= r.hi
    # with per-request noise the true p99 ratio (from a far larger sample) still lies inside
    noisy = _policy(work, 1.1, 0.1, 5)
    (r99,) = paired_ratios(noisy, [base], (0.99,), seed=6)
    big = _requests(200_000, 7)
    truth = sorted(_policy(big, 1.1, 0.1, 8))[int(0.99 * 200_000)] / sorted(big)[int(0.99 * 200_000)]
    assert r99.lo <= truth <= r99.hi


def test_a_clearly_slower_policy_excludes_one_and_is_missed() -> None:
    work = _requests(1500, 11)
    std = _policy(work, 1.0, 0.05, 12)
    spec = _policy(work, 1.4, 0.05, 13)
    slow = _policy(work, 1.5, 0.05, 14)
    p50, p99 = paired_ratios(slow, [std, spec], seed=15)
    assert p99.lo > 1.0
    assert p50.lo > 1.0
    assert 1.3 < p99.value < 1.7
    assert verdict(p99, 1.15) == "missed"
    fast = _policy(work, 0.7, 0.05, 16)
    (r,) = paired_ratios(fast, [std, spec], (0.99,), seed=17)
    assert r.hi < 1.0
    assert verdict(r, 0.9) == "met"


def test_pairing_narrows_the_interval_and_the_seed_fixes_it() -> None:
    work = _requests(400, 21)
    a, b = _policy(work, 1.0, 0.05, 22), _policy(work, 1.0, 0.05, 23)
    paired = paired_ratios(a, [b], (0.99,), seed=1)[0]
    unpaired = paired_ratios(a, [_policy(_requests(400, 99), 1.0, 0.05, 23)], (0.99,), seed=1)[0]
    assert paired.hi - paired.lo < unpaired.hi - unpaired.lo
    assert paired_ratios(a, [b], seed=3) == paired_ratios(a, [b], seed=3)


def test_no_interval_without_the_same_requests() -> None:
    assert not paired_ratios([], [[1.0]])[0].known
    assert not paired_ratios([1.0, 2.0], [[1.0]])[1].known  # different lengths: not the same requests
    assert verdict(paired_ratios([], [[1.0]])[0], 1.1) == "unknown"


def test_a_failed_request_counts_as_the_slowest() -> None:
    work = _requests(200, 31)
    failing = [math.inf if i % 10 == 0 else w for i, w in enumerate(work)]  # 10% failed: beyond the p99
    (r,) = paired_ratios(failing, [work], (0.99,), seed=2)
    assert r.value == math.inf
    assert verdict(r, 1.15) == "missed"


def test_verdicts_and_limits() -> None:
    assert verdict(Ratio(1.0, 0.9, 1.1), 1.15) == "met"
    assert verdict(Ratio(1.3, 1.2, 1.4), 1.15) == "missed"
    assert verdict(Ratio(1.1, 1.0, 1.2), 1.15) == "undecided"
    t = Target(1.1, 0.1, (0.5, 0.7))
    assert limits_at(0.3, t) == [("<= x1.10", 1.1)]
    assert limits_at(0.5, t) == [("<= x1.10", 1.1), (">= 10% below", 0.9)]


def test_the_table_gives_each_point_its_interval_and_verdict() -> None:
    work = _requests(600, 41)

    def pt(policy: str, load: float, values: list[float], lag: float = 0.001) -> Point:
        p99 = sorted(values)[math.ceil(0.99 * len(values)) - 1]
        s = Summary("all", len(values), 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1.0, 1.0, p99))
        return Point(policy, load, load, s, (), 1.0, e2e_s=tuple(values), lag=lag)

    pts = [pt("standard", 0.5, _policy(work, 1.0, 0.05, 1)), pt("speculative", 0.5, _policy(work, 3.0, 0.05, 2))]
    pts.append(pt("adaptive", 0.5, _policy(work, 1.5, 0.05, 3)))
    text = "\n".join(ratio_table(pts, Target(1.1, 0.1, (0.5,))))
    row = next(line for line in text.splitlines() if line.startswith("| 50% |"))
    assert "| all standard |" in row
    assert row.endswith("| <= x1.10; >= 10% below | missed; missed | 0.1% |")
    assert "missed at 50%" in text
    # a server whose steps started late measured the machine: the verdict stands but is marked not valid
    pts.append(pt("standard", 0.9, _policy(work, 1.0, 0.0, 4), lag=0.08))
    pts.append(pt("adaptive", 0.9, _policy(work, 0.8, 0.0, 5)))
    text = "\n".join(ratio_table(pts, Target(1.1, 0.1, (0.5,))))
    row = next(line for line in text.splitlines() if line.startswith("| 90% |"))
    assert row.endswith("| <= x1.10 | met (not valid) | 8.0% |")
    assert ratio_table([p for p in pts if p.policy != "adaptive"]) == []
