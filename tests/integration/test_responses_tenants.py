"""Two tenants (two API keys) sharing one simulated vLLM 0.33 endpoint with its response store on, through a real
uvicorn gateway: response ids are the gateway's, and each key sees, continues, cancels and deletes only its own.

The attack this guards against: vLLM stores a response under the body's ``request_id``, in one store for every
caller of the server. Were the id the client's, tenant A could post ``request_id: "order-42"``, tenant B later the
same id, and A would read B's text under ``order-42``; or B could post A's id and overwrite what A retrieves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import MODEL, ServerThread, rules_for

pytestmark = pytest.mark.integration

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"
MINTED = re.compile(r"resp_[0-9a-f]{32}")


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    options = SimOptions(
        model=MODEL,
        port=0,
        time_scale=0.002,
        output_lengths=OutputLengths(median=16, sigma=0),
        enable_responses_store=True,
    )
    server = SimServer(options).start()
    yield server
    server.stop()


def _one_endpoint(url: str) -> dict[str, Any]:
    """Every request to the one standard endpoint both tenants share."""
    rules = rules_for([], [url])
    rules["pools"] = [p for p in rules["pools"] if p["name"] == "std"]
    rules["classes"] = [{"name": "default", "route": {"preferred": "std"}}]
    return rules


@pytest.fixture
def gw(sim: SimServer, gateway: Callable[..., ServerThread]) -> ServerThread:
    return gateway(_one_endpoint(sim.url), api_keys=f"{KEY_A},{KEY_B}")


@pytest.fixture
def http(gw: ServerThread) -> Iterator[Callable[[str], httpx.Client]]:
    clients: list[httpx.Client] = []

    def make(key: str) -> httpx.Client:
        c = httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {key}"}, timeout=30)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def create(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/v1/responses", json={"model": MODEL, "input": "Tell me a story.", **body})
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def not_found(r: httpx.Response) -> dict[str, Any]:
    """The 404 every id the caller does not own gets: OpenAI's envelope, code ``response_not_found``."""
    assert r.status_code == 404, r.text
    assert r.headers["x-should-retry"] == "false"
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "response_not_found"
    return err


def same_as_unknown(r: httpx.Response, rid: str, unknown: httpx.Response, unknown_id: str) -> None:
    """Another tenant's id is answered exactly as an id nobody ever made: its existence is not revealed."""
    got, ref = not_found(r), not_found(unknown)
    # Each message ends with its own request's id; everything before it must be the same.
    assert got["message"].endswith(f"(request id {r.headers['x-request-id']})")
    assert ref["message"].endswith(f"(request id {unknown.headers['x-request-id']})")
    assert {**got, "message": got["message"].replace(rid, "ID").rsplit(" (request id ", 1)[0]} == {
        **ref,
        "message": ref["message"].replace(unknown_id, "ID").rsplit(" (request id ", 1)[0],
    }
    assert r.headers.get("retry-after") == unknown.headers.get("retry-after")


def test_a_client_request_id_never_becomes_the_stored_id(http: Callable[[str], httpx.Client], sim: SimServer) -> None:
    a = http(KEY_A)
    whole = create(a, request_id="order-42")
    assert MINTED.fullmatch(whole["id"]), whole["id"]
    body = {"model": MODEL, "input": "Hi", "stream": True, "request_id": "s-1"}
    with a.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == "event: response.created"
    streamed = orjson.loads(lines[1][6:])["response"]["id"]
    assert MINTED.fullmatch(streamed)
    assert streamed != whole["id"]
    with httpx.Client(base_url=sim.url, timeout=10) as direct:  # the pool never stored anything under the client's
        for client_id in ("order-42", "s-1"):
            assert direct.get(f"/v1/responses/{client_id}").status_code == 404
        assert direct.get(f"/v1/responses/{whole['id']}").status_code == 200
        assert direct.delete(f"/v1/responses/{whole['id']}").status_code == 405  # vLLM 0.33 has no DELETE route
    assert a.get(f"/v1/responses/{streamed}").json()["id"] == streamed  # a streamed response is recorded too


def test_same_request_id_from_two_tenants_reads_each_its_own(http: Callable[[str], httpx.Client]) -> None:
    a, b = http(KEY_A), http(KEY_B)
    mine = create(a, request_id="order-42", instructions="secret of A")
    theirs = create(b, request_id="order-42", instructions="secret of B")
    assert mine["id"] != theirs["id"]
    not_found(a.get("/v1/responses/order-42"))  # the client's id names nothing
    got_a, got_b = a.get(f"/v1/responses/{mine['id']}").json(), b.get(f"/v1/responses/{theirs['id']}").json()
    assert (got_a["instructions"], got_b["instructions"]) == ("secret of A", "secret of B")
    assert got_a["output"] == mine["output"]


