"""``specgate explain FILE``: ask a running gateway's admin API why a request would go where it goes.

FILE holds the request body exactly as a client would POST it (``-``: standard input). The admin token, when the
gateway has one, comes from ``SPECGATE_ADMIN_TOKEN`` (never a flag). Exit codes: 0 the explanation was printed;
1 the admin API answered an error (its message is printed); 2 a usage or connection problem.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import orjson
import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.admin import TOKEN_ENV
from gateway.explain import DEFAULT_PATH

DEFAULT_URL = "http://127.0.0.1:8081"


def _fail(err: Console, message: str, code: int) -> typer.Exit:
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _fmt(value: Any, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    """A number for a table cell; '–' for unknown (null), never 0."""
    if value is None or isinstance(value, bool):
        return "–" if value is None else str(value).lower()
    if isinstance(value, int | float):
        if not math.isfinite(value):
            return "–"
        return f"{value * scale:.{digits}f}{unit}"
    return escape(str(value))


def _headers(pairs: list[str], err: Console) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            raise _fail(err, f"--header {pair!r}: expected NAME:VALUE (e.g. 'X-Task-Type: code')", 2)
        out[name.strip()] = value.strip()
    return out


def _read(file: Path, err: Console) -> bytes:
    if str(file) == "-":
        return sys.stdin.buffer.read()
    try:
        return file.read_bytes()
    except OSError as exc:
        raise _fail(err, f"cannot read {file}: {exc.strerror or exc}", 2) from exc


def fetch_explanation(
    url: str, path: str, body: bytes, headers: dict[str, str], token: str | None, timeout_s: float
) -> httpx.Response:
    sent = {"content-type": "application/json", **headers}
    if token:
        sent["authorization"] = f"Bearer {token}"
    return httpx.post(
        url.rstrip("/") + "/admin/explain", params={"path": path}, content=body, headers=sent, timeout=timeout_s
    )


def _roles(route: dict[str, Any] | None) -> dict[str, str]:
    roles: dict[str, str] = {}
    if not route:
        return roles
    for name in route.get("fallback") or []:
        roles[name] = "fallback"
    if route.get("saturated"):
        roles[route["saturated"]] = "saturated"
    roles[route["preferred"]] = "preferred"
    return roles


def _header_lines(data: dict[str, Any]) -> list[str]:
    tc = data.get("traffic_class") or {}
    route = tc.get("route")
    f = data.get("features") or {}
    lines = [f"[bold]class[/] {escape(str(tc.get('name')))}"]
    if data.get("task_type") is not None:
        lines[0] += f"   [bold]task[/] {escape(str(data['task_type']))} (from {escape(str(data.get('task_source')))})"
    if route:
        r = f"preferred {route['preferred']}"
        if route.get("saturated"):
            r += f", saturated {route['saturated']}"
        if route.get("fallback"):
            r += f", fallback {', '.join(route['fallback'])}"
        lines.append(f"[bold]route[/] {escape(r)}")
    if f:
        lines.append(
            "[bold]request[/] "
            + escape(
                f"model {f.get('model')}, temperature {_fmt(f.get('temperature'))}, top_p {_fmt(f.get('top_p'))}, "
                f"max_tokens {_fmt(f.get('max_tokens'), digits=0)}, stream {_fmt(f.get('stream'))}, "
                f"~{f.get('prompt_tokens')} prompt tokens, response_format {f.get('response_format')}, "
                f"tools {_fmt(f.get('tools'))}"
            )
        )
    ctl, choice = data.get("controller"), data.get("choice")
    if ctl:
        share = (choice or {}).get("share", ctl.get("share"))
        text = f"state {ctl.get('state')}"
        if share is not None:
            text += f", speculative share {_fmt(share)}"
        if ctl.get("last_reason"):
            text += f", last change: {ctl['last_reason']}"
        if ctl.get("holding"):
            text += f", holding: {ctl['holding']}"
        if ctl.get("guard_tripped"):
            text += f", fallback guard tripped ({ctl.get('guard_cause')})"
        if choice:
            text += f"; this request: {choice.get('pick')}"
        lines.append(f"[bold]controller[/] {escape(text)}")
        obs = ctl.get("last_observation")
        if obs:
            lines.append(
                "[bold]last observation[/] "
                + escape(
                    f"expected delay speculative {_fmt(obs.get('spec_delay_s'), ' s', digits=3)} vs standard "
                    f"{_fmt(obs.get('alt_delay_s'), ' s', digits=3)}, {obs.get('samples')} samples, acceptance "
                    f"{_fmt(obs.get('acceptance'))}{', stale' if obs.get('stale') else ''}"
                )
            )
    elif tc.get("route") is not None:
        lines.append("[bold]controller[/] none (static route)")
    return lines


def _live_table(data: dict[str, Any]) -> Table:
    roles = _roles((data.get("traffic_class") or {}).get("route"))
    t = Table(title="live pools (– unknown)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("pool", "role", "eps", "in-flt", "run", "wait", "KV", "TPOT", "accept", "len"):
        t.add_column(col, justify="left" if col in ("pool", "role") else "right", no_wrap=True)
    for name, p in (data.get("live") or {}).items():
        if not p.get("known"):
            t.add_row(escape(name), roles.get(name, ""), *["–"] * 8)
            continue
        t.add_row(
            escape(name),
            roles.get(name, "") + (" [bold](saturated)[/]" if p.get("saturated") else ""),
            f"{p.get('routable_endpoints')}/{p.get('endpoints')}",
            _fmt(p.get("in_flight"), digits=0),
            _fmt(p.get("running"), digits=0),
            _fmt(p.get("waiting"), digits=0),
            _fmt(p.get("kv_usage"), "%", 100, 0),
            _fmt(p.get("tpot_mean_s"), "ms", 1000, 1),
            _fmt(p.get("acceptance_rate")),
            _fmt(p.get("mean_acceptance_length")),
        )
    return t


def _plan_table(plan: dict[str, Any]) -> Table:
    t = Table(
        title=f"plan (max {plan.get('max_attempts')} attempts)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for col in ("attempt", "pool", "kind", "why"):
        t.add_column(col, justify="right" if col == "attempt" else "left")
    for s in plan.get("steps") or []:
        t.add_row(str(s.get("attempt")), escape(str(s.get("pool"))), escape(str(s.get("kind"))), escape(s["reason"]))
    for s in plan.get("skipped") or []:
        t.add_row("–", escape(str(s.get("pool"))), "", f"[dim]skipped: {escape(str(s.get('reason')))}[/]")
    return t


def render(data: dict[str, Any], out: Console) -> None:
    for line in _header_lines(data):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(_live_table(data))
    live = data.get("live") or {}
    stale = [name for name, p in live.items() if p.get("known") and p.get("stale")]
    if stale:
        out.print(f"[dim]stale (no fresh scrape): {escape(', '.join(stale))}[/]", highlight=False, soft_wrap=True)
    plan = data.get("plan") or {}
    out.print(_plan_table(plan))
    if len(plan.get("steps") or []) > 1:
        out.print("[dim]each next attempt only if the one before failed before the first byte[/]", highlight=False)
    if plan.get("empty"):
        out.print("[bold red]no pool can take this request now:[/] the gateway would answer 503", highlight=False)
    cfg = data.get("config") or {}
    out.print(f"[dim]config {escape(str(cfg.get('source')))} ({cfg.get('digest')})[/]", highlight=False)


def explain_command(
    file: Annotated[Path, typer.Argument(help="JSON request body, as a client would send it ('-': stdin).")],
    url: Annotated[str, typer.Option(envvar="SPECGATE_ADMIN_URL", help="The gateway's admin API.")] = DEFAULT_URL,
    path: Annotated[str, typer.Option(help="The client path the request would go to.")] = DEFAULT_PATH,
    header: Annotated[
        list[str] | None,
        typer.Option("--header", "-H", help="A request header, NAME:VALUE (e.g. 'X-Task-Type: code'); repeatable."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the admin API's raw JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the admin API.")] = 10.0,
) -> None:
    """Why a request would go where it goes: class, controller state, live pool numbers, and the attempt plan.
    Sends nothing to any model server. Token: SPECGATE_ADMIN_TOKEN."""
    out, err = Console(), Console(stderr=True)
    headers = _headers(header or [], err)
    body = _read(file, err)
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    try:
        r = fetch_explanation(url, path, body, headers, token, timeout)
    except httpx.InvalidURL as exc:
        raise _fail(err, f"bad --url {url!r}: {exc}", 2) from exc
    except httpx.HTTPError as exc:
        raise _fail(
            err,
            f"cannot reach the admin API at {url}: {exc or type(exc).__name__}. "
            "Is the gateway running with --admin-port? Check --url.",
            2,
        ) from exc
    try:
        data = orjson.loads(r.content)
    except orjson.JSONDecodeError:
        data = None
    if r.status_code >= 400:
        e = data.get("error") if isinstance(data, dict) else None
        message = e.get("message") if isinstance(e, dict) else r.text[:300] or f"HTTP {r.status_code}"
        hint = ""
        if r.status_code == 401:
            hint = f" (set {TOKEN_ENV} to the gateway's admin token)" if token is None else f" (check {TOKEN_ENV})"
        raise _fail(err, f"the admin API answered {r.status_code}: {message}{hint}", 1)
    if not isinstance(data, dict):
        raise _fail(err, f"{url} did not answer like a specgate admin API (check --url)", 2)
    if as_json:
        typer.echo(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
        return
    render(data, out)
