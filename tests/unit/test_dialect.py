"""Stream dialects: how chat and Responses API streams end, fail, and are ended by the gateway."""

from __future__ import annotations

import orjson
import pytest

from gateway.proxy.dialect import CHAT, ResponsesDialect, event_data, event_type, response_id_of, typed_event
from gateway.proxy.wire import SSE_DONE, is_done_event, is_error_event

CREATED = {"id": "resp_1", "object": "response", "status": "in_progress", "model": "m", "output": []}


def ev(kind: str, seq: int, **fields: object) -> bytes:
    return typed_event({"type": kind, "sequence_number": seq, **fields})


def sdk_view(raw: bytes) -> list[tuple[str | None, dict[str, object]]]:
    """(event, data) pairs as the OpenAI SDK's SSE decoder sees them."""
    out: list[tuple[str | None, dict[str, object]]] = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        kind = None
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                kind = line[6:].strip().decode()
        out.append((kind, event_data(block + b"\n\n")))
    return out


@pytest.mark.parametrize(
    "event", [b"data: [DONE]\n\n", b'data: {"error": {"message": "x"}}\n\n', b'data: {"choices": []}\n\n']
)
def test_chat_dialect_is_the_old_functions(event: bytes) -> None:
    assert CHAT.is_done(event) == is_done_event(event)
    assert CHAT.is_error(event) == is_error_event(event)
    assert CHAT.asks_usage
    assert CHAT.failure("cut").endswith(SSE_DONE)


def test_event_type_from_the_event_line_or_the_data() -> None:
    assert event_type(ev("response.output_text.delta", 3, delta="x")) == b"response.output_text.delta"
    assert event_type(b'data: {"type": "response.completed", "response": {}}\n\n') == b"response.completed"
    assert event_type(b"event: error\r\ndata: {}\r\n\r\n") == b"error"
    assert event_type(b'data: {"error": {"message": "x"}}\n\n') == b"error"
    assert event_type(b"data: not json\n\n") == b""


@pytest.mark.parametrize(
    ("kind", "done", "error"),
    [
        ("response.completed", True, False),
        ("response.incomplete", True, False),
        ("response.failed", True, True),
        ("error", True, True),
        ("response.output_text.delta", False, False),
        ("response.created", False, False),
    ],
)
def test_responses_terminal_events(kind: str, done: bool, error: bool) -> None:
    d = ResponsesDialect()
    event = ev(kind, 0)
    assert (d.is_done(event), d.is_error(event)) == (done, error)
    assert not d.asks_usage


def test_responses_failure_is_the_apis_own_and_makes_the_sdk_raise() -> None:
    d = ResponsesDialect()
    for i, e in enumerate([ev("response.created", 0, response=CREATED), ev("response.in_progress", 1), ev("x", 2)]):
        assert not d.is_done(e), i
    raw = d.failure("upstream closed the stream")
    (k1, failed), (k2, error) = sdk_view(raw)
    assert (k1, failed["type"], failed["sequence_number"]) == ("response.failed", "response.failed", 3)
    response = failed["response"]
    assert isinstance(response, dict)
    assert response["id"] == "resp_1"
    assert response["status"] == "failed"
    assert response["error"] == {"code": "server_error", "message": "upstream closed the stream"}
    assert (k2, error["type"], error["sequence_number"], error["code"]) == ("error", "error", 4, "stream_interrupted")
    assert isinstance(error["error"], dict)
    assert error["error"]["message"] == "upstream closed the stream"
    assert SSE_DONE not in raw  # the Responses API has no [DONE]
    assert not failed.get("error")  # the SDK raises on the second event, after yielding response.failed


def test_failure_without_a_created_event_still_has_a_response() -> None:
    (_, failed), _ = sdk_view(ResponsesDialect().failure("x"))
    assert failed["response"] == {
        "id": None,
        "object": "response",
        "output": [],
        "status": "failed",
        "error": {"code": "server_error", "message": "x"},
    }


def test_response_id_of_a_body_or_a_created_event() -> None:
    assert response_id_of(orjson.dumps(CREATED)) == "resp_1"
    assert response_id_of(ev("response.created", 0, response=CREATED)) == "resp_1"
    assert response_id_of(b"not json") is None
    assert response_id_of(b'{"id": 5}') is None
    assert response_id_of(b"data: [DONE]\n\n") is None