def test_posting_another_tenants_id_overwrites_nothing(http: Callable[[str], httpx.Client]) -> None:
    a, b = http(KEY_A), http(KEY_B)
    mine = create(a, instructions="secret of A")
    attack = create(b, request_id=mine["id"], instructions="written by B")
    assert attack["id"] != mine["id"]
    got = a.get(f"/v1/responses/{mine['id']}").json()
    assert got["instructions"] == "secret of A"
    assert got["output"] == mine["output"]


def test_another_tenants_id_is_404_on_every_route_as_an_unknown_one(http: Callable[[str], httpx.Client]) -> None:
    a, b = http(KEY_A), http(KEY_B)
    rid = create(a, instructions="secret of A")["id"]
    unknown = "resp_" + "0" * 32
    pairs = [
        (b.get(f"/v1/responses/{rid}"), b.get(f"/v1/responses/{unknown}")),
        (b.post(f"/v1/responses/{rid}/cancel"), b.post(f"/v1/responses/{unknown}/cancel")),
        (b.delete(f"/v1/responses/{rid}"), b.delete(f"/v1/responses/{unknown}")),
    ]
    for got, ref in pairs:
        same_as_unknown(got, rid, ref, unknown)
    follow = {"model": MODEL, "input": "and then?"}
    got = b.post("/v1/responses", json={**follow, "previous_response_id": rid})
    ref = b.post("/v1/responses", json={**follow, "previous_response_id": unknown})
    same_as_unknown(got, rid, ref, unknown)
    assert not_found(got)["param"] == "previous_response_id"
    assert a.get(f"/v1/responses/{rid}").json()["instructions"] == "secret of A"  # B's DELETE dropped nothing


def test_owner_deletes_then_the_id_resolves_no_more(http: Callable[[str], httpx.Client], gw: ServerThread) -> None:
    a = http(KEY_A)
    first = create(a, instructions="to be deleted")
    follow = create(a, input="and then?", previous_response_id=first["id"])  # a conversation, before the delete
    assert follow["previous_response_id"] == first["id"]
    r = a.delete(f"/v1/responses/{first['id']}")
    assert r.status_code == 200, r.text
    assert r.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    assert r.headers["x-request-id"]
    not_found(a.get(f"/v1/responses/{first['id']}"))
    not_found(a.post(f"/v1/responses/{first['id']}/cancel"))
    not_found(a.delete(f"/v1/responses/{first['id']}"))
    again = a.post("/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": first["id"]})
    assert not_found(again)["param"] == "previous_response_id"
    assert a.get(f"/v1/responses/{follow['id']}").status_code == 200  # only the deleted id is gone
    sdk = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY_A, max_retries=0)
    sdk.responses.delete(follow["id"])  # the official SDK's delete works against it
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(follow["id"])


def test_without_client_keys_the_id_is_still_the_gateways(sim: SimServer, gateway: Callable[..., ServerThread]) -> None:
    gw = gateway(_one_endpoint(sim.url))
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        got = create(c, request_id="chosen-by-client")
        assert MINTED.fullmatch(got["id"])
        assert c.get(f"/v1/responses/{got['id']}").json()["id"] == got["id"]
        not_found(c.get("/v1/responses/chosen-by-client"))


def test_other_routes_never_forward_a_client_request_id(
    fake: Callable[..., FakeUpstreamServer], gateway: Callable[..., ServerThread]
) -> None:
    std = fake("std", embeddings=True)
    rules = _one_endpoint(std.url)
    rules["embeddings_pool"] = "std"
    gw = gateway(rules)
    messages = [{"role": "user", "content": "hi"}]
    sent = [
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "request_id": "mine"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": messages, "stream": True, "request_id": "mine"}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "request_id": "mine"}),
        ("/v1/embeddings", {"model": MODEL, "input": "hi", "request_id": "mine"}),
    ]
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for path, body in sent:
            r = c.post(path, json=body, headers={"x-request-id": "client-rid"})
            assert r.status_code == 200, (path, r.text)
    received = [r for r in std.state.requests if r["method"] == "POST"]
    assert [r["path"] for r in received] == [p for p, _ in sent]
    for r, (_, body) in zip(received, sent, strict=True):
        got = r["body"] if isinstance(r["body"], dict) else orjson.loads(r["body"])
        assert "request_id" not in got
        assert got == {k: v for k, v in body.items() if k != "request_id"}
        assert r["headers"]["x-request-id"] == "client-rid"  # the engine id comes from the gateway's header
