"""``specgate bench capacity``: each policy's sustainable rate of conversations on its fleet, by one long run that
climbs and bisects a ladder of offered rates (``bench.capacity_judge`` decides), and the ratio of the first
policy's to the second's (specgate's to the cache-aware peer's).

Conversations arrive open loop (Poisson at the step's rate, the same draws for every policy; the rate changes at
each step boundary and the conversations already going go on), as in ``bench.multiturn``: each turn waits for the
previous answer and the think time. The first step begins with ``warmup_s`` more of settling (the conversations in
flight build up from none); every step then settles ``settle_s`` and is judged over ``window_s`` (wall seconds).
The turn backlog is the load generator's count of turns sent and not yet answered, sampled every ``SAMPLE_S``.
Offered rates are fractions of ``bench.multiturn``'s computed capacity (turns/s of as many standard servers at a
full batch with a perfectly warm prefix cache), so both policies are measured on one scale.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
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
    bracket,
    compare,
    next_fraction,
    verdict,
)  # fmt: skip
from gateway.bench.conversations import Conversation, ConversationSpec, plan_conversations, turn_request
from gateway.bench.cpu import CpuMeter
from gateway.bench.fleet import clock_lag, policy_rules, running_fleet, sim_clocks
from gateway.bench.jobs import interrupt_on_term
from gateway.bench.mix import Mix
from gateway.bench.multiturn import conversation_capacity, send_turn
from gateway.bench.points import LABELS, Setup
from gateway.bench.policies import busiest, check_policies
from gateway.config.packaged import DEFAULT_RULES

SAMPLE_S = 0.5  # wall seconds between two samples of the backlog
BATCH = 200  # conversations planned at a time


@dataclass(frozen=True, slots=True)
class Ladder:
    """How the rates are stepped and how long each is held (wall seconds)."""

    start: float = 0.9
    step: float = 0.2
    resolution: float = 0.05
    steps: int = 4
    warmup_s: float = 45.0
    settle_s: float = 25.0
    window_s: float = 40.0

    def wall_s(self) -> float:
        return self.warmup_s + self.steps * (self.settle_s + self.window_s)


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
    run: _Run, spec: ConversationSpec, mix: Mix, setup: Setup, start: Callable[[Conversation], None]
) -> None:
    """Poisson arrivals at ``run.conv_rate`` (read as it changes): each needs one unit-exponential draw of
    rate x elapsed time, the same draws for every policy."""
    rng = random.Random(setup.seed)
    planned: list[Conversation] = []
    k = 0
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
            planned = plan_conversations(spec, mix.classes, setup.seed, BATCH, first=k)
            k += BATCH
        start(planned.pop(0))


async def _sampler(run: _Run, t0: float) -> None:
    while not run.stopping:
        run.samples.append((time.monotonic() - t0, float(run.backlog)))
        await asyncio.sleep(SAMPLE_S)


async def climb(
    url: str, ports: list[int], mix: Mix, spec: ConversationSpec, setup: Setup, capacity: float, per_conv: float,
    ladder: Ladder, model: str, log: Callable[[str], None], rules: Rules | None = None,
) -> list[tuple[Step, bool, str]]:  # fmt: skip
    """One policy's run against its front at ``url``: every step with its verdict and why."""
    run = _Run()
    tasks: set[asyncio.Task[None]] = set()
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    out: list[tuple[Step, bool, str]] = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.monotonic()

        def start(conv: Conversation) -> None:
            task = asyncio.create_task(_converse(run, session, url, conv, model, setup, t0, mix.send_task_header))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        background = [
            asyncio.create_task(_arrivals(run, spec, mix, setup, start)),
            asyncio.create_task(_sampler(run, t0)),
        ]
        try:
            fraction = next_fraction([], ladder.start, ladder.step, ladder.resolution)
            k = 0
            while fraction is not None and k < ladder.steps:
                run.conv_rate = fraction * capacity / per_conv / setup.time_scale
                settle = ladder.settle_s + (ladder.warmup_s if k == 0 else 0.0)
                await asyncio.sleep(settle)
                w0 = time.monotonic() - t0
                clocks = await asyncio.to_thread(sim_clocks, ports)
                await asyncio.sleep(ladder.window_s)
                w1 = time.monotonic() - t0
                lag = clock_lag(clocks, await asyncio.to_thread(sim_clocks, ports))
                step = _measure(run, fraction, capacity, w0, w1, setup.time_scale, lag)
                ok, why = verdict(step, len(ports), rules)
                out.append((step, ok, why))
                log(
                    f"  step {k + 1}: {fraction:.0%} ({step.turns_rate:.2f} turns/s): backlog {step.mean_backlog:.0f}"
                    f", {step.throughput:.2f} turns/s answered, {step.failed} failed, "
                    f"{'sustained' if ok else 'NOT sustained'}: {why}"
                )
                k += 1
                fraction = next_fraction([(s.fraction, v) for s, v, _ in out], ladder.start, ladder.step,
                                         ladder.resolution)  # fmt: skip
        finally:
            run.stopping = True
            for task in [*background, *tasks]:
                task.cancel()
            await asyncio.gather(*background, *tasks, return_exceptions=True)
    return out


