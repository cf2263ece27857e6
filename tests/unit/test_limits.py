"""Pure limits: JSON depth, the header deny-list and X-Forwarded-For, pool keys with control characters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config.loader import RulesError, load_rules_text, pool_key_issues
from gateway.config.schema import RoutingRules
from gateway.config.settings import Settings, SettingsError
from gateway.errors import InvalidJSON
from gateway.proxy.headers import forwarded_for, upstream_request_headers
from gateway.proxy.json_depth import check_json_depth


def nested(levels: int, kind: str = "list") -> Any:
    """A body whose arrays / objects nest ``levels`` deep, the top object included."""
    value: Any = 1
    for _ in range(levels - 1):
        value = [value] if kind == "list" else {"a": value}
    return {"model": "m", "x": value}


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_json_depth_at_the_limit_passes_and_one_more_is_invalid_json(kind: str) -> None:
    ok = nested(128, kind)
    check_json_depth(orjson.dumps(ok), 128)
    deep = nested(129, kind)
    with pytest.raises(InvalidJSON, match="deeper than 128"):
        check_json_depth(orjson.dumps(deep), 128)


def test_brackets_inside_strings_do_not_make_a_flat_body_too_deep() -> None:
    body = {"messages": [{"role": "user", "content": "[" * 10_000 + "{" * 10_000}]}
    check_json_depth(orjson.dumps(body), 8)


def test_the_deepest_accepted_body_can_be_reserialised() -> None:
    from gateway.config.settings import MAX_JSON_DEPTH

    body = nested(MAX_JSON_DEPTH)
    check_json_depth(orjson.dumps(body), MAX_JSON_DEPTH)
    orjson.dumps({"wrapped": body}, option=orjson.OPT_SORT_KEYS)  # what the fingerprint and the usage option do


def test_only_the_allow_listed_client_headers_reach_a_pool() -> None:
    client = [
        ("X-data-parallel-rank", "3"),
        ("X-Specgate-Pool", "forged"),
        ("Forwarded", "for=1.2.3.4"),
        ("X-Real-IP", "1.2.3.4"),
        ("Cookie", "session=secret"),
        ("X-Api-Key", "sk-client"),
        ("X-Forwarded-Host", "evil.example"),
        ("X-Vllm-Foo", "bar"),
        ("OpenAI-Organization", "org-1"),
        ("X-Forwarded-For", "6.6.6.6"),
        ("Content-Type", "text/plain"),
        ("X-Sim-Task", "code"),
        ("X-Fake-Behavior", "{}"),
        ("Accept", "text/event-stream"),
        ("traceparent", "00-abc-def-01"),
        ("tracestate", "k=v"),
    ]
    out = upstream_request_headers(client, request_id="r", api_key="pool-key", forwarded_for="10.0.0.9")
    assert out == {
        "x-sim-task": "code",
        "x-fake-behavior": "{}",
        "accept": "text/event-stream",
        "traceparent": "00-abc-def-01",
        "tracestate": "k=v",
        "x-forwarded-for": "10.0.0.9",
        "x-request-id": "r",
        "content-type": "application/json",
        "accept-encoding": "identity",
        "authorization": "Bearer pool-key",
    }


@pytest.mark.parametrize(
    ("peer", "trusted", "expected"),
    [
        ("10.0.0.9", "", "10.0.0.9"),  # no trusted proxies: the client's values are dropped
        ("10.0.0.9", "127.0.0.1/32", "10.0.0.9"),  # a peer that is not trusted
        ("127.0.0.1", "127.0.0.1/32", "1.1.1.1, 2.2.2.2, 3.3.3.3, 127.0.0.1"),
        ("10.1.2.3", "192.168.0.1, 10.0.0.0/8", "1.1.1.1, 2.2.2.2, 3.3.3.3, 10.1.2.3"),
        ("::ffff:10.1.2.3", "10.0.0.0/8", "1.1.1.1, 2.2.2.2, 3.3.3.3, ::ffff:10.1.2.3"),
        ("/tmp/gw.sock", "10.0.0.0/8", "/tmp/gw.sock"),
    ],
)
def test_x_forwarded_for_is_kept_only_from_a_trusted_proxy(peer: str, trusted: str, expected: str) -> None:
    networks = Settings(rules=Path("r.yaml"), trusted_proxies=trusted).trusted_proxy_networks()
    client = [("X-Forwarded-For", "1.1.1.1"), ("x-forwarded-for", "2.2.2.2, 3.3.3.3")]
    assert forwarded_for(peer, client, networks) == expected
    assert forwarded_for(peer, [], networks) == peer
    assert forwarded_for(None, client, networks) is None


def test_a_malformed_trusted_proxy_is_refused_naming_the_setting() -> None:
    with pytest.raises(SettingsError, match=r"trusted_proxies: 'ten\.0\.0\.0/8'"):
        Settings(rules=Path("r.yaml"), trusted_proxies="127.0.0.1, ten.0.0.0/8")


RULES = """\
version: 1
pools:
  - name: spec
    kind: speculative
    speculative: {method: eagle3, num_speculative_tokens: 4}
    models: [m]
    api_key_env: SPEC_KEY
    endpoints: [{url: "http://a:8000"}]
