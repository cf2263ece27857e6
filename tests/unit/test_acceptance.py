"""Per-request acceptance: parsing, the usage chunk the gateway adds and strips, and the per-class window."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest

from gateway.observability.acceptance import AcceptanceWindow, SpecSample, sample_from_metrics, temperature_band
from gateway.observability.metrics import GatewayMetrics
from gateway.proxy.stream_tap import StreamTap, sample_from_body, with_include_usage
from gateway.proxy.wire import SSESplitter

SD = {
    "mean_acceptance_length": 3.4,
    "draft_acceptance_rate": 0.6,
    "acceptance_histogram": [1, 0, 2, 1, 1],
    "num_spec_steps": 5,
    "num_accepted_draft_tokens": 12,
    "num_draft_tokens": 20,
    "num_spec_tokens": 4,
}
FP = "vllm-0.33.0-abcdef12"


def ev(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def token(text: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}],
    }
    chunk.update(extra)
    chunk["kv_transfer_params"] = None
    return chunk


def usage_chunk(metrics: Any = None, **extra: Any) -> dict[str, Any]:
    chunk: dict[str, Any] = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    chunk.update(extra)
    if metrics is not None:
        chunk["metrics"] = metrics
    return chunk


DONE = b"data: [DONE]\n\n"


def test_sample_from_metrics_reads_vllm_names() -> None:
    s = sample_from_metrics({"speculative_decoding": SD})
    assert s == SpecSample(drafted=20, accepted=12, steps=5, mean_acceptance_length=3.4)
    assert s is not None
    assert s.rate == pytest.approx(0.6)
    assert sample_from_metrics(None) is None  # n > 1
    assert sample_from_metrics({"speculative_decoding": None}) is None
    assert sample_from_metrics({"speculative_decoding": {**SD, "num_draft_tokens": "x"}}) is None
    assert sample_from_metrics({"speculative_decoding": {**SD, "num_accepted_draft_tokens": 21}}) is None
    nothing = sample_from_metrics(
        {"speculative_decoding": {**SD, "num_draft_tokens": 0, "num_accepted_draft_tokens": 0}}
    )
    assert nothing is not None
    assert nothing.rate is None
    derived = sample_from_metrics(
        {"speculative_decoding": {"num_draft_tokens": 8, "num_accepted_draft_tokens": 4, "num_drafts": 2}}
    )
    assert derived == SpecSample(8, 4, 2, 3.0)


def test_sample_from_body() -> None:
    body = orjson.dumps({"id": "x", "choices": [], "usage": {}, "metrics": {"speculative_decoding": SD}})
    assert sample_from_body(body) == sample_from_metrics({"speculative_decoding": SD})
    assert sample_from_body(orjson.dumps({"id": "x", "metrics": None})) is None  # n > 1: no parse at all
    assert sample_from_body(b'{"speculative_decoding": broken') is None


def test_temperature_band() -> None:
    assert [temperature_band(t) for t in (None, 0, 0.29, 0.3, 0.69, 0.7, 1.5, True, "1")] == [
        "unset",
        "0-0.3",
        "0-0.3",
        "0.3-0.7",
        "0.3-0.7",
        "0.7+",
        "0.7+",
        "unset",
        "unset",
    ]


def test_with_include_usage() -> None:
    body = {"model": "m", "stream": True, "unknown_field": {"keep": [1, 2.5, None]}}
    out = with_include_usage(body)
    assert out is not None
    assert orjson.loads(out) == {**body, "stream_options": {"include_usage": True}}
    # the client asked for usage: its body is sent as it came
    assert with_include_usage({**body, "stream_options": {"include_usage": True}}) is None
    assert with_include_usage({**body, "stream_options": "bad"}) is None
    # continuous usage only works with include_usage: turned off, so no chunk gains a usage
    cont = with_include_usage({**body, "stream_options": {"continuous_usage_stats": True, "x": 1}})
    assert cont is not None
    assert orjson.loads(cont)["stream_options"] == {"continuous_usage_stats": False, "x": 1, "include_usage": True}


def relay(tap: StreamTap, raw: bytes, cut: int) -> bytes:
    """Feed raw upstream bytes through the splitter and the tap in reads of ``cut`` bytes."""
    splitter = SSESplitter()
    out = []
    for i in range(0, len(raw), cut):
        out += tap.feed(splitter.feed(raw[i : i + cut]))
    return b"".join(out)


@pytest.mark.parametrize("cut", [1, 7, 64, 10_000])
def test_strip_the_added_usage_chunk_split_across_reads(cut: int) -> None:
    upstream = (
        ev(token("Hel"))
        + ev(token("lo", new_field={"a": 1}))
        + ev(token("!", "stop"))
        + ev(usage_chunk({"speculative_decoding": SD}, system_fingerprint=FP))
        + DONE
    )
    tap = StreamTap(strip=True)
    seen = relay(tap, upstream, cut)
    # what the client would have got from vLLM without usage: the fingerprint on the finish chunk, no usage chunk
    assert (
        seen
        == ev(token("Hel")) + ev(token("lo", new_field={"a": 1})) + ev(token("!", "stop", system_fingerprint=FP)) + DONE
    )
    assert tap.sample == sample_from_metrics({"speculative_decoding": SD})


def test_client_that_asked_for_usage_keeps_it() -> None:
    upstream = (
        ev(token("a"))
        + ev(token("b", "stop"))
        + ev(usage_chunk({"speculative_decoding": SD}, system_fingerprint=FP))
        + DONE
    )
    tap = StreamTap(strip=False)
    assert relay(tap, upstream, 5) == upstream
    assert tap.sample is not None
    assert tap.sample.accepted == 12


def test_usage_without_metrics_and_n_gt_1() -> None:
    upstream = ev(token("a", "stop")) + ev(usage_chunk(None)) + DONE
    tap = StreamTap(strip=True)
    assert relay(tap, upstream, 3) == ev(token("a", "stop")) + DONE
    assert tap.sample is None


def test_a_usage_like_chunk_not_before_done_is_kept() -> None:
    odd = ev(usage_chunk({"speculative_decoding": SD}))
    upstream = ev(token("a")) + odd + ev(token("b", "stop")) + DONE
    tap = StreamTap(strip=True)
    assert relay(tap, upstream, 11) == upstream
    # and a stream that ends without [DONE] gets back what was held
    tap = StreamTap(strip=True)
    assert relay(tap, ev(token("a", "stop")) + odd, 4) == b""
    assert b"".join(tap.flush()) == ev(token("a", "stop")) + odd


def test_window_pools_counts_and_slides() -> None:
    w = AcceptanceWindow(size=3)
    assert math.isnan(w.ratio)
    assert math.isnan(w.mean_acceptance_length)
    w.add(SpecSample(10, 9, 3, None))
    w.add(SpecSample(100, 10, 25, None))
    assert w.ratio == pytest.approx(19 / 110)  # pooled, not the mean of 0.9 and 0.1
    assert w.mean_acceptance_length == pytest.approx(1 + 19 / 28)
    w.add(SpecSample(0, 0, 0, None))
    w.add(SpecSample(10, 5, 3, None))  # the first one leaves the window
    assert len(w) == 3
    assert w.ratio == pytest.approx(15 / 110)


def test_metrics_observe_acceptance() -> None:
    m = GatewayMetrics()
    m.observe_acceptance("precise", "0-0.3", SpecSample(20, 12, 5, 3.4))
    m.observe_acceptance("precise", "unset", SpecSample(0, 0, 0, 1.0))
    text = m.render().decode()
    assert 'specgate_class_acceptance_ratio{class="precise"} 0.6' in text
    assert 'specgate_class_acceptance_count{class="precise",temperature_band="0-0.3"} 1.0' in text
    assert 'specgate_class_acceptance_bucket{class="precise",le="0.55",temperature_band="0-0.3"} 0.0' in text
    assert 'specgate_class_acceptance_bucket{class="precise",le="0.6",temperature_band="0-0.3"} 1.0' in text
    assert "unset" not in text  # nothing drafted: no rate to observe
    assert 'specgate_class_draft_tokens_total{class="precise"} 20.0' in text
