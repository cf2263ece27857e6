"""A tenant's priority end to end, through real sockets (uvicorn, a simulated vLLM scheduling by priority): at a full
pool the gateway admits a high-priority request before low-priority ones that were waiting in its waiting room, and
without an admission bound the priority it writes in the body reorders the simulator's own queue."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin.app import state_dict
from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import MODEL, ServerThread
from tests.integration.test_overload import one_pool_rules, wait_for

pytestmark = pytest.mark.integration

Gateway = Callable[..., ServerThread]
BATCH, ONLINE = "sk-batch-000001", "sk-online-00001"


@pytest.fixture
def sim() -> Iterator[SimServer]:
    # One running place; answers of 200 tokens at about 15 ms a step hold it about 3 s or more (the first request's;
    # the others ask for 20 tokens)
    opts = SimOptions(
        model=MODEL,
        port=0,
        max_num_seqs=1,
        seed=5,
        scheduling_policy="priority",
        time_scale=1.0,
        output_lengths=OutputLengths(200, 0),
    )
    server = SimServer(opts).start()
    yield server
    server.stop()


def tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    spec = {
        "tenants": [
            {"name": "batch", "keys": [BATCH], "priority": 10},
            {"name": "online", "keys": [ONLINE], "priority": 0},
        ],
        "waiting": {"wait_s": 60, "max_waiting_per_pool": 8},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


class Requests:
    """Requests sent from threads; each one's name in the order their answers ended."""

    def __init__(self, gw: ServerThread) -> None:
        self.gw = gw
        self.done: list[str] = []
        self.statuses: dict[str, int] = {}
        self.threads: list[threading.Thread] = []

    def send(self, name: str, key: str, max_tokens: int = 20) -> None:
        def run() -> None:
            body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}
            body["max_tokens"] = max_tokens
            r = httpx.post(
                self.gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=120
            )
            self.statuses[name] = r.status_code
            self.done.append(name)

        t = threading.Thread(target=run)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=150)


def sim_stats(sim: SimServer) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{sim.url}/sim/stats", timeout=10).json()
    return stats


def test_a_high_priority_request_is_admitted_before_earlier_low_priority_waiters(
    sim: SimServer, gateway: Gateway, tmp_path: Path
) -> None:
    # Bound: 1 endpoint x (max_num_seqs 1 + 1 waiting) = 2; the second slot is the better priority's fast lane.
    rules = one_pool_rules(
        sim.url, max_num_seqs=1, admission={"max_waiting_per_endpoint": 1}, scheduling_policy="priority"
    )
    gw = gateway(rules, tenants_file=tenants(tmp_path), health_interval_s=600)
    tenancy = gw.app.runtime.tenancy
    sent = Requests(gw)
    sent.send("b1", BATCH, max_tokens=200)
    assert wait_for(lambda: sim_stats(sim)["running"] == 1)
    for n, name in enumerate(("b2", "b3"), start=1):  # one after the other: their order in the room is known
        sent.send(name, BATCH)
        assert wait_for(lambda n=n: "std" in tenancy.rooms and len(tenancy.rooms["std"]) == n)
    shown = {t["name"]: t for t in state_dict(gw.app.runtime)["tenants"]}  # /admin/state, the console's panel
    assert (shown["batch"]["waiting"], shown["online"]["waiting"]) == ({"std": 2}, {})
    sent.send("o1", ONLINE)  # after both batch waiters: it takes the fast lane, and vLLM's next place
    sent.join()
    assert sent.statuses == {"b1": 200, "b2": 200, "b3": 200, "o1": 200}
    assert sent.done.index("o1") < sent.done.index("b2") < sent.done.index("b3"), sent.done
    assert tenancy.rooms["std"].granted == 0
    assert not tenancy.rooms["std"].waiters


def test_the_priority_in_the_body_reorders_the_simulators_queue(
    sim: SimServer, gateway: Gateway, tmp_path: Path
) -> None:
    # No admission bound: every request goes straight to the simulator, which queues all but one.
    rules = one_pool_rules(sim.url, max_num_seqs=1, admission={"enabled": False}, scheduling_policy="priority")
    gw = gateway(rules, tenants_file=tenants(tmp_path), health_interval_s=600)
    sent = Requests(gw)
    sent.send("b1", BATCH, max_tokens=200)
    assert wait_for(lambda: sim_stats(sim)["running"] == 1)
    for name in ("b2", "b3", "b4"):
        sent.send(name, BATCH)
    assert wait_for(lambda: sim_stats(sim)["waiting"] == 3)
    started = time.monotonic()
    sent.send("o1", ONLINE)
    assert wait_for(lambda: sim_stats(sim)["waiting"] == 4 or "b1" in sent.done)
    sent.join()
    assert set(sent.statuses.values()) == {200}
    # The one running when it arrived ended first; of the three batch requests queued before it, at most one (one
    # admitted in the same step) answered before it. First come first served, it would have been last.
    before = sent.done[: sent.done.index("o1")]
    assert len(before) <= 2, (sent.done, time.monotonic() - started)