def _measure(run: _Run, fraction: float, capacity: float, w0: float, w1: float, ts: float, lag: float) -> Step:
    mean, rise = backlog_trend([s for s in run.samples if w0 <= s[0] <= w1])
    done = [ok for t, ok in run.answered if w0 <= t <= w1]
    return Step(fraction, fraction * capacity, (w1 - w0) / ts, mean, rise, len(done), done.count(False), lag)


@dataclass(frozen=True, slots=True)
class PolicyCapacity:
    policy: str
    steps: tuple[tuple[Step, bool, str], ...]
    cpu: dict[str, float]
    wall_s: float

    @property
    def bracket(self) -> tuple[float | None, float | None]:
        return bracket([(s.fraction, ok) for s, ok, _ in self.steps])

    @property
    def saturated(self) -> float:
        """Turns answered per simulated second at the unsustained steps (NaN: none): the fleet's own ceiling."""
        rates = [s.throughput for s, ok, _ in self.steps if not ok]
        return max(rates) if rates else math.nan


def bench_capacity(
    mix: Mix, spec: ConversationSpec, setup: Setup, ladder: Ladder, out_dir: Path, *,
    policies: tuple[str, ...] = ("adaptive", "peer-cache-aware"), root: Path = Path("."),
    log: Callable[[str], None] = print,
) -> list[PolicyCapacity]:  # fmt: skip
    """Every policy's run, one after the other; report.md and steps.json in ``out_dir``."""
    check_policies(policies)
    adaptive = yaml.safe_load(((root / mix.rules) if mix.rules else DEFAULT_RULES).read_text())
    if mix.output_len_median is not None:
        setup = replace(setup, output_median=mix.output_len_median)
    capacity, how = conversation_capacity(mix, spec, setup)
    per_conv = sum(len(c.turns) for c in plan_conversations(spec, mix.classes, setup.seed, 400)) / 400
    out_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"capacity {capacity:.2f} turns/s (simulated); planned: {len(policies)} policies x at most "
        f"{ladder.wall_s() + 15:.0f} s ≈ {len(policies) * (ladder.wall_s() + 15) / 60:.1f} min"
    )
    before = os.getloadavg()[0]
    results: list[PolicyCapacity] = []
    with interrupt_on_term():
        for policy in policies:
            began = time.monotonic()
            rules = policy_rules(policy, adaptive, root)
            log(f"{LABELS[policy]}:")
            with running_fleet(policy, rules, setup, mix.model, ("--enable-prompt-tokens-details",)) as fleet:
                meter = CpuMeter(fleet.pids)
                meter.start()
                steps = asyncio.run(
                    climb(fleet.url, fleet.sim_ports, mix, spec, setup, capacity, per_conv, ladder, fleet.model, log)
                )
                cpu = meter.stop()
            results.append(PolicyCapacity(policy, tuple(steps), cpu, time.monotonic() - began))
            log(f"  ({results[-1].wall_s:.0f} s; busiest process {busiest(cpu)})")
    machine = f"{os.cpu_count()} cores, load average {before:.1f} at the start and {os.getloadavg()[0]:.1f} at the end"
    (out_dir / "report.md").write_text(render(results, mix, setup, ladder, how, machine))
    rows = [{"policy": r.policy, **asdict(s), "sustained": ok, "why": why} for r in results for s, ok, why in r.steps]
    (out_dir / "steps.json").write_text(json.dumps([{k: _finite(v) for k, v in row.items()} for row in rows], indent=1))
    return results


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _pct(f: float | None) -> str:
    return "-" if f is None else f"{f:.0%}"


