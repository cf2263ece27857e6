"""The controller end to end: the gateway in front of two simulated pools, a load step low → high → low.

The "precise" class is at home on the speculative pool. Under high load that pool's queue grows until its expected
delay is clearly above the standard pool's and the controller moves part of the class off it (``split``: a share
of its requests goes to the standard pool), and further while the delays stay apart; once the load is low again
the speculative pool is the faster one and the class comes back. Seen from the clients (``x-specgate-route``), in
``/metrics`` (``specgate_controller_transitions_total``, ``specgate_class_route_state``,
``specgate_class_speculative_share``) and in ``POST /admin/explain``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admin.app import create_admin_app
from gateway.sim.app import SimOptions
from gateway.sim.server import SimServer
from gateway.sim.wire import OutputLengths
from tests.conftest import ADMIN_AUTH, MODEL, RedisServer, Served, ServerThread, poll, rules_for, static_routes

pytestmark = pytest.mark.integration

K = 4
SPEC = f'{{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "num_speculative_tokens": {K}}}'
BATCH = 4  # --max-num-seqs: more concurrent clients than this queue
LOW, HIGH = 1, 32  # concurrent clients
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Write a python function."}], "temperature": 0}


def start(**overrides: Any) -> SimServer:
    options: dict[str, Any] = {
        "model": MODEL,
        "port": 0,
        "time_scale": 0.02,
        "output_lengths": OutputLengths(median=300, sigma=0),
        "max_num_seqs": BATCH,
        "seed": 5,
    }
    options.update(overrides)
    return SimServer(SimOptions(**options)).start()


@pytest.fixture
def sims() -> Iterator[tuple[SimServer, SimServer]]:
    spec = start(speculative_config=SPEC, fixed_acceptance=0.8, per_request_spec_decode_metrics="summary")
    std = start()
    yield spec, std
    spec.stop()
    std.stop()


def controlled_rules(spec_url: str, std_url: str) -> dict[str, Any]:
    # A scrape or two that time out on a loaded machine must not send the class to its safe state (a return home
    # that is not the load step this test watches): a sample stays fresh for 2 s.
    scrape = {"interval_s": 0.25, "timeout_s": 0.25, "stale_after_s": 2.0, "window_s": 1.0}
    rules = rules_for([spec_url], [std_url], scrape=scrape)
    static_routes(rules)  # only "precise" has a controller: the audit log and metrics are its alone
    rules["classes"][0]["controller"] = {
        "window_s": 1.0,
        "min_samples": 2,
        "min_hold_s": 1.0,
        "exit_margin": 2.5,
        "enter_margin": 0.9,
        "acceptance_weight": 0.0,
        "max_changes_per_hour": 60,
        "safe_state": "speculative",
        "share_step": 0.5,
    }
    return rules


class Load:
    """``HIGH`` client threads; the first ``level`` of them send requests back to back, the others wait."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.level = 0
        self.stop = threading.Event()
        self.routes: list[tuple[float, str]] = []  # (time, x-specgate-route) of each answer
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def client(self, i: int) -> None:
        with httpx.Client(timeout=30) as http:
            while not self.stop.is_set():
                if i >= self.level:
                    time.sleep(0.01)
                    continue
                r = http.post(f"{self.url}/v1/chat/completions", json=BODY)
                with self._lock:
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code}: {r.text[:200]}")
                    self.routes.append((time.monotonic(), r.headers.get("x-specgate-route", "")))


def transitions(url: str) -> dict[tuple[str, str, str], float]:
    text = httpx.get(f"{url}/metrics").text
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "specgate_controller_transitions_total" and s.labels["class"] == "precise":
                out[(s.labels["from"], s.labels["to"], s.labels["reason"])] = s.value
    return out


