"""The report of ``specgate bench controller`` (``gateway.bench.controller``): the controllers' transitions, per
phase and class the requests, errors, shed ones, the speculative share, latency and acceptance; the step against
the unloaded first phase; and the recovery after the busiest phase, by the time each request of the later phases
was due (with how late the load generator sent it, and the gateway's in-flight count and admission bound)."""

from __future__ import annotations

import math
from typing import Any

from gateway.bench.controller import Run


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def render(run: Run, spec_pools: set[str]) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buf = StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    t = 0.0
    spans = []
    for p in run.phases:
        spans.append(f"{p.name} {p.rate:g}/s {t:g}-{t + p.duration_s:g}s")
        t += p.duration_s
    console.print("phases: " + ", ".join(spans))
    changes = Table(title="controller state changes (seconds since start)")
    for col in ("t", "class", "state", "speculative share", "reason"):
        changes.add_column(col)
    for c in run.changes:
        changes.add_row(f"{c.at:.2f}", c.traffic_class, c.state, f"{c.share:.3g}", c.reason)
    console.print(changes)
    table = Table(title="per phase and class")
    for col in ("phase", "class", "requests", "errors", "shed", "on speculative", "p50 s", "p95 s", "acceptance rate"):
        table.add_column(col, justify="right" if col not in ("phase", "class") else "left")
    names = [p.name for p in run.phases]
    keys = [k for k in run.boundaries if k.endswith("@start")]
    for i, phase in enumerate(names):
        start = run.boundaries.get(keys[i], {}) if i < len(keys) else {}
        stop = run.boundaries.get(keys[i + 1], {}) if i + 1 < len(keys) else run.boundaries.get("end", {})
        rows = [r for r in run.results if r.phase == phase]
        for cls in sorted({r.traffic_class for r in rows}):
            mine = [r for r in rows if r.traffic_class == cls]
            ok = [r for r in mine if r.status == 200]
            on_spec = sum(1 for r in ok if r.pool in spec_pools)
            d0, a0 = start.get(cls, (0.0, 0.0))
            d1, a1 = stop.get(cls, (d0, a0))
            acc = f"{(a1 - a0) / (d1 - d0):.3f}" if d1 > d0 else "-"
            lat = [r.latency_s for r in ok]
            table.add_row(
                phase,
                cls,
                str(len(mine)),
                str(sum(1 for r in mine if r.error)),
                str(sum(1 for r in mine if r.shed)),
                f"{on_spec / len(ok):.0%}" if ok else "-",
                f"{_pct(lat, 0.5):.3f}",
                f"{_pct(lat, 0.95):.3f}",
                acc,
            )
    console.print(table)
    console.print(step_summary(run))
    console.print(recovery_table(run))
    return buf.getvalue()


def step_summary(run: Run) -> str:
    """The load step against the unloaded first phase: the admitted requests' p95 as a multiple of the unloaded
    p95, and how many were shed and how fast their answer came."""
    if len(run.phases) < 2:
        return ""
    first = run.phases[0].name
    busiest = max(run.phases, key=lambda p: p.rate).name
    unloaded = [r.latency_s for r in run.results if r.phase == first and r.status == 200]
    step = [r for r in run.results if r.phase == busiest]
    admitted = [r.latency_s for r in step if r.status == 200]
    shed = [r.latency_s for r in step if r.shed]
    base = _pct(unloaded, 0.95)
    ratio = _pct(admitted, 0.95) / base if base > 0 else math.nan
    return (
        f"unloaded ({first}): p50 {_pct(unloaded, 0.5):.3f} s, p95 {base:.3f} s; {busiest}: admitted p95 "
        f"{_pct(admitted, 0.95):.3f} s ({ratio:.1f}x unloaded), shed {len(shed)} of {len(step)} "
        f"({len(shed) / max(1, len(step)):.0%}) answered in p95 {_pct(shed, 0.95):.3f} s, "
        f"errors {sum(1 for r in step if r.error)}"
    )


def recovery_rows(run: Run, bin_s: float = 5.0) -> list[dict[str, float]]:
    """After the busiest phase, per ``bin_s`` seconds: the requests of the later phases due in the bin (by their
    schedule, not by when a lagging generator sent them), the shed and failed ones, p50/p95 of the answered ones,
    the generator's p95 lateness, and the gateway's largest in-flight count and smallest admission bound polled
    in the bin."""
    if not run.phases:
        return []
    busiest = max(range(len(run.phases)), key=lambda i: run.phases[i].rate)
    end = sum(p.duration_s for p in run.phases[: busiest + 1])
    total = sum(p.duration_s for p in run.phases)
    later = {p.name for p in run.phases[busiest + 1 :]}
    rows = []
    t = end
    while t < total - 1e-9:
        mine = [r for r in run.results if r.phase in later and t <= r.due < t + bin_s]
        lat = [r.latency_s for r in mine if r.status == 200]
        polls = [x for x in run.load if t <= x.at < t + bin_s]
        rows.append(
            {
                "from": t - end,
                "to": min(t + bin_s, total) - end,
                "requests": len(mine),
                "shed": sum(1 for r in mine if r.shed),
                "errors": sum(1 for r in mine if r.error),
                "p50": _pct(lat, 0.5),
                "p95": _pct(lat, 0.95),
                "late_p95": _pct([r.late_s for r in mine], 0.95),
                "in_flight": max((x.in_flight for x in polls), default=math.nan),
                "limit": min((x.limit for x in polls), default=math.nan),
            }
        )
        t += bin_s
    return rows


def recovery_table(run: Run, bin_s: float = 5.0) -> Any:
    """``recovery_rows`` as a table (the time it takes latency to come back once the load step ends)."""
    from rich.table import Table

    table = Table(title="after the busiest phase (requests of the later phases, by the time each was due)")
    cols = ["seconds after it", "requests", "shed", "errors", "p50 s", "p95 s", "p95 / unloaded", "sent late p95 s"]
    cols += ["in flight", "bound"]
    for col in cols:
        table.add_column(col, justify="right")
    first = run.phases[0].name if run.phases else ""
    base = _pct([r.latency_s for r in run.results if r.phase == first and r.status == 200], 0.95)
    for row in recovery_rows(run, bin_s):
        table.add_row(
            f"{row['from']:g}-{row['to']:g}",
            f"{row['requests']:g}",
            f"{row['shed']:g}",
            f"{row['errors']:g}",
            f"{row['p50']:.3f}",
            f"{row['p95']:.3f}",
            f"{row['p95'] / base:.1f}" if base > 0 else "-",
            f"{row['late_p95']:.3f}",
            f"{row['in_flight']:g}",
            f"{row['limit']:g}",
        )
    return table
