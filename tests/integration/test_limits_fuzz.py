"""A fuzz of the client surface against a real uvicorn gateway (hypothesis): random paths, methods, bodies (bytes,
JSON of any type and nesting, chat requests with fields of the wrong types), and headers. Whatever arrives, the
gateway never answers 500 (its own fault) and every error is the OpenAI envelope."""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for

Fake = Callable[..., FakeUpstreamServer]
Gateway = Callable[..., ServerThread]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()  # the standard library writes integers of any size (orjson: 64 bits)


def deep(levels: int) -> bytes:
    return b'{"model":"m","x":' + b"[" * levels + b"1" + b"]" * levels + b"}"


chat_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just(MODEL) | json_values,
        "messages": st.just([{"role": "user", "content": "hi"}]) | json_values,
        "prompt": st.text(max_size=20) | json_values,
        "temperature": st.floats(allow_nan=False) | json_values,
        "top_p": json_values,
        "max_tokens": st.integers(min_value=-5, max_value=8) | json_values,
        "stream": st.booleans() | json_values,
        "n": json_values,
        "tools": json_values,
        "response_format": json_values,
        "stream_options": json_values,
    },
)

bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(_dumps),
    chat_fields.map(_dumps),
    st.integers(min_value=1, max_value=400).map(deep),
)

token = st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=20)
_VISIBLE = string.ascii_letters + string.digits + string.punctuation + " \t"
header_value = st.text(alphabet=_VISIBLE, max_size=40).map(lambda v: v.strip(" \t"))  # as HTTP clients send them
headers = st.dictionaries(
    st.sampled_from(
        ["idempotency-key", "x-task-type", "x-request-id", "content-type", "authorization", "x-data-parallel-rank"]
    )
    | token,
    header_value,
    max_size=6,
)
paths = st.sampled_from(
    [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/models",
        "/health",
        "/ready",
        "/nope",
    ]
)


@pytest.fixture
def gw(fake: Fake, gateway: Gateway) -> ServerThread:
    spec, std = fake("spec"), fake("std")
    return gateway(rules_for([spec.url], [std.url]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=paths, method=st.sampled_from(["POST", "GET"]), body=bodies, hdrs=headers)
def test_no_gateway_fault_and_every_error_is_an_envelope(
    gw: ServerThread, path: str, method: str, body: bytes, hdrs: dict[str, str]
) -> None:
    with httpx.Client(timeout=30) as client:
        r = client.request(method, gw.url + path, content=body if method == "POST" else None, headers=hdrs)
    assert r.status_code != 500, r.text[:500]
    if r.status_code >= 400:
        ctype = r.headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            return
        err = r.json()["error"]
        assert isinstance(err["message"], str)
        assert err["message"]
        assert isinstance(err["type"], str)
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.content.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
