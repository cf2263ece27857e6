"""`specgate bench overhead` end to end with the built-in load tool (what runs where wrk is not installed):
the static upstream, both minimal proxies and the gateway as real processes, every number filled in."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.bench.closed_loop import drive
from gateway.bench.overhead import TARGETS, TRACED, bench_overhead, epp_skipped, render
from gateway.bench.overhead_epp import EPP_TARGETS
from gateway.sim.launch import free_port, wait_for_port


def test_the_builtin_closed_loop_counts_requests_and_errors() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.bench.static_upstream", "--port", str(port)])
    try:
        wait_for_port(port, 30.0)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        rps, p50, p99, errors = asyncio.run(drive(url, b'{"stream": false}', {}, 4, 0.5))
        assert rps > 50
        assert 0 < p50 <= p99
        assert errors == 0
        gone = f"http://127.0.0.1:{free_port()}/v1/chat/completions"  # nothing listens: every request fails
        rps, _p50, _p99, errors = asyncio.run(drive(gone, b"{}", {}, 2, 0.2))
        assert errors > 0
    finally:
        proc.terminate()
        proc.wait(10)


def test_bench_overhead_runs_end_to_end_with_the_builtin_tool() -> None:
    rows, streams = bench_overhead([1], 1, prompt_chars=200, tool="builtin")
    assert [(r.mode, r.connections) for r in rows] == [("json", 1), ("stream", 1)]
    skipped = epp_skipped()
    for row in rows:
        with_epp = row.mode == "json" and skipped is None  # Envoy alone and Envoy + specgate epp, where here
        assert set(row.results) == set(TARGETS) | (set(EPP_TARGETS) if with_epp else set())
        for target, result in row.results.items():
            assert result.errors == 0, target
            assert result.rps > 0, target
            assert not math.isnan(result.p50_s), target
    assert set(streams.ttft_p50_s) == {"direct", "minimal-aiohttp", "specgate"}
    text = render(rows, streams, skipped)
    assert "added p50, 1 connection" in text
    assert ("EPP added p50, 1 connection" in text) if skipped is None else ("not measured: " + skipped in text)
    assert "added TTFT p50" in text


def test_bench_overhead_with_tracing_measures_the_traced_gateways_in_turns() -> None:
    pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.proto")
    rows, _streams = bench_overhead([32], 1, prompt_chars=200, tool="builtin", tracing=True, epp=False)
    for row in rows:
        assert set(row.results) == {*TARGETS, *TRACED}
        for target in ("specgate", *TRACED):
            assert row.results[target].errors == 0, target
            assert row.results[target].rps > 0, target
            if Path("/proc/self/stat").exists():
                assert row.cpu_us[target] > 0, target
    text = render(rows)
    assert "tracing on (specgate-trace100, json)" in text
    assert "tracing on (specgate-trace10, stream)" in text
