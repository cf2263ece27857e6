"""``specgate bench policies``' outputs: PNG plots (matplotlib, Agg) and the markdown report with the target check."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from gateway.bench.mix import Mix, Target
from gateway.bench.paired import LEVEL, Ratio, limits_at, paired_ratios, verdict
from gateway.bench.points import FIRST_WARMUP, LABELS, POLICY_FILES, Point, Setup
from gateway.bench.variant import variant_table

METRICS: tuple[tuple[str, str, Callable[[Point], float]], ...] = (
    ("e2e_p50", "p50 E2E (s)", lambda p: p.summary.e2e[0]),
    ("e2e_p99", "p99 E2E (s)", lambda p: p.summary.e2e[2]),
    ("tpot_p50", "p50 TPOT (ms)", lambda p: p.summary.tpot[0] * 1000),
    ("goodput", "goodput (req/s)", lambda p: p.summary.goodput_rps),
)


def _series(points: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:
        out.setdefault(p.policy, []).append(p)
    return {k: sorted(v, key=lambda p: p.load) for k, v in out.items()}


# matplotlib is an optional dependency: the runtime image and a plain ``pip install specgate`` go without it.
BENCH_EXTRA_HINT = "pip install 'specgate[bench]'"
LAG_OK = 0.02  # late steps worth up to 2% of a point's simulated time: within the noise of its p99


class PlotsUnavailable(RuntimeError):
    """matplotlib (the ``bench`` extra) is not installed: the report goes without plots."""


def plot_points(points: list[Point], out_dir: Path) -> list[str]:
    """One PNG per metric plus ``policies.png`` with all four; the file names. ``PlotsUnavailable`` without
    matplotlib."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable(f"plots not drawn: matplotlib is not installed ({BENCH_EXTRA_HINT})") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _series(points)
    names = []
    fig_all, axes = plt.subplots(2, 2, figsize=(11, 8))
    for (key, label, get), ax_all in zip(METRICS, axes.flat, strict=True):
        fig, ax = plt.subplots(figsize=(6, 4))
        for target in (ax, ax_all):
            for policy, pts in series.items():
                target.plot([p.load * 100 for p in pts], [get(p) for p in pts], marker="o", label=LABELS[policy])
            target.set_xlabel("offered load (% of capacity)")
            target.set_ylabel(label)
            target.grid(True, alpha=0.3)
            target.legend(fontsize=8)
        ax.set_title(label)
        fig.tight_layout()
        fig.savefig(out_dir / f"{key}.png", dpi=100)
        plt.close(fig)
        names.append(f"{key}.png")
    fig_all.suptitle("specgate bench policies")
    fig_all.tight_layout()
    fig_all.savefig(out_dir / "policies.png", dpi=100)
    plt.close(fig_all)
    return ["policies.png", *names]