classes:
  - name: default
    route: {preferred: spec}
"""


@pytest.mark.parametrize("bad", ["abc\r\nx-injected: 1", "abc\ndef", "a\x01b", "key\x7f"])
def test_a_pool_key_with_a_control_character_is_refused_at_load_with_its_yaml_path(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPEC_KEY", bad)
    with pytest.raises(RulesError) as info:
        load_rules_text(RULES)
    text = str(info.value)
    assert "pools[0].api_key_env" in text
    assert "control character" in text
    assert bad not in text  # the secret itself is never printed


def test_a_pool_key_with_a_trailing_newline_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEC_KEY", "secret-key\n")
    load_rules_text(RULES)
    rules = RoutingRules.model_validate(__import__("yaml").safe_load(RULES))
    assert pool_key_issues(rules, {"SPEC_KEY": " ok \n"}) == []
    assert pool_key_issues(rules, {}) == []


def test_h1client_decoder_never_outputs_past_the_cap() -> None:
    """The decoded-size cap on its own (the integration tests may hit the body or event cap first)."""
    import asyncio
    import gzip

    from gateway.fleet.h1response import H1Response, ResponseTooLarge

    class Pool:
        max_body_bytes = 1 << 20

    class Conn:
        def __init__(self) -> None:
            self.pool = Pool()
            self.loop = asyncio.new_event_loop()
            self.abandoned = False

        def abandon(self) -> None:
            self.abandoned = True

        def pause(self) -> None: ...

    conn = Conn()
    try:
        r = H1Response(conn)  # type: ignore[arg-type]
        r.headers["content-encoding"] = "gzip"
        import zlib

        r._decoder = zlib.decompressobj(16 + zlib.MAX_WBITS)
        r._feed(gzip.compress(b"a" * (50 << 20)))
        assert isinstance(r._exc, ResponseTooLarge)
        assert r._exc.limit == "decoded_bytes"
        assert r._size == 0
        assert conn.abandoned
    finally:
        conn.loop.close()


async def test_memory_store_keeps_its_stored_bytes_within_the_budget_oldest_completed_first() -> None:
    from gateway.store.base import Claimed, Completed
    from gateway.store.memory import MemoryStore

    store = MemoryStore(max_bytes=1000)
    tokens = {}
    for key in ("a", "b", "c", "running"):
        got = await store.claim(key, "fp", lease_ms=60_000)
        assert isinstance(got, Claimed)
        tokens[key] = got.token
    for key in ("a", "b", "c"):
        assert await store.complete(key, tokens[key], b"x" * 400, ttl_ms=60_000)
        assert store.stored_bytes <= 1000
    assert await store.get("a") is None  # the oldest completion made room for c
    assert isinstance(await store.get("b"), Completed)
    assert isinstance(await store.get("c"), Completed)
    assert store.stored_bytes == 800
    assert await store.get("running") is not None  # a running claim is never dropped for bytes
    with pytest.raises(Exception, match="exceeds the store's 1000 bytes"):
        await store.complete("running", tokens["running"], b"y" * 1001, ttl_ms=60_000)


def test_the_recorder_stops_keeping_bytes_past_its_limit_and_stores_the_410_marker() -> None:
    from gateway.proxy.stored_response import NOT_STORED_CODE, Recorder

    rec = Recorder(limit=100)
    rec.record({"type": "http.response.start", "status": 200, "headers": [(b"x-request-id", b"r1")]})
    for _ in range(10):
        rec.record({"type": "http.response.body", "body": b"z" * 50, "more_body": True})
        assert sum(len(c) for c in rec.chunks) <= 100
    rec.record({"type": "http.response.body", "body": b"", "more_body": False})
    stored = rec.response()
    assert stored is not None
    assert stored.status == 410
    assert orjson.loads(stored.body)["error"]["code"] == NOT_STORED_CODE
    assert (b"x-request-id", b"r1") in stored.headers


def test_detached_budget_counts_per_scope_and_in_total() -> None:
    from gateway.runtime.detached import DetachedBudget

    b = DetachedBudget(total=3, per_scope=2)
    assert b.acquire(b"a")
    assert b.acquire(b"a")
    assert not b.acquire(b"a")
    assert b.acquire(b"b")
    assert not b.acquire(b"c")  # the total
    b.release(b"a")
    assert b.acquire(b"c")
    assert b.running == 3
    assert b.running_for(b"a") == 1
    with pytest.raises(RuntimeError):
        b.release(b"zzz")
