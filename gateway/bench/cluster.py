"""``specgate bench cluster``: R gateway replicas × E endpoints on one machine, sharing a private redis-server.

The replicas are full gateway runtimes (``Runtime``: lease, scraper, health checker, controllers, shared counts)
in one event loop; the endpoints are fake vLLM servers, one uvicorn serving E ports, counting the ``/metrics`` and
``/health`` GETs each port answers. Measured, in order:

1. steady state: scrapes and health checks per endpoint per second (one leader: ~1/interval each, whatever R);
   snapshot lag (publish → applied on a follower) and each replica's role;
2. share agreement: a forced change of one class on the leader, and the time until every follower routes on it;
   a queue appearing on every endpoint, and the time until every follower's busy test (overload's back-pressure)
   says so; a follower's own ejection of an endpoint, and the time until every other replica has it ejected;
3. failover: the leader killed without handover, the time until another replica leads and its snapshot reached
   every follower;
4. Redis down: the time until every replica acts alone, the scrape rate then (R× per endpoint), and the time
   to rejoin once Redis is back.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
import yaml
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config.settings import Settings
from gateway.runtime.container import Runtime
from gateway.sim.launch import free_port, wait_for_port
from gateway.testing.fake_upstream import FakeConfig
from gateway.testing.fake_upstream.app import create_fake_upstream

MODEL = "meta-llama/Llama-3.3-70B-Instruct"


class _PerPort:
    """Counts the GETs of /metrics and /health per server port."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.hits: Counter[tuple[int, str]] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("server"):
            self.hits[(scope["server"][1], scope["path"])] += 1
        await self.app(scope, receive, send)


@dataclass
class ClusterRun:
    replicas: int
    endpoints: int
    interval_s: float
    scrapes_per_endpoint_s: list[float] = field(default_factory=list)
    health_per_endpoint_s: list[float] = field(default_factory=list)
    lag_s: list[float] = field(default_factory=list)
    roles: dict[str, int] = field(default_factory=dict)
    agreement_s: float | None = None
    queue_s: float | None = None  # a scraped queue reaching every follower's busy test
    ejection_s: float | None = None  # one follower's passive ejection reaching every other replica
    failover_s: float | None = None
    redis_down_local_s: float | None = None
    scrapes_per_endpoint_s_alone: float | None = None
    rejoin_s: float | None = None


