"""The gateway follows simulated vLLM servers' KV cache events over ZMQ (real uvicorn, real simulators publishing as
vLLM does): an endpoint's prefix index learns the server's live block count, and a cache reset on the server
(``POST /reset_prefix_cache``) empties that endpoint's index at once."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.fleet.pools import EndpointState
from gateway.sim.app import SimOptions
from gateway.sim.launch import free_port
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, ServerThread, rules_for

pytestmark = pytest.mark.integration

Gateway = Callable[..., ServerThread]


def prompt(i: int) -> str:
    return f"conversation {i}: " + " ".join(f"w{i}x{j:05d}" for j in range(500))  # ~5,000 characters


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def only_std(rules: dict[str, Any]) -> dict[str, Any]:
    rules["pools"] = [p for p in rules["pools"] if p["name"] == "std"]
    rules["classes"] = [{"name": "default", "route": {"preferred": "std"}}]
    return rules


def test_the_index_follows_the_servers_kv_events(gateway: Gateway) -> None:
    pubs = [free_port(), free_port()]
    sims = []
    for pub in pubs:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}"}
        opts = SimOptions(model=MODEL, port=0, time_scale=0.05, kv_events_config=json.dumps(config),
                          output_lengths=OutputLengths(median=4, sigma=0))  # fmt: skip
        sims.append(SimServer(opts).start())
    try:
        rules = only_std(rules_for([], [s.url for s in sims]))
        for ep_cfg, pub in zip(rules["pools"][0]["endpoints"], pubs, strict=True):
            ep_cfg["kv_events"] = f"tcp://127.0.0.1:{pub}"
        gw = gateway(rules)
        eps: list[EndpointState] = gw.app.state.runtime.live.pools["std"].endpoints  # type: ignore[attr-defined]
        assert [e.kv_events for e in eps] == [f"tcp://127.0.0.1:{p}" for p in pubs]

        def batches(endpoint: str, result: str) -> float:
            text = httpx.get(f"{gw.url}/metrics").text
            total = 0.0
            for line in text.splitlines():
                ours = line.startswith("specgate_kv_event_batches_total{") and f'endpoint="{endpoint}"' in line
                if ours and (result == "any" or f'result="{result}"' in line):
                    total += float(line.rsplit(" ", 1)[1])
            return total

        counter = itertools.count()
        with httpx.Client(base_url=gw.url, timeout=30) as client:

            def send() -> str:
                body = {"model": MODEL, "messages": [{"role": "user", "content": prompt(next(counter))}],
                        "max_tokens": 4}  # fmt: skip
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.headers["x-specgate-endpoint"]

            # Each follower's SUB socket connects in its first round; a PUB drops what nobody subscribed to yet, so
            # new prompts go out until both endpoints' events have reached the gateway.
            def both_heard() -> bool:
                send()
                return all(batches(e.id, "any") > 0 for e in eps)

            wait_for(both_heard, "KV event batches did not reach the gateway from both servers")
            ep0 = eps[0]

            def recorded_on_ep0() -> bool:
                if len(ep0.prefixes) > 0:
                    return True
                send()
                return False

            wait_for(recorded_on_ep0, "nothing recorded on std-0")
            # A reset on the first server empties its index at once, and from then on its live count is known.
            assert httpx.post(f"{sims[0].url}/reset_prefix_cache").status_code == 200
            wait_for(lambda: batches("std-0", "clear") >= 1, "the reset did not reach the gateway")
            assert len(ep0.prefixes) == 0
            assert ep0.prefixes.live_chunks == 0
            assert len(eps[1].prefixes) > 0  # the other server's index is untouched
            # New prompts until one lands on the reset server: its blocks are stored, its index holds the prompt's
            # chunks, bounded by the server's live count.
            wait_for(lambda: send() == "std-0", "no new prompt went to std-0")
            wait_for(lambda: (ep0.prefixes.live_chunks or 0) > 0, "no BlockStored after the reset")
            live = ep0.prefixes.live_chunks
            assert live is not None
            assert 0 < len(ep0.prefixes) <= live
    finally:
        for s in sims:
            s.stop()


def test_a_publisher_that_is_not_there_costs_nothing(gateway: Gateway, fake: Callable[..., Any]) -> None:
    ups = [fake("std0"), fake("std1")]
    rules = only_std(rules_for([], [u.url for u in ups]))
    rules["pools"][0]["endpoints"][0]["kv_events"] = f"tcp://127.0.0.1:{free_port()}"
    gw = gateway(rules)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for i in range(4):
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt(i)}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    eps: list[EndpointState] = gw.app.state.runtime.live.pools["std"].endpoints  # type: ignore[attr-defined]
    assert eps[0].prefixes.live_chunks is None  # nothing heard: no bound
    assert sum(len(e.prefixes) for e in eps) > 0


def test_kv_events_must_name_a_server_to_connect_to() -> None:
    from pydantic import ValidationError

    from gateway.config.pool import Endpoint

    assert Endpoint(url="http://a:8000", kv_events="tcp://a:5557").kv_events == "tcp://a:5557"
    for bad in ("tcp://*:5557", "http://a:5557", "tcp://a", "tcp://a:5557/x", "tcp://a:notaport"):
        with pytest.raises(ValidationError):
            Endpoint(url="http://a:8000", kv_events=bad)
