"""The on-call CLI: ``specgate pools | weight | drain | undrain | force | overrides | audit | reload``.

Every command talks to a running gateway's admin API (``--url``, default ``SPECGATE_ADMIN_URL`` or
http://127.0.0.1:8081); the admin token comes from ``SPECGATE_ADMIN_TOKEN`` (never a flag, so it does not show in
``ps``). The HTTP side and the exit codes are in ``gateway.admin.client``: 0 ok; 1 the admin API refused or failed
the operation (its message is printed); 2 a usage error or the admin API cannot be reached; 3 authentication failed.

``specgate explain FILE`` is ``gateway.cli.explain``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import MappingProxyType
from typing import Annotated, Any

import orjson
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.admin import client as ac
from gateway.admin.client import Call
from gateway.admin.protocol import ACTOR_ENV, DEFAULT_URL, TOKEN_ENV, URL_ENV
from gateway.cli.console import Command, fail
from gateway.cli.render import cell
from gateway.cli.tables import Column, fit_table

# --- pools, weight, drain, undrain, force, overrides, audit, reload -------------------------------------------

EXIT_CODES_HELP = (
    "Exit codes: 0 ok; 1 the admin API refused or failed the operation (its message is printed); "
    "2 usage error or the admin API cannot be reached at --url; 3 authentication failed (401/403)."
)
TTL_HELP = "How long it lasts: 90s, 30m, 2h, 1d; 'never' = until removed. Default: the YAML's admin.default_ttl_s."

UrlOption = Annotated[
    str, typer.Option("--url", envvar=URL_ENV, help="The gateway's admin API (--admin-port).", show_envvar=True)
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the admin API's raw JSON answer.")]
TimeoutOption = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the admin API.")]
TtlOption = Annotated[str | None, typer.Option("--ttl", help=TTL_HELP, show_default=False)]
ReasonOption = Annotated[str, typer.Option("--reason", help="Why (required): kept in the audit log.")]


def _client(url: str, timeout: float) -> ac.AdminClient:
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    actor = os.environ.get(ACTOR_ENV, "").strip() or None
    return ac.AdminClient(url, token, timeout, actor)


def _dump(data: Any) -> None:
    typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())


def _run(
    url: str, timeout: float, build: Callable[[], Call], as_json: bool, show: Callable[[dict[str, Any]], None]
) -> None:
    """Build the call (a ``ValueError`` is a usage error: exit 2), send it, print the answer (``--json``: raw);
    a failure prints its message (and any path-named errors) and exits with its code."""
    err = Console(stderr=True)
    try:
        call = build()
    except ValueError as exc:
        raise fail(str(exc), ac.EXIT_USAGE) from exc
    try:
        data = _client(url, timeout).send(call)
    except ac.AdminFailure as f:
        if as_json and f.data is not None:
            _dump(f.data)
        details = ac.error_details(f.data) if f.exit_code == ac.EXIT_REFUSED else []
        if not details:
            raise fail(f.message, f.exit_code) from f
        fail(f"the admin API answered {f.status} with {len(details)} error(s) (nothing was changed):", 0)
        for line in details:
            err.print(f"  {escape(line)}", highlight=False, soft_wrap=True)
        raise typer.Exit(f.exit_code) from f
    _dump(data) if as_json else show(data)


OVERRIDE_COLUMNS = (
    Column("id"),
    Column("kind", drop=3),  # what target and value say again
    Column("target"),
    Column("value"),
    Column("expires", drop=1),
    Column("actor", drop=2),
    Column("reason", "text"),
)


def _overrides_table(overrides: list[dict[str, Any]], title: str, width: int) -> Table:
    rows = [
        [
            escape(str(c))
            for c in (
                o.get("id"),
                o.get("kind"),
                ac.describe_target(o),
                ac.describe_value(o),
                ac.expires_text(o.get("expires_at")),
                o.get("actor", "–"),
                o.get("reason", ""),
            )
        ]
        for o in overrides
    ]
    return fit_table(title, OVERRIDE_COLUMNS, rows, width)


def _print_change(data: dict[str, Any]) -> None:
    out = Console()
    o = data.get("override")
    if isinstance(o, dict):
        text = f"{ac.describe_target(o)}: {ac.describe_value(o)}, expires {ac.expires_text(o.get('expires_at'))}"
        out.print(f"[bold green]done:[/] {escape(text)} [dim]({escape(str(o.get('id')))})[/]", highlight=False)
    removed = data.get("removed")
    if isinstance(removed, dict):
        removed = [removed]
    if isinstance(removed, list):
        if not removed:
            out.print("nothing to remove: no such override was active", highlight=False)
        else:
            out.print(_overrides_table(removed, f"removed {len(removed)} override(s)", out.width))


def pools_command(url: UrlOption = DEFAULT_URL, as_json: JsonOption = False, timeout: TimeoutOption = 10.0) -> None:
    _run(url, timeout, lambda: ac.get_call("/admin/state"), as_json, _print_pools)


# The endpoint's state says healthy, down (failed its health check), ejected (passive outlier detection) or
# drained (its pool); the weight, the configured one and, when an override changed it, the effective one (1→0).
POOL_COLUMNS = (
    Column("pool"),
    Column("kind", drop=4),
    Column("endpoint"),
    Column("state"),
    Column("weight", "number"),
    Column("in-flight", "number"),
    Column("queue", "number", drop=2),
    Column("batch", "number", drop=3),
    Column("accept", "number", drop=1),
)


def endpoint_state(pool: dict[str, Any], endpoint: dict[str, Any]) -> str:
    """``ok``, or what keeps the endpoint from new requests: ``drained``, ``down``, ``ejected`` (comma-separated);
    ``–`` unknown."""
    drained = pool.get("drained") or any(o.get("kind") == "drain" for o in pool.get("overrides") or [])
    healthy, out = endpoint.get("healthy"), ac.ejected(endpoint)
    flags = [name for name, on in (("drained", drained), ("down", healthy is False), ("ejected", out)) if on]
    if flags:
        return "[bold red]" + ",".join(flags) + "[/]"
    return "–" if healthy is None else "ok"


def cluster_in_flight(pool: dict[str, Any], endpoint: dict[str, Any]) -> Any:
    """Requests in flight to the endpoint from every replica and worker (not only the one that answered)."""
    if "in_flight" not in endpoint:
        return pool.get("cluster_in_flight", pool.get("in_flight"))
    remote = endpoint.get("remote_in_flight") or 0
    mine = endpoint.get("in_flight")
    return mine + remote if isinstance(mine, int | float) and isinstance(remote, int | float) else mine


def weight_text(endpoint: dict[str, Any]) -> str:
    configured = ac.number_text(endpoint.get("configured_weight", endpoint.get("weight")))
    effective = ac.number_text(endpoint.get("effective_weight"))
    return configured if effective in ("–", configured) else f"{configured}→{effective}"


def _print_pools(data: dict[str, Any]) -> None:
    rows: list[list[str]] = []
    for name, p in (data.get("pools") or {}).items():
        p = p if isinstance(p, dict) else {}
        pool_cells = (
            cell(p.get("waiting"), digits=0),
            cell(p.get("running"), digits=0),
            cell(p.get("acceptance_rate")),
        )
        for e in p.get("endpoints") or [{}]:
            rows.append(
                [
                    escape(name),
                    escape(str(p.get("kind", "–"))),
                    escape(str(e.get("id", "–"))),
                    endpoint_state(p, e),
                    weight_text(e),
                    cell(cluster_in_flight(p, e), digits=0),
                    *pool_cells,
                ]
            )
    out = Console()
    out.print(fit_table("pools (– unknown)", POOL_COLUMNS, rows, out.width))
    cfg = data.get("config") or {}
    version = f"version {cfg['version']}, " if cfg.get("version") is not None else ""
    digest = cfg.get("hash", cfg.get("digest"))
    out.print(
        f"[dim]config {escape(str(cfg.get('source')))} ({escape(version)}{escape(str(digest))})[/]", highlight=False
    )
    active = data.get("overrides")
    if isinstance(active, list) and active:
        out.print(f"{len(active)} active override(s): see [bold]specgate overrides[/]", highlight=False)


def weight_command(
    target: Annotated[str, typer.Argument(help="POOL, or POOL/ENDPOINT for one endpoint.", show_default=False)],
    weight: Annotated[float, typer.Argument(help="The new weight (>= 0; 0 = no new requests).", min=0)],
    reason: ReasonOption,
    ttl: TtlOption = None,
    url: UrlOption = DEFAULT_URL,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    _run(url, timeout, lambda: ac.weight_call(target, weight, ttl, reason), as_json, _print_change)


def drain_command(
    pool: Annotated[str, typer.Argument(help="The pool to drain (in-flight requests finish).")],
    reason: ReasonOption,
    ttl: TtlOption = None,
    url: UrlOption = DEFAULT_URL,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    _run(url, timeout, lambda: ac.drain_call(pool, ttl, reason), as_json, _print_change)


def undrain_command(
    pool: Annotated[str, typer.Argument(help="The drained pool.")],
    reason: ReasonOption,
    url: UrlOption = DEFAULT_URL,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    _run(url, timeout, lambda: ac.undrain_call(pool, reason), as_json, _print_change)


def force_command(
    klass: Annotated[str, typer.Argument(metavar="CLASS", help="The traffic class.")],
    route: Annotated[str, typer.Argument(metavar="standard|speculative|auto", help="'auto' removes the force.")],
    reason: ReasonOption,
    ttl: TtlOption = None,
    url: UrlOption = DEFAULT_URL,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    _run(url, timeout, lambda: ac.force_call(klass, route, ttl, reason), as_json, _print_change)


def overrides_command(
    remove: Annotated[str | None, typer.Option("--remove", metavar="ID", help="Remove this override.")] = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why (required with --remove).")] = None,
    url: UrlOption = DEFAULT_URL,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    if remove is not None:
        if reason is None:
            raise fail("--remove needs --reason: say why, for the audit log", ac.EXIT_USAGE)
        _run(url, timeout, lambda: ac.remove_override_call(remove, reason), as_json, _print_change)
    else:
        _run(url, timeout, lambda: ac.get_call("/admin/overrides"), as_json, _print_overrides)


def _print_overrides(data: dict[str, Any]) -> None:
    active = data.get("overrides") or []
    if not active:
        Console().print("no active overrides", highlight=False)
        return
    out = Console()
    out.print(_overrides_table(active, f"{len(active)} active override(s)", out.width))


def audit_command(
    limit: Annotated[int | None, typer.Option("--limit", min=1, max=1000, help="At most N records (newest).")] = None,
    since: Annotated[
        str | None, typer.Option("--since", help="Only after: a duration ago (30m, 2h), an epoch or an ISO time.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 10.0,
) -> None:
    _run(
        url,
        timeout,
        lambda: ac.audit_call(limit, None if since is None else ac.parse_since(since)),
        as_json,
        _print_audit,
    )


AUDIT_COLUMNS = (
    Column("time"),
    Column("actor", drop=2),
    Column("action"),
    Column("target"),
    Column("reason", "text"),
    Column("detail", "text", drop=1),
)


def _print_audit(data: dict[str, Any]) -> None:
    records = data.get("records") or []
    rows = [
        [
            ac.local_time(r.get("at"))[5:],  # the year goes: the audit keeps weeks, not years
            *(escape(str(r.get(k, "–"))) for k in ("actor", "action", "target", "reason")),
            escape(ac.detail_text(r.get("detail"))),
        ]
        for r in reversed(records)  # newest first, as the console shows them (the API answers oldest first)
    ]
    out = Console()
    title = f"audit ({len(records)} of {data.get('total', '–')} records, newest first)"
    out.print(fit_table(title, AUDIT_COLUMNS, rows, out.width))


def reload_command(url: UrlOption = DEFAULT_URL, as_json: JsonOption = False, timeout: TimeoutOption = 30.0) -> None:
    _run(url, timeout, lambda: Call("POST", "/admin/reload", "/admin/reload"), as_json, _print_reload)


def _print_reload(data: dict[str, Any]) -> None:
    out = Console()
    result = str(data.get("result", "?"))
    style = "bold green" if result == "ok" else "bold"
    text = f"version {data.get('version')}, hash {data.get('hash')}"
    out.print(f"[{style}]{escape(result)}[/]: {escape(text)}", highlight=False)
    dropped = data.get("dropped_overrides") or []
    if dropped:
        title = f"dropped {len(dropped)} override(s): their pool or class is gone"
        out.print(_overrides_table(dropped, title, out.width))


def _on_call(name: str, run: Callable[..., None], help_text: str, numbers_are_arguments: bool = False) -> Command:
    """An on-call command: its help ends with the exit codes. ``numbers_are_arguments``: ``weight POOL -1`` reads
    -1 as the weight (refused by its range, saying so), not as an option."""
    context = MappingProxyType({"ignore_unknown_options": True}) if numbers_are_arguments else None
    return Command(name, run, f"{help_text}\n\n{EXIT_CODES_HELP} Token: SPECGATE_ADMIN_TOKEN.", context)


COMMANDS: tuple[Command, ...] = (
    _on_call("pools", pools_command, "Pools and endpoints: health, configured and effective weights, in-flight, load."),
    _on_call(
        "weight",
        weight_command,
        "Set a pool's weight (POOL) or one endpoint's (POOL/ENDPOINT) for --ttl; 0 = no new requests.",
        numbers_are_arguments=True,
    ),
    _on_call("drain", drain_command, "Drain a pool for --ttl: no new requests; requests in flight finish."),
    _on_call("undrain", undrain_command, "End a pool's drain."),
    _on_call(
        "force", force_command, "Force a traffic class to its standard or speculative pool for --ttl; auto ends it."
    ),
    _on_call("overrides", overrides_command, "The active overrides; --remove ID --reason … removes one."),
    _on_call("audit", audit_command, "The audit log: every admin change, expiry and controller transition, with why."),
    _on_call(
        "reload",
        reload_command,
        "Re-read the routing YAML now: prints ok, unchanged, or every error (nothing changes).",
    ),
)
