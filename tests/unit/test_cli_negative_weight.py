"""``specgate weight POOL -1``: the negative number is read as the weight and refused by its range, not reported as
an unknown option; an unknown option is still refused."""

from __future__ import annotations

from typer.testing import CliRunner

from gateway.cli.main import app


def test_a_negative_weight_is_refused_as_a_weight() -> None:
    r = CliRunner().invoke(app, ["weight", "speculative", "-1", "--reason", "x", "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 2
    assert "greater than or equal to 0" in r.output
    assert "No such option" not in r.output


def test_an_unknown_option_is_still_refused() -> None:
    r = CliRunner().invoke(app, ["weight", "speculative", "1", "--reason", "x", "--bogus"])
    assert r.exit_code == 2
    assert "--bogus" in r.output