def _rules(urls: list[str], interval_s: float) -> dict[str, Any]:
    half = max(1, len(urls) // 2)
    spec, std = urls[:half], urls[half:] or urls[:1]
    return {
        "version": 1,
        "scrape": {"interval_s": interval_s, "timeout_s": min(1.0, interval_s * 0.8)},
        "pools": [
            {
                "name": "spec",
                "kind": "speculative",
                "speculative": {"method": "eagle3", "num_speculative_tokens": 4},
                "models": [MODEL],
                "endpoints": [{"url": u, "id": f"spec-{i}"} for i, u in enumerate(spec)],
            },
            {
                "name": "std",
                "kind": "standard",
                "models": [MODEL],
                "endpoints": [{"url": u, "id": f"std-{i}"} for i, u in enumerate(std)],
            },
        ],
        "classes": [
            {
                "name": "precise",
                "when": {"temperature": {"lte": 0.5}},
                "route": {"preferred": "spec", "saturated": "std", "fallback": ["std"]},
                "controller": {"window_s": 10, "min_samples": 1000, "min_hold_s": 1},
            },
            {"name": "default", "route": {"preferred": "std", "fallback": ["spec"]}},
        ],
    }


async def _until(check: Callable[[], bool], timeout_s: float) -> float | None:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            return None
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


def _leaders(rts: list[Runtime]) -> list[Runtime]:
    return [rt for rt in rts if rt.cluster is not None and rt.cluster.lease.held]


class _Redis:
    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen([*args, "--dir", str(self.workdir)], stdout=subprocess.DEVNULL)
        wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


def _rates(counter: _PerPort, ports: list[int], path: str, span_s: float) -> list[float]:
    return [counter.hits[(p, path)] / span_s for p in ports]


async def _run(replicas: int, endpoints: int, interval_s: float, duration_s: float, tmp: Path) -> ClusterRun:
    run = ClusterRun(replicas, endpoints, interval_s)
    counter = _PerPort(create_fake_upstream(FakeConfig(name="bench")))
    socks = []
    for _ in range(endpoints):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    server = uvicorn.Server(uvicorn.Config(counter, log_config=None, access_log=False, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": socks}, daemon=True)
    thread.start()
    redis = _Redis(tmp)
    redis.start()
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(_rules([f"http://127.0.0.1:{p}" for p in ports], interval_s)))
    url = f"redis://127.0.0.1:{redis.port}/0"
    rts: list[Runtime] = []
    dead: list[Runtime] = []
    try:
        wait_for_port(ports[0])
        for _ in range(replicas):
            settings = Settings(
                rules=rules, redis_url=url, health_interval_s=interval_s, health_timeout_s=interval_s * 0.8
            )
            rt = Runtime.from_settings(settings)
            await rt.start()
            rts.append(rt)
        await _until(lambda: len(_leaders(rts)) == 1 and all(r.cluster and r.cluster.role != "local" for r in rts), 30)
        # 1. steady state
        counter.hits.clear()
        lags: list[float] = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < duration_s:
            await asyncio.sleep(interval_s)
            lags += [r.cluster.last_lag_s for r in rts if r.cluster and r.cluster.last_lag_s is not None]
        span = time.monotonic() - t0
        run.scrapes_per_endpoint_s = _rates(counter, ports, "/metrics", span)
        run.health_per_endpoint_s = _rates(counter, ports, "/health", span)
        run.lag_s = lags
        run.roles = dict(Counter(r.cluster.role for r in rts if r.cluster))
        # 2. share agreement
        leader = _leaders(rts)[0]
        followers = [r for r in rts if r is not leader]
        ctl = leader.routing._classes["precise"].controller
        ctl.force("standard" if ctl.state != "standard" else "speculative", time.monotonic(), ttl_s=60)
        want = (ctl.state, ctl.share)

        def agree() -> bool:
            rng = random.Random(0)
            return all(
                (c.state, c.share) == want
                for r in followers
                if (c := r.routing.choose("precise", rng, count=False)) is not None
            )

        run.agreement_s = await _until(agree, 10 * interval_s)
        # 2b. vLLM's queue on every endpoint, as the leader scrapes it: every follower's busy test sees it
        fake = counter.app.state.fake  # type: ignore[attr-defined]
        fake.waiting[MODEL] = 2

        def all_busy() -> bool:
            return all(r.attempts.busy(p, p.endpoints[0]) for r in followers for p in r.live.pools.values())

        run.queue_s = await _until(all_busy, 10 * interval_s)
        fake.waiting[MODEL] = 0
        await _until(
            lambda: not any(r.attempts.busy(p, p.endpoints[0]) for r in rts for p in r.live.pools.values()),
            10 * interval_s,
        )
        # 2c. a follower's own ejection (its failures) reaching every other replica through the shared counts
        pool = followers[0].live.pools["spec"]
        if len(pool.endpoints) > 1:
            pool.endpoints[-1].eject(time.monotonic(), base_s=30.0, max_s=60.0)
            key = pool.endpoints[-1].id
            run.ejection_s = await _until(
                lambda: all(not next(e for e in r.live.pools["spec"].endpoints if e.id == key).routable for r in rts),
                10 * interval_s,
            )
        # 3. failover: the leader dies without a handover
        assert leader.cluster is not None
        for task in [*leader._tasks, *leader.cluster._tasks]:
            task.cancel()
        leader.cluster.lease._valid_until = 0.0
        rts.remove(leader)
        dead.append(leader)
        t_kill = time.monotonic()
        await _until(lambda: len(_leaders(rts)) == 1, 20 * interval_s)
        if _leaders(rts):
            new = _leaders(rts)[0].cluster
            assert new is not None
            rest = [r for r in rts if r.cluster is not new]
            done = await _until(
                lambda: all(r.cluster and (r.cluster.snapshot or {}).get("leader") == new.replica for r in rest),
                20 * interval_s,
            )
            run.failover_s = None if done is None else time.monotonic() - t_kill
        # 4. Redis down, then back
        redis.stop()
        run.redis_down_local_s = await _until(
            lambda: all(r.cluster is not None and r.cluster.role == "local" for r in rts), 30 * interval_s
        )
        counter.hits.clear()
        t0 = time.monotonic()
        await asyncio.sleep(max(3 * interval_s, 2.0))
        run.scrapes_per_endpoint_s_alone = statistics.mean(_rates(counter, ports, "/metrics", time.monotonic() - t0))
        redis.start()
        run.rejoin_s = await _until(
            lambda: len(_leaders(rts)) == 1 and all(r.cluster and r.cluster.role != "local" for r in rts),
            30 * interval_s,
        )
    finally:
        for rt in [*rts, *dead]:
            await rt.stop()
        redis.stop()
        server.should_exit = True
        thread.join(timeout=10)
    return run


def bench_cluster(replicas: int, endpoints: int, interval_s: float, duration_s: float) -> ClusterRun:
    if replicas < 2 or endpoints < 2:
        raise ValueError("--replicas and --endpoints must be at least 2")
    with tempfile.TemporaryDirectory(prefix="specgate-bench-cluster-") as tmp:
        return asyncio.run(_run(replicas, endpoints, interval_s, duration_s, Path(tmp)))


def _fmt(v: float | None, unit: str = "s") -> str:
    return "not reached" if v is None else f"{v:.2f} {unit}"


def render(run: ClusterRun) -> str:
    s, h = run.scrapes_per_endpoint_s, run.health_per_endpoint_s
    lag = sorted(run.lag_s)

    def p(q: float) -> float:
        return lag[min(len(lag) - 1, int(q * len(lag)))] if lag else float("nan")

    lines = [
        f"{run.replicas} replicas x {run.endpoints} endpoints, scrape and health interval {run.interval_s:g} s",
        f"  /metrics per endpoint:  mean {statistics.mean(s):.2f}/s, max {max(s):.2f}/s "
        f"(one replica alone: {1 / run.interval_s:.2f}/s; "
        f"every replica scraping: {run.replicas / run.interval_s:.2f}/s)",
        f"  /health per endpoint:   mean {statistics.mean(h):.2f}/s, max {max(h):.2f}/s "
        "(the health checker's, leader only)",
        f"  roles: {run.roles}",
        f"  snapshot lag publish->applied: p50 {p(0.5) * 1000:.1f} ms, p99 {p(0.99) * 1000:.1f} ms "
        f"({len(lag)} samples)",
        f"  share agreement after a change on the leader: {_fmt(run.agreement_s)}",
        f"  a scraped queue in every follower's busy test: {_fmt(run.queue_s)}",
        f"  a follower's passive ejection on every other replica: {_fmt(run.ejection_s)}",
        f"  failover (leader killed, no handover) to every follower on the new leader: {_fmt(run.failover_s)}",
        f"  Redis down -> every replica acting alone: {_fmt(run.redis_down_local_s)}; /metrics per endpoint then "
        f"{_fmt(run.scrapes_per_endpoint_s_alone, '/s')}",
        f"  Redis back -> one leader again, all following: {_fmt(run.rejoin_s)}",
    ]
    return "\n".join(lines)
