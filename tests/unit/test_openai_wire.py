"""SSE framing and the normalisation of upstream error bodies."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.proxy.wire import SSESplitter, is_done_event, is_error_event, normalise_error, sse_error


def test_splitter_keeps_events_whole_and_unmerged() -> None:
    s = SSESplitter()
    assert s.feed(b'data: {"a":1}\n\ndata: {"b"') == [b'data: {"a":1}\n\n']
    assert s.feed(b":2}\n") == []
    assert s.feed(b"\ndata: [DONE]\n\n") == [b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]
    assert s.pending == b""


def test_splitter_handles_crlf() -> None:
    s = SSESplitter()
    assert s.feed(b"data: 1\r\n\r\ndata: 2\n\n") == [b"data: 1\r\n\r\n", b"data: 2\n\n"]


@given(
    st.lists(st.binary(min_size=1, max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b), max_size=20),
    st.integers(min_value=1, max_value=17),
)
def test_splitter_any_chunking_gives_same_events(payloads: list[bytes], size: int) -> None:
    events = [b"data: " + p + b"\n\n" for p in payloads]
    stream = b"".join(events)
    s = SSESplitter()
    got: list[bytes] = []
    for i in range(0, len(stream), size):
        got += s.feed(stream[i : i + size])
    assert got == events


def test_done_and_error_events() -> None:
    assert is_done_event(b"data: [DONE]\n\n")
    assert not is_done_event(b'data: {"x": "[DONE]"}\n\n')
    assert is_error_event(b'data: {"error": {"message": "x"}}\n\n')
    assert is_error_event(b'data:{"error":{}}\n\n')
    assert not is_error_event(b'data: {"choices": [], "error_count": 0}\n\n')
    assert is_error_event(b'data: { "error" : {}}\n\n')  # spaces between the tokens
    assert not is_error_event(b'data: {"err or": 1}\n\n')  # a key that only looks like "error" without its spaces


def test_sse_error_ends_with_done() -> None:
    raw = sse_error("broke")
    first, second = raw.split(b"\n\n")[:2]
    assert orjson.loads(first[6:])["error"]["message"] == "broke"
    assert second == b"data: [DONE]"


@pytest.mark.parametrize(
    ("status", "body", "message", "type_", "code", "param"),
    [
        (
            400,
            b'{"error":{"message":"too long","type":"BadRequestError","param":"input_tokens","code":400}}',
            "too long",
            "invalid_request_error",
            "400",
            "input_tokens",
        ),
        (
            404,
            b'{"error":{"message":"no model","type":"NotFoundError","param":"model","code":404}}',
            "no model",
            "not_found_error",
            "404",
            "model",
        ),
        (
            503,
            b'{"error":{"message":"queue full","type":"Service Unavailable","param":null,"code":503}}',
            "queue full",
            "upstream_error",
            "503",
            None,
        ),
        (401, b'{"error":"Unauthorized"}', "Unauthorized", "authentication_error", "401", None),
        (500, b"Internal Server Error", "Internal Server Error", "upstream_error", "500", None),
        (502, b"", "upstream returned 502", "upstream_error", "502", None),
        (
            400,
            b'{"error":{"message":"m","type":"invalid_request_error","param":null,"code":"bad_x"}}',
            "m",
            "invalid_request_error",
            "bad_x",
            None,
        ),
    ],
)
def test_normalise_error(status: int, body: bytes, message: str, type_: str, code: str, param: str | None) -> None:
    err = orjson.loads(normalise_error(status, body))["error"]
    assert err == {"message": message, "type": type_, "param": param, "code": code}


@settings(max_examples=300, deadline=None)
@given(
    data=st.binary(max_size=80).map(lambda b: bytes(b"ab\n:"[x % 4] for x in b)),
    cuts=st.lists(st.integers(0, 80), max_size=6),
)
def test_the_lf_fast_path_cuts_exactly_like_the_regex_path(data: bytes, cuts: list[int]) -> None:
    points = sorted({c for c in cuts if c <= len(data)})
    chunks = [data[i:j] for i, j in zip([0, *points], [*points, len(data)], strict=True)]
    fast, general = SSESplitter(), SSESplitter()
    general.feed(b"\r")  # a CR switches a splitter to the regex path for good
    general._buf.clear()
    general._scanned = 0
    assert [e for c in chunks for e in fast.feed(c)] == [e for c in chunks for e in general.feed(c)]
    assert fast.pending == general.pending
