"""Per-class acceptance through the gateway, in front of simulated vLLM pools on real sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, ServerThread, rules_for

pytestmark = pytest.mark.integration

K = 4
A = 0.8
SPEC = f'{{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": {K}}}'
PRECISE: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0.1,
    "messages": [{"role": "user", "content": "Write a python function that adds two numbers."}],
}
CASUAL: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}]}


def start(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "model": MODEL,
        "port": 0,
        "time_scale": 0.005,
        "output_lengths": OutputLengths(median=60, sigma=0),
        "seed": 5,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture(scope="module")
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    spec = start(speculative_config=SPEC, per_request_spec_decode_metrics="summary", fixed_acceptance=A)
    std = start()
    yield spec, std
    spec.stop()
    std.stop()


@pytest.fixture
def gw(sims: tuple[SimServer, SimServer], gateway: Callable[..., ServerThread]) -> str:
    spec, std = sims
    return gateway(rules_for([spec.url], [std.url])).url


def events(raw: bytes) -> list[Any]:
    out = []
    for block in raw.split(b"\n\n"):
        if block.startswith(b"data: ") and block != b"data: [DONE]":
            out.append(orjson.loads(block[6:]))
    assert raw.endswith(b"data: [DONE]\n\n")
    return out


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def expected_rate(a: float, k: int) -> float:
    """Δaccepted/Δdrafted under the truncated geometric: (a − a^(K+1)) / ((1 − a)·K)."""
    return (a - a ** (k + 1)) / ((1 - a) * k)


def test_per_class_acceptance_in_metrics(gw: str) -> None:
    with httpx.Client(timeout=10) as c:
        for i in range(12):
            body = {**PRECISE, "seed": i}
            if i % 2:
                body["stream"] = True
            r = c.post(f"{gw}/v1/chat/completions", json=body)
            assert r.status_code == 200
            assert r.headers["x-specgate-class"] == "precise"
            assert r.headers["x-specgate-pool"] == "spec"
        r = c.post(f"{gw}/v1/chat/completions", json=CASUAL)
        assert r.headers["x-specgate-pool"] == "std"
        text = c.get(f"{gw}/metrics").text
    ratio = samples(text, "specgate_class_acceptance_ratio")
    assert set(ratio) == {(("class", "precise"),)}  # the standard pool's class has no acceptance
    assert ratio[(("class", "precise"),)] == pytest.approx(expected_rate(A, K), abs=0.08)
    counts = samples(text, "specgate_class_acceptance_count")
    assert counts == {(("class", "precise"), ("temperature_band", "0-0.3")): 12.0}
    length = samples(text, "specgate_class_mean_acceptance_length")[(("class", "precise"),)]
    assert 1 + K * expected_rate(A, K) - 0.4 < length < 1 + K * expected_rate(A, K) + 0.4


def test_stream_without_include_usage_gets_no_usage_chunk(gw: str, sims: tuple[SimServer, SimServer]) -> None:
    spec, _ = sims
    body = {**PRECISE, "stream": True, "seed": 42, "unknown_field": 1}
    with httpx.Client(timeout=10) as c:
        via = c.post(f"{gw}/v1/chat/completions", json=body)
        direct = c.post(f"{spec.url}/v1/chat/completions", json=body)
    assert via.headers["x-specgate-pool"] == "spec"
    got, want = events(via.content), events(direct.content)
    assert all(ch["choices"] for ch in got)
    assert all("usage" not in ch for ch in got)
    # the chunks the pool sends a client without usage (the steps' sizes are random, the shapes are not)
    assert {tuple(sorted(ch)) for ch in got[:-1]} == {tuple(sorted(ch)) for ch in want[:-1]}
    assert sorted(got[-1]) == sorted(want[-1])
    assert got[-1]["choices"][0]["finish_reason"] == want[-1]["choices"][0]["finish_reason"] == "stop"
    assert got[-1]["system_fingerprint"] == want[-1]["system_fingerprint"]
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in got)
    assert text == "".join(ch["choices"][0]["delta"].get("content", "") for ch in want)


def test_stream_with_include_usage_keeps_it(gw: str) -> None:
    body = {**PRECISE, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=10) as c:
        got = events(c.post(f"{gw}/v1/chat/completions", json=body).content)
        casual = events(c.post(f"{gw}/v1/chat/completions", json={**CASUAL, **body, "temperature": 1.0}).content)
    assert got[-1]["choices"] == []
    assert got[-1]["usage"]["completion_tokens"] == 60
    assert got[-1]["metrics"]["speculative_decoding"]["num_spec_tokens"] == K
    assert all(ch["choices"] for ch in got[:-1])
    assert casual[-1]["choices"] == []
    assert "usage" in casual[-1]


def test_n_gt_1_has_no_metrics(gw: str) -> None:
    with httpx.Client(timeout=10) as c:
        r = c.post(f"{gw}/v1/chat/completions", json={**PRECISE, "n": 2, "temperature": 0.4})
        assert r.status_code == 200
        assert r.json().get("metrics") is None
        text = c.get(f"{gw}/metrics").text
    assert not samples(text, "specgate_class_acceptance_count")
