"""A policy's running fleet for ``specgate bench policies``: the simulated servers' command lines, the routing rules
each policy runs (the bench's endpoints, scaled time constants and saturation thresholds), starting the servers and
the front (the gateway or the ``vllm-router`` peer) and stopping them all, and the servers' late-step clocks.

The policies' variants of the adaptive rules: ``adaptive-no-affinity`` is ``adaptive`` with prefix affinity off in
every pool, so neither the endpoint pick inside a pool nor the warm-home pool choice weighs prefix warmth: the
routing as it was before either existed, on the same servers and the same requests.

Stopping is bounded: every process is asked to stop (SIGTERM), and whatever is still running after ``STOP_GRACE_S``
(a simulated server finishing its streams, a gateway supervisor and its workers) is killed with its descendants.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.controller import scaled_rules
from gateway.bench.cpu import descendants, started
from gateway.bench.peer import MIXED_PEERS, PEER_POLICIES, require_router, router_command
from gateway.bench.points import POLICY_FILES, Setup
from gateway.sim.launch import PRESET, free_port, spec_config_json, wait_for_port

STOP_GRACE_S = 5.0  # seconds the fleet's processes get to stop on SIGTERM before they are killed
ADAPTIVE_VARIANTS = frozenset({"adaptive", "adaptive-no-affinity"})  # the adaptive rules, as given or varied


def _physics_args(setup: Setup, method: str | None) -> list[str]:
    t, d = setup.costs(method)
    args = ["--gamma-s", f"{t.gamma_s:g}", "--gamma-prefill-s", f"{t.gamma_prefill_s:g}", "--alpha-s", f"{t.alpha_s:g}"]
    if d is not None:
        args += ["--draft-gamma-s", f"{d.gamma_s:g}", "--draft-alpha-s", f"{d.alpha_s:g}"]
        args += ["--draft-gamma-prefill-s", f"{d.gamma_prefill_s:g}"]
    return args


def sim_command(setup: Setup, pool: dict[str, Any], port: int, seed: int) -> list[str]:
    model = pool["models"][0]
    cmd = [sys.executable, "-P", "-m", "gateway", "sim", model, "--port", str(port), "--preset", PRESET]
    cmd += ["--time-scale", str(setup.time_scale), "--max-num-seqs", str(setup.max_num_seqs), "--seed", str(seed)]
    cmd += ["--output-len-median", str(setup.output_median), "--output-len-sigma", str(setup.output_sigma)]
    for m in pool["models"]:
        cmd += ["--served-model-name", m]
    spec = spec_config_json(pool)
    method = None
    if spec is not None:
        cmd += ["--speculative-config", spec, "--per-request-spec-decode-metrics", "summary"]
        method = json.loads(spec)["method"]
    return cmd + _physics_args(setup, method)


def _without_affinity(rules: dict[str, Any]) -> dict[str, Any]:
    """The rules with prefix affinity off everywhere (the defaults and every pool's own block): no prefix index, so
    no warm endpoint and no warm home either."""
    out = dict(rules)
    defaults = dict(out.get("defaults") or {})
    defaults["prefix_affinity"] = {**(defaults.get("prefix_affinity") or {}), "enabled": False}
    out["defaults"] = defaults
    out["pools"] = [
        {**p, "prefix_affinity": {**p["prefix_affinity"], "enabled": False}} if p.get("prefix_affinity") else p
        for p in out["pools"]
    ]
    return out


def policy_rules(policy: str, adaptive: dict[str, Any], root: Path) -> dict[str, Any]:
    """The routing rules of a policy, its pools' model (and speculative method) taken from the adaptive rules."""
    pools = [p for p in adaptive["pools"] if p["name"] != adaptive.get("embeddings_pool")]
    if policy in ADAPTIVE_VARIANTS or policy in MIXED_PEERS:  # a mixed-fleet peer: the same servers, another router
        rules: dict[str, Any] = dict(adaptive)
        rules.pop("embeddings_pool", None)
        rules["pools"] = pools
        return _without_affinity(rules) if policy == "adaptive-no-affinity" else rules
        rules["pools"] = pools
        return rules
    rules = yaml.safe_load((root / POLICY_FILES[policy]).read_text())
    spec = next(p for p in pools if p.get("kind") == "speculative")
    model = spec["models"][0]
    for p in rules["pools"]:
        p["models"] = [model]
        if p.get("kind") == "speculative":
            p["speculative"] = dict(spec["speculative"])
    return rules


def _scaled_saturation(cls: dict[str, Any], scale: int) -> dict[str, Any]:
    route = cls.get("route") or {}
    sat = route.get("saturation")
    if not isinstance(sat, dict) or "max_inflight_per_endpoint" not in sat or scale == 1:
        return cls
    c = dict(cls)
    c["route"] = {**route, "saturation": {**sat, "max_inflight_per_endpoint": _ceil_div(sat, scale)}}
    return c


def _ceil_div(sat: dict[str, Any], scale: int) -> int:
    return max(1, math.ceil(int(sat["max_inflight_per_endpoint"]) / scale))


def bench_rules(rules: dict[str, Any], ports: dict[str, list[int]], setup: Setup) -> dict[str, Any]:
    """The rules as the bench runs them: local endpoints, scaled time constants and saturation thresholds."""
    out = dict(rules)
    pools = []
    for pool in rules["pools"]:
        p = dict(pool)
        p.pop("api_key_env", None)
        p["endpoints"] = [
            {"url": f"http://127.0.0.1:{port}", "weight": 1, "id": f"{p['name']}-sim-{i}"}
            for i, port in enumerate(ports[p["name"]])
        ]
        pools.append(p)
    out["pools"] = pools
    out["classes"] = [_scaled_saturation(c, setup.scale) for c in rules["classes"]]
    # --controller-time-scale: the scrape and controller time constants shrink further than the simulators' clock,
    # so that a controller window is a fraction of one load point instead of longer than it
    cts = setup.time_scale if setup.controller_time_scale is None else setup.controller_time_scale
    return scaled_rules(out, cts)


def servers_per_pool(rules: dict[str, Any], setup: Setup | None = None) -> dict[str, int]:
    """The fleet's servers: all in the one pool of a homogeneous fleet, ``setup.fleet`` by kind otherwise."""
    setup = setup or Setup()
    names = [p["name"] for p in rules["pools"]]
    if len(names) == 1:
        return {names[0]: setup.servers}
    if len(names) != 2:
        raise ValueError(f"a policy needs one or two pools, got {names}")
    return {
        p["name"]: setup.spec_servers if p.get("kind") == "speculative" else setup.std_servers for p in rules["pools"]
    }


def _alive(procs: list[subprocess.Popen[bytes]], what: str) -> None:
    """Every started process still runs: a port answered by something else does not count as ours."""
    dead = [p for p in procs if p.poll() is not None]
    if dead:
        raise RuntimeError(f"{what} exited (status {dead[0].returncode}) before the sweep could use it")


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to every process; after ``grace_s`` in all, SIGKILL to those still running and to their descendants
    (a gateway supervisor's workers), so that nothing of the fleet outlives the sweep for long."""
    # who they are before the supervisors stop and orphan them (a pid with another start time is no longer ours)
    family = {proc.pid: [(pid, started(pid)) for pid in descendants(proc.pid)] for proc in procs}
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        left = [pid for pid, t0 in family[proc.pid] if t0 is not None and started(pid) == t0]
        if proc.poll() is None:
            proc.kill()
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


@dataclass(frozen=True, slots=True)
class Fleet:
    """A policy's running servers and the router in front of them."""

    url: str  # the front: the gateway or a peer router
    sim_ports: list[int]
    pids: dict[str, int | None]  # process name -> pid, for ``CpuMeter`` (None: this process)
    spec_pools: frozenset[str]
    model: str
    endpoints: dict[str, int] = field(default_factory=dict)  # the gateway's endpoint id -> its server's port


@contextlib.contextmanager
def running_fleet(
    policy: str, rules: dict[str, Any], setup: Setup, model: str | None = None, sim_args: tuple[str, ...] = ()
) -> Iterator[Fleet]:
    """Start the policy's simulated servers (``sim_args`` added to their command lines) and its front (the gateway,
    or ``vllm-router`` for a peer policy); stop them all on the way out."""
    counts = servers_per_pool(rules, setup)
    ports = {name: [free_port() for _ in range(k)] for name, k in counts.items()}
    procs: list[subprocess.Popen[bytes]] = []
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    spec_pools = frozenset(p["name"] for p in rules["pools"] if p.get("kind") == "speculative")
    router = require_router() if policy in PEER_POLICIES else None  # before any server starts
    try:
        for pool in rules["pools"]:
            for i, port in enumerate(ports[pool["name"]]):
                cmd = [*sim_command(setup, pool, port, setup.seed + i), *sim_args]
                procs.append(subprocess.Popen(cmd, **quiet))  # type: ignore[call-overload]
        with tempfile.TemporaryDirectory(prefix="specgate-policies-") as tmp:
            for plist in ports.values():
                for port in plist:
                    wait_for_port(port, 30.0)
            _alive(procs, "a simulated server")  # a server that died (its port taken) must not pass as another's
            front_port = free_port()
            if router is not None:
                workers = [f"http://127.0.0.1:{port}" for plist in ports.values() for port in plist]
                cmd = router_command(router, policy, workers, front_port, free_port())
                what = "vllm-router"
                procs.append(subprocess.Popen(cmd, **quiet))  # type: ignore[call-overload]
            else:
                path = Path(tmp) / "rules.yaml"
                path.write_text(yaml.safe_dump(bench_rules(rules, ports, setup), sort_keys=False))
                cmd = [sys.executable, "-P", "-m", "gateway", "serve", "--rules", str(path), "--port", str(front_port)]
                cmd += ["--host", "127.0.0.1", "--health-interval", "0.5", "--log-level", "error", "--admin-port", "0"]
                if setup.gateway_workers > 1:  # without Redis: each process its own state, as replicas would be
                    cmd += ["--workers", str(setup.gateway_workers), "--per-worker-state"]
                what = "the gateway"
                procs.append(subprocess.Popen(cmd))
            wait_for_port(front_port, 60.0)
            _alive(procs, what)
            sim_pids = [p.pid for p in procs[:-1]]
            servers = {f"server {i}": pid for i, pid in enumerate(sim_pids)}
            front = "vllm-router" if router is not None else "gateway"
            yield Fleet(
                url=f"http://127.0.0.1:{front_port}",
                sim_ports=[port for plist in ports.values() for port in plist],
                pids={"load generator": None, front: procs[-1].pid, **servers},
                spec_pools=spec_pools,
                model=model or rules["pools"][0]["models"][0],
                endpoints={} if router is not None else _endpoint_ports(ports),
            )
    finally:
        stop_processes(procs)


def _endpoint_ports(ports: dict[str, list[int]]) -> dict[str, int]:
    """The endpoint ids ``bench_rules`` gives the servers, with their ports."""
    return {f"{pool}-sim-{i}": port for pool, plist in ports.items() for i, port in enumerate(plist)}


def sim_clocks(ports: list[int]) -> list[tuple[float, float] | None]:
    """Each simulated server's (late-step seconds, simulated seconds) from its ``/sim/stats``; None where it did not
    answer. A step that starts after the previous one ended (the machine did not run the server in time) adds to
    the first: that time shows in every request of the step as latency that a real GPU would not have added."""
    out: list[tuple[float, float] | None] = []
    for port in ports:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/sim/stats", timeout=5) as resp:
                stats = json.loads(resp.read())
            engine = stats["engine"]
            out.append((float(engine["lag_s"]), float(engine["sim_time_s"])))
        except (OSError, ValueError, KeyError):
            out.append(None)
    return out


def clock_lag(before: list[tuple[float, float] | None], after: list[tuple[float, float] | None]) -> float:
    """The worst server's late-step time over a point, as a share of the point's simulated time (NaN: unknown)."""
    shares = [
        (a[0] - b[0]) / (a[1] - b[1])
        for b, a in zip(before, after, strict=True)
        if a is not None and b is not None and a[1] > b[1]
    ]
    return max(shares) if shares else math.nan
