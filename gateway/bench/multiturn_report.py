"""``specgate bench policies``' report for a multi-turn mix (``bench.multiturn``): its measured points and
report.md with TTFT p50/p90, E2E p50/p99, the prefix hit rate from the servers' counters, throughput, the
bootstrap intervals of specgate's E2E against each peer's, and the harness's CPU."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.bench.cpu import SATURATED
from gateway.bench.interval import LEVEL, ratio_interval
from gateway.bench.load import Result, percentile
from gateway.bench.mix import Mix
from gateway.bench.peer import PEER_POLICIES
from gateway.bench.points import LABELS, POLICY_FILES, Setup
from gateway.bench.prefix_precision import BLOCK_TOKENS, EndpointPrecision, overall, shortfall


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int
    kind: str
    result: Result
    prompt_tokens: int = 0  # from the answer's usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens (None: not reported)
    class_changed: bool = False  # this turn's class differs from the previous turn's
    predicted_tokens: int | None = None  # the gateway's predicted hit tokens, replayed (None: not known)


@dataclass(frozen=True, slots=True)
class MultiTurnPoint:
    policy: str
    load: float
    rate_rps: float  # offered turns per simulated second
    conv_rate: float  # offered conversations per simulated second
    window_s: float  # simulated seconds of the measured window
    turns: tuple[TurnResult, ...]
    hits: float = math.nan  # prefix-cache hit tokens over the window, all servers
    queries: float = math.nan  # prefix-cache queried tokens over the window, all servers
    cpu: dict[str, float] = field(default_factory=dict)
    lag: float = math.nan
    wall_s: float = 0.0
    precision: tuple[EndpointPrecision, ...] = ()  # per endpoint: predicted and measured hit tokens (specgate)

    @property
    def results(self) -> list[Result]:
        return [t.result for t in self.turns]

    @property
    def ok(self) -> list[Result]:
        return [t.result for t in self.turns if t.result.ok]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries > 0 else math.nan

    def e2e(self, q: float) -> float:
        return percentile((r.e2e_s for r in self.ok), q)

    def ttft(self, q: float) -> float:
        return percentile((r.ttft_s for r in self.ok if r.ttft_s is not None), q)

    @property
    def throughput(self) -> float:
        """Turns answered per simulated second of the window."""
        return len(self.ok) / self.window_s if self.window_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float:
        return sum(r.completion_tokens for r in self.ok) / self.window_s if self.window_s > 0 else math.nan


METRICS: tuple[tuple[str, Callable[[MultiTurnPoint], float], int], ...] = (
    ("TTFT p50 (s, streamed turns)", lambda p: p.ttft(0.5), 2),
    ("TTFT p90 (s, streamed turns)", lambda p: p.ttft(0.9), 2),
    ("E2E p50 (s)", lambda p: p.e2e(0.5), 2),
    ("E2E p99 (s)", lambda p: p.e2e(0.99), 2),
    ("prefix-cache hit rate (hit / queried prompt tokens, all servers)", lambda p: p.hit_rate, 3),
    ("throughput (turns answered / s)", lambda p: p.throughput, 2),
    ("output tokens / s", lambda p: p.tokens_per_s, 0),
    ("turns measured", lambda p: float(len(p.turns)), 0),
    ("errors", lambda p: float(len(p.turns) - len(p.ok)), 0),
)


def _fmt(v: float, digits: int) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def mt_table(points: list[MultiTurnPoint], get: Callable[[MultiTurnPoint], float], digits: int = 2) -> str:
    policies = list(dict.fromkeys(p.policy for p in points))
    loads = sorted({p.load for p in points})
    by = {(p.policy, p.load): p for p in points}
    rate = {p.load: p.rate_rps for p in points}
    lines = ["| offered load | turns/s | " + " | ".join(LABELS[p] for p in policies) + " |"]
    lines.append("|" + "---:|" * (2 + len(policies)))
    for load in loads:
        cells = [_fmt(get(by[(pol, load)]), digits) if (pol, load) in by else "-" for pol in policies]
        lines.append(f"| {load:.0%} | {rate[load]:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def intervals(points: list[MultiTurnPoint], mine: str = "adaptive") -> list[str]:
    """specgate's E2E p50 and p99 over each other policy's at every load, with bootstrap intervals."""
    by = {(p.policy, p.load): p for p in points}
    others = [pol for pol in dict.fromkeys(p.policy for p in points) if pol != mine]
    loads = sorted({p.load for p in points if p.policy == mine})
    if not others or not loads:
        return []
    lines = [
        f"## {LABELS[mine]} E2E over each other policy's ({LEVEL:.0%} bootstrap interval; below 1: {LABELS[mine]} "
        "faster)",
        "",
        "| offered load | against | p50 ratio | interval | p99 ratio | interval |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for load in loads:
        a = by[(mine, load)]
        mine_e2e = [r.e2e_s for r in a.ok]
        for other in others:
            b = by.get((other, load))
            if b is None:
                continue
            theirs = [r.e2e_s for r in b.ok]
            cells = []
            for q in (0.5, 0.99):
                ratio = a.e2e(q) / b.e2e(q) if b.e2e(q) > 0 else math.nan
                lo, hi = ratio_interval(mine_e2e, [theirs], seed=round(load * 1000), q=q)
                cells += [_fmt(ratio, 2), f"{_fmt(lo, 2)}-{_fmt(hi, 2)}"]
            lines.append(f"| {load:.0%} | {LABELS[other]} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def by_kind(points: list[MultiTurnPoint]) -> list[str]:
    """E2E p50 per conversation kind: which traffic gained or lost."""
    kinds = sorted({t.kind for p in points for t in p.turns})
    lines = ["## E2E p50 (s) per conversation kind", ""]
    lines += ["| policy | offered load | " + " | ".join(kinds) + " |", "|---|---:|" + "---:|" * len(kinds)]
    for p in points:
        cells = [_fmt(percentile((t.result.e2e_s for t in p.turns if t.kind == k and t.result.ok), 0.5), 2)
                 for k in kinds]  # fmt: skip
        lines.append(f"| {LABELS[p.policy]} | {p.load:.0%} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def cached_shares(points: list[MultiTurnPoint]) -> list[str]:
    """The cached share of the prompt tokens (from each answer's usage), for the turns whose class changed from the
    previous turn's and for the other later turns: what a class change costs in cache."""
    lines = ["## cached share of prompt tokens (usage.cached_tokens / prompt_tokens), later turns", ""]
    lines += ["| policy | offered load | class kept | class changed |", "|---|---:|---:|---:|"]
    shown = False
    for p in points:
        cells = []
        for changed in (False, True):
            ts = [t for t in p.turns if t.turn > 0 and t.class_changed == changed and t.cached_tokens is not None]
            prompt = sum(t.prompt_tokens for t in ts)
            cells.append(_fmt(sum(t.cached_tokens or 0 for t in ts) / prompt if prompt else math.nan, 3))
            shown = shown or bool(ts)
        lines.append(f"| {LABELS[p.policy]} | {p.load:.0%} | " + " | ".join(cells) + " |")
    return [*lines, ""] if shown else []


def prefix_precision(points: list[MultiTurnPoint]) -> list[str]:
    """The gateway's predicted hit tokens against the servers' measured ones per endpoint, and the share of turns
    predicted warmer than they were: how far the approximate index is from the caches."""
    shown = [p for p in points if p.precision and overall(p.precision).predicted > 0]
    if not shown:
        return []
    lines = [
        "## Prefix index against the caches (predicted / measured hit tokens over the window)",
        "",
        "Predicted: the gateway's `specgate_prefix_predicted_hit_tokens_total` (64-character chunks x 16, no "
        "tokenizer); measured: each server's `vllm:prefix_cache_hits_total`. Short turns: the turn's "
        f"`cached_tokens` fell short of the prediction (replayed in the harness) by more than one block "
        f"({BLOCK_TOKENS} tokens). A ratio near 1 with few short turns leaves precise block matching (vLLM's own "
        "block hashes) little to gain; above 1, the index thought endpoints warmer than they were.",
        "",
        "| policy | offered load | endpoint | predicted | measured | predicted / measured |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for p in shown:
        for r in (*p.precision, overall(p.precision)):
            lines.append(
                f"| {LABELS[p.policy]} | {p.load:.0%} | {r.endpoint} | {r.predicted:.0f} | {r.measured:.0f} | "
                f"{_fmt(r.ratio, 2)} |"
            )
    lines += ["", "| policy | offered load | short turns | turns compared | share |", "|---|---:|---:|---:|---:|"]
    for p in shown:
        short, counted = shortfall((t.predicted_tokens, t.cached_tokens) for t in p.turns)
        share = _fmt(short / counted if counted else math.nan, 3)
        lines.append(f"| {LABELS[p.policy]} | {p.load:.0%} | {short} | {counted} | {share} |")
    return [*lines, ""]


def harness(points: list[MultiTurnPoint]) -> list[str]:
    measured = [p for p in points if p.cpu]
    if not measured:
        return ["## Harness CPU", "", "- not measured here (no /proc)", ""]
    cores = os.cpu_count() or 1
    hot = [f"{p.policy} at {p.load:.0%} ({n} {v:.2f})" for p in measured for n, v in p.cpu.items() if v > SATURATED]
    full = [f"{p.policy} at {p.load:.0%} (all {sum(p.cpu.values()):.2f})" for p in measured
            if sum(p.cpu.values()) > SATURATED * cores]  # fmt: skip
    verdict = (
        f"- no process used more than {SATURATED:g} of a core, and all together less than {SATURATED:.0%} of the "
        f"machine's {cores} cores: the simulated servers, not the Python event loops, set the latencies"
        if not hot and not full
        else "- **the harness may have been the bottleneck** at: " + "; ".join(hot + full)
    )
    procs = sorted({n for p in measured for n in p.cpu})
    lines = ["## Harness CPU (share of one core during each measured window)", "", verdict, ""]
    lines += ["| policy | offered load | " + " | ".join(procs) + " | late steps (worst server) |"]
    lines += ["|---|---:|" + "---:|" * (len(procs) + 1)]
    for p in measured:
        cells = [_fmt(p.cpu.get(n, math.nan), 2) for n in procs]
        lines.append(f"| {LABELS[p.policy]} | {p.load:.0%} | " + " | ".join(cells) + f" | {_fmt(p.lag * 100, 2)}% |")
    return [*lines, ""]


def render_multiturn_report(
    points: list[MultiTurnPoint],
    mix: Mix,
    setup: Setup,
    capacity_how: str,
    policies: tuple[str, ...],
    machine: str = "",
) -> str:
    adaptive = mix.rules or "routing_rules/default.yaml"

    def fleet(p: str) -> str:
        front = f"vllm-router --policy {PEER_POLICIES[p]}" if p in PEER_POLICIES else "specgate"
        homogeneous = POLICY_FILES.get(p, "") == "bench/policies/standard-only.yaml"
        servers = f"{setup.servers}x standard" if homogeneous else f"{setup.fleet} (speculative+standard)"
        rules = POLICY_FILES.get(p, adaptive) if p not in PEER_POLICIES else "-"
        return f"{LABELS[p]}: {front} in front of {servers}" + (f" (`{rules}`)" if rules != "-" else "")

    parts = [
        f"# specgate bench policies: multi-turn mix `{mix.name}`",
        "",
        mix.description,
        "",
        "- policies: " + "; ".join(fleet(p) for p in policies),
        *(
            [
                f"- specgate: {setup.gateway_workers} gateway processes on one port, each with its own prefix "
                "indexes (as replicas behind a balancer without session affinity: a conversation's turns land on any)"
            ]
            if setup.gateway_workers > 1
            else []
        ),
        f"- simulated servers: {setup.max_num_seqs} running sequences at most, per-token costs x{setup.scale}, "
        f"clock x{setup.time_scale:g}, answers ~{setup.output_median:g} tokens (lognormal sigma "
        f"{setup.output_sigma:g}) capped by each turn's max_tokens; prefix caching on (vLLM's default)",
        f"- each load point: {setup.warmup_s:g} wall seconds of conversation arrivals that fill the caches and are "
        f"not measured, then {setup.duration_s:g} wall seconds measured (turns sent in the window); no turn is sent "
        f"after it; seed {setup.seed}, the same conversations for every policy and new ones at every load",
        f"- capacity (100% load): {capacity_how}",
        "- all times and rates on the simulated clock (wall time / time scale)",
        *([f"- machine: {machine}"] if machine else []),
        "",
    ]
    for label, get, digits in METRICS:
        parts += [f"## {label}", "", mt_table(points, get, digits), ""]
    parts += intervals(points)
    parts += by_kind(points)
    parts += cached_shares(points)
    parts += prefix_precision(points)
    parts += harness(points)
    return "\n".join(parts)


def write_multiturn_report(
    points: list[MultiTurnPoint],
    mix: Mix,
    setup: Setup,
    capacity_how: str,
    out_dir: Path,
    policies: tuple[str, ...],
    machine: str = "",
) -> None:
    (out_dir / "report.md").write_text(render_multiturn_report(points, mix, setup, capacity_how, policies, machine))
