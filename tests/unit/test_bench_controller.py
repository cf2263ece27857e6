"""gateway.bench.controller: phases, the scaled rules and the report (the run itself: `specgate bench controller`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.bench.controller import (
    Change,
    GatewayLoad,
    Phase,
    Result,
    Run,
    error_code,
    is_shed,
    parse_phases,
    scaled_rules,
)
from gateway.bench.controller_report import recovery_rows, render, step_summary
from gateway.config.schema import RoutingRules

ROOT = Path(__file__).resolve().parents[2]


def test_phases_parse_and_repeated_names_stay_apart() -> None:
    assert parse_phases("low:10:15, high:80:40,low:10:30") == [
        Phase("low", 10.0, 15.0),
        Phase("high", 80.0, 40.0),
        Phase("low-2", 10.0, 30.0),
    ]
    for bad in ("low:10", "low:0:5", "low:5:-1", "low:x:5"):
        with pytest.raises(ValueError, match="low"):
            parse_phases(bad)


def test_scaled_rules_shrink_the_controllers_time_constants_and_stay_valid() -> None:
    rules = yaml.safe_load((ROOT / "routing_rules" / "default.yaml").read_text())
    out = scaled_rules(rules, 0.05)
    RoutingRules.model_validate(out)  # still a valid config
    ctl = next(c for c in out["classes"] if c["name"] == "predictable-low-temperature")["controller"]
    assert ctl["window_s"] == pytest.approx(1.5)
    assert ctl["min_hold_s"] == pytest.approx(3.0)
    assert ctl["reenable_after_s"] == pytest.approx(30.0)
    assert out["scrape"]["interval_s"] == 0.25  # the floor: a loaded machine answers /metrics in tens of ms
    assert ctl["window_s"] >= 2 * out["scrape"]["interval_s"]
    # the input is not modified
    assert rules["classes"][2]["controller"]["window_s"] == 30


def test_render_reports_transitions_and_per_phase_acceptance() -> None:
    run = Run([Phase("low", 1, 10), Phase("high", 5, 10)])
    run.changes = [Change(12.5, "precise", "split", 0.75, "load")]
    run.results = [
        Result(1.0, "code", "low", 200, 0.1, "precise", "spec"),
        Result(11.0, "code", "high", 200, 0.3, "precise", "std"),
        Result(12.0, "code", "high", 200, 0.2, "precise", "spec"),
        Result(13.0, "code", "high", 0, 0.0, "ClientOSError"),
    ]
    run.boundaries = {"low@start": {}, "high@start": {"precise": (100.0, 70.0)}, "end": {"precise": (300.0, 130.0)}}
    text = render(run, {"spec"})
    change = next(line for line in text.splitlines() if "12.50" in line)
    assert ("split" in change, "load" in change) == (True, True)
    high = next(line for line in text.splitlines() if "high" in line and "precise" in line)
    assert "50%" in high  # one of two answers from the speculative pool
    assert "0.300" in high  # (130 - 70) / (300 - 100)


def test_recovery_counts_the_later_phases_by_when_each_request_was_due() -> None:
    run = Run([Phase("low", 1, 10), Phase("high", 5, 10), Phase("low-2", 1, 10)])
    run.results = [
        # a request of the step that a lagging generator only sent after it: not the later phase's
        Result(21.0, "code", "high", 503, 0.01, shed=True, due_at=19.0, code="overloaded"),
        Result(21.5, "code", "low-2", 200, 0.2, due_at=21.0),  # sent half a second late
        Result(22.0, "code", "low-2", 503, 0.01, due_at=22.0, code="upstream_timeout"),  # an error, not shed
        Result(26.0, "code", "low-2", 200, 0.1, due_at=26.0),
    ]
    run.load = [GatewayLoad(20.5, 7.0, 12.0, 2.0), GatewayLoad(24.0, 3.0, 12.0, 2.0), GatewayLoad(26.0, 1.0, 6.0, 1.0)]
    rows = recovery_rows(run)
    assert [(r["from"], r["requests"], r["shed"], r["errors"]) for r in rows] == [(0, 2, 0, 1), (5, 1, 0, 0)]
    assert rows[0]["late_p95"] == pytest.approx(0.5)
    assert (rows[0]["in_flight"], rows[0]["limit"]) == (7.0, 12.0)  # the most in flight, the smallest bound
    assert (rows[1]["in_flight"], rows[1]["limit"]) == (1.0, 6.0)


def test_only_admission_controls_answer_counts_as_shed() -> None:
    assert is_shed(503, True, "overloaded")
    assert is_shed(429, True, "")
    assert not is_shed(503, True, "upstream_timeout")  # a refusal after failures is an error
    assert not is_shed(503, False, "overloaded")
    assert error_code(b'{"error": {"code": "overloaded", "message": "full"}}') == "overloaded"
    assert error_code(b"not json") == ""
    assert error_code(b'{"error": "flat"}') == ""


def test_the_step_summary_compares_the_admitted_with_the_unloaded() -> None:
    run = Run([Phase("low", 1, 10), Phase("high", 5, 10), Phase("low-2", 1, 10)])
    run.results = [
        Result(1.0, "code", "low", 200, 0.1),
        Result(11.0, "code", "high", 200, 0.3),
        Result(12.0, "code", "high", 503, 0.01, shed=True, code="overloaded"),
        Result(13.0, "code", "high", 503, 0.02, shed=True, code="overloaded"),
    ]
    text = step_summary(run)
    assert "p95 0.100 s" in text
    assert "admitted p95 0.300 s (3.0x unloaded)" in text
    assert "shed 2 of 3 (67%) answered in p95 0.020 s" in text
