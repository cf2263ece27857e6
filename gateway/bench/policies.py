"""``specgate bench policies``: routing policies under the same open-loop mix, across offered loads.

Every policy gets the same number of simulated vLLM servers (``specgate sim``; ``Setup.fleet``, 1+1 by default:
speculative + standard servers of the mixed fleet) and the gateway in front of them:

- ``standard``: only standard servers (``bench/policies/standard-only.yaml``);
- ``speculative``: only speculative servers (``bench/policies/speculative-only.yaml``);
- ``nginx``: the mixed fleet behind a common NGINX + Lua rule (temperature and max_tokens thresholds), ported as a
  routing file (``bench/policies/nginx-seed.yaml``, missing temperature → speculative, as the Lua does);
- ``adaptive``: the mixed fleet behind specgate's routing for the mix (``routing_rules/default.yaml`` for the default
  mix), with its controllers; their time constants are scaled like the simulators' clocks
  (``bench controller``'s ``scaled_rules``).
- ``peer-cache-aware``, ``peer-round-robin``, ``peer-cache-aware-mixed``: the Rust ``vllm-router`` instead of the
  gateway, in front of the homogeneous standard fleet or the mixed one (``bench.peer``), only when asked for.

A mix with conversations goes to ``bench.multiturn`` instead (the CLI dispatches); ``running_fleet`` starts the
servers and the front for both.

The simulated servers are scaled-down copies of the 70B preset: a running batch of ``max_num_seqs`` (8) stands
for one of ``max_num_seqs × scale`` (256), because every per-token cost (γ, γ_prefill, α of the target and the
drafter) is multiplied by ``scale`` while the fixed per-step costs (δ, ε) are not. Step times, TTFT and TPOT at
batch b are then those of the real server at batch b·scale, at 1/scale of its request rate: speculation keeps its
low-load speedup and its loss near saturation, with few enough tokens per second for a 2-core machine. The
adaptive rules' in-flight saturation thresholds are divided by ``scale`` for the same reason.

Offered load is a fraction of the fleet's capacity, computed from the simulator's physics (not probed): as many
standard servers at a full batch, ``capacity = n / (E[output]·step(B)/B + E[prompt]·γ_prefill)`` with the mix's
expected output and prompt lengths. The same seed gives every policy the same arrival times and requests; a mix's
``arrivals`` (bursts, steps) scale with the load point's rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.controller import scaled_rules
from gateway.bench.cpu import CpuMeter
from gateway.bench.load import Result, arrival_times, run_load, summarise, write_jsonl
from gateway.bench.mix import Mix, plan_request
from gateway.bench.peer import MIXED_PEERS, PEER_POLICIES, require_router, router_command
from gateway.bench.plots import write_report
from gateway.bench.points import DEFAULT_POLICIES, FIRST_WARMUP, LABELS, POLICIES, POLICY_FILES, Point, Setup
from gateway.config.packaged import DEFAULT_RULES
from gateway.sim.launch import PRESET, free_port, spec_config_json, wait_for_port
from gateway.sim.physics import step_time
from gateway.sim.wire import count_tokens


def _physics_args(setup: Setup, method: str | None) -> list[str]:
    t, d = setup.costs(method)
    args = ["--gamma-s", f"{t.gamma_s:g}", "--gamma-prefill-s", f"{t.gamma_prefill_s:g}", "--alpha-s", f"{t.alpha_s:g}"]
    if d is not None:
        args += ["--draft-gamma-s", f"{d.gamma_s:g}", "--draft-alpha-s", f"{d.alpha_s:g}"]
        args += ["--draft-gamma-prefill-s", f"{d.gamma_prefill_s:g}"]
    return args


def sim_command(setup: Setup, pool: dict[str, Any], port: int, seed: int) -> list[str]:
    model = pool["models"][0]
    cmd = [sys.executable, "-m", "gateway", "sim", model, "--port", str(port), "--preset", PRESET]
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


def policy_rules(policy: str, adaptive: dict[str, Any], root: Path) -> dict[str, Any]:
    """The routing rules of a policy, its pools' model (and speculative method) taken from the adaptive rules."""
    pools = [p for p in adaptive["pools"] if p["name"] != adaptive.get("embeddings_pool")]
    if policy == "adaptive" or policy in MIXED_PEERS:  # a mixed-fleet peer: the same servers, another router
        rules: dict[str, Any] = dict(adaptive)
        rules.pop("embeddings_pool", None)
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


