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
  gateway, in front of the homogeneous standard fleet or the mixed one (``bench.peer``), only when asked for;
- ``adaptive-no-affinity``: ``adaptive`` with prefix affinity (and so warm homes) off, only when asked for: with
  ``adaptive`` in the same sweep, the report gives the paired interval of the one against the other.

A mix with conversations goes to ``bench.multiturn`` instead (the CLI dispatches); ``bench.fleet``'s
``running_fleet`` starts the servers and the front for both, and ``bench.jobs`` runs policies side by side
(``--jobs``) and stops everything when the sweep is interrupted or terminated.

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
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from gateway.bench.cpu import CpuMeter
from gateway.bench.fleet import clock_lag, policy_rules, running_fleet, sim_clocks
from gateway.bench.jobs import interrupt_on_term, run_side_by_side
from gateway.bench.load import Result, arrival_times, run_load, summarise, write_jsonl
from gateway.bench.mix import Mix, plan_request
from gateway.bench.peer import PEER_POLICIES, require_router
from gateway.bench.plots import write_report
from gateway.bench.points import DEFAULT_POLICIES, FIRST_WARMUP, LABELS, POLICIES, Point, Setup
from gateway.config.packaged import DEFAULT_RULES
from gateway.sim.launch import PRESET
from gateway.sim.physics import step_time
from gateway.sim.wire import count_tokens


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
    calls = [(p, rules[p], mix, loads, capacity, setup, parts[p]) for p in policies]
    points = [pt for got in run_side_by_side(_policy_job, calls, jobs) for pt in got]
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
    with interrupt_on_term():  # SIGTERM stops the servers and gateways as Ctrl-C does
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
