"""``specgate bench load``, ``bench policies``, ``bench capacity`` and ``bench reference``: the traffic-mix sweeps
(listed in the ``bench`` group's commands by ``gateway.cli.bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gateway.cli.console import Command, out
from gateway.cli.console import fail as _fail


def bench_load_cmd(
    url: Annotated[str, typer.Option(help="Base URL of an OpenAI-compatible server or of the gateway.")],
    mix: Annotated[str, typer.Option(help="Traffic mix: a YAML file or a name in bench/mixes/.")] = "default",
    rate: Annotated[float, typer.Option(help="Requests per second (poisson, constant).")] = 2.0,
    arrival: Annotated[
        str,
        typer.Option(help="poisson | constant | burst:BASE,PEAK,PERIOD,LENGTH | step:RATE@SECONDS,RATE@SECONDS..."),
    ] = "poisson",
    duration: Annotated[float, typer.Option(help="Seconds of arrivals (step: the sum of its segments).")] = 30.0,
    out_file: Annotated[Path | None, typer.Option("--out", help="Raw results, one JSON object per request.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and requests.")] = 7,
    time_scale: Annotated[
        float, typer.Option(help="The server's clock (a simulator's --time-scale): times are divided by it.")
    ] = 1.0,
) -> None:
    """Open-loop load from a traffic mix: TTFT, TPOT, inter-chunk, E2E per class and goodput."""
    from gateway.bench.load import bench_load, render_summary
    from gateway.bench.mix import load_mix

    try:
        results, summaries = bench_load(
            url,
            load_mix(mix),
            arrival=arrival,
            rate=rate,
            duration_s=duration,
            seed=seed,
            time_scale=time_scale,
            out=out_file,
        )
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from exc
    out.print(render_summary(summaries, f"bench load: {len(results)} requests"), highlight=False, soft_wrap=True)


def bench_policies_cmd(
    mix: Annotated[str, typer.Option(help="Traffic mix: a YAML file or a name in bench/mixes/.")] = "default",
    loads: Annotated[
        str, typer.Option(help="Offered loads as fractions of capacity, comma-separated.")
    ] = "0.1,0.3,0.5,0.7,0.9,1.1",
    policies: Annotated[
        str | None,
        typer.Option(
            help="Policies, comma-separated: standard, speculative, nginx, adaptive, and the vllm-router peers "
            "peer-cache-aware, peer-round-robin (standard fleet), peer-cache-aware-mixed (mixed fleet). Default: "
            "the first four; a multi-turn mix: adaptive, peer-cache-aware, peer-round-robin."
        ),
    ] = None,
    time_scale: Annotated[float, typer.Option(help="Simulator clock and controller time constants x this.")] = 0.5,
    duration: Annotated[float, typer.Option(help="Wall seconds of arrivals per load point.")] = 12.0,
    max_num_seqs: Annotated[int, typer.Option(help="Largest running batch of each simulated server.")] = 32,
    scale: Annotated[int, typer.Option(help="Per-token costs x this: a batch stands for one this much larger.")] = 8,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and requests (the same for every policy).")] = 7,
    repeats: Annotated[
        int, typer.Option(help="Runs per load point, each with its own arrivals; percentiles over all of them.")
    ] = 3,
    controller_time_scale: Annotated[
        float | None,
        typer.Option(help="Scrape and controller time constants x this instead of --time-scale (shorter windows)."),
    ] = 0.1,
    min_requests: Annotated[
        int, typer.Option(help="Measured requests per load point at least (low loads get more runs than --repeats).")
    ] = 200,
    warmup: Annotated[
        float, typer.Option(help="Wall seconds of unmeasured arrivals at each load before its measured runs.")
    ] = 12.0,
    fleet: Annotated[
        str, typer.Option(help="Speculative+standard servers of the mixed fleet (homogeneous fleets: as many).")
    ] = "1+1",
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for report.md, the plots, results.jsonl.")] = Path(
        "bench-results/policies"
    ),
    jobs: Annotated[int, typer.Option(help="Policies run at once, each in a process with its own servers.")] = 1,
    gateway_workers: Annotated[
        int,
        typer.Option(
            help="Gateway processes sharing the port, each with its own state and prefix indexes (as replicas behind "
            "a balancer without session affinity)."
        ),
    ] = 1,
) -> None:
    """Routing policies (all standard, all speculative, a common NGINX rule, specgate adaptive, vllm-router peers) on
    simulated pools across offered loads: report.md, PNG plots, raw JSONL. A multi-turn mix (one with
    conversations) sends conversations and reports prefix-cache hit rates."""
    from gateway.bench.conversations import spec_of
    from gateway.bench.mix import load_mix
    from gateway.bench.multiturn import MULTITURN_POLICIES, bench_multiturn
    from gateway.bench.points import DEFAULT_POLICIES, Setup
    from gateway.bench.policies import bench_policies

    try:
        if repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if not 1 <= gateway_workers <= 16:
            raise ValueError("--gateway-workers must be 1 to 16")
        setup = Setup(
            controller_time_scale=controller_time_scale,
            time_scale=time_scale,
            max_num_seqs=max_num_seqs,
            scale=scale,
            duration_s=duration,
            seed=seed,
            repeats=repeats,
            warmup_s=warmup,
            min_requests=min_requests,
            gateway_workers=gateway_workers,
        ).fleet_from(fleet)
        fractions = [float(x) for x in loads.split(",") if x.strip()]
        the_mix = load_mix(mix)
        spec = spec_of(the_mix)
        default = DEFAULT_POLICIES if spec is None else MULTITURN_POLICIES
        names = tuple(p.strip() for p in policies.split(",") if p.strip()) if policies else default
        if spec is None:
            bench_policies(the_mix, fractions, setup, out_dir, policies=names, log=out.print, jobs=jobs)
        else:
            bench_multiturn(the_mix, spec, fractions, setup, out_dir, policies=names, log=out.print, jobs=jobs)
    except (ValueError, OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    out.print(f"report: {out_dir / 'report.md'}", highlight=False)
    out.print((out_dir / "report.md").read_text(), highlight=False, soft_wrap=True, markup=False)


def bench_capacity_cmd(
    mix: Annotated[str, typer.Option(help="A multi-turn mix: a YAML file or a name in bench/mixes/.")] = "multiturn",
    policies: Annotated[
        str, typer.Option(help="Policies, comma-separated; the report gives the first's rate over the second's.")
    ] = "adaptive,peer-cache-aware",
    fleet: Annotated[str, typer.Option(help="Speculative+standard servers of the mixed fleet.")] = "2+2",
    time_scale: Annotated[float, typer.Option(help="Simulator clock and controller time constants x this.")] = 0.5,
    max_num_seqs: Annotated[int, typer.Option(help="Largest running batch of each simulated server.")] = 16,
    scale: Annotated[int, typer.Option(help="Per-token costs x this: a batch stands for one this much larger.")] = 16,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and conversations (the same for every policy).")] = 7,
    overload: Annotated[
        float, typer.Option(help="The ceiling phase's offered load, fraction of the computed capacity.")
    ] = 1.4,
    settle: Annotated[float, typer.Option(help="Wall seconds the ceiling phase builds its backlog.")] = 45.0,
    ceiling_window: Annotated[float, typer.Option(help="Wall seconds the ceiling is measured over.")] = 60.0,
    holds: Annotated[
        str,
        typer.Option(help="The holds' offered turns, shares of the ceiling, comma-separated: the next if one fails."),
    ] = "0.9,0.8",
    warmup: Annotated[float, typer.Option(help="Wall seconds of the hold phase before it is judged.")] = 50.0,
    hold_window: Annotated[float, typer.Option(help="Wall seconds the hold is judged over.")] = 120.0,
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for report.md and steps.json.")] = Path(
        "bench-results/capacity"
    ),
    jobs: Annotated[int, typer.Option(help="Policies run at once, each in a process with its own servers.")] = 1,
) -> None:
    """Each policy's sustainable rate on a multi-turn mix: its ceiling (the turns it answers when offered too many),
    then a long hold at a share of it judged by whether the turn backlog grows; the first policy's over the
    second's."""
    from gateway.bench.capacity import Plan, bench_capacity
    from gateway.bench.conversations import spec_of
    from gateway.bench.mix import load_mix
    from gateway.bench.points import Setup

    try:
        the_mix = load_mix(mix)
        spec = spec_of(the_mix)
        if spec is None:
            raise ValueError(f"--mix {mix}: bench capacity runs conversations; this mix has none")
        setup = Setup(time_scale=time_scale, max_num_seqs=max_num_seqs, scale=scale, seed=seed).fleet_from(fleet)
        shares = tuple(float(x) for x in holds.split(",") if x.strip())
        if not shares or not all(0 < x <= 1.5 for x in shares):
            raise ValueError("--holds: shares of the ceiling, such as 0.9,0.8")
        plan = Plan(overload, settle, ceiling_window, shares, warmup, hold_window)
        names = tuple(p.strip() for p in policies.split(",") if p.strip())
        bench_capacity(the_mix, spec, setup, plan, out_dir, policies=names, log=out.print, jobs=jobs)
    except (ValueError, OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc
    out.print((out_dir / "report.md").read_text(), highlight=False, soft_wrap=True, markup=False)


def bench_reference_cmd(
    mix: Annotated[str, typer.Option(help="Traffic mix: a YAML file or a name in bench/mixes/.")] = "default",
    loads: Annotated[
        str, typer.Option(help="Offered loads as fractions of capacity, comma-separated.")
    ] = "0.1,0.3,0.5,0.7,0.9,1.1",
    duration: Annotated[float, typer.Option(help="Simulated seconds of arrivals per load point.")] = 400.0,
    fleet: Annotated[str, typer.Option(help="Speculative+standard servers of the mixed fleet.")] = "1+1",
    seed: Annotated[int, typer.Option(help="Seed of arrivals, requests and coin flips.")] = 7,
    sweep: Annotated[
        Path | None,
        typer.Option(help="A `bench policies` results.jsonl: its adaptive/best-homogeneous p99 ratios go beside."),
    ] = None,
    out_file: Annotated[Path | None, typer.Option("--out", help="Write the markdown report here.")] = None,
) -> None:
    """The best any fixed split of the mix's classes between the pool kinds reaches on the fleet (virtual clock,
    the same requests and physics as `bench policies`): whether a missed target was within reach of shares."""
    import yaml

    from gateway.bench.mix import load_mix
    from gateway.bench.points import Setup
    from gateway.bench.policies import estimate_capacity
    from gateway.bench.reference import reference_fleet_spec, render, search, sweep_ratios
    from gateway.config.packaged import DEFAULT_RULES

    try:
        the_mix = load_mix(mix)
        if any(c.api == "responses" for c in the_mix.classes):
            raise ValueError("the reference model replays chat completions; this mix sends Responses requests")
        setup = Setup(seed=seed).fleet_from(fleet)
        if the_mix.output_len_median is not None:
            from dataclasses import replace

            setup = replace(setup, output_median=the_mix.output_len_median)
        rules = yaml.safe_load((Path(the_mix.rules) if the_mix.rules else DEFAULT_RULES).read_text())
        spec_json = reference_fleet_spec(rules)
        capacity, _ = estimate_capacity(the_mix, setup)
        points = [
            search(the_mix, setup, float(x), capacity, spec_json, duration_s=duration, seed=seed, log=out.print)
            for x in loads.split(",")
            if x.strip()
        ]
        measured = sweep_ratios(sweep) if sweep is not None else {}
        text = render(the_mix, setup, points, the_mix.target.within, measured)
    except (ValueError, OSError) as exc:
        raise _fail(str(exc)) from exc
    if out_file is not None:
        out_file.write_text(text)
    out.print(text, highlight=False, soft_wrap=True, markup=False)


COMMANDS: tuple[Command, ...] = (
    Command("load", bench_load_cmd),
    Command("policies", bench_policies_cmd),
    Command("capacity", bench_capacity_cmd),
    Command("reference", bench_reference_cmd),
)