def route_state(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        s.labels["state"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "specgate_class_route_state" and s.labels["class"] == "precise"
    }


HOME = {"speculative": 1.0, "split": 0.0, "standard": 0.0}


def queued(sim: SimServer) -> float:
    """The simulated server's scraped queue (``vllm:num_requests_waiting``)."""
    text = httpx.get(f"{sim.url}/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:num_requests_waiting"
    )


def explain(admin_url: str) -> dict[str, Any]:
    r = httpx.post(f"{admin_url}/admin/explain", json=BODY, headers=ADMIN_AUTH)  # a token-less admin ignores it
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


class Watcher:
    """Polls ``specgate_class_route_state`` every 50 ms and keeps the moments (since ``t0``) the state changed."""

    def __init__(self, url: str, t0: float) -> None:
        self.url, self.t0 = url, t0
        self.changes: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            current = next((s for s, v in route_state(self.url).items() if v == 1.0), "?")
            if not self.changes or self.changes[-1][1] != current:
                self.changes.append((round(time.monotonic() - self.t0, 2), current))
            time.sleep(0.05)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_load_step_moves_the_class_off_the_speculative_pool_and_back(
    workers: int,
    sims: tuple[SimServer, SimServer],
    gateway: Callable[..., ServerThread],
    served: Callable[..., Served],
    request: pytest.FixtureRequest,
) -> None:
    """One worker: the gateway in this process. Two: ``specgate serve --workers 2`` with a private redis-server,
    each worker a replica of the cluster (one leader runs the controller, the other routes on its snapshot), the
    admin API served by both, and the audit read from Redis."""
    spec, std = sims
    rules = controlled_rules(spec.url, std.url)
    # generous health timeouts: on a busy CI machine a slow /health must not take the pools out of rotation
    if workers == 1:
        gw = gateway(rules, health_interval_s=0.5, health_timeout_s=2.0)
        admin_thread = ServerThread(create_admin_app(gw.app.state.runtime, None)).start()  # type: ignore[attr-defined]
        request.addfinalizer(admin_thread.stop)
        url, admin_url = gw.url, admin_thread.url
    else:
        redis: RedisServer = request.getfixturevalue("redis_server")
        args = ["--health-interval", "0.5", "--health-timeout", "2"]
        proc = served(rules, workers=2, redis_url=redis.url, args=args)
        url, admin_url = proc.url, proc.admin

        def roles() -> set[str]:
            answers = [httpx.get(f"{admin_url}/admin/state", headers=ADMIN_AUTH).json() for _ in range(8)]
            return {a["cluster"]["role"] for a in answers}

        assert poll(lambda: roles() == {"leader", "follower"}, 20.0), roles()  # each worker answered
    load = Load(url)
    t0 = time.monotonic()
    watcher = Watcher(url, t0)
    with ThreadPoolExecutor(HIGH + 1) as pool:
        futures = [pool.submit(load.client, i) for i in range(HIGH)] + [pool.submit(watcher.run)]
        try:
            load.level = LOW
            time.sleep(2.0)
            assert transitions(url) == {}  # low load: the class stays home
            assert route_state(url) == HOME
            calm = explain(admin_url)
            assert calm["traffic_class"]["name"] == "precise"
            assert (calm["controller"]["state"], calm["plan"]["reason"]) == ("speculative", "controller:speculative")
            assert [s["pool"] for s in calm["plan"]["steps"]][:2] == ["spec", "std"]
            high_at = time.monotonic() - t0
            load.level = HIGH
            moved_off = poll(lambda: ("speculative", "split", "load") in transitions(url), 4.0 * workers)
            off_at = time.monotonic() - t0
            assert moved_off, transitions(url)
            busy = explain(admin_url)  # the controller's state, the delays it compared, and this draw's plan
            assert busy["controller"]["state"] in ("split", "standard")
            assert busy["controller"]["last_reason"] == "load"
            assert busy["choice"]["share"] < 1.0
            compared = busy["controller"]["last_observation"]
            assert compared["spec_cost_s"] > 0
            assert compared["std_cost_s"] > 0
            assert busy["plan"]["reason"].startswith("controller:")
            time.sleep(max(0.0, high_at + 4.0 - off_at))  # the rest of 4 s of high load
            low_at = time.monotonic() - t0
            load.level = LOW
            back = poll(lambda: route_state(url).get("speculative") == 1.0, 8.0 * workers)
            assert back, transitions(url)
            # the queues the step built drain first; while they do the comparison is a real one and the class may
            # step off and back once more. The claim is that at low load, drained, it then stays home.
            drained = poll(lambda: queued(spec) + queued(std) == 0 and route_state(url) == HOME, 10.0 * workers)
            assert drained, (queued(spec), queued(std), route_state(url), transitions(url))
            time.sleep(1.0)  # one controller window on the drained pools
            assert poll(lambda: route_state(url) == HOME, 5.0 * workers), transitions(url)
            settled = transitions(url)
            time.sleep(2.0)  # low load again: the class stays on the speculative pool
            assert transitions(url) == settled
            assert route_state(url) == HOME
        finally:
            load.stop.set()
            watcher.stop.set()
        for f in futures:
            f.result()
    assert not load.errors, load.errors[:3]
    moved = transitions(url)
    assert moved[("speculative", "split", "load")] >= 1
    assert sum(v for (_, to, why), v in moved.items() if to == "speculative" and why == "load_recovered") >= 1
    # every answer that came back before the load step came from the speculative pool; under high load part of
    # the class went to the standard pool
    assert {r for t, r in load.routes if t - t0 < high_at} == {"controller:speculative"}
    high_routes = [r for t, r in load.routes if high_at <= t - t0 < low_at]
    assert any(r in ("controller:split:standard", "controller:standard") for r in high_routes), set(high_routes)
    assert watcher.changes[0][1] == "speculative"
    assert watcher.changes[-1][1] == "speculative"
    # the audit (the store's, oldest first): controller transitions, each once (only the leader audits them)
    r = httpx.get(f"{admin_url}/admin/audit", params={"limit": 1000}, headers=ADMIN_AUTH)
    audit = [a for a in r.json()["records"] if a["action"].startswith("controller")]
    assert [(a["action"], a["target"]) for a in audit][:1] == [("controller_transition", "class/precise")]
    assert {a["reason"] for a in audit} >= {"load", "load_recovered"}
    assert len([a for a in audit if a["action"] == "controller_transition"]) == sum(moved.values())
    print(
        f"\nworkers {workers}: high at {high_at:.2f}s, low at {low_at:.2f}s; route state (seconds since start, "
        f"state): {watcher.changes}; transitions {moved}"
    )
