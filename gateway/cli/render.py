"""Rendering a routing explanation (the admin API's ``/admin/explain`` answer) for the terminal: the header
lines (class, task, route, features, controller), the live-pools table, the attempt-plan table, the prefix
affinity table (fitted to the terminal: ``gateway.cli.tables``), and ``cell``, the table-cell number format the
admin CLI's tables share.
"""

from __future__ import annotations

import math
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gateway.cli.tables import Column, fit_table


def cell(value: Any, unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    """A number for a table cell; '–' for unknown (null), never 0."""
    if value is None or isinstance(value, bool):
        return "–" if value is None else str(value).lower()
    if isinstance(value, int | float):
        if not math.isfinite(value):
            return "–"
        return f"{value * scale:.{digits}f}{unit}"
    return escape(str(value))


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


def _tenant_line(t: dict[str, Any]) -> str:
    if not t.get("known"):
        return f"{t.get('name')}: not a tenant of the tenants file (known: {', '.join(t.get('tenants') or [])})"
    limits = {k: v for k, v in (t.get("limits") or {}).items() if v is not None and k != "reserve_output_tokens"}
    text = f"{t['name']}: priority {t.get('priority')}, weight {cell(t.get('weight'))}, {t.get('in_flight')} in flight"
    text += ", limits " + (", ".join(f"{k} {v}" for k, v in limits.items()) or "none")
    for pool, p in (t.get("pools") or {}).items():
        mine = (p.get("by_tenant") or {}).get(t["name"], 0)
        share = cell(p.get("share"), digits=1)
        text += f"; {pool}: {mine} of its share {share} ({p.get('in_flight')}/{p.get('bound')})"
    return text


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
        if route.get("pin"):
            r += f"; pinned to {route['pin']} pools"
        lines.append(f"[bold]route[/] {escape(r)}")
    if f:
        lines.append(
            "[bold]request[/] "
            + escape(
                f"model {f.get('model')}, temperature {cell(f.get('temperature'))}, top_p {cell(f.get('top_p'))}, "
                f"max_tokens {cell(f.get('max_tokens'), digits=0)}, stream {cell(f.get('stream'))}, "
                f"~{f.get('prompt_tokens')} prompt tokens, response_format {f.get('response_format')}, "
                f"tools {cell(f.get('tools'))}"
            )
        )
    tenant = data.get("tenant")
    if tenant:
        lines.append("[bold]tenant[/] " + escape(_tenant_line(tenant)))
    ctl, choice = data.get("controller"), data.get("choice")
    if ctl:
        share = (choice or {}).get("share", ctl.get("share"))
        text = f"state {ctl.get('state')}"
        if share is not None:
            text += f", speculative share {cell(share)}"
        if ctl.get("last_reason"):
            text += f", last change: {ctl['last_reason']}"
        if ctl.get("holding"):
            text += f", holding: {ctl['holding']}"
        if ctl.get("rule"):
            text += f", decided by rule {ctl['rule']}"
        if ctl.get("guard_tripped"):
            text += f", fallback guard tripped ({ctl.get('guard_cause')})"
        if ctl.get("probe_share"):
            text += f", probing speculative at {cell(ctl['probe_share'])}"
        if choice:
            text += f"; this request: {choice.get('pick')}"
            if choice.get("why"):
                text += f" ({WHY.get(choice['why'], choice['why'])})"
        lines.append(f"[bold]controller[/] {escape(text)}")
        obs = ctl.get("last_observation")
        if obs:
            lines.append(
                "[bold]last observation[/] "
                + escape(
                    f"cost speculative {cell(obs.get('spec_cost_s'), ' s', digits=3)} vs standard "
                    f"{cell(obs.get('std_cost_s'), ' s', digits=3)}, {obs.get('samples')} samples, acceptance "
                    f"{cell(obs.get('acceptance'))}{', stale' if obs.get('stale') else ''}"
                )
            )
    elif tc.get("route") is not None:
        lines.append("[bold]controller[/] none (static route)")
    return lines


WHY = {
    "home": "home: its home pool",
    "spill": "spill: a share of the class goes to the other pool, clearly faster there",
    "probe": "probe: measuring the class's acceptance",
    "guard": "guard: the fallback guard keeps it off speculation",
    "forced": "forced by on-call",
    "stale": "stale measurements: the safe state",
}


COMPLETION_ROWS: tuple[tuple[str, str, str, float, int], ...] = (
    # (row label, field, unit, scale, digits)
    ("cost", "cost_s", " s", 1.0, 3),
    ("  expected time", "expected_s", " s", 1.0, 3),
    ("    queue", "queue_s", " s", 1.0, 3),
    ("    1st step", "first_token_s", " s", 1.0, 3),
    ("    decode", "decode_s", " s", 1.0, 3),
    ("  impact on others", "impact_s", " s", 1.0, 3),
    ("output tokens", "output_tokens", "", 1.0, 0),
    ("TPOT of the pool", "tpot_s", "ms", 1000.0, 1),
    ("TPOT of the class", "class_tpot_s", "ms", 1000.0, 1),
)


def _completion_table(data: dict[str, Any]) -> Table | None:
    """One column per pool, one row per term: two pools fit an 80-column terminal."""
    est = data.get("expected_completion")
    if not est:
        return None
    t = Table(
        title="this class on each pool (last scrape round; – unknown): cost = its expected time + what it adds to "
        "the requests running there",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    t.add_column("", justify="left", no_wrap=True)
    for name, e in est.items():
        t.add_column(f"{escape(name)} ({escape(str(e.get('kind')))})", justify="right", no_wrap=True)
    for label, key, unit, scale, digits in COMPLETION_ROWS:
        row = [label]
        for e in est.values():
            value = e.get(key)
            if key == "cost_s" and value is None:  # a gateway that reports no impact yet: its expected time
                value = e.get("expected_s")
            row.append(cell(value, unit, scale, digits))
        t.add_row(*row)
    accept = ["acceptance"]
    for e in est.values():
        a = e.get("acceptance")
        accept.append("–" if a is None else f"{cell(a)} ({e.get('acceptance_source')})")
    t.add_row(*accept)
    return t


LIVE_COLUMNS = (
    Column("pool"),
    Column("role"),
    Column("eps", "number"),
    Column("in-flt", "number"),
    Column("run", "number", drop=3),
    Column("wait", "number"),
    Column("KV", "number", drop=4),
    Column("TPOT", "number", drop=2),
    Column("accept", "number"),
    Column("len", "number", drop=1),
)


def _live_table(data: dict[str, Any], width: int) -> Table:
    roles = _roles((data.get("traffic_class") or {}).get("route"))
    rows: list[list[str]] = []
    for name, p in (data.get("live") or {}).items():
        if not p.get("known"):
            rows.append([escape(name), roles.get(name, ""), *["–"] * 8])
            continue
        rows.append(
            [
                escape(name),
                roles.get(name, "") + (" [bold](saturated)[/]" if p.get("saturated") else ""),
                f"{p.get('routable_endpoints')}/{p.get('endpoints')}",
                cell(p.get("in_flight"), digits=0),
                cell(p.get("running"), digits=0),
                cell(p.get("waiting"), digits=0),
                cell(p.get("kv_usage"), "%", 100, 0),
                cell(p.get("tpot_mean_s"), "ms", 1000, 1),
                cell(p.get("acceptance_rate")),
                cell(p.get("mean_acceptance_length")),
            ]
        )
    return fit_table("live pools (– unknown)", LIVE_COLUMNS, rows, width)


PLAN_COLUMNS = (Column("attempt", "number"), Column("pool"), Column("kind"), Column("why", "text"))


def _plan_table(plan: dict[str, Any], width: int) -> Table:
    rows = [
        [str(s.get("attempt")), escape(str(s.get("pool"))), escape(str(s.get("kind"))), escape(s["reason"])]
        for s in plan.get("steps") or []
    ]
    rows += [
        ["–", escape(str(s.get("pool"))), "", f"[dim]skipped: {escape(str(s.get('reason')))}[/]"]
        for s in plan.get("skipped") or []
    ]
    return fit_table(f"plan (max {plan.get('max_attempts')} attempts)", PLAN_COLUMNS, rows, width)


AFFINITY_COLUMNS = (
    Column("pool"),
    Column("endpoint"),
    Column("warm tok", "number"),
    Column("load", "number"),
    Column("index", "number", drop=1),
    Column("verdict", "text"),
)


def _affinity_table(data: dict[str, Any], width: int) -> Table | None:
    """Each planned pool's endpoints with this prompt's warm prefix and load, and the endpoint prefix affinity
    picks (``gateway.fleet.affinity``); None when no pool has two endpoints."""
    pools = (data.get("prefix_affinity") or {}).get("pools") or {}
    rows: list[list[str]] = []
    for name, p in pools.items():
        eps = p.get("endpoints") or []
        if len(eps) < 2:
            continue
        for e in eps:
            verdict = ""
            if e.get("endpoint") == p.get("pick"):
                verdict = "[bold]picked: warm[/]"
            elif e.get("over_bound"):
                verdict = "over the load bound"
            elif not e.get("counted") and e.get("warm_tokens"):
                verdict = "too short to count"
            rows.append(
                [
                    escape(name),
                    escape(str(e.get("endpoint"))),
                    cell(e.get("warm_tokens"), digits=0),
                    cell(e.get("load"), digits=1),
                    f"{e.get('index_chunks')}/{e.get('index_capacity')}",
                    verdict,
                ]
            )
        if p.get("pick") is None:
            why = {"cold": "no warm prefix: least loaded", "over_bound": "warm ones too busy: least loaded"}
            rows.append([escape(name), "", "", "", "", escape(why.get(str(p.get("why")), str(p.get("why"))))])
    if not rows:
        return None
    return fit_table("prefix affinity (warm prompt tokens, approximate)", AFFINITY_COLUMNS, rows, width)


def render(data: dict[str, Any], out: Console) -> None:
    for line in _header_lines(data):
        out.print(line, highlight=False, soft_wrap=True)
    out.print(_live_table(data, out.width))
    completion = _completion_table(data)
    if completion is not None:
        out.print(completion)
    live = data.get("live") or {}
    stale = [name for name, p in live.items() if p.get("known") and p.get("stale")]
    if stale:
        out.print(f"[dim]stale (no fresh scrape): {escape(', '.join(stale))}[/]", highlight=False, soft_wrap=True)
    plan = data.get("plan") or {}
    out.print(_plan_table(plan, out.width))
    affinity = _affinity_table(data, out.width)
    if affinity is not None:
        out.print(affinity)
    warm = data.get("warm_home")
    if warm:
        tokens = ", ".join(f"{p}: {t}" for p, t in (warm.get("warmth") or {}).items())
        line = f"warm home: {warm.get('verdict')} ({warm.get('note')}); warm prefix per pool: {tokens}"
        out.print(escape(line), highlight=False, soft_wrap=True)
    if len(plan.get("steps") or []) > 1:
        out.print("[dim]each next attempt only if the one before failed before the first byte[/]", highlight=False)
    if plan.get("empty"):
        out.print("[bold red]no pool can take this request now:[/] the gateway would answer 503", highlight=False)
    cfg = data.get("config") or {}
    out.print(f"[dim]config {escape(str(cfg.get('source')))} ({cfg.get('digest')})[/]", highlight=False)
