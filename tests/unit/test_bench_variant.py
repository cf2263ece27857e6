"""gateway.bench.variant and the ``adaptive-no-affinity`` policy: the adaptive rules with prefix affinity off
everywhere, and the paired table of adaptive against it."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from gateway.bench.fleet import policy_rules
from gateway.bench.load import Summary
from gateway.bench.paired import Ratio
from gateway.bench.points import POLICIES, Point
from gateway.bench.variant import VARIANT, reading, variant_table
from gateway.config.loader import load_rules_file

ROOT = Path(__file__).resolve().parents[2]


def test_the_variant_is_the_adaptive_rules_with_affinity_off_everywhere(tmp_path: Path) -> None:
    assert VARIANT in POLICIES
    adaptive = yaml.safe_load((ROOT / "routing_rules" / "default.yaml").read_text())
    adaptive["pools"][0]["prefix_affinity"] = {"min_prefix_tokens": 512}  # a pool's own block is turned off too
    rules = policy_rules(VARIANT, adaptive, ROOT)
    assert rules["defaults"]["prefix_affinity"] == {"enabled": False}
    assert rules["pools"][0]["prefix_affinity"] == {"min_prefix_tokens": 512, "enabled": False}
    assert rules["classes"] == adaptive["classes"]
    assert "prefix_affinity" not in adaptive["defaults"]  # the adaptive rules themselves are left alone
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    loaded = load_rules_file(path)
    assert not any(loaded.affinity_of(p).enabled for p in loaded.pools)
    same = policy_rules("adaptive", adaptive, ROOT)
    assert same["pools"][0]["prefix_affinity"] == {"min_prefix_tokens": 512}


def test_a_reading_says_worse_only_when_the_whole_interval_is_above_one() -> None:
    assert reading(Ratio(1.2, 1.05, 1.3)) == "worse"
    assert reading(Ratio(1.05, 0.98, 1.1)) == "no worse"
    assert reading(Ratio(0.9, 0.85, 0.97)) == "better"
    assert reading(Ratio(1.05, 1.02, 1.1), tolerance=0.03) == "no worse"
    assert reading(Ratio(math.nan, math.nan, math.nan)) == "unknown"


def _point(policy: str, load: float, e2e: list[float], lag: float = 0.0) -> Point:
    s = Summary("all", len(e2e), 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1, 1, 1), 0.5)
    return Point(policy, load, 1.0, s, (), 1.0, e2e_s=tuple(e2e), lag=lag)


def test_the_table_pairs_adaptive_with_the_variant_per_load() -> None:
    base = [1.0 + (i % 17) / 10 for i in range(300)]
    points = [
        _point("adaptive", 0.5, base),
        _point(VARIANT, 0.5, base),
        _point("adaptive", 0.9, [x * 1.5 for x in base]),
        _point(VARIANT, 0.9, base, lag=0.05),
        _point("standard", 0.9, base),
    ]
    lines = variant_table(points, lag_ok=0.02)
    text = "\n".join(lines)
    assert "| 50% | 1.00 (1.00-1.00) | no worse | 1.00 (1.00-1.00) | no worse | 0.0% |" in text
    assert "| 90% | 1.50 (1.50-1.50) | worse (not valid) |" in text
    assert variant_table([_point("adaptive", 0.5, base)], lag_ok=0.02) == []
