"""A large body read in a parsing process (``gateway.proxy.body_view``) decides exactly as the event loop's path.

Each body below is read both ways: parsed here and read by the classifier, the fingerprint, the prompt key and the
body rewrites; and summarized (as the parsing process does) and read through its view. Features, errors, hashes
and the bytes forwarded must agree. One body goes through a real process pool, so what crosses it is picklable.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config.loader import load_rules_text
from gateway.config.settings import Settings
from gateway.errors import GatewayError, InvalidJSON, Overloaded
from gateway.fleet.prefix_index import chain_hashes
from gateway.proxy.body_read import LARGE_BODY_BYTES, MANY_BRACKETS, read_json
from gateway.proxy.body_view import HEAD_MEMBER_BYTES, BodyView, Refusal, ViewRequest, summarize
from gateway.proxy.idempotency import fingerprint
from gateway.proxy.json_depth import check_json_containers
from gateway.proxy.owned_ids import with_response_id, without_request_id
from gateway.proxy.stream_tap import with_include_usage
from gateway.routing.classify import ApiKind, Classifier
from gateway.routing.prompt_key import prompt_chunks
from gateway.runtime.parse_pool import ParsePool
from tests.unit.test_classify import RULES_YAML

CLASSIFIER = Classifier(load_rules_text(RULES_YAML))
LIMITS = {"max_depth": 128, "max_containers": 1_000_000, "scan_chars": CLASSIFIER.scan_chars}


def many(n: int, **msg: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"hello {i}", **msg} for i in range(n)]


TOOLS = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(400)]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": [f"v{i}" for i in range(3000)]}}}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40_000}}

BODIES: list[tuple[ApiKind, dict[str, Any]]] = [
    ("chat", {"model": "m", "messages": many(3000), "temperature": 0.2, "max_tokens": 9}),
    ("chat", {"model": "m", "messages": [{"role": "system", "content": "x" * 50_000 + " python"}, *many(2000)]}),
    ("chat", {"model": "m", "stream": True, "messages": many(2000), "tools": TOOLS, "request_id": "client-id"}),
    ("chat", {"model": "m", "messages": many(2000), "response_format": SCHEMA, "top_p": 0.5, "n": 2}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "hi"}]}] * 3}),
    ("chat", {"model": "m", "stream": True, "stream_options": {"include_usage": False}, "messages": many(2000)}),
    ("chat", {"model": "m", "messages": many(2000), "extra": [[{"a": [1, 2, {"b": None}]}] * 900]}),
    # the member the classifier reads comes after more members than a stand-in keeps
    (
        "chat",
        {
            "model": "m",
            "messages": many(9),
            "response_format": {**{f"k{i}": "v" * 300 for i in range(99)}, "type": "json_object"},
        },
    ),
    ("completions", {"model": "m", "prompt": ["def f(x):"] * 3000, "max_tokens": 3}),
    ("completions", {"model": "m", "prompt": list(range(20_000))}),
    ("responses", {"model": "m", "instructions": "be brief", "input": many(2000), "store": False}),
    ("responses", {"model": "m", "input": "y" * 40_000, "previous_response_id": "resp_abc", "tools": TOOLS}),
    ("responses", {"model": "m", "input": [{"type": "function_call_output", "output": "z" * 30_000}] * 3}),
]
# Bodies with a client error: the same error (status, message, param) both ways, in the same order of checks.
BAD: list[tuple[ApiKind, dict[str, Any]]] = [
    ("chat", {"model": "m", "messages": [*many(2000), "not an object"]}),
    ("chat", {"model": "m", "messages": []}),
    ("chat", {"model": 5, "messages": [*many(2000), 7]}),  # the model's error comes first, as in the loop's path
    ("chat", {"model": "m", "temperature": 9, "messages": many(2000)}),
    ("completions", {"model": "m", "prompt": [{"x": 1}] * 2000}),
    ("responses", {"model": "m", "input": [*many(2000), 3]}),
    ("responses", {"model": "m", "instructions": ["no"], "input": many(2000)}),
    ("responses", {"model": "m", "input": many(2000), "previous_response_id": "bad id!"}),
]


def view_of(endpoint: ApiKind, raw: bytes, *, fp: tuple[str, str] | None = None) -> BodyView:
    got = summarize(raw, ViewRequest(endpoint, fingerprint=fp, prompt=True, **LIMITS))
    assert isinstance(got, BodyView), got
    return got


@pytest.mark.parametrize(("endpoint", "body"), BODIES)
def test_a_view_decides_and_forwards_as_the_parsed_body(endpoint: ApiKind, body: dict[str, Any]) -> None:
    raw = orjson.dumps(body)
    view = view_of(endpoint, raw, fp=("POST", "/v1/x"))
    head = view.head
    text = orjson.dumps(head)  # the bulk stayed behind: few objects come back (strings are one object each)
    assert text.count(b"[") + text.count(b"{") < 3 * HEAD_MEMBER_BYTES / 2
    # the classification features
    for header in (None, "custom"):
        want = CLASSIFIER.classify(endpoint, body, header)
        got = CLASSIFIER.classify(endpoint, head, header, texts=view.read_texts)
        assert got == want
    # the Idempotency-Key fingerprint and the prefix-affinity key
    assert view.fingerprint == fingerprint("POST", "/v1/x", body)
    assert chain_hashes(view.prompt) == prompt_chunks(endpoint, body)
    # the bytes forwarded: unchanged, or rewritten as the parsed body would be
    assert orjson.loads(view.serialize(head)) == body
    raw_out, owned = without_request_id(raw, head, view.serialize)
    assert orjson.loads(raw_out) == {k: v for k, v in body.items() if k != "request_id"}
    assert orjson.loads(with_response_id(head, "resp_1", view.serialize)[0]) == {**body, "request_id": "resp_1"}
    usage = with_include_usage(owned, view.serialize)
    plain = with_include_usage({k: v for k, v in body.items() if k != "request_id"})
    assert (usage is None) == (plain is None)
    if usage is not None and plain is not None:
        assert orjson.loads(usage) == orjson.loads(plain)
    assert orjson.loads(view.serialize({**head, "model": "other"})) == {**body, "model": "other"}


def error_of(call: Any) -> tuple[int, str, str | None] | None:
    try:
        call()
    except GatewayError as exc:
        return exc.status, exc.message, exc.param
    return None


@pytest.mark.parametrize(("endpoint", "body"), BAD)
def test_a_bad_body_gets_the_same_error_both_ways(endpoint: ApiKind, body: dict[str, Any]) -> None:
    view = view_of(endpoint, orjson.dumps(body))
    want = error_of(lambda: CLASSIFIER.features(endpoint, body))
    assert want is not None
    assert error_of(lambda: CLASSIFIER.features(endpoint, view.head, texts=view.read_texts)) == want


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[1, 2]", "must be a JSON object"),
        (b'{"model": "m", "messages": [', "not valid JSON"),
        (orjson.dumps({"a": [[[[[[0]]]]]] * 3}).replace(b"[0]", b"[" * 130 + b"0" + b"]" * 130), "deeper than 128"),
        (orjson.dumps({"model": "m", "x": [[]] * 1_000_000}), "more than 1000000 arrays and objects"),
    ],
)
def test_the_text_checks_refuse_in_the_parsing_process(raw: bytes, message: str) -> None:
    got = summarize(raw, ViewRequest("chat", **LIMITS))
    assert isinstance(got, Refusal)
    err = got.error()
    assert isinstance(err, InvalidJSON)
    assert message in err.message


def test_the_container_cap_counts_brackets_outside_strings_only() -> None:
    in_strings = orjson.dumps({"s": ["[[{{"] * 10})  # 1 object, 1 array; 40 brackets inside strings
    check_json_containers(in_strings, 2)
    with pytest.raises(InvalidJSON, match="more than 1 arrays"):
        check_json_containers(in_strings, 1)
    escaped = orjson.dumps({"s": '\\"[[[' * 50})
    check_json_containers(escaped, 1)
    with pytest.raises(InvalidJSON):
        check_json_containers(orjson.dumps([[], {}, [[]]]), 4)
    check_json_containers(orjson.dumps([[], {}, [[]]]), 5)


def test_a_view_crosses_a_real_process_pool_and_the_pool_sheds_past_its_queue() -> None:
    endpoint, body = BODIES[2]
    raw = orjson.dumps(body)
    req = ViewRequest(endpoint, fingerprint=("POST", "/p"), prompt=True, **LIMITS)

    settings = Settings(rules=Path("unused.yaml"))

    async def read(body: bytes, pool: ParsePool) -> BodyView | None:
        return (await read_json(body, settings, pool, "chat", scan_chars=100, fingerprint=None, pools={}))[1]

    async def run() -> tuple[Any, list[Any]]:
        pool = ParsePool(1)
        pool.start()
        try:
            one = await pool.run(summarize, raw, req)
            burst = await asyncio.gather(
                *(pool.run(summarize, raw, req) for _ in range(pool.limit + 2)), return_exceptions=True
            )
            # which bodies go to the process: over 1 MiB, or over 50,000 brackets however short
            assert await read(orjson.dumps({"model": "m", "messages": many(3)}), pool) is None
            large = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 1000}] * 1100})
            assert len(large) > LARGE_BODY_BYTES
            assert await read(large, pool) is not None
            brackets = orjson.dumps({"model": "m", "messages": many(3), "x": [[]] * (MANY_BRACKETS + 10)})
            assert len(brackets) < LARGE_BODY_BYTES / 4
            assert await read(brackets, pool) is not None
            return one, burst
        finally:
            await pool.close()

    got, burst = asyncio.run(run())
    assert got == summarize(raw, req)
    assert CLASSIFIER.classify(endpoint, got.head, texts=got.read_texts) == CLASSIFIER.classify(endpoint, body)
    assert chain_hashes(got.prompt) == prompt_chunks(endpoint, body)  # the hashes are the gateway's own
    shed = [r for r in burst if isinstance(r, Overloaded)]
    assert len(shed) == 2
    assert all(r.status == 503 for r in shed)
    assert all(r == got for r in burst if not isinstance(r, BaseException))
