"""``specgate bench capacity``: each policy's sustainable rate of conversations on its fleet and the first policy's
over the second's (specgate's over the cache-aware peer's). ``bench.capacity_judge`` says why it is measured so.

Per policy, one fleet and two phases of conversations (as in ``bench.multiturn``: open-loop Poisson arrivals, the
same draws and conversations for every policy; each turn waits for the previous answer and the think time):

1. the ceiling: offered ``Plan.overload`` x the computed capacity; after ``Plan.settle_s`` the turns answered per
   second over ``Plan.ceiling_s`` are the fleet's ceiling. Its conversations are then dropped (the load generator
   closes their connections) and the servers left to drain;
2. the holds: new conversations at the first of ``Plan.holds`` x the ceiling; ``Plan.warmup_s`` brings the open
   conversations to their steady state, then ``Plan.hold_s`` is judged: the turn backlog (the load generator's turns
   sent and not yet answered, sampled every ``SAMPLE_S``) flat and next to no failures, or not. A hold that does not
   sustain its rate is dropped and drained like the ceiling, and the next share is held.

Offered rates are fractions of ``bench.multiturn``'s computed capacity (turns/s of as many standard servers at a
full batch with a perfectly warm prefix cache), so both policies are measured on one scale. All durations in
``Plan`` are wall seconds.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.bench.capacity_judge import (
    LIMIT,
    Rules,
    Step,
    backlog_trend,
    compare,
    rate_and_error,
    saturated,
    sustained_bounds,
    verdict,
)  # fmt: skip
from gateway.bench.conversations import Conversation, ConversationSpec, plan_conversations, turn_request
from gateway.bench.cpu import CpuMeter
from gateway.bench.fleet import clock_lag, policy_rules, running_fleet, sim_clocks
from gateway.bench.jobs import interrupt_on_term, run_side_by_side
from gateway.bench.mix import Mix
from gateway.bench.multiturn import CONVERSATIONS_PER_LOAD, conversation_capacity, send_turn
from gateway.bench.points import LABELS, Setup
from gateway.bench.policies import busiest, check_policies
from gateway.config.packaged import DEFAULT_RULES

SAMPLE_S = 0.5  # wall seconds between two samples of the backlog
BATCH = 200  # conversations planned at a time
DRAIN_LIMIT_S = 30.0  # the most the servers get to empty after the ceiling phase


@dataclass(frozen=True, slots=True)
class Plan:
    """The two phases of a policy's run (wall seconds)."""

    overload: float = 1.4  # the ceiling phase's offered load, fraction of the computed capacity
    settle_s: float = 45.0
    ceiling_s: float = 60.0
    holds: tuple[float, ...] = (0.9, 0.8)  # the holds' offered turns, shares of the ceiling: the next if one fails
    warmup_s: float = 50.0
    hold_s: float = 120.0

    def wall_s(self, holds: int = 1) -> float:
        """Per policy with the fleet's start, ``holds`` holds and typical drains (the most: every hold run)."""
        return 15.0 + self.settle_s + self.ceiling_s + holds * (10.0 + self.warmup_s + self.hold_s)


@dataclass(slots=True)
class _Run:
    """The live state of one policy's run, shared by its tasks."""

    conv_rate: float = 0.0  # conversations per wall second now
    backlog: int = 0
    active: int = 0
    samples: list[tuple[float, float]] = field(default_factory=list)  # (wall s, turns in flight)
    answered: list[tuple[float, bool]] = field(default_factory=list)  # (wall s answered, ok)
    stopping: bool = False


async def _converse(
    run: _Run, session: aiohttp.ClientSession, url: str, conv: Conversation, model: str, setup: Setup, t0: float,
    send_task_header: bool,
) -> None:  # fmt: skip
    run.active += 1
    answers: list[str] = []
    try:
        for t, turn in enumerate(conv.turns):
            if t:
                await asyncio.sleep(turn.think_s * setup.time_scale)
            if run.stopping:
                return
            req = turn_request(conv, t, answers, model, send_task_header=send_task_header)
            run.backlog += 1
            try:
                res, answer, _ = await send_turn(session, url, req, turn.cls, time.monotonic() - t0, setup.time_scale)
            finally:
                run.backlog -= 1
            run.answered.append((time.monotonic() - t0, res.ok))
            if not res.ok:
                return  # the history is broken: the conversation ends here
            answers.append(answer)
    finally:
        run.active -= 1


