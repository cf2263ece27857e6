"""gateway.bench.load / mix / policies: mix parsing, arrival processes, statistics, TPOT, policy rules."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import time
from pathlib import Path

import pytest
import yaml

from gateway.bench.fleet import bench_rules, policy_rules
from gateway.bench.load import (
    Result,
    arrival_span,
    arrival_times,
    meets_targets,
    percentile,
    summarise,
    tpot_from_chunks,
    write_jsonl,
)
from gateway.bench.mix import load_mix, parse_mix, plan_request
from gateway.bench.plots import target_check
from gateway.bench.points import POLICIES, Point, Setup
from gateway.bench.policies import estimate_capacity
from gateway.config.schema import RoutingRules
from gateway.routing.classify import Classifier

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_mixes_parse_and_default_is_60_40() -> None:
    for name in ("default", "code-assistant", "summarization-rag"):
        mix = load_mix(name, ROOT / "bench" / "mixes")
        assert mix.classes
        assert mix.rules
        assert (ROOT / mix.rules).exists()
    mix = load_mix("default", ROOT / "bench" / "mixes")
    assert {c.name: c.weight for c in mix.classes} == {"structured": 0.6, "creative": 0.4}
    rng = random.Random(1)
    plans = [plan_request(mix, "m", rng) for _ in range(4000)]
    structured = [p for p in plans if p.cls.name == "structured"]
    assert len(structured) / len(plans) == pytest.approx(0.6, abs=0.03)
    assert all(
        p.body["temperature"] <= 0.2 and p.body["response_format"] == {"type": "json_object"} for p in structured
    )
    creative = [p for p in plans if p.cls.name == "creative"]
    missing = sum(1 for p in creative if "temperature" not in p.body)
    assert missing / len(creative) == pytest.approx(0.25, abs=0.05)  # null: the field is left out
    assert sum(p.stream for p in plans) / len(plans) == pytest.approx(0.5, abs=0.03)
    assert all(p.body["stream_options"] == {"include_usage": True} for p in plans if p.stream)
    assert all(p.headers["x-sim-task"] == p.cls.task and "x-task-type" not in p.headers for p in plans)


def test_mix_distributions_jsonl_prompts_and_errors(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(
        json.dumps("plain prompt") + "\n" + json.dumps({"q": "field prompt"}) + "\n"
        "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    data = {
        "name": "t",
        "send_task_header": True,
        "targets": {"ttft_s": 2.0, "tpot_s": 0.1},
        "classes": [
            {"name": "a", "task": "code", "temperature": {"uniform": [0.1, 0.3]}, "max_tokens": {"uniform": [10, 20]},
             "prompts": {"file": "p.jsonl", "field": "q"}, "targets": {"ttft_s": 0.5}},
        ],
    }  # fmt: skip
    mix = parse_mix(data, tmp_path)
    cls = mix.classes[0]
    assert (cls.targets.ttft_s, cls.targets.tpot_s) == (0.5, 0.1)
    assert len(cls.prompts) == 3
    rng = random.Random(0)
    for _ in range(200):
        p = plan_request(mix, "m", rng)
        assert 0.1 <= p.body["temperature"] <= 0.3
        assert 10 <= p.body["max_tokens"] <= 20
        assert isinstance(p.body["max_tokens"], int)
        assert p.body["stream"] is False
        assert p.headers["x-task-type"] == "code"
    for bad in (
        {"classes": []},
        {"classes": [{"name": "x", "task": "poetry"}]},
        {"classes": [{"name": "x", "temperature": {"choice": [0.1], "weights": [1, 2]}}]},
        {"classes": [{"name": "x", "stream": 1.5}]},
        {"classes": [{"name": "x", "temperature": "hot"}]},
    ):
        with pytest.raises(ValueError, match=r"classes|choice|weights|stream|expected|task"):
            parse_mix(bad)


def test_poisson_rate_within_tolerance_and_reproducible() -> None:
    times = arrival_times("poisson", 20.0, 100.0, random.Random(3))
    assert len(times) / 100.0 == pytest.approx(20.0, rel=0.05)
    assert times == sorted(times)
    assert times[0] >= 0
    assert times[-1] < 100.0
    assert times == arrival_times("poisson", 20.0, 100.0, random.Random(3))
    gaps = [b - a for a, b in itertools.pairwise(times)]
    cv = math.sqrt(sum((g - 0.05) ** 2 for g in gaps) / len(gaps)) / 0.05
    assert cv == pytest.approx(1.0, abs=0.1)  # exponential gaps, not a constant stream


def test_constant_burst_and_step_shapes() -> None:
    assert arrival_times("constant", 4.0, 2.0, random.Random(0)) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    burst = arrival_times("burst:1,50,10,2", 0.0, 200.0, random.Random(1))
    in_burst = sum(1 for t in burst if t % 10 < 2)
    assert in_burst / 40.0 == pytest.approx(50.0, rel=0.1)  # 20 bursts of 2 s at 50/s
    assert (len(burst) - in_burst) / 160.0 == pytest.approx(1.0, rel=0.25)
    step = arrival_times("step:2@50,20@50", 0.0, 0.0, random.Random(2))
    assert sum(1 for t in step if t < 50) / 50 == pytest.approx(2.0, rel=0.25)
    assert sum(1 for t in step if t >= 50) / 50 == pytest.approx(20.0, rel=0.1)
    assert max(step) < 100
    assert arrival_span("step:2@50,20@50", 5.0) == 100.0
    for bad in ("burst:1,2,3", "burst:1,5,2,3", "step:5", "step:x@3", "zipf"):
        with pytest.raises(ValueError, match="arrival"):
            arrival_times(bad, 1.0, 10.0, random.Random(0))


def test_percentiles_tpot_and_goodput() -> None:
    assert percentile([], 0.5) != percentile([], 0.5)  # NaN
    values = [float(i) for i in range(1, 101)]
    assert (percentile(values, 0.5), percentile(values, 0.95), percentile(values, 0.99)) == (50.0, 95.0, 99.0)
    assert percentile([3.0], 0.99) == 3.0
    # 3 chunks carrying 9 tokens (a speculative server sends several per chunk): the first token is excluded
    assert tpot_from_chunks([0.5, 0.7, 1.3], 9) == pytest.approx(0.1)
    assert tpot_from_chunks([0.5], 1) is None

    def res(cls: str, ttft: float | None, tpot: float | None, e2e: float, status: int = 200, n: int = 11) -> Result:
        r = Result(0.0, cls, "chat", ttft is not None, status, "" if status == 200 else "boom", e2e, ttft, tpot, n)
        r.pool = "spec" if cls == "a" else "std"
        r.itl_s = [0.01, 0.03] if ttft is not None else []
        r.good = meets_targets(r, 1.0, 0.05)
        return r

    results = [
        res("a", 0.5, 0.04, 1.0),  # good
        res("a", 1.5, 0.01, 1.6),  # TTFT too slow
        res("a", 0.2, 0.06, 0.9),  # TPOT too slow
        res("b", None, None, 1.4),  # non-streaming: 1.4 <= 1.0 + 0.05 * 10 → good
        res("b", None, None, 1.6),  # > 1.5
        res("b", None, None, 0.1, status=503),  # error: never good
    ]
    assert [r.good for r in results] == [True, False, False, True, False, False]
    by = {s.cls: s for s in summarise(results, 2.0, frozenset({"spec"}))}
    assert by["all"].requests == 6
    assert by["all"].errors == 1
    assert by["all"].goodput_rps == pytest.approx(1.0)
    assert by["a"].goodput_rps == pytest.approx(0.5)
    assert by["a"].ttft[0] == 0.5
    assert by["a"].itl[2] == 0.03
    assert by["b"].ttft[0] != by["b"].ttft[0]
    assert by["a"].spec_share == 1.0
    assert by["b"].spec_share == 0.0


def test_results_jsonl_has_no_nan(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    write_jsonl(path, [Result(0.0, "a", "chat", False, 0, "ClientError")], {"policy": "x"})
    row = json.loads(path.read_text())
    assert row["policy"] == "x"
    assert row["e2e_s"] is None
    assert row["error"] == "ClientError"


def _route(rules: dict[str, object], body: dict[str, object]) -> str:
    cls = Classifier(RoutingRules.model_validate(rules)).classify("chat", body).traffic_class
    return str(cls.route.preferred)


def test_nginx_port_keeps_the_seeds_missing_temperature_behaviour() -> None:
    adaptive = yaml.safe_load((ROOT / "routing_rules" / "default.yaml").read_text())
    rules = policy_rules("nginx", adaptive, ROOT)
    base = {"model": "meta-llama/Llama-3.3-70B-Instruct", "messages": [{"role": "user", "content": "a story"}]}
    cases = [
        ({"stream": True, "max_tokens": 256}, "speculative"),  # no temperature: speculative, as the Lua does
        ({"stream": True, "max_tokens": 256, "temperature": 1.0}, "speculative"),  # not > 1.0
        ({"stream": True, "max_tokens": 256, "temperature": 0.0}, "speculative"),  # 0 is truthy in Lua
        ({"stream": True, "max_tokens": 256, "temperature": 1.2}, "standard"),
        ({"stream": True, "max_tokens": 16}, "standard"),  # max_tokens < 32
        ({"max_tokens": 48}, "standard"),  # no stream = not streaming, and < 64
        ({"stream": True, "max_tokens": 48}, "speculative"),
        ({"stream": False}, "speculative"),  # no max_tokens: no short rule
    ]
    for extra, pool in cases:
        assert _route(rules, {**base, **extra}) == pool, extra


def test_policy_rules_are_valid_and_scaled() -> None:
    adaptive = yaml.safe_load((ROOT / "routing_rules" / "default.yaml").read_text())
    setup = Setup()
    for policy in POLICIES:
        rules = policy_rules(policy, adaptive, ROOT)
        ports = {p["name"]: [1000 + i for i in range(2 if len(rules["pools"]) == 1 else 1)] for p in rules["pools"]}
        out = bench_rules(rules, ports, setup)
        RoutingRules.model_validate(out)
        assert sum(len(p["endpoints"]) for p in out["pools"]) == 2
    out = bench_rules(policy_rules("adaptive", adaptive, ROOT), {"speculative": [1], "standard": [2]}, setup)
    sat = {c["name"]: c["route"].get("saturation") for c in out["classes"]}
    assert sat["predictable-low-temperature"] == {"max_inflight_per_endpoint": math.ceil(128 / setup.scale)}
    ctl = next(c for c in out["classes"] if c["name"] == "low-temperature")["controller"]
    cts = setup.time_scale if setup.controller_time_scale is None else setup.controller_time_scale
    assert ctl["min_hold_s"] == pytest.approx(60 * cts)
    ngram = yaml.safe_load((ROOT / "routing_rules" / "examples" / "ngram-summarization-rag.yaml").read_text())
    spec = policy_rules("speculative", ngram, ROOT)
    assert spec["pools"][0]["speculative"]["method"] == "ngram"
    assert [p["name"] for p in policy_rules("adaptive", ngram, ROOT)["pools"]] == ["ngram", "standard"]


def test_capacity_estimate_and_target_check() -> None:
    mix = load_mix("default", ROOT / "bench" / "mixes")
    cap, how = estimate_capacity(mix, Setup(), n=500)
    assert 1.0 < cap < 20.0
    assert "step model" in how
    from gateway.bench.load import Summary

    def pt(policy: str, load: float, p99: float) -> Point:
        s = Summary("all", 10, 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1.0, 1.0, p99))
        return Point(policy, load, load * cap, s, (), 1.0)

    points = [pt("standard", 0.5, 2.0), pt("speculative", 0.5, 1.0), pt("nginx", 0.5, 3.0), pt("adaptive", 0.5, 1.05)]
    points += [pt("standard", 1.1, 4.0), pt("speculative", 1.1, 9.0), pt("nginx", 1.1, 10.0), pt("adaptive", 1.1, 4.8)]
    lines = target_check(points)
    assert "**MET**" in lines[0]
    assert "NOT MET at 110% (+20%)" in lines[1]
    assert "52%" in lines[2]
    assert "**MET**" in lines[2]


def test_cpu_meter_sees_a_busy_child_and_an_idle_one() -> None:
    import subprocess
    import sys

    from gateway.bench.cpu import CpuMeter, cpu_seconds

    if cpu_seconds(os.getpid()) is None:
        pytest.skip("no /proc here")
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    try:
        time.sleep(0.3)  # past the interpreters' start-up
        meter = CpuMeter({"busy": busy.pid, "idle": idle.pid, "me": None})
        meter.start()
        time.sleep(1.0)
        cpu = meter.stop()
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    # A spinning process gets a core on a quiet machine and a share of one on a busy one: compared with the idle
    # one, not with a fixed share.
    assert cpu["busy"] > 0.05
    assert cpu["busy"] > 10 * cpu["idle"]
    assert cpu["idle"] < 0.1
    assert cpu["me"] < 0.5  # this process slept
    assert CpuMeter({"gone": busy.pid}).stop() == {}  # a process that is gone is left out, not zero


def test_the_report_says_whether_the_harness_was_the_bottleneck() -> None:
    from gateway.bench.load import Summary
    from gateway.bench.plots import harness_cpu

    s = Summary("all", 10, 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1.0, 1.0, 2.0))
    cool = [Point("standard", 0.5, 1.0, s, (), 1.0, {"gateway": 0.2, "server 0": 0.3, "load generator": 0.1})]
    assert "not the Python event loops" in "\n".join(harness_cpu(cool))
    hot = [Point("adaptive", 1.1, 2.0, s, (), 1.0, {"gateway": 0.95, "server 0": 0.3})]
    text = "\n".join(harness_cpu(hot))
    assert "may have been the bottleneck" in text
    assert "adaptive at 110% (gateway 0.95)" in text
    assert "not measured" in "\n".join(harness_cpu([Point("standard", 0.5, 1.0, s, (), 1.0)]))
    cpu = {"gateway": 0.2}
    kept = [Point("standard", 0.5, 1.0, s, (), 1.0, cpu, lag=0.004), Point("adaptive", 0.5, 1.0, s, (), 1.0, cpu)]
    assert "kept their clocks: steps that started late add at most 0.4%" in "\n".join(harness_cpu(kept))
    late = [Point("standard", 0.5, 1.0, s, (), 1.0, cpu, lag=0.07)]
    assert "**the simulated servers ran late** by up to 7.0%" in "\n".join(harness_cpu(late))


def test_a_points_clock_lag_is_its_worst_servers_share_of_late_steps() -> None:
    from gateway.bench.fleet import clock_lag, sim_clocks

    before = [(1.0, 100.0), (0.0, 100.0), None]
    after = [(1.5, 150.0), (2.0, 150.0), (0.0, 10.0)]
    assert clock_lag(before, after) == pytest.approx(0.04)  # the second server: 2 s late in 50 s
    assert clock_lag([None], [None]) != clock_lag([None], [None])  # NaN: nothing read
    assert sim_clocks([1]) == [None]  # nothing listens on port 1


def test_responses_mix_plans_responses_api_bodies() -> None:
    from gateway.config.loader import load_rules_file
    from gateway.routing.classify import Classifier

    mix = load_mix("agents-responses", ROOT / "bench" / "mixes")
    classifier = Classifier(load_rules_file(ROOT / "routing_rules" / "default.yaml"))
    rng = random.Random(3)
    plans = [plan_request(mix, "meta-llama/Llama-3.3-70B-Instruct", rng) for _ in range(200)]
    assert {p.path for p in plans} == {"/v1/responses"}
    for p in plans:
        assert "messages" not in p.body
        assert "stream_options" not in p.body
        assert p.body["max_output_tokens"] > 0
        f = classifier.features("responses", p.body)
        assert f.endpoint == "responses"
        if p.cls.name == "structured":
            assert p.body["text"] == {"format": {"type": "json_object"}}
            assert f.task_type == "structured"
    with pytest.raises(ValueError, match="api"):
        parse_mix({"classes": [{"name": "x", "api": "assistants"}]})


def test_the_report_shows_where_the_adaptive_policy_put_each_request_class() -> None:
    from gateway.bench.load import Summary
    from gateway.bench.plots import class_shares

    def summ(cls: str, share: float) -> Summary:
        return Summary(cls, 10, 0, 1.0, 1.0, (0, 0, 0), (0, 0, 0), (0, 0, 0), (1, 1, 1), share)

    points = [
        Point("adaptive", 0.7, 7.0, summ("all", 0.5), (summ("chat", 0.25), summ("json", 1.0)), 1.0),
        Point("adaptive", 0.1, 1.0, summ("all", 0.9), (summ("chat", 0.8), summ("json", 1.0)), 1.0),
        Point("standard", 0.1, 1.0, summ("all", 0.0), (summ("chat", 0.0),), 1.0),
    ]
    lines = class_shares(points)
    assert "| offered load | chat | json |" in lines
    assert lines.index("| 10% | 0.80 | 1.00 |") < lines.index("| 70% | 0.25 | 1.00 |")  # by load, adaptive only
    assert class_shares([points[2]]) == []


def test_a_policy_process_stops_when_the_sweep_that_started_it_is_gone() -> None:
    import subprocess
    import sys

    # a child whose "parent" pid is not its parent: the watcher interrupts its main thread at once
    code = (
        "import time\n"
        "from gateway.bench.jobs import job_process\n"
        "try:\n"  # the interrupt may come before the next line starts on a loaded machine: inside the try
        "    job_process(-1, poll_s=0.01)\n"
        "    time.sleep(30)\n"
        "except KeyboardInterrupt:\n"
        "    print('stopped')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.strip() == "stopped", done.stderr