def estimate_capacity(mix: Mix, setup: Setup, n: int = 4000) -> tuple[float, str]:
    """Simulated requests/s as many standard servers as the fleet has sustain on this mix at a full batch."""
    rng = random.Random(setup.seed)
    outs, prompts = [], []
    for i in range(n):
        planned = plan_request(mix, "m", rng)
        cap = planned.body.get("max_tokens") or planned.body.get("max_output_tokens") or 10**9
        outs.append(min(setup.lengths.natural(i), int(cap)))
        messages = planned.body.get("messages") or planned.body.get("input") or []
        prompts.append(sum(count_tokens(str(m.get("content", ""))) for m in messages))
    mean_out = sum(outs) / n
    mean_prompt = sum(prompts) / n
    b = setup.max_num_seqs
    f = setup.scale
    target, _ = setup.costs(None)
    ctx = mean_prompt + mean_out / 2
    step = step_time(target, None, 0, b, 0, round(b * ctx))
    per_request = mean_out * step / b + mean_prompt * target.gamma_prefill_s
    cap = setup.servers / per_request
    how = (
        f"from the simulator's step model ({PRESET}, per-token costs x{f}): {setup.servers} standard servers at a "
        "full batch of "
        f"{b}; step {step * 1000:.1f} ms, mean output {mean_out:.0f} tokens, mean prompt {mean_prompt:.0f} tokens "
        f"-> {cap:.2f} requests/s (simulated clock)"
    )
    return cap, how


def _alive(procs: list[subprocess.Popen[bytes]], what: str) -> None:
    """Every started process still runs: a port answered by something else does not count as ours."""
    dead = [p for p in procs if p.poll() is not None]
    if dead:
        raise RuntimeError(f"{what} exited (status {dead[0].returncode}) before the sweep could use it")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


@dataclass(frozen=True, slots=True)
class Fleet:
    """A policy's running servers and the router in front of them."""

    url: str  # the front: the gateway or a peer router
    sim_ports: list[int]
    pids: dict[str, int | None]  # process name -> pid, for ``CpuMeter`` (None: this process)
    spec_pools: frozenset[str]
    model: str


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
                cmd = [sys.executable, "-m", "gateway", "serve", "--rules", str(path), "--port", str(front_port)]
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
            )
    finally:
        _stop(procs)


def run_policy(
    policy: str,
    rules: dict[str, Any],
    mix: Mix,
    loads: list[float],
    capacity_rps: float,
    setup: Setup,
    *,
    jsonl: Path | None = None,
    log: Callable[[str], None] = print,
) -> list[Point]:
    """Start the policy's servers and its front; one open-loop run per load; stop everything."""
    points: list[Point] = []
    with running_fleet(policy, rules, setup, mix.model) as fleet:
        url, model, sim_ports, spec_pools = fleet.url, fleet.model, fleet.sim_ports, fleet.spec_pools
        meter = CpuMeter(fleet.pids)
        for i, load in enumerate(loads):
            rate = load * capacity_rps
            start = time.monotonic()
            if setup.warmup_s > 0:  # the controllers settle at the new rate; nothing of it is measured
                warm = arrival_times(
                    mix.arrival_kind(rate / setup.time_scale),
                    rate / setup.time_scale,
                    # the first point starts from the YAML's homes, not from a neighbouring load's shares
                    setup.warmup_s * (FIRST_WARMUP if i == 0 else 1),
                    random.Random(setup.seed + i + 500),
                )
                asyncio.run(run_load(url, mix, warm, model=model, seed=setup.seed + 600 + i,
                                     time_scale=setup.time_scale))  # fmt: skip
            lag_before = sim_clocks(sim_ports)
            meter.start()
            results: list[Result] = []
            repeats = runs_for(rate, setup)
            for r in range(repeats):  # repeat 0 has the seeds of a single run
                times = arrival_times(
                    mix.arrival_kind(rate / setup.time_scale),
                    rate / setup.time_scale,
                    setup.duration_s,
                    random.Random(setup.seed + i + 1000 * r),
                )
                run = asyncio.run(
                    run_load(url, mix, times, model=model, seed=setup.seed + 100 + i + 1000 * r,
                             time_scale=setup.time_scale)
                )  # fmt: skip
                results += run
                if jsonl is not None:
                    meta = {"policy": policy, "load": load, "rate_rps": rate, "repeat": r}
                    write_jsonl(jsonl, run, meta, append=True)
            cpu = meter.stop()
            lag = clock_lag(lag_before, sim_clocks(sim_ports))
            wall = time.monotonic() - start
            sims = summarise(results, repeats * setup.duration_s / setup.time_scale, spec_pools)
            e2e = tuple(r.e2e_s if r.ok else math.inf for r in results)  # paired: request i of every policy
            points.append(Point(policy, load, rate, sims[-1], tuple(sims[:-1]), wall, cpu, e2e, lag))
            s = sims[-1]
            log(
                f"  {LABELS[policy]:<18} load {load:>4.0%} ({rate:.2f} req/s): {s.requests} requests, "
                f"{s.errors} errors, E2E p50 {s.e2e[0]:.2f} s p99 {s.e2e[2]:.2f} s, "
                f"goodput {s.goodput_rps:.2f} req/s ({wall:.0f} s; busiest process {busiest(cpu)})"
            )
    return points


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


def runs_for(rate: float, setup: Setup) -> int:
    """Runs at a load point of ``rate`` simulated requests/s: ``setup.repeats``, more where that many would send
    fewer than ``setup.min_requests`` (low loads), so that a p99 is not the slowest of a few dozen requests."""
    per_run = rate / setup.time_scale * setup.duration_s
    if per_run <= 0:
        return setup.repeats
    return max(setup.repeats, math.ceil(setup.min_requests / per_run))