def _fmt(v: float, digits: int = 2) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def table(points: list[Point], get: Callable[[Point], float], digits: int = 2) -> str:

    series = _series(points)
    policies = list(series)
    loads = sorted({p.load for p in points})
    rate = {p.load: p.rate_rps for p in points}
    head = "| offered load | req/s | " + " | ".join(LABELS[p] for p in policies) + " |"
    lines = [head, "|" + "---:|" * (2 + len(policies))]
    for load in loads:
        cells = []
        for policy in policies:
            pt = next((p for p in series[policy] if p.load == load), None)
            cells.append("-" if pt is None else _fmt(get(pt), digits))
        lines.append(f"| {load:.0%} | {rate[load]:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def class_shares(points: list[Point], policy: str = "adaptive") -> list[str]:
    """The policy's share of each request class answered by a speculative server, per load: where it put what."""
    mine = sorted((p for p in points if p.policy == policy), key=lambda p: p.load)
    names = sorted({c.cls for p in mine for c in p.per_class})
    if not mine or not names:
        return []
    lines = [f"## share of each request class answered by a speculative server ({LABELS[policy]})", ""]
    lines += ["| offered load | " + " | ".join(names) + " |", "|" + "---:|" * (1 + len(names))]
    for p in mine:
        got = {c.cls: c.spec_share for c in p.per_class}
        lines.append(f"| {p.load:.0%} | " + " | ".join(_fmt(got.get(n, math.nan), 2) for n in names) + " |")
    return [*lines, ""]


def target_check(points: list[Point], target: Target | None = None) -> list[str]:
    """The mix's policy target, line by line: met or not, with the numbers."""
    target = target or Target()
    by = {(p.policy, p.load): p.summary.e2e[2] for p in points}
    loads = sorted({p.load for p in points})
    have = {p.policy for p in points}
    lines: list[str] = []
    if "adaptive" not in have:
        return ["- the adaptive policy was not run: no target check"]
    mixed = [p for p in ("nginx",) if p in have]
    homo = [p for p in ("standard", "speculative") if p in have]
    if not mixed and not homo:
        return ["- neither a homogeneous fleet nor the NGINX rule was run: no target check"]
    if mixed:
        bad = [f"{load:.0%}" for load in loads if by[("adaptive", load)] > min(by[(m, load)] for m in mixed)]
        ok = "MET" if not bad else "NOT MET (at " + ", ".join(bad) + ")"
        lines.append(f"- lowest p99 E2E of the mixed-fleet policies at every load: **{ok}**")
    if homo:
        worst = []
        for load in loads:
            best = min(by[(h, load)] for h in homo)
            worst.append((by[("adaptive", load)] / best - 1.0, load))
        limit = target.within - 1.0
        bad = [f"{load:.0%} (+{r:.0%})" for r, load in worst if r > limit + 1e-9]
        ok = "MET" if not bad else "NOT MET at " + ", ".join(bad)
        lines.append(f"- within {limit:.0%} of the best homogeneous fleet's p99 E2E at every load: **{ok}**")
        at = [(r, load) for r, load in worst if any(abs(load - x) < 1e-9 for x in target.below_at)]
        if target.below_by > 0 and at:
            shown = ", ".join(f"{load:.0%}: {r:+.0%}" for r, load in at)
            ok = "MET" if all(-r >= target.below_by for r, _ in at) else "NOT MET"
            lines.append(
                f"- at least {target.below_by:.0%} below the best homogeneous fleet's p99 E2E at "
                f"{', '.join(f'{x:.0%}' for x in target.below_at)} load ({shown} against it): **{ok}**"
            )
    if "nginx" in have:
        top = loads[-1]
        gain = 1.0 - by[("adaptive", top)] / by[("nginx", top)]
        ok = "MET" if gain >= 0.20 else "NOT MET"
        lines.append(
            f"- beats the NGINX rule by >= 20% on p99 E2E at the highest load ({top:.0%}): {gain:.0%} **{ok}**"
        )
    return lines


def ratio_table(points: list[Point], target: Target | None = None) -> list[str]:
    """Adaptive over the best homogeneous fleet at each load, p50 and p99 E2E, each with its paired bootstrap
    interval, and per point whether the p99 target is met (the whole interval within it), missed (the whole
    interval beyond it) or undecided (the interval straddles it: more requests would settle it)."""
    target = target or Target()
    by = {(p.policy, p.load): p for p in points}
    homo = [h for h in ("standard", "speculative") if any(p.policy == h for p in points)]
    loads = sorted({p.load for p in points if p.policy == "adaptive"})
    if not homo or not loads or not all(by[("adaptive", x)].e2e_s for x in loads):
        return []
    lines = [
        f"## adaptive E2E against the best homogeneous fleet (paired, {LEVEL:.0%} bootstrap interval)",
        "",
        "The same requests under every policy; each draw resamples requests and picks the best homogeneous fleet "
        "again (a failed request counts as the slowest). met: the whole interval within the target; missed: the "
        f"whole interval beyond it; undecided: the interval straddles it. A point where a simulated server's steps "
        f"started late by more than {LAG_OK:.0%} of its time (late steps: the worst server of the policies compared) "
        "measured the machine, not the routing: its verdict is marked not valid.",
        "",
        "| offered load | best homogeneous (p99) | p50 ratio | p50 interval | p99 ratio | p99 interval | p99 target "
        "| verdict | late steps |",
        "|---:|---|---:|---:|---:|---:|---|---|---:|",
    ]
    tally: dict[str, list[str]] = {}
    for load in loads:
        a = by[("adaptive", load)]
        base = [by[(h, load)] for h in homo if (h, load) in by]
        if not base:
            continue
        best = min(base, key=lambda p: p.summary.e2e[2])
        p50, p99 = paired_ratios(a.e2e_s, [b.e2e_s for b in base], (0.5, 0.99), seed=round(load * 1000))
        limits = limits_at(load, target)
        verdicts = [verdict(p99, limit) for _name, limit in limits]
        lag = max((p.lag for p in (a, *base) if not math.isnan(p.lag)), default=math.nan)
        if lag > LAG_OK:
            verdicts = [f"{v} (not valid)" for v in verdicts]
        for v in verdicts:
            tally.setdefault(v, []).append(f"{load:.0%}")
        late = "-" if math.isnan(lag) else f"{lag:.1%}"
        lines.append(
            f"| {load:.0%} | {LABELS[best.policy]} | {_fmt(p50.value, 2)} | {_span(p50)} | {_fmt(p99.value, 2)} | "
            f"{_span(p99)} | {'; '.join(name for name, _ in limits)} | {'; '.join(verdicts)} | {late} |"
        )
    summary = ", ".join(f"{v} at {', '.join(at)}" for v, at in sorted(tally.items()))
    return [*lines, "", f"- p99 target per point: {summary}", ""]


def _span(r: Ratio) -> str:
    return f"{r.lo:.2f}-{r.hi:.2f}" if r.known else "-"


def render_report(
    points: list[Point],
    mix: Mix,
    setup: Setup,
    capacity_how: str,
    plots: list[str],
    policies: tuple[str, ...],
    machine: str = "",
) -> str:

    adaptive = mix.rules or "routing_rules/default.yaml"
    files = ", ".join(f"{LABELS[p]}: `{POLICY_FILES.get(p, adaptive)}`" for p in policies)
    parts = [
        f"# specgate bench policies: mix `{mix.name}`",
        "",
        mix.description,
        "",
        f"- policies ({setup.servers} simulated servers each; the mixed fleets {setup.spec_servers} speculative + "
        f"{setup.std_servers} standard): {files}",
        f"- simulated servers: {setup.max_num_seqs} running sequences at most, per-token costs x{setup.scale} "
        f"(a batch of {setup.max_num_seqs} behaves like one of {setup.max_num_seqs * setup.scale} on the real "
        f"server), clock x{setup.time_scale:g}, answers ~{setup.output_median:g} tokens (lognormal sigma "
        f"{setup.output_sigma:g}); {setup.duration_s:g} wall seconds of {mix.arrivals} arrivals per point"
        + (f", {setup.repeats} runs per point with their own arrivals (percentiles over all)" * (setup.repeats > 1))
        + f", more runs at low loads until at least {setup.min_requests} requests per point" * (setup.min_requests > 0)
        + f", seed {setup.seed}, the same requests for every policy"
        + (
            f"; scrape and controller time constants x{setup.controller_time_scale:g}"
            if setup.controller_time_scale is not None
            else ""
        ),
        f"- each load point starts with {setup.warmup_s:g} wall seconds of unmeasured arrivals at its rate (the "
        "controllers adapt to the new load and the queues fill before anything is measured), the first point "
        f"{setup.warmup_s * FIRST_WARMUP:g} s (the controllers start there from the YAML's homes)"
        if setup.warmup_s > 0
        else "- no warm-up: each load point is measured from its first request",
        f"- capacity (100% load): {capacity_how}",
        "- all times and rates on the simulated clock (wall time / time scale)",
        *([f"- machine: {machine}"] if machine else []),
        "",
        "## Policy target",
        "",
        *target_check(points, mix.target),
        "",
        *ratio_table(points, mix.target),
        *variant_table(points, LAG_OK),
    ]
    for _key, label, get in METRICS:
        parts += [f"## {label}", "", table(points, get, 1 if "ms" in label else 2), ""]
    parts += ["## requests measured", "", table(points, lambda p: float(p.summary.requests), 0), ""]
    parts += ["## errors", "", table(points, lambda p: float(p.summary.errors), 0), ""]
    parts += ["## share answered by a speculative server", "", table(points, lambda p: p.summary.spec_share, 2), ""]
    parts += class_shares(points)
    parts += harness_cpu(points)
    shown = [f"![{name}]({name})" for name in plots] or [f"- not drawn: matplotlib not installed ({BENCH_EXTRA_HINT})"]
    parts += ["## Plots", "", *shown, ""]
    return "\n".join(parts)


def write_report(
    points: list[Point],
    mix: Mix,
    setup: Setup,
    capacity_how: str,
    out_dir: Path,
    policies: tuple[str, ...],
    log: Callable[[str], None],
    machine: str = "",
) -> None:
    """The plots (when matplotlib is there; otherwise one line to ``log`` saying how to get them) and report.md.
    ``machine``: how busy the machine was (the load average), said in the report."""
    try:
        plots = plot_points(points, out_dir)
    except PlotsUnavailable as exc:
        log(str(exc))
        plots = []
    (out_dir / "report.md").write_text(render_report(points, mix, setup, capacity_how, plots, policies, machine))


def harness_cpu(points: list[Point]) -> list[str]:
    """The report's proof that the harness was not the bottleneck: each point's busiest process and the CPU of
    all of them together (shares of one core; the machine has ``os.cpu_count()``)."""
    from gateway.bench.cpu import SATURATED

    measured = [p for p in points if p.cpu]
    if not measured:
        return ["## Harness CPU", "", "- not measured here (no /proc)", ""]
    cores = os.cpu_count() or 1
    hot = [
        f"{p.policy} at {p.load:.0%} ({name} {share:.2f})"
        for p in measured
        for name, share in p.cpu.items()
        if share > SATURATED
    ]
    full = [
        f"{p.policy} at {p.load:.0%} (all together {sum(p.cpu.values()):.2f})"
        for p in measured
        if sum(p.cpu.values()) > SATURATED * cores
    ]
    verdict = (
        f"- no process used more than {SATURATED:g} of a core, and all together less than {SATURATED:.0%} of the "
        f"machine's {cores} cores, at any point: the simulated servers, not the Python event loops, set the latencies"
        if not hot and not full
        else "- **the harness may have been the bottleneck** at: " + "; ".join(hot + full)
    )
    lags = [p.lag for p in measured if not math.isnan(p.lag)]
    worst = max(lags, default=math.nan)
    clock = (
        f"- the simulated servers kept their clocks: steps that started late add at most {worst:.1%} of a point's "
        "simulated time on any server"
        if lags and worst <= LAG_OK
        else f"- **the simulated servers ran late** by up to {worst:.1%} of a point's simulated time (late steps)"
        if lags
        else "- the simulated servers' clocks were not read"
    )
    return [
        "## Harness CPU (share of one core during each point)",
        "",
        verdict,
        clock,
        "",
        "busiest process:",
        "",
        table(points, lambda p: max(p.cpu.values()) if p.cpu else math.nan, 2),
        "",
        "all processes together (load generator, gateway, the servers):",
        "",
        table(points, lambda p: sum(p.cpu.values()) if p.cpu else math.nan, 2),
        "",
        "late steps of the worst server (% of the point's simulated time that its steps started late, added to its "
        "requests' latency):",
        "",
        table(points, lambda p: p.lag * 100, 2),
        "",
    ]