async def _arrivals(
    run: _Run, spec: ConversationSpec, mix: Mix, seed: int, first: int, start: Callable[[Conversation], None]
) -> None:
    """Poisson arrivals at ``run.conv_rate`` (read as it changes): each needs one unit-exponential draw of
    rate x elapsed time; conversations ``first`` on; the same draws and conversations for every policy."""
    rng = random.Random(seed)
    planned: list[Conversation] = []
    k = first
    while not run.stopping:
        need = rng.expovariate(1.0)
        while need > 0 and not run.stopping:
            rate = max(run.conv_rate, 1e-9)
            began = time.monotonic()
            await asyncio.sleep(min(need / rate, 0.25))
            need -= rate * (time.monotonic() - began)
        if run.stopping:
            return
        if not planned:
            planned = plan_conversations(spec, mix.classes, seed, BATCH, first=k)
            k += BATCH
        start(planned.pop(0))


async def _sampler(run: _Run, t0: float) -> None:
    while not run.stopping:
        run.samples.append((time.monotonic() - t0, float(run.backlog)))
        await asyncio.sleep(SAMPLE_S)


async def phase(
    url: str, ports: list[int], mix: Mix, spec: ConversationSpec, setup: Setup, model: str, *,
    fraction: float, capacity: float, per_conv: float, settle_s: float, window_s: float, index: int,
) -> Step:  # fmt: skip
    """One phase against the front at ``url``: conversations at ``fraction`` x ``capacity`` turns/s, settled for
    ``settle_s`` and measured over ``window_s`` (wall); then every conversation is dropped (connections closed)."""
    run = _Run(conv_rate=fraction * capacity / per_conv / setup.time_scale)
    tasks: set[asyncio.Task[None]] = set()
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.monotonic()

        def start(conv: Conversation) -> None:
            task = asyncio.create_task(_converse(run, session, url, conv, model, setup, t0, mix.send_task_header))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        first = CONVERSATIONS_PER_LOAD * index  # each phase its own conversations, the same for every policy
        background = [
            asyncio.create_task(_arrivals(run, spec, mix, setup.seed + index, first, start)),
            asyncio.create_task(_sampler(run, t0)),
        ]
        try:
            await asyncio.sleep(settle_s)
            w0 = time.monotonic() - t0
            clocks = await asyncio.to_thread(sim_clocks, ports)
            await asyncio.sleep(window_s)
            w1 = time.monotonic() - t0
            lag = clock_lag(clocks, await asyncio.to_thread(sim_clocks, ports))
        finally:
            run.stopping = True
            for task in [*background, *tasks]:
                task.cancel()
            await asyncio.gather(*background, *tasks, return_exceptions=True)
    mean, rise = backlog_trend([x for x in run.samples if w0 <= x[0] <= w1])
    done = [ok for t, ok in run.answered if w0 <= t <= w1]
    ts = setup.time_scale
    # answered turns per simulated second: wall times / time scale
    _, se = rate_and_error([t / ts for t, ok in run.answered if ok], w0 / ts, w1 / ts)
    return Step(fraction, fraction * capacity, (w1 - w0) / ts, mean, rise, len(done), done.count(False), se, lag)


