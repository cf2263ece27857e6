"""``specgate bench reference``: what any fixed split of a mix's classes between the two pool kinds can reach.

The policy sweep measures specgate's routing against the homogeneous fleets; this model answers the question a
missed target raises: *could any routing of shares have met it on this fleet?* It replays the same requests as
``bench policies`` (the mix's planned requests, their prompt and answer lengths as the simulator plans them, the
same scaled step physics) through one in-process simulated engine per server on its **virtual clock** (time jumps
from event to event: exact, fast, no harness in the measurement), for a fixed split: each class sends a share of
its requests to the speculative servers, the rest to the standard ones, and within a pool the requests take the
servers in turn (round robin).

Every evaluated split draws the same arrivals, lengths, acceptances and coin flips (common random numbers), so two
splits are compared on the same requests; the search is a coordinate descent over the per-class shares from the
best of the simple rules (everything speculative, everything standard, each class wholly on one kind). The
homogeneous fleets are modelled the same way (round robin), so the ratios are like for like. What the
model leaves out: queue-aware choices between servers (the gateway's endpoint balancing and spill), the gateway's
own overhead and the controllers' reaction time; it bounds what fixed shares can do, not what a queue-aware router
can.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.bench.load import arrival_times, percentile
from gateway.bench.mix import Mix, plan_request
from gateway.bench.points import Setup
from gateway.sim.engine import Engine, GenRequest
from gateway.sim.launch import PRESET
from gateway.sim.metrics import VllmMetrics
from gateway.sim.parsing import OutputLengths, parse_request
from gateway.sim.physics import AcceptanceModel, SpecConfig
from gateway.sim.presets import get_preset

GRID = tuple(i / 8 for i in range(9))  # the shares a class may send to the speculative servers


@dataclass(frozen=True, slots=True)
class Req:
    """One planned request as a simulated server sees it."""

    at_s: float  # arrival, simulated seconds
    cls: int  # index of its class in the mix
    prompt_tokens: int
    output_tokens: int
    acceptance: float  # its draft acceptance on the speculative servers
    coin: float  # uniform [0, 1): speculative when below its class's share


def plan(mix: Mix, setup: Setup, rate: float, duration_s: float, method: str, seed: int) -> list[Req]:
    """The requests of one load point: ``rate`` simulated requests/s for ``duration_s`` simulated seconds."""
    ts = setup.time_scale
    times = [
        t / ts for t in arrival_times(mix.arrival_kind(rate / ts), rate / ts, duration_s * ts, random.Random(seed))
    ]
    rng = random.Random(seed + 1)
    coins = random.Random(seed + 2)
    accept = AcceptanceModel()
    names = [c.name for c in mix.classes]
    lengths = OutputLengths(setup.output_median, setup.output_sigma)
    max_len = get_preset(PRESET).max_model_len
    out = []
    for t in times:
        p = plan_request(mix, "m", rng)
        sim = parse_request("chat", p.body, served=["m"], max_model_len=max_len, lengths=lengths)
        temperature = sim.temperature
        a = accept.draw(coins, temperature, p.headers.get("x-sim-task", "chat"), method)
        seq = sim.seqs[0]
        out.append(Req(t, names.index(p.cls.name), seq.prompt_tokens, seq.output_tokens, a, coins.random()))
    return out


def _engine(setup: Setup, spec_json: str | None, seed: int) -> Engine:
    spec = SpecConfig.from_json(spec_json) if spec_json else None
    target, draft = setup.costs(spec.method if spec is not None else None)
    metrics = VllmMetrics(model_name="m", speculative=spec.num_speculative_tokens if spec else None)
    return Engine(
        get_preset(PRESET), spec, metrics, max_num_seqs=setup.max_num_seqs, seed=seed, target=target, draft=draft,
        virtual_clock=True,
    )  # fmt: skip


async def _serve(setup: Setup, spec_json: str | None, reqs: Sequence[Req], seed: int) -> list[float]:
    """E2E seconds of each request on one server (virtual clock)."""
    engine = _engine(setup, spec_json, seed)
    await engine.start()
    e2e: list[float] = []

    async def one(r: Req, i: int) -> None:
        gen = engine.submit(GenRequest(f"r{i}", r.prompt_tokens, r.output_tokens, r.acceptance if spec_json else 0.0))
        async for _ in gen:
            pass
        if gen.finished is not None and gen.arrival is not None:
            e2e.append(gen.finished - gen.arrival)

    tasks = []
    try:
        for i, r in enumerate(reqs):
            await engine.sleep_until(r.at_s)
            tasks.append(asyncio.create_task(one(r, i)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await engine.stop()
    return e2e


def fleet_e2e(
    reqs: Sequence[Req], shares: Sequence[float], setup: Setup, spec_json: str | None, spec_n: int, std_n: int
) -> list[float]:
    """Every request's E2E on a fleet of ``spec_n`` speculative and ``std_n`` standard servers, class ``c`` sending
    ``shares[c]`` of its requests to the speculative ones (a homogeneous fleet: one count 0, its shares all 0 or 1)."""
    groups: dict[tuple[bool, int], list[Req]] = {}
    sent = {True: 0, False: 0}
    for r in reqs:
        spec = r.coin < shares[r.cls]
        n = spec_n if spec else std_n
        groups.setdefault((spec, sent[spec] % n), []).append(r)  # round robin within a pool
        sent[spec] += 1

    async def all_servers() -> list[float]:
        runs = [_serve(setup, spec_json if spec else None, g, 11 + i) for (spec, i), g in sorted(groups.items())]
        return [x for xs in await asyncio.gather(*runs) for x in xs]

    return asyncio.run(all_servers())


@dataclass(frozen=True, slots=True)
class Frontier:
    load: float
    requests: int
    standard_p99: float  # the homogeneous fleets (as many servers, taking requests in turn)
    speculative_p99: float
    best_shares: tuple[float, ...]  # per class of the mix
    best_p99: float
    rules: dict[str, float]  # p99 of the simple rules: "all speculative", "all standard", "only <class> speculative"
    evaluated: int
    fresh_ratio: float = math.nan  # the best split's ratio to the best homogeneous fleet on other requests

    @property
    def best_homogeneous(self) -> float:
        return min(self.standard_p99, self.speculative_p99)


def search(
    mix: Mix, setup: Setup, load: float, capacity_rps: float, spec_json: str, *, duration_s: float, seed: int,
    log: Callable[[str], None] = print,
) -> Frontier:  # fmt: skip
    """The best fixed split of the mix's classes at one load (coordinate descent over ``GRID``)."""
    method = json.loads(spec_json)["method"]
    reqs = plan(mix, setup, load * capacity_rps, duration_s, method, seed)
    n = len(mix.classes)
    servers = setup.servers
    seen: dict[tuple[float, ...], float] = {}

    def p99(shares: tuple[float, ...]) -> float:
        if shares not in seen:
            seen[shares] = percentile(
                fleet_e2e(reqs, shares, setup, spec_json, setup.spec_servers, setup.std_servers), 0.99
            )
        return seen[shares]

    std = percentile(fleet_e2e(reqs, (0.0,) * n, setup, None, 1, servers), 0.99)
    spec = percentile(fleet_e2e(reqs, (1.0,) * n, setup, spec_json, servers, 1), 0.99)
    rules = {"all speculative": p99((1.0,) * n), "all standard": p99((0.0,) * n)}
    corners = list(itertools.product((0.0, 1.0), repeat=n))
    for c in corners:
        p99(c)
    best = min(corners, key=p99)
    for _ in range(2):  # two passes of coordinate descent
        for k in range(n):
            for share in GRID:
                trial = (*best[:k], share, *best[k + 1 :])
                if p99(trial) < p99(best):
                    best = trial
    for i, cls in enumerate(mix.classes):
        rules[f"only {cls.name} speculative"] = p99(tuple(1.0 if j == i else 0.0 for j in range(n)))
    # the lowest of some fifty p99s on one set of requests is optimistic: the chosen split again, on other requests
    fresh = plan(mix, setup, load * capacity_rps, duration_s, method, seed + 1000)
    fresh_best = min(
        percentile(fleet_e2e(fresh, (0.0,) * n, setup, None, 1, servers), 0.99),
        percentile(fleet_e2e(fresh, (1.0,) * n, setup, spec_json, servers, 1), 0.99),
    )
    fresh_split = percentile(fleet_e2e(fresh, best, setup, spec_json, setup.spec_servers, setup.std_servers), 0.99)
    log(
        f"  load {load:.0%}: {len(reqs)} requests; {servers}x standard {std:.2f} s, {servers}x speculative "
        f"{spec:.2f} s, best split {p99(best):.2f} s at "
        f"{', '.join(f'{c.name} {s:.2f}' for c, s in zip(mix.classes, best, strict=True))}; on other requests "
        f"{fresh_split / fresh_best:.2f}x the best fleet"
    )
    return Frontier(load, len(reqs), std, spec, best, p99(best), rules, len(seen), fresh_split / fresh_best)


