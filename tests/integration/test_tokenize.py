"""vLLM's ``POST /tokenize`` / ``POST /detokenize`` through the gateway: unclassified, to a pool serving the model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from tests.conftest import MODEL, SPEC_ONLY_MODEL, ServerThread, closed_port_url, rules_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    server = SimServer(SimOptions(model=MODEL, served_model_names=(MODEL, SPEC_ONLY_MODEL), port=0)).start()
    yield server
    server.stop()


def test_tokenize_and_detokenize_reach_a_pool_serving_the_model(
    sim: SimServer, gateway: Callable[..., ServerThread]
) -> None:
    gw = gateway(rules_for([sim.url], [closed_port_url()]))
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        r = c.post("/tokenize", json={"model": SPEC_ONLY_MODEL, "prompt": "Hello there, world"})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        assert body["count"] == len(body["tokens"]) == 5
        assert (r.headers["x-specgate-pool"], r.headers["x-specgate-route"]) == ("spec", "unclassified")
        assert "x-specgate-class" not in r.headers
        chat = c.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200
        assert chat.json()["count"] > 0
        d = c.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert d.status_code == 200
        assert isinstance(d.json()["prompt"], str)
        missing = c.post("/tokenize", json={"prompt": "x"})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "model")
        unknown = c.post("/detokenize", json={"model": "nope", "tokens": [1]})
        assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
        bad = c.post("/detokenize", json={"model": MODEL, "tokens": "x"})
        assert bad.status_code == 400  # vLLM's own validation, relayed


def test_a_pool_that_fails_is_replaced_by_the_next_one_serving_the_model(
    sim: SimServer, gateway: Callable[..., ServerThread]
) -> None:
    gw = gateway(rules_for([closed_port_url()], [sim.url]))  # spec refuses connections; std serves MODEL
    r = httpx.post(gw.url + "/tokenize", json={"model": MODEL, "prompt": "abcd"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["x-specgate-pool"] == "std"  # spec is out after its failed health check, or failed its attempt
    only_spec = httpx.post(gw.url + "/tokenize", json={"model": SPEC_ONLY_MODEL, "prompt": "abcd"}, timeout=10)
    assert only_spec.status_code == 503  # the one pool serving it is down: never another model's pool