def render(
    results: list[PolicyCapacity], mix: Mix, setup: Setup, ladder: Ladder, how: str, machine: str
) -> str:  # fmt: skip
    rules = Rules()
    lines = [
        f"# specgate bench capacity: mix `{mix.name}`, fleet {setup.fleet}",
        "",
        mix.description,
        "",
        f"- capacity (100%): {how}",
        f"- one run per policy: {ladder.warmup_s:g} s of warm-up, then steps of {ladder.settle_s:g} s settling + "
        f"{ladder.window_s:g} s judged (wall; clock x{setup.time_scale:g}); first step {ladder.start:.0%}, "
        f"{ladder.step:.0%} up or down, then bisection to {ladder.resolution:.0%}, at most {ladder.steps} steps; "
        f"seed {setup.seed}, the same conversations and arrival draws for every policy",
        f"- sustained: the turn backlog's fitted rise over the window within {rules.rise_share:.0%} of its mean (or "
        f"{rules.rise_floor:g} turns per server), and at most {rules.max_failed:.0%} of the answered turns failed "
        "(`gateway/bench/capacity_judge.py`)",
        f"- simulated servers: {setup.max_num_seqs} running sequences at most, per-token costs x{setup.scale}",
        f"- machine: {machine}",
        "",
        "| policy | step | offered | turns/s offered | backlog mean | rise | answered turns/s | failed | late steps "
        "| verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        for i, (s, ok, why) in enumerate(r.steps, 1):
            late = "-" if math.isnan(s.lag) else f"{s.lag:.1%}"
            lines.append(
                f"| {LABELS[r.policy]} | {i} | {s.fraction:.0%} | {s.turns_rate:.2f} | {s.mean_backlog:.0f} | "
                f"{s.rise:+.0f} | {s.throughput:.2f} | {s.failed} | {late} | "
                f"{'sustained' if ok else 'not sustained'}: {why} |"
            )
    lines += ["", "| policy | sustainable (highest sustained) | lowest not sustained | answered turns/s when not |"]
    lines += ["|---|---:|---:|---:|"]
    for r in results:
        lo, hi = r.bracket
        ceiling = "-" if math.isnan(r.saturated) else f"{r.saturated:.2f}"
        lines.append(f"| {LABELS[r.policy]} | {_pct(lo)} | {_pct(hi)} | {ceiling} |")
    if len(results) >= 2:
        mine, peer = results[0], results[1]
        c = compare(mine.bracket, peer.bracket)
        sat = mine.saturated / peer.saturated
        lines += [
            "",
            f"- {LABELS[mine.policy]} / {LABELS[peer.policy]}: sustainable {c.value:.2f}x (bounds from the brackets "
            f"{c.lo:.2f}-{c.hi:.2f}); at least {LIMIT:g}x: **{c.reading()}**"
            + ("" if math.isnan(sat) else f"; answered turns/s when not sustained: {sat:.2f}x"),
        ]
    lags = [s.lag for r in results for s, _, _ in r.steps if not math.isnan(s.lag)]
    if lags and max(lags) > 0.02:
        lines.append(f"- **the simulated servers ran late** by up to {max(lags):.1%}: the machine, not the fleet")
    return "\n".join([*lines, ""])