def drain(ports: list[int], limit_s: float = DRAIN_LIMIT_S) -> float:
    """Wait until no simulated server runs or queues a request (at most ``limit_s``); the seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        busy = 0.0
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            break
        time.sleep(0.5)
    return time.monotonic() - began


@dataclass(frozen=True, slots=True)
class PolicyCapacity:
    policy: str
    ceiling: Step
    saturated: bool  # the ceiling phase kept every server's batch full on average
    holds: tuple[tuple[Step, bool, str], ...]  # each hold with its verdict and why, until one sustained
    cpu: dict[str, float]
    wall_s: float

    @property
    def sustained(self) -> Step | None:
        """The hold that sustained its rate (None: none did)."""
        return next((h for h, ok, _ in self.holds if ok), None)


def measure_policy(
    policy: str, rules: dict[str, Any], mix: Mix, spec: ConversationSpec, setup: Setup, capacity: float,
    per_conv: float, plan: Plan, log: Callable[[str], None] = print,
) -> PolicyCapacity:  # fmt: skip
    """Start the policy's fleet, measure its ceiling, hold shares of it until one is sustained, stop the fleet."""
    began = time.monotonic()
    name = LABELS[policy]
    holds: list[tuple[Step, bool, str]] = []
    with running_fleet(policy, rules, setup, mix.model, ("--enable-prompt-tokens-details",)) as fleet:
        meter = CpuMeter(fleet.pids)
        meter.start()
        args = (fleet.url, fleet.sim_ports, mix, spec, setup, fleet.model)
        top = asyncio.run(phase(*args, fraction=plan.overload, capacity=capacity, per_conv=per_conv,
                                settle_s=plan.settle_s, window_s=plan.ceiling_s, index=1))  # fmt: skip
        slots = len(fleet.sim_ports) * setup.max_num_seqs
        log(
            f"{name}: ceiling {top.throughput:.2f} +- {top.throughput_se:.2f} turns/s answered at {plan.overload:.0%} "
            f"offered ({top.failed} failed, backlog {top.mean_backlog:.0f} for {slots} batch slots, late steps "
            f"{top.lag:.1%})"
        )
        for i, share in enumerate(plan.holds):
            drained = drain(fleet.sim_ports)
            fraction = share * top.throughput / capacity
            held = asyncio.run(phase(*args, fraction=fraction, capacity=capacity, per_conv=per_conv,
                                     settle_s=plan.warmup_s, window_s=plan.hold_s, index=2 + i))  # fmt: skip
            ok, why = verdict(held, len(fleet.sim_ports))
            holds.append((held, ok, why))
            log(
                f"{name}: hold {share:.0%} of the ceiling, {held.turns_rate:.2f} turns/s (drained in {drained:.0f} s): "
                f"{held.throughput:.2f} answered, {'sustained' if ok else 'NOT sustained'}: {why}"
            )
            if ok:
                break
        cpu = meter.stop()
    log(f"{name}: done ({time.monotonic() - began:.0f} s; busiest process {busiest(cpu)})")
    return PolicyCapacity(policy, top, saturated(top, slots), tuple(holds), cpu, time.monotonic() - began)


def _printed(line: str) -> None:
    print(line, flush=True)


def _capacity_job(
    policy: str, rules: dict[str, Any], mix: Mix, spec: ConversationSpec, setup: Setup, capacity: float,
    per_conv: float, plan: Plan,
) -> PolicyCapacity:  # fmt: skip
    return measure_policy(policy, rules, mix, spec, setup, capacity, per_conv, plan, _printed)


