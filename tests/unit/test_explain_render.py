"""gateway.cli.render: the expected-completion table and why a request drew its pool."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from gateway.cli.render import render


def explained() -> dict[str, Any]:
    est = {
        "spec": {
            "kind": "speculative",
            "cost_s": 1.534,
            "expected_s": 1.234,
            "impact_s": 0.3,
            "queue_s": 0.0,
            "first_token_s": 0.012,
            "decode_s": 1.222,
            "output_tokens": 256.0,
            "tpot_s": 0.012,
            "class_tpot_s": 0.00477,
            "acceptance": 0.31,
            "acceptance_source": "prior",
        },
        "std": {
            "kind": "standard",
            "expected_s": 5.14,
            "queue_s": 0.0,
            "first_token_s": 0.02,
            "decode_s": 5.12,
            "output_tokens": 256.0,
            "tpot_s": 0.02,
            "class_tpot_s": 0.02,
            "acceptance": None,
            "acceptance_source": "none",
        },
    }
    return {
        "traffic_class": {"name": "chat", "route": {"preferred": "std", "fallback": [], "pin": None}},
        "controller": {"state": "split", "share": 0.5, "probe_share": 0.0},
        "choice": {"pick": "speculative", "share": 0.5, "why": "spill"},
        "expected_completion": est,
        "live": {},
        "plan": {"max_attempts": 2, "steps": [{"attempt": 1, "pool": "spec", "kind": "speculative", "reason": "x"}]},
        "config": {},
    }


def text(data: dict[str, Any]) -> str:
    console = Console(width=200, record=True, color_system=None)
    render(data, console)
    return console.export_text()


def test_the_table_gives_each_pools_expected_time_and_inputs_and_the_line_the_draws_reason() -> None:
    out = text(explained())
    assert "this request: speculative (spill: a share of the class goes to the other pool" in out
    words = [line.split() for line in out.splitlines()]
    assert [
        "spec",
        "speculative",
        "1.534",
        "s",
        "1.234",
        "s",
        "0.300",
        "s",
        "0.000",
        "s",
        "0.012",
        "s",
        "1.222",
        "s",
        "256",
        "12.0ms",
        "4.8ms",
        "0.31",
        "(prior)",
    ] in words
    assert [  # from a gateway that did not report the impact yet: cost = expected time, impact unknown
        "std",
        "standard",
        "5.140",
        "s",
        "5.140",
        "s",
        "–",
        "0.000",
        "s",
        "0.020",
        "s",
        "5.120",
        "s",
        "256",
        "20.0ms",
        "20.0ms",
        "–",
    ] in words


def test_a_pin_and_a_probe_are_said() -> None:
    data = explained()
    data["traffic_class"]["route"]["pin"] = "standard"
    data["controller"]["probe_share"] = 0.02
    data["choice"]["why"] = "probe"
    out = text(data)
    assert "pinned to standard pools" in out
    assert "probing speculative at 0.02" in out
    assert "(probe: measuring the class's acceptance)" in out
    assert "cost = its expected time + what it adds" in out
    data["expected_completion"] = None
    assert "cost = its expected time + what it adds" not in text(data)