def busiest(cpu: dict[str, float]) -> str:
    """The process that used the most CPU during a point, as "name 0.42" (share of one core)."""
    if not cpu:
        return "unknown"
    name = max(cpu, key=lambda k: cpu[k])
    return f"{name} {cpu[name]:.2f}"


def planned_seconds(n_policies: int, n_loads: int, setup: Setup) -> float:
    """A rough wall-clock estimate: start-up per policy, arrivals plus the drain per load."""
    warmups = (n_loads + FIRST_WARMUP - 1) * setup.warmup_s
    return n_policies * (8.0 + warmups + n_loads * (4.0 + setup.repeats * (setup.duration_s + 4.0)))


def _printed(line: str) -> None:
    print(line, flush=True)


def _follow_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """A policy process's initializer: when the sweep that started it dies (killed, not interrupted), stop this
    policy as Ctrl-C would (its servers and gateway are stopped in ``run_policy``'s ``finally``) instead of
    running on as an orphan whose load generator finds other sweeps' servers on reused ports."""

    def watch() -> None:
        time.sleep(poll_s)
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGINT)  # a real signal: it wakes a sleeping main thread or event loop

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def _policy_job(
    policy: str, rules: dict[str, Any], mix: Mix, loads: list[float], capacity: float, setup: Setup, jsonl: Path
) -> list[Point]:
    """One policy's runs in a process of its own (``jobs`` > 1): its servers, gateway and load generator."""
    return run_policy(policy, rules, mix, loads, capacity, setup, jsonl=jsonl, log=_printed)


def _run_parallel(
    policies: tuple[str, ...], rules: dict[str, dict[str, Any]], mix: Mix, loads: list[float], capacity: float,
    setup: Setup, jsonl: Path, jobs: int,
) -> list[Point]:  # fmt: skip
    """Policies side by side, each in its own process with its own servers (they share nothing but the CPUs: the
    report's harness-CPU section says whether those kept up). Each writes its own JSONL, joined in policy order."""
    parts = {p: jsonl.with_name(f"{jsonl.stem}-{p}.jsonl") for p in policies}
    for part in parts.values():
        part.unlink(missing_ok=True)  # an earlier sweep's, in the same folder
    ctx = multiprocessing.get_context("spawn")
    workers = min(jobs, len(policies))
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_follow_parent, initargs=(os.getpid(),)) as pool:
        futures = [
            pool.submit(_policy_job, p, rules[p], mix, loads, capacity, setup, parts[p]) for p in policies
        ]  # fmt: skip
        points = [pt for f in futures for pt in f.result()]
    with jsonl.open("a") as out:
        for p in policies:
            if parts[p].exists():
                out.write(parts[p].read_text())
                parts[p].unlink()
    return points


def check_policies(policies: tuple[str, ...]) -> None:
    """Known policies, and the peer router installed where one is asked for: checked before any server starts."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if any(p in PEER_POLICIES for p in policies):
        require_router()


def bench_policies(
    mix: Mix,
    loads: list[float],
    setup: Setup,
    out_dir: Path,
    *,
    policies: tuple[str, ...] = DEFAULT_POLICIES,
    root: Path = Path("."),
    log: Callable[[str], None] = print,
    jobs: int = 1,
) -> list[Point]:
    """The whole sweep: every policy at every load; report.md, the plots and results.jsonl in ``out_dir``.
    ``jobs`` > 1 runs that many policies at once, each in a process of its own."""

    check_policies(policies)
    adaptive = yaml.safe_load(((root / mix.rules) if mix.rules else DEFAULT_RULES).read_text())
    if mix.output_len_median is not None:
        setup = replace(setup, output_median=mix.output_len_median)
    capacity, how = estimate_capacity(mix, setup)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl = out_dir / "results.jsonl"
    jsonl.write_text("")
    log(
        f"capacity {capacity:.2f} req/s (simulated) = {capacity / setup.time_scale:.2f} req/s wall; "
        f"planned: {len(policies)} policies x {len(loads)} loads x {setup.duration_s:g} s "
        f"≈ {planned_seconds(len(policies), len(loads), setup) / 60:.1f} min"
    )
    points: list[Point] = []
    before = os.getloadavg()[0]
    rules = {policy: policy_rules(policy, adaptive, root) for policy in policies}
    if jobs > 1 and len(policies) > 1:
        points = _run_parallel(policies, rules, mix, loads, capacity, setup, jsonl, jobs)
    else:
        for policy in policies:
            points += run_policy(policy, rules[policy], mix, loads, capacity, setup, jsonl=jsonl, log=log)
    machine = (
        f"{os.cpu_count()} cores, load average {before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end "
        "(the harness-CPU section shows what the bench's own processes used; the load average also counts what "
        "else ran)" + (f"; {min(jobs, len(policies))} policies ran at once" if jobs > 1 and len(policies) > 1 else "")
    )
    write_report(points, mix, setup, how, out_dir, policies, log, machine)
    return points