def bench_capacity(
    mix: Mix, spec: ConversationSpec, setup: Setup, plan: Plan, out_dir: Path, *,
    policies: tuple[str, ...] = ("adaptive", "peer-cache-aware"), root: Path = Path("."),
    log: Callable[[str], None] = print, jobs: int = 1,
) -> list[PolicyCapacity]:  # fmt: skip
    """Every policy's run (``jobs`` at once, each in a process of its own); report.md and steps.json in
    ``out_dir``."""
    check_policies(policies)
    adaptive = yaml.safe_load(((root / mix.rules) if mix.rules else DEFAULT_RULES).read_text())
    if mix.output_len_median is not None:
        setup = replace(setup, output_median=mix.output_len_median)
    capacity, how = conversation_capacity(mix, spec, setup)
    per_conv = sum(len(c.turns) for c in plan_conversations(spec, mix.classes, setup.seed, 400)) / 400
    out_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"capacity {capacity:.2f} turns/s (simulated); planned: {len(policies)} policies x {plan.wall_s():.0f} s "
        f"(each hold after a failed one: {plan.wall_s(2) - plan.wall_s():.0f} s more) ≈ "
        f"{len(policies) * plan.wall_s() / 60 / max(1, min(jobs, len(policies))):.1f} min"
    )
    before = os.getloadavg()[0]
    rules = {policy: policy_rules(policy, adaptive, root) for policy in policies}
    calls = [(p, rules[p], mix, spec, setup, capacity, per_conv, plan) for p in policies]
    with interrupt_on_term():
        if jobs > 1 and len(policies) > 1:
            results = run_side_by_side(_capacity_job, calls, jobs)
        else:
            results = [measure_policy(*args, log=log) for args in calls]
    machine = f"{os.cpu_count()} cores, load average {before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end"
    if jobs > 1 and len(policies) > 1:
        machine += f"; {min(jobs, len(policies))} policies ran at once"
    (out_dir / "report.md").write_text(render(results, mix, setup, plan, how, machine))
    rows = [
        {"policy": r.policy, "phase": name, **asdict(step), "throughput": step.throughput, "sustained": ok, "why": why}
        for r in results
        for name, step, ok, why in (("ceiling", r.ceiling, r.saturated, "saturated"), *(("hold", *h) for h in r.holds))
    ]
    (out_dir / "steps.json").write_text(json.dumps([{k: _finite(v) for k, v in row.items()} for row in rows], indent=1))
    return results


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def render(
    results: list[PolicyCapacity], mix: Mix, setup: Setup, plan: Plan, how: str, machine: str
) -> str:  # fmt: skip
    rules = Rules()
    shares = ", then ".join(f"{h:.0%}" for h in plan.holds)
    lines = [
        f"# specgate bench capacity: mix `{mix.name}`, fleet {setup.fleet}",
        "",
        mix.description,
        "",
        f"- capacity (100%): {how}",
        f"- per policy, on one fleet: the ceiling (conversations offered at {plan.overload:.0%}, {plan.settle_s:g} s "
        f"to build the backlog, then the turns answered over {plan.ceiling_s:g} s, with a standard error from 6 "
        "sub-windows; saturated: a mean backlog of at least every server's full batch), its conversations dropped "
        f"and the servers drained, then the holds (new conversations at {shares} of the ceiling until one sustains "
        f"it, each {plan.warmup_s:g} s of warm-up and {plan.hold_s:g} s judged); wall seconds, clock "
        f"x{setup.time_scale:g}; seed {setup.seed}, the same conversations and arrival draws for every policy",
        f"- a hold sustained its rate: the turn backlog's fitted rise over the window within {rules.rise_share:.0%}"
        f" of its mean (or {rules.rise_floor:g} turns per server), and at most {rules.max_failed:.0%} of the answered"
        " turns failed (`gateway/bench/capacity_judge.py` says why a ceiling and holds, not a ladder of short steps)",
        f"- simulated servers: {setup.max_num_seqs} running sequences at most, per-token costs x{setup.scale}; rates "
        "in turns per simulated second",
        f"- machine: {machine}",
        "",
        "| policy | ceiling: answered turns/s | +- (se) | failed | backlog mean | saturated | late steps |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        c = r.ceiling
        lines.append(
            f"| {LABELS[r.policy]} | {c.throughput:.2f} | {c.throughput_se:.2f} | {c.failed} | {c.mean_backlog:.0f} | "
            f"{'yes' if r.saturated else 'no'} | {_pct(c.lag)} |"
        )
    lines += [
        "",
        "| policy | hold: offered turns/s | answered turns/s | backlog mean | rise | failed | late steps | sustained |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for h, ok, why in r.holds:
            lines.append(
                f"| {LABELS[r.policy]} | {h.turns_rate:.2f} ({h.fraction:.0%}) | {h.throughput:.2f} | "
                f"{h.mean_backlog:.0f} | {h.rise:+.0f} | {h.failed} | {_pct(h.lag)} | {'yes' if ok else 'no'}: {why} |"
            )
    if len(results) >= 2:
        lines += ["", *_comparison(results[0], results[1])]
    lags = [s.lag for r in results for s in (r.ceiling, *(h for h, _, _ in r.holds)) if not math.isnan(s.lag)]
    if lags and max(lags) > 0.02:
        lines.append(f"- **the simulated servers ran late** by up to {max(lags):.1%}: the machine, not the fleet")
    return "\n".join([*lines, ""])


def _comparison(mine: PolicyCapacity, peer: PolicyCapacity) -> list[str]:
    """The first policy against the second: their ceilings, and their sustainable rates bounded by holds and
    ceilings."""
    who = f"{LABELS[mine.policy]} / {LABELS[peer.policy]}"
    ratio = compare(mine.ceiling, peer.ceiling)
    reading = ratio.reading() if mine.saturated and peer.saturated else "unknown: a ceiling phase was not saturated"
    out = [f"- {who}, ceilings: {ratio.value:.2f}x (95% interval {ratio.lo:.2f}-{ratio.hi:.2f}); at least {LIMIT:g}x: "
           f"**{reading}**"]  # fmt: skip
    a, b = mine.sustained, peer.sustained
    if a is None or b is None:
        out.append(f"- {who}, sustainable rates: **unknown**: not both policies sustained a hold")
        return out
    bounds = sustained_bounds(a.turns_rate, mine.ceiling.throughput, b.turns_rate, peer.ceiling.throughput)
    out.append(
        f"- {who}, sustainable rates: {a.turns_rate:.2f} / {b.turns_rate:.2f} turns/s sustained = {bounds.value:.2f}x "
        f"(each between its sustained hold and its ceiling: {bounds.lo:.2f}-{bounds.hi:.2f}x); at least {LIMIT:g}x: "
        f"**{bounds.reading()}**"
    )
    return out


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.1%}"
