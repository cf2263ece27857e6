"""gateway.bench.mix / policies / plots: the mixes of ``bench policies`` (arrivals, tools, answer length, target)
and the fleet shapes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.bench.fleet import policy_rules, servers_per_pool
from gateway.bench.load import Summary, arrival_times
from gateway.bench.mix import load_mix, parse_mix, plan_request
from gateway.bench.plots import target_check
from gateway.bench.points import Point, Setup
from gateway.bench.policies import estimate_capacity
from gateway.config.loader import load_rules_file
from gateway.routing.classify import Classifier

ROOT = Path(__file__).resolve().parents[2]
MIXES = ("default", "code-assistant", "summarization-rag", "chat-heavy", "agentic", "bursty")


@pytest.mark.parametrize("name", MIXES)
def test_every_shipped_mix_parses_with_its_rules_and_target(name: str) -> None:
    mix = load_mix(name, ROOT / "bench" / "mixes")
    assert mix.rules is not None
    assert (ROOT / mix.rules).is_file()
    assert mix.target.within in (1.10, 1.15)
    assert abs(sum(c.weight for c in mix.classes) - 1.0) < 1e-9


def test_burst_and_step_arrivals_scale_with_the_load_points_rate() -> None:
    mix = parse_mix({"arrivals": "burst:0.5,2.5,6,1.5", "classes": [{"name": "a"}]})
    assert mix.arrival_kind(4.0) == "burst:2,10,6,1.5"
    times = arrival_times(mix.arrival_kind(4.0), 4.0, 600.0, random.Random(1))
    assert len(times) / 600.0 == pytest.approx(4.0, rel=0.1)  # the mean is the load point's rate
    step = parse_mix({"arrivals": "step:0.5@4,2@4,0.5@4", "classes": [{"name": "a"}]})
    assert step.arrival_kind(2.0) == "step:1@4,4@4,1@4"
    assert parse_mix({"classes": [{"name": "a"}]}).arrival_kind(3.0) == "poisson"
    for bad in ("burst:1,2", "step:1", "gamma", "burst:1,2,3,4x"):
        with pytest.raises(ValueError, match="arrivals"):
            parse_mix({"arrivals": bad, "classes": [{"name": "a"}]})


def test_agentic_tool_calls_carry_a_tool_and_classify_as_tool_use() -> None:
    mix = load_mix("agentic", ROOT / "bench" / "mixes")
    rules = load_rules_file(ROOT / "routing_rules" / "default.yaml")
    classifier = Classifier(rules)
    rng = random.Random(3)
    seen: dict[str, set[str]] = {}
    for _ in range(200):
        planned = plan_request(mix, "meta-llama/Llama-3.3-70B-Instruct", rng)
        c = classifier.classify("chat", planned.body, None)
        seen.setdefault(planned.cls.name, set()).add(c.traffic_class.name)
        if planned.cls.name == "tool-call":
            assert planned.body["tools"][0]["type"] == "function"
            assert c.features.task_type == "tool_use"
    assert seen["tool-call"] == {"predictable-low-temperature"}
    assert seen["chat-turn"] == {"open-mid-temperature"}


def test_fleet_shapes_set_the_servers_and_the_capacity() -> None:
    adaptive = load_rules_file(ROOT / "routing_rules" / "default.yaml").model_dump(mode="json", exclude_none=True)
    two_one = Setup(spec_servers=2, std_servers=1)
    assert servers_per_pool(policy_rules("adaptive", adaptive, ROOT), two_one) == {"speculative": 2, "standard": 1}
    assert servers_per_pool(policy_rules("standard", adaptive, ROOT), two_one) == {"standard": 3}
    assert servers_per_pool(policy_rules("speculative", adaptive, ROOT), Setup()) == {"speculative": 2}
    mix = load_mix("default", ROOT / "bench" / "mixes")
    one, _ = estimate_capacity(mix, Setup(), n=300)
    three, how = estimate_capacity(mix, Setup(spec_servers=1, std_servers=2), n=300)
    assert three == pytest.approx(1.5 * one)
    assert "3 standard servers" in how


def test_the_target_check_uses_the_mixs_target() -> None:
    def pt(policy: str, load: float, p99: float) -> Point:
        s = Summary("all", 10, 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1.0, 1.0, p99))
        return Point(policy, load, load, s, (), 1.0)

    points = [pt("standard", 0.5, 2.0), pt("speculative", 0.5, 2.5), pt("adaptive", 0.5, 1.9)]
    points += [pt("standard", 1.1, 4.0), pt("speculative", 1.1, 9.0), pt("adaptive", 1.1, 4.5)]
    chat = load_mix("chat-heavy", ROOT / "bench" / "mixes").target
    default = load_mix("default", ROOT / "bench" / "mixes").target
    assert "within 15% of the best homogeneous fleet's p99 E2E at every load: **MET**" in target_check(points, chat)[0]
    lines = target_check(points, default)
    assert "within 10% of the best homogeneous fleet's p99 E2E at every load: **NOT MET at 110% (+12%)**" in lines[0]
    assert (
        "at least 10% below the best homogeneous fleet's p99 E2E at 50%, 70% load (50%: -5% against it): **NOT MET**"
        in lines[1]
    )


def test_a_controller_time_scale_shortens_the_windows_below_one_load_point() -> None:
    from gateway.bench.fleet import bench_rules

    adaptive = load_rules_file(ROOT / "routing_rules" / "default.yaml").model_dump(
        mode="json", exclude_none=True, by_alias=True
    )
    rules = policy_rules("adaptive", adaptive, ROOT)
    ports = {"speculative": [1], "standard": [2]}
    plain = bench_rules(rules, ports, Setup(controller_time_scale=None))  # the clock's scale for both
    fast = bench_rules(rules, ports, Setup(controller_time_scale=0.1))
    assert plain["defaults"]["controller"]["window_s"] == pytest.approx(15.0)  # 30 s x the clock's 0.5
    assert fast["defaults"]["controller"]["window_s"] == pytest.approx(3.0)
    assert fast["defaults"]["controller"]["min_hold_s"] == pytest.approx(6.0)
    assert fast["scrape"]["interval_s"] == 0.25