def render(mix: Mix, setup: Setup, points: list[Frontier], within: float, measured: dict[float, float]) -> str:
    """The reference model's report: per load, the homogeneous fleets, the best fixed split and its ratio to the
    best homogeneous fleet, and (when given) the live sweep's adaptive ratio next to it."""
    names = [c.name for c in mix.classes]
    lines = [
        f"# specgate bench reference: mix `{mix.name}`, fleet {setup.fleet}",
        "",
        "p99 E2E (simulated seconds) of fixed splits on the virtual clock; shares = each class's share sent to the "
        "speculative servers; the best split is chosen on one set of requests and its ratio checked on another "
        '("on other requests"): it meets the target only where both ratios do.',
        "",
        f"| load | requests | {setup.servers}x standard | {setup.servers}x speculative | best split | its ratio "
        "| shares ("
        + ", ".join(names)
        + ") | on other requests | fixed splits meet x"
        + f"{within:g}?"
        + (" | adaptive (live sweep) |" if measured else " |"),
        "|---:|---:|---:|---:|---:|---:|---|---:|---|" + ("---:|" if measured else ""),
    ]
    for p in points:
        ratio = p.best_p99 / p.best_homogeneous if p.best_homogeneous > 0 else math.nan
        live = f" {measured[p.load]:.2f} |" if p.load in measured else (" - |" if measured else "")
        lines.append(
            f"| {p.load:.0%} | {p.requests} | {p.standard_p99:.2f} | {p.speculative_p99:.2f} | {p.best_p99:.2f} | "
            f"{ratio:.2f} | {', '.join(f'{s:.2f}' for s in p.best_shares)} | {p.fresh_ratio:.2f} | "
            f"{'yes' if max(ratio, p.fresh_ratio) <= within else 'no'} |" + live
        )
    lines += ["", "simple rules (ratio to the best homogeneous fleet):", ""]
    rule_names = list(points[0].rules) if points else []
    lines += ["| load | " + " | ".join(rule_names) + " |", "|---:|" + "---:|" * len(rule_names)]
    for p in points:
        lines.append(
            f"| {p.load:.0%} | " + " | ".join(f"{p.rules[r] / p.best_homogeneous:.2f}" for r in rule_names) + " |"
        )
    return "\n".join(lines) + "\n"


def reference_fleet_spec(rules: dict[str, Any]) -> str:
    """The speculative config of the adaptive rules' speculative pool (what the sweep's servers run)."""
    from gateway.sim.launch import spec_config_json

    for pool in rules["pools"]:
        cfg = spec_config_json(pool)
        if cfg is not None:
            return cfg
    raise ValueError("the mix's routing rules have no speculative pool")


def sweep_ratios(results_jsonl: Path) -> dict[float, float]:
    """Adaptive p99 E2E over the best homogeneous fleet's, per load, from a ``bench policies`` results.jsonl."""
    e2e: dict[tuple[str, float], list[float]] = {}
    with results_jsonl.open() as f:
        for line in f:
            row = json.loads(line)
            if row.get("status") == 200 and not row.get("error") and row.get("e2e_s") is not None:
                e2e.setdefault((row["policy"], float(row["load"])), []).append(float(row["e2e_s"]))
    out = {}
    for (policy, load), values in e2e.items():
        base = [percentile(e2e[(h, load)], 0.99) for h in ("standard", "speculative") if (h, load) in e2e]
        if policy == "adaptive" and base:
            out[load] = percentile(values, 0.99) / min(base)
    return out
