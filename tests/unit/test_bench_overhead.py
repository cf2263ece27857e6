"""The wrk output parser of ``specgate bench overhead`` (the benchmark itself is run by hand, not in tests)."""

from __future__ import annotations

import pytest

from gateway.bench.overhead import parse_wrk

WRK = """Running 5s test @ http://127.0.0.1:9914/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    29.43ms   10.12ms  94.08ms   70.00%
    Req/Sec     1.06k   100.00     1.20k    70.00%
  Latency Distribution
     50%   29.43ms
     75%   35.00ms
     90%   45.00ms
     99%   94.08ms
  5270 requests in 5.00s, 3.20MB read
  Socket errors: connect 0, read 2, write 0, timeout 3
  Non-2xx or 3xx responses: 7
Requests/sec:   1054.00
Transfer/sec:    655.00KB
"""


def test_parse_wrk() -> None:
    r = parse_wrk(WRK)
    assert r.rps == pytest.approx(1054.0)
    assert r.p50_s == pytest.approx(0.02943)
    assert r.p99_s == pytest.approx(0.09408)
    assert r.errors == 12


def test_parse_wrk_microseconds_and_garbage() -> None:
    text = WRK.replace("29.43ms", "52.00us").replace("94.08ms", "1.20s")
    r = parse_wrk(text)
    assert r.p50_s == pytest.approx(52e-6)
    assert r.p99_s == pytest.approx(1.2)
    with pytest.raises(RuntimeError):
        parse_wrk("wrk: connection refused")


def test_load_tool_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.bench import overhead

    monkeypatch.setattr(overhead.shutil, "which", lambda name: None)
    assert overhead.load_tool("auto") == "builtin"
    with pytest.raises(RuntimeError, match="apt-get install wrk"):
        overhead.load_tool("wrk")
    with pytest.raises(ValueError, match="unknown load tool"):
        overhead.load_tool("hey!")
    monkeypatch.setattr(overhead.shutil, "which", lambda name: "/usr/bin/wrk")
    assert overhead.load_tool("auto") == "wrk"
    assert overhead.load_tool("builtin") == "builtin"
