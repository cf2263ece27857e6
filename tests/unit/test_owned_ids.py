"""The body rewrites that keep the ids a pool stores things under the gateway's."""

from __future__ import annotations

import orjson

from gateway.proxy.owned_ids import mint_response_id, with_response_id, without_request_id


def test_minted_ids_are_vllm_shaped_and_fresh() -> None:
    ids = {mint_response_id() for _ in range(1000)}
    assert len(ids) == 1000
    for rid in ids:
        assert rid.startswith("resp_")
        assert len(rid) == 37
        int(rid[5:], 16)


def test_responses_body_gets_the_gateways_id_whatever_the_client_sent() -> None:
    body = {"model": "m", "input": "x", "request_id": "order-42", "temperature": 0.25}
    raw, owned = with_response_id(body, "resp_" + "a" * 32)
    assert orjson.loads(raw) == owned == {**body, "request_id": "resp_" + "a" * 32}
    assert body["request_id"] == "order-42"  # the client's body (the Idempotency-Key fingerprint's) is untouched
    raw, owned = with_response_id({"model": "m", "input": "x"}, "resp_1")
    assert orjson.loads(raw)["request_id"] == "resp_1"


def test_other_bodies_lose_the_client_request_id_and_stay_as_sent_without_one() -> None:
    raw = b'{"model": "m",  "messages": [], "request_id": "mine", "n": 1}'
    body = orjson.loads(raw)
    out, owned = without_request_id(raw, body)
    assert orjson.loads(out) == owned == {"model": "m", "messages": [], "n": 1}
    untouched = b'{"model": "m",  "messages": []}'
    parsed = orjson.loads(untouched)
    out, owned = without_request_id(untouched, parsed)
    assert out is untouched
    assert owned is parsed
