"""The multi-turn bench's comparison of the gateway's predicted prefix hits with the servers' measured ones."""

from __future__ import annotations

import math

from gateway.bench.load import Result
from gateway.bench.multiturn_report import MultiTurnPoint, TurnResult, prefix_precision
from gateway.bench.prefix_precision import (
    EndpointPrecision,
    Snapshot,
    TurnMirror,
    cache_chunks,
    overall,
    precision,
    predicted_by_endpoint,
    samples,
    shortfall,
    total,
)

GATEWAY = """\
# HELP specgate_prefix_predicted_hit_tokens_total Prompt tokens the gateway expected
# TYPE specgate_prefix_predicted_hit_tokens_total counter
specgate_prefix_predicted_hit_tokens_total{endpoint="standard-sim-0",pool="standard"} 3200.0
specgate_prefix_predicted_hit_tokens_total{endpoint="standard-sim-1",pool="standard"} 160.0
specgate_prefix_predicted_hit_tokens_created{endpoint="standard-sim-0",pool="standard"} 1.7e9
specgate_prefix_prompt_tokens_total{endpoint="standard-sim-0",pool="standard"} 9999.0
"""

SIM = """\
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1500.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4000.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="2048",engine="0"} 1.0
"""


def test_parses_the_gateway_and_server_expositions() -> None:
    assert predicted_by_endpoint(GATEWAY) == {"standard-sim-0": 3200.0, "standard-sim-1": 160.0}
    assert total(SIM, "vllm:prefix_cache_hits_total") == 1500.0
    assert samples(SIM, "vllm:prefix_cache_hits") == []  # a name is matched whole, never as another's start
    assert samples(SIM, "vllm:prefix_cache_hits_total") == [({"engine": "0", "model_name": "m"}, 1500.0)]
    assert cache_chunks(SIM) == 2048  # 2048 blocks x 16 tokens / 16 tokens a chunk
    assert cache_chunks("vllm:prefix_cache_hits_total 3\n") is None


def test_window_deltas_and_ratio_per_endpoint_and_in_total() -> None:
    before = Snapshot({"a": 100.0}, {"a": 50.0, "b": 0.0})
    after = Snapshot({"a": 1100.0, "b": 320.0}, {"a": 550.0, "b": 0.0})
    rows = precision(before, after)
    assert rows == (EndpointPrecision("a", 1000.0, 500.0), EndpointPrecision("b", 320.0, 0.0))
    assert rows[0].ratio == 2.0
    assert math.isnan(rows[1].ratio)  # nothing measured: no ratio
    assert overall(rows) == EndpointPrecision("all", 1320.0, 500.0)
    assert precision(None, after) == ()


def test_shortfall_counts_turns_short_by_more_than_one_block() -> None:
    pairs = [(160, 160), (160, 144), (160, 143), (320, 0), (None, 10), (10, None), (0, 64)]
    assert shortfall(pairs) == (2, 5)  # 160 vs 143 (17 short) and 320 vs 0; the unknowns not compared


def _turn_body(history: list[str]) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": h} for h in history]}


def test_mirror_predicts_the_previous_turns_prefix_on_the_same_endpoint() -> None:
    mirror = TurnMirror({"a": 1024})
    first = ["x" * 640]
    assert mirror.record("a", "/v1/chat/completions", _turn_body(first)) == 0
    warm = mirror.record("a", "/v1/chat/completions", _turn_body([*first, "y" * 640]))
    assert warm is not None
    assert warm >= 128  # at least the first turn's whole chunks, 16 tokens each
    assert mirror.record("b", "/v1/chat/completions", _turn_body(first)) == 0  # another endpoint: cold
    assert mirror.record("", "/v1/chat/completions", _turn_body(first)) is None


def test_report_section_shows_rows_total_and_short_share() -> None:
    def turn(predicted: int | None, cached: int | None) -> TurnResult:
        return TurnResult(0, 1, "chat", Result(0.0, "chat", "chat", False, status=200), 500, cached, False, predicted)

    rows = (EndpointPrecision("standard-sim-0", 900.0, 600.0), EndpointPrecision("standard-sim-1", 300.0, 400.0))
    point = MultiTurnPoint("adaptive", 0.3, 1.0, 0.2, 30.0, (turn(320, 0), turn(160, 160)), precision=rows)
    text = "\n".join(prefix_precision([point]))
    assert "| standard-sim-0 | 900 | 600 | 1.50 |" in text
    assert "| all | 1200 | 1000 | 1.20 |" in text
    assert "| 1 | 2 | 0.500 |" in text
    cold = MultiTurnPoint("adaptive", 0.3, 1.0, 0.2, 30.0, (), precision=(EndpointPrecision("a", 0.0, 5.0),))
    assert prefix_precision([cold]) == []  # no prediction (affinity off, or a peer front): no section
