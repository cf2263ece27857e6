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


def text(data: dict[str, Any], width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    render(data, console)
    return console.export_text()


def test_the_table_gives_each_pools_expected_time_and_inputs_and_the_line_the_draws_reason() -> None:
    out = text(explained())
    assert "this request: speculative (spill: a share of the class goes to the other pool" in out
    words = [line.split() for line in out.splitlines()]
    assert ["spec", "(speculative)", "std", "(standard)"] in words
    # from a gateway that did not report the impact yet (std): cost = expected time, impact unknown
    assert ["cost", "1.534", "s", "5.140", "s"] in words
    assert ["expected", "time", "1.234", "s", "5.140", "s"] in words
    assert ["queue", "0.000", "s", "0.000", "s"] in words
    assert ["1st", "step", "0.012", "s", "0.020", "s"] in words
    assert ["decode", "1.222", "s", "5.120", "s"] in words
    assert ["impact", "on", "others", "0.300", "s", "–"] in words
    assert ["output", "tokens", "256", "256"] in words
    assert ["TPOT", "of", "the", "pool", "12.0ms", "20.0ms"] in words
    assert ["TPOT", "of", "the", "class", "4.8ms", "20.0ms"] in words
    assert ["acceptance", "0.31", "(prior)", "–"] in words


def test_the_table_fits_an_80_column_terminal() -> None:
    out = text(explained(), width=80)
    table = out[out.index("this class on each pool") : out.index("plan (max")]
    assert "12.0ms" in table  # nothing cut off
    assert "(prior)" in table
    assert all(len(line) <= 80 for line in table.splitlines())


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
