"""The simulator's prefix cache over HTTP (real uvicorn on free ports): a repeated 2,000-token prompt, hit counters,
``cached_tokens`` in usage, ``--no-enable-prefix-caching``, ``vllm:cache_config_info``, and KV events received by
a ZMQ SUB socket (BlockStored, BlockRemoved after eviction, replay)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.app import SimOptions
from gateway.sim.kv_events import decode_batch
from gateway.sim.launch import free_port
from gateway.sim.prefix_cache import chain_hashes, external_hash
from gateway.sim.server import SimServer
from gateway.sim.tokens import chat_prompt_ids
from gateway.sim.wire import OutputLengths

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.3-70B-Instruct"
SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
# ~2,000 prompt tokens (four characters a token), distinct blocks
LONG = " ".join(f"w{i:05d}" for i in range(1140))


def start(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "port": 0,
        "time_scale": 1.0,  # real time: a cold 2,000-token prefill takes ~0.3 s, far above the HTTP overhead
        "output_lengths": OutputLengths(median=4, sigma=0),
        "enable_prompt_tokens_details": True,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


def metric(c: httpx.Client, server: SimServer, name: str) -> float:
    text = c.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    raise AssertionError(f"{name} not served")


def chat(c: httpx.Client, server: SimServer, content: str, **params: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **params}
    r = c.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def ttft(c: httpx.Client, server: SimServer, content: str) -> tuple[float, dict[str, Any]]:
    """Wall seconds to the first token of a streamed chat request, and the final usage."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    assert first is not None
    return first, usage


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as c:
        yield c


def test_a_repeated_2000_token_prompt_hits_the_cache(client: httpx.Client) -> None:
    server = start()
    try:
        queries0 = metric(client, server, "vllm:prefix_cache_queries_total")
        first, usage1 = ttft(client, server, LONG)
        hits1 = metric(client, server, "vllm:prefix_cache_hits_total")
        second, usage2 = ttft(client, server, LONG)
        hits2 = metric(client, server, "vllm:prefix_cache_hits_total")
        queries2 = metric(client, server, "vllm:prefix_cache_queries_total")
        whole = chat(client, server, LONG)
    finally:
        server.stop()
    prompt = usage1["prompt_tokens"]
    assert 1900 <= prompt <= 2100
    assert usage1["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = usage2["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt - 1) // 16 * 16  # every full block but the one holding the last token
    assert (hits1, hits2 - hits1) == (0, cached)
    assert queries2 - queries0 == 2 * prompt
    assert whole["usage"]["prompt_tokens_details"] == {
        "cached_tokens": cached,
        "created_cache_tokens": None,
        "multimodal_tokens": None,
    }
    print(f"TTFT of a {prompt}-token prompt: first {first * 1e3:.1f} ms, second {second * 1e3:.1f} ms (wall)")
    assert second <= 0.3 * first, (first, second)


def test_no_prefix_caching_gives_no_hits(client: httpx.Client) -> None:
    server = start(enable_prefix_caching=False, time_scale=0.01)
    try:
        for _ in range(2):
            assert chat(client, server, LONG)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert metric(client, server, "vllm:prefix_cache_hits_total") == 0
        assert metric(client, server, "vllm:prefix_cache_queries_total") == 0
        info = {
            f.name: s.labels
            for f in text_string_to_metric_families(client.get(f"{server.url}/metrics").text)
            for s in f.samples
            if f.name == "vllm:cache_config_info"
        }["vllm:cache_config_info"]
    finally:
        server.stop()
    assert info["enable_prefix_caching"] == "False"
    assert info["block_size"] == "16"
    assert info["num_gpu_blocks"] == str(465_000 // 16)
    assert info["engine"] == "0"


def test_speculative_server_holds_fewer_blocks_and_responses_report_cached_tokens(client: httpx.Client) -> None:
    server = start(speculative_config=SPEC, block_size=32, time_scale=0.01)
    try:
        text = client.get(f"{server.url}/metrics").text
        body = {"model": MODEL, "input": LONG, "max_output_tokens": 4}
        usages = [client.post(f"{server.url}/v1/responses", json=body).json()["usage"] for _ in range(2)]
    finally:
        server.stop()
    assert f'num_gpu_blocks="{int(465_000 * 0.97) // 32}"' in text
    assert 'block_size="32"' in text
    assert 'user_specified_block_size="True"' in text
    details = [u["input_tokens_details"] for u in usages]
    assert details[0]["cached_tokens"] == 0
    assert details[1]["cached_tokens"] == (usages[1]["input_tokens"] - 1) // 32 * 32
    assert details[1]["cached_tokens_per_turn"] == [details[1]["cached_tokens"]]


def receive(sub: zmq.Socket[bytes], timeout_s: float = 10.0) -> tuple[bytes, int, Any]:
    assert sub.poll(int(timeout_s * 1000)), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)


def test_kv_events_over_zmq_stored_removed_and_replay(client: httpx.Client) -> None:
    pub_port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv-events",
    }
    # 300 blocks of 16 tokens: two 2,000-token prompts (126 blocks each with the answer) fit, a third evicts
    server = start(kv_events_config=json.dumps(config), kv_cache_tokens=300 * 16, time_scale=0.01)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    try:
        time.sleep(0.3)  # the subscription reaches the publisher (a PUB drops what no one subscribed to yet)
        chat(client, server, LONG)
        topic, seq0, batch = receive(sub)
        assert topic == b"kv-events"
        assert batch.data_parallel_rank == 0
        stored = [e for e in batch.events if type(e).__name__ == "BlockStored"]
        assert stored
        ids = chat_prompt_ids([{"role": "user", "content": LONG}])
        expected = [external_hash(h) for h in chain_hashes(ids, 16)]
        assert stored[0].block_hashes == expected  # the prompt's blocks when its prefill completed
        assert stored[0].parent_block_hash is None
        assert stored[0].token_ids == ids[: len(expected) * 16]
        assert (stored[0].block_size, stored[0].medium) == (16, "GPU")
        seen = [batch]
        removed: list[int] = []
        for i in range(2):
            chat(client, server, LONG.replace("w", "xyz"[i]))
        deadline = time.monotonic() + 10
        while not removed:
            assert time.monotonic() < deadline, "no BlockRemoved after eviction"
            _, _, batch = receive(sub)
            seen.append(batch)
            removed += [h for e in batch.events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
        assert set(removed) <= set(expected) | {
            h for b in seen for e in b.events if type(e).__name__ == "BlockStored" for h in e.block_hashes
        }
        assert set(removed) & set(expected)  # the oldest prompt's blocks went first
        # replay: ask for everything from the first batch on
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", seq0.to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "the replay socket did not answer"
            frames = dealer.recv_multipart()
            _, topic, seq, payload = frames
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert (topic, payload) == (b"", b"")
                break
            replayed.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        dealer.close(linger=0)
        assert replayed[0][0] == seq0
        assert [s for s, _ in replayed] == list(range(seq0, seq0 + len(replayed)))
        assert replayed[0][1].events == seen[0].events
    finally:
        sub.close(linger=0)
        ctx.term()
        server.stop()
