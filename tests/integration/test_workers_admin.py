"""The admin API of a real ``specgate serve`` with one worker and with two (a private redis-server, fake pools).

With ``--workers 2`` every worker serves the admin app on the one admin socket the supervisor bound, so each call
below is made on a fresh connection (the kernel hands it to either worker) and repeated: every answer must be the
same whichever worker gave it. Without Redis (``--per-worker-state``) reads answer and changes are refused.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import yaml

from gateway.testing.fake_upstream import FakeUpstreamServer
from tests.conftest import ADMIN_AUTH, MODEL, RedisServer, Served, poll, rules_for, static_routes

pytestmark = pytest.mark.integration

CODE = {"model": MODEL, "temperature": 0.2, "messages": [{"role": "user", "content": "Write a python function."}]}
CHAT = {"model": MODEL, "temperature": 1.0, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
TRIES = 8  # fresh connections per check: both workers answer some of them (the kernel spreads accepts)


def fresh(method: str, url: str, **kw: Any) -> httpx.Response:
    """One request on its own connection."""
    kw.setdefault("headers", ADMIN_AUTH)
    with httpx.Client(timeout=10) as c:
        return c.request(method, url, **kw)


def every_answer(gw: Served, method: str, path: str, **kw: Any) -> list[httpx.Response]:
    out = [fresh(method, gw.admin + path, **kw) for _ in range(TRIES)]
    for r in out:
        assert r.status_code == 200, r.text
    return out


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    return poll(check, timeout_s)


def answering_pids(states: list[dict[str, Any]]) -> set[int]:
    return {s["worker"]["pid"] for s in states if s["worker"] is not None}


@pytest.mark.parametrize("workers", [1, 2])
def test_admin_api_answers_the_same_from_every_worker(
    workers: int, served: Callable[..., Served], fake: Callable[..., FakeUpstreamServer], redis_server: RedisServer
) -> None:
    spec, std = fake("spec"), fake("std")
    rules = static_routes(rules_for([spec.url], [std.url]))  # the audit holds the changes below alone
    gw = served(rules, workers=workers, redis_url=redis_server.url, args=["--health-interval", "0.2"])

    # -- reads: the token policy, state, config, explain, openapi
    assert fresh("GET", gw.admin + "/admin/state", headers={}).status_code == 401
    assert fresh("GET", gw.url + "/admin/state").status_code == 404  # not on the client port
    assert fresh("GET", gw.admin + "/health").status_code == 404  # and the client app not on the admin port
    states = [r.json() for r in every_answer(gw, "GET", "/admin/state")]
    assert {s["config"]["hash"] for s in states} == {states[0]["config"]["hash"]}
    assert all(set(s["pools"]) == {"spec", "std"} for s in states)
    assert all(s["admin"]["changes_allowed"] for s in states)
    if workers == 2:
        assert eventually(lambda: len(answering_pids([r.json() for r in every_answer(gw, "GET", "/admin/state")])) == 2)
        assert all(s["worker"]["workers"] == 2 and s["worker"]["same_config"] for s in states)
        # one cluster leader, seen alike by both workers (each is a replica)
        assert eventually(
            lambda: (
                len({fresh("GET", gw.admin + "/admin/state").json()["cluster"]["leader"] for _ in range(TRIES)}) == 1
            )
        )
    else:
        assert all(s["worker"] is None for s in states)
    for r in every_answer(gw, "POST", "/admin/explain", json=CODE):
        assert r.json()["traffic_class"]["name"] == "precise"
        assert [s["pool"] for s in r.json()["plan"]["steps"]] == ["spec", "std"]
    assert {r.json()["info"]["title"] for r in every_answer(gw, "GET", "/admin/openapi.json")} != set()

    # -- a change through one worker is what every worker shows at once (the overrides are read back from Redis)
    r = fresh("POST", gw.admin + "/admin/pools/spec/drain", json={"reason": "workers test", "ttl": "10m"})
    assert r.status_code == 200, r.text
    drain = r.json()["override"]
    for s in (r.json() for r in every_answer(gw, "GET", "/admin/state")):
        assert [o["id"] for o in s["pools"]["spec"]["overrides"]] == [drain["id"]]
        assert s["pools"]["spec"]["endpoints"][0]["routable"] is False
    for r in every_answer(gw, "GET", "/admin/overrides"):
        assert [o["id"] for o in r.json()["overrides"]] == [drain["id"]]
    for r in every_answer(gw, "POST", "/admin/explain", json=CODE):
        assert [s["pool"] for s in r.json()["plan"]["steps"]] == ["std"]

    # and the client traffic of both workers follows it
    def chats() -> int:
        return sum(1 for r in spec.state.requests if r["path"] == "/v1/chat/completions")

    before = chats()
    for _ in range(TRIES):
        assert fresh("POST", gw.url + "/v1/chat/completions", json=CODE, headers={}).status_code == 200
    assert chats() == before
    r = fresh("PUT", gw.admin + "/admin/classes/precise/route", json={"route": "standard", "reason": "force"})
    assert r.status_code == 200, r.text
    for s in (r.json() for r in every_answer(gw, "GET", "/admin/state")):
        assert {c["name"]: c["forced_route"] for c in s["classes"]}["precise"] == "standard"
    assert fresh("POST", gw.admin + "/admin/pools/spec/undrain", json={"reason": "done"}).status_code == 200
    assert (
        fresh("PUT", gw.admin + "/admin/classes/precise/route", json={"route": "auto", "reason": "done"}).status_code
        == 200
    )
    for s in (r.json() for r in every_answer(gw, "GET", "/admin/state")):
        assert s["overrides"] == []
    # the audit log is the store's: each change once, whichever worker made or reads it
    for r in every_answer(gw, "GET", "/admin/audit"):
        actions = [(a["action"], a["target"]) for a in r.json()["records"] if a["action"] != "config_reload"]
        assert actions == [
            ("drain", "pool/spec"),
            ("class_route", "class/precise"),
            ("undrain", "pool/spec"),
            ("class_route_auto", "class/precise"),
        ], actions

    # -- a reload through one worker reloads every worker before it answers
    gw.rules.write_text(yaml.safe_dump(rules, sort_keys=False) + "# revision 2\n")
    r = fresh("POST", gw.admin + "/admin/reload")
    assert r.status_code == 200, r.text
    new_hash = r.json()["hash"]
    assert new_hash != states[0]["config"]["hash"]
    if workers == 2:
        assert (r.json()["workers"]["signalled"], r.json()["workers"]["pending"]) == (1, [])
    for r in every_answer(gw, "GET", "/admin/config"):
        assert r.json()["hash"] == new_hash
        assert "# revision 2" in r.json()["yaml"]

    # -- SIGHUP to the supervisor reloads every worker in place (no restart: the same workers answer)
    pids = answering_pids([r.json() for r in every_answer(gw, "GET", "/admin/state")])

    def signalled_reloads() -> int:
        records = fresh("GET", gw.admin + "/admin/audit", params={"limit": 1000}).json()["records"]
        return sum(1 for a in records if a["action"] == "config_reload" and a["actor"] == "signal")

    before = signalled_reloads()
    gw.rules.write_text(yaml.safe_dump(rules, sort_keys=False) + "# revision 3\n")
    os.kill(gw.proc.pid, signal.SIGHUP)
    assert eventually(lambda: all("# revision 3" in r.json()["yaml"] for r in every_answer(gw, "GET", "/admin/config")))
    assert eventually(lambda: signalled_reloads() == before + workers)  # each worker got the signal (not a restart)
    assert answering_pids([r.json() for r in every_answer(gw, "GET", "/admin/state")]) <= pids


def test_per_worker_state_refuses_changes_and_still_reloads_every_worker(
    served: Callable[..., Served], fake: Callable[..., FakeUpstreamServer]
) -> None:
    spec, std = fake("spec"), fake("std")
    rules = static_routes(rules_for([spec.url], [std.url]))  # the audit holds the changes below alone
    gw = served(rules, workers=2, args=["--health-interval", "0.2"])
    for s in (r.json() for r in every_answer(gw, "GET", "/admin/state")):
        assert s["admin"]["changes_allowed"] is False
        assert "--per-worker-state" in s["admin"]["changes_refused"]
        assert s["worker"]["workers"] == 2
    for _ in range(TRIES):
        r = fresh("POST", gw.admin + "/admin/pools/spec/drain", json={"reason": "one worker only"})
        assert r.status_code == 409, r.text
        assert r.json()["error"]["code"] == "per_worker_state"
        assert "--redis-url" in r.json()["error"]["message"]
    assert all(s["overrides"] == [] for s in (r.json() for r in every_answer(gw, "GET", "/admin/state")))
    gw.rules.write_text(yaml.safe_dump(rules, sort_keys=False) + "# revision 5\n")
    r = fresh("POST", gw.admin + "/admin/reload")
    assert r.status_code == 200, r.text
    assert r.json()["workers"]["pending"] == []
    assert {r.json()["hash"] for r in every_answer(gw, "GET", "/admin/config")} == {r.json()["hash"]}
