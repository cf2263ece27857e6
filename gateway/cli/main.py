"""The ``specgate`` command: serve | epp | validate | explain | demo | sim | bench | report, and the admin commands
(pools, weight, drain, undrain, force, overrides, audit, reload: ``gateway.cli.admin``).

Every command is registered one way: each module of commands lists its own (``COMMANDS``, of ``console.Command``)
and ``build`` adds them to their group. ``serve``'s options are built from ``Settings``' fields (``gateway.cli
.options``); every one can also be given as its ``SPECGATE_*`` environment variable (the flag wins).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from gateway import __version__
from gateway.cli import admin, bench, explain, report
from gateway.cli.console import Command, err, out
from gateway.cli.console import fail as _fail
from gateway.cli.options import settings_command
from gateway.config.packaged import DEFAULT_RULES
from gateway.config.settings import Settings
from gateway.sim.command import sim_command

# The fields of ``Settings`` that ``specgate epp`` shares with ``serve``, and what it means differently by them.
EPP_SETTINGS = (
    "rules",
    "host",
    "port",
    "max_body_bytes",
    "api_keys",
    "health_interval_s",
    "health_timeout_s",
    "log_level",
    "admin_host",
    "admin_port",
    "redis_url",
)
EPP_CHANGES: dict[str, dict[str, Any]] = {
    "port": {"default": 9002, "env": "SPECGATE_EPP_PORT", "help": "gRPC port of the ext_proc service."},
    "max_body_bytes": {"help": "Largest request body classified."},
    "api_keys": {"instead": ""},  # no keys file here
    "redis_url": {"help": "Redis shared by the replicas (overrides, cluster state)."},
}


def _version(value: bool) -> None:
    if value:
        out.print(f"specgate {__version__}")
        raise typer.Exit()


def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """specgate: an OpenAI-compatible gateway that routes each request to a speculative or standard vLLM pool."""


@settings_command(Settings)
def serve(settings: Settings) -> None:
    """Start the gateway."""
    from gateway.cli.serve import run_server

    run_server(settings)


@settings_command(Settings, EPP_SETTINGS, EPP_CHANGES)
def epp(
    settings: Settings,
    metrics_port: Annotated[
        int, typer.Option(envvar="SPECGATE_METRICS_PORT", help="HTTP port of /metrics, /ready, /health (0: off).")
    ] = 9090,
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
    from gateway.epp.tuning import prefer_poller_io

    prefer_poller_io()  # before gRPC is imported (gateway.cli.epp imports it)
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


COMMANDS: tuple[Command, ...] = (
    Command("serve", serve),
    Command("epp", epp),
    Command("validate", validate),
    Command("demo", demo),
    Command("sim", sim_command, "A simulated vLLM server (speculative-decoding physics, vLLM 0.33 wire format)."),
)
SUBGROUPS = (("bench", bench.HELP, bench.COMMANDS), ("report", report.HELP, report.COMMANDS))


def build() -> typer.Typer:
    """The ``specgate`` command tree: the top-level commands, then each group's."""
    top = typer.Typer(
        name="specgate",
        help="Traffic-class routing gateway for vLLM: speculative vs standard pools.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    top.callback()(_main)
    groups: list[tuple[typer.Typer, Sequence[Command]]] = [(top, COMMANDS + explain.COMMANDS + admin.COMMANDS)]
    for name, help_text, listed in SUBGROUPS:
        group = typer.Typer(help=help_text, no_args_is_help=True)
        top.add_typer(group, name=name)
        groups.append((group, listed))
    for group, commands in groups:
        for c in commands:
            context = dict(c.context_settings) if c.context_settings is not None else None
            group.command(c.name, help=c.help, context_settings=context)(c.run)
    return top


app = build()


def main() -> None:
    app()
