"""The EPP's bounded reader of usage and spec-decode acceptance in a response body (whole or streamed)."""

from __future__ import annotations

import orjson

from gateway.epp.usage import UsageReader

METRICS = {"speculative_decoding": {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_draft_tokens": 30}}
USAGE = {"prompt_tokens": 9, "completion_tokens": 31, "prompt_tokens_details": {"cached_tokens": 7}}


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


STREAM = (
    event({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
    + event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    + event({"choices": [], "usage": USAGE, "metrics": METRICS})
    + b"data: [DONE]\n\n"
)


def test_a_stream_split_anywhere_gives_its_usage_chunk() -> None:
    for cut in range(1, len(STREAM), 7):
        reader = UsageReader(stream=True, limit=4096)
        reader.feed(STREAM[:cut], end=False)
        reader.feed(STREAM[cut:], end=True)
        assert reader.sample is not None, cut
        assert (reader.sample.drafted, reader.sample.accepted) == (40, 30)
        assert reader.cached_tokens == 7


def test_a_whole_body_is_read_at_its_end() -> None:
    body = orjson.dumps({"choices": [{"index": 0}], "usage": USAGE, "metrics": METRICS})
    reader = UsageReader(stream=False, limit=4096)
    reader.feed(body[:10], end=False)
    assert reader.sample is None
    reader.feed(body[10:], end=True)
    assert reader.sample is not None
    assert reader.sample.accepted == 30
    assert reader.cached_tokens == 7


def test_past_the_bound_nothing_more_is_read() -> None:
    body = orjson.dumps({"pad": "x" * 200, "usage": USAGE, "metrics": METRICS})
    reader = UsageReader(stream=False, limit=100)
    reader.feed(body, end=True)
    assert reader.gave_up
    assert reader.sample is None
    # a stream whose unfinished last event grows past the bound: given up, later events are ignored
    streamed = UsageReader(stream=True, limit=64)
    streamed.feed(b"data: " + b"y" * 100, end=False)
    assert streamed.gave_up
    streamed.feed(STREAM, end=True)
    assert streamed.sample is None
