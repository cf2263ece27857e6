"""The admin CLI's tables at 80, 100 and 120 columns: ids and headers are never split, nothing is wider than the
terminal, and a narrow terminal gets fewer columns rather than broken ones."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console

from gateway.cli import admin as admin_cli
from gateway.cli import render as render_cli
from gateway.cli.tables import Column, fit_columns, fit_table

NOW = time.time()
LONG_IDS = ["vllm-spec-0.vllm.svc:8000", "vllm-spec-1.vllm.svc:8000", "vllm-std-0.vllm.svc:8000"]
STATE: dict[str, Any] = {
    "pools": {
        "speculative": {
            "kind": "speculative",
            "waiting": 3,
            "running": 41,
            "acceptance_rate": 0.62,
            "endpoints": [
                {"id": LONG_IDS[0], "healthy": True, "configured_weight": 1, "effective_weight": 1, "in_flight": 7},
                {
                    "id": LONG_IDS[1],
                    "healthy": False,
                    "configured_weight": 1,
                    "effective_weight": 0.5,
                    "in_flight": 5,
                    "ejected": True,
                },
            ],
        },
        "standard": {
            "kind": "standard",
            "drained": True,
            "waiting": 0,
            "running": 12,
            "endpoints": [
                {"id": LONG_IDS[2], "healthy": True, "configured_weight": 2, "effective_weight": 2, "in_flight": 3}
            ],
        },
    },
    "config": {"source": "rules.yaml", "version": 3, "hash": "sha256:ab12cd34ef56"},
}
SHORT_STATE: dict[str, Any] = {
    "pools": {
        name: {**p, "endpoints": [{**e, "id": f"{name[:4]}-{i}"} for i, e in enumerate(p["endpoints"])]}
        for name, p in STATE["pools"].items()
    }
}
OVERRIDES = [
    {
        "id": "ovr_9bc29eaed7dd",
        "kind": "pool_weight",
        "pool": "speculative",
        "endpoint": None,
        "class": None,
        "value": 0.5,
        "reason": "vllm upgrade on the spec nodes, rolling one by one",
        "actor": "admin:alice",
        "expires_at": NOW + 1800,
    },
    {
        "id": "ovr_0123456789ab",
        "kind": "class_route",
        "pool": None,
        "endpoint": None,
        "class": "precise-code",
        "value": "standard",
        "reason": "spec degraded",
        "actor": "admin",
        "expires_at": None,
    },
]
AUDIT = {
    "total": 2,
    "records": [
        {
            "at": NOW - 60,
            "actor": "admin:alice",
            "action": "pool_weight",
            "target": "pool/speculative",
            "reason": "vllm upgrade on the spec nodes, rolling one by one",
            "detail": {"override": OVERRIDES[0]},
        },
        {
            "at": NOW - 30,
            "actor": "controller",
            "action": "controller_transition",
            "target": "class/precise-code",
            "reason": "expected delay speculative 1.9 s > standard 1.2 s",
            "detail": {"from": "speculative", "to": "split"},
        },
    ],
}
EXPLAIN = {
    "traffic_class": {"name": "precise-code", "route": {"preferred": "speculative", "saturated": "standard"}},
    "live": {
        "speculative": {
            "known": True,
            "saturated": True,
            "routable_endpoints": 2,
            "endpoints": 2,
            "in_flight": 96,
            "running": 80,
            "waiting": 12,
            "kv_usage": 0.91,
            "tpot_mean_s": 0.0312,
            "acceptance_rate": 0.58,
            "mean_acceptance_length": 3.1,
        },
        "standard": {"known": False},
    },
    "plan": {
        "max_attempts": 2,
        "steps": [
            {"attempt": 1, "pool": "standard", "kind": "standard", "reason": "speculative is saturated (96 in flight)"}
        ],
        "skipped": [],
    },
    "config": {"source": "rules.yaml", "digest": "sha256:ab12"},
}


def _printed(monkeypatch: pytest.MonkeyPatch, width: int, show: Callable[[], None]) -> list[str]:
    buf = io.StringIO()

    def console(**kwargs: Any) -> Console:
        return Console(file=buf, width=width, no_color=True, highlight=False, **kwargs)

    monkeypatch.setattr(admin_cli, "Console", console)
    show()
    return buf.getvalue().splitlines()


def _words(lines: list[str]) -> set[str]:
    return {w for line in lines for w in line.split()}


@pytest.mark.parametrize("width", [80, 100, 120])
def test_pools_never_split_an_id_or_a_header(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    lines = _printed(monkeypatch, width, lambda: admin_cli._print_pools(STATE))
    assert max(len(line.rstrip()) for line in lines) <= width
    words = _words(lines)
    assert {*LONG_IDS, "speculative", "standard", "pool", "endpoint", "state", "weight", "in-flight"} <= words
    assert {"ok", "down,ejected", "drained", "1→0.50"} <= words  # the state and weight columns never go


def test_pools_at_100_columns_show_every_column_with_short_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = _printed(monkeypatch, 100, lambda: admin_cli._print_pools(SHORT_STATE))
    header = next(line.split() for line in lines if line.split()[:1] == ["pool"])
    assert header == [c.header for c in admin_cli.POOL_COLUMNS]
    assert max(len(line.rstrip()) for line in lines) <= 100


def test_pools_get_fewer_columns_when_narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    def header(width: int) -> list[str]:
        lines = _printed(monkeypatch, width, lambda: admin_cli._print_pools(STATE))
        return next(line.split() for line in lines if line.split()[:1] == ["pool"])

    wide, narrow = header(120), header(80)
    assert wide == [c.header for c in admin_cli.POOL_COLUMNS]
    assert narrow == ["pool", "endpoint", "state", "weight", "in-flight"]


@pytest.mark.parametrize("width", [80, 100, 120])
def test_overrides_and_audit_keep_ids_whole(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    lines = _printed(monkeypatch, width, lambda: admin_cli._print_overrides({"overrides": OVERRIDES}))
    assert max(len(line.rstrip()) for line in lines) <= width
    assert {"ovr_9bc29eaed7dd", "ovr_0123456789ab", "precise-code", "speculative", "id", "target", "value"} <= (
        _words(lines)
    )
    assert "spec degraded" in "\n".join(lines)
    if width >= 100:
        assert "never (until removed)" in "\n".join(lines)
    lines = _printed(monkeypatch, width, lambda: admin_cli._print_audit(AUDIT))
    assert max(len(line.rstrip()) for line in lines) <= width
    assert {"pool_weight", "controller_transition", "pool/speculative", "class/precise-code", "action"} <= (
        _words(lines)
    )
    if width >= 100:
        assert "ovr_9bc29eaed7dd:" in _words(lines)  # the detail column, from 100 columns on


@pytest.mark.parametrize("width", [80, 100, 120])
def test_explain_tables_fit(width: int) -> None:
    buf = io.StringIO()
    render_cli.render(EXPLAIN, Console(file=buf, width=width, no_color=True, highlight=False))
    lines = buf.getvalue().splitlines()
    table_lines = [line for line in lines if not line.startswith(("class", "route", "request", "controller"))]
    assert max(len(line.rstrip()) for line in table_lines) <= width
    words = _words(lines)
    assert {"speculative", "standard", "preferred", "(saturated)", "in-flt", "accept", "attempt", "why"} <= words
    assert "speculative is saturated (96 in flight)" in " ".join(" ".join(line.split()) for line in lines)


def test_columns_are_dropped_in_their_order_and_ids_stay() -> None:
    columns = [Column("id"), Column("a", "number", drop=1), Column("b", "number", drop=2), Column("text", "text")]
    rows = [["x" * 30, "1" * 10, "2" * 10, "some words to wrap"]]
    assert fit_columns(columns, rows, 200) == [0, 1, 2, 3]
    assert fit_columns(columns, rows, 64) == [0, 1, 3]  # b first (drop 2), then a
    assert fit_columns(columns, rows, 40) == [0, 3]
    buf = io.StringIO()
    Console(file=buf, width=50, no_color=True).print(fit_table("t", columns, rows, 50))
    assert "x" * 30 in buf.getvalue()
