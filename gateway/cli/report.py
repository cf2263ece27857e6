"""``specgate report ...``: operators' reports from Prometheus."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from gateway.cli.console import Command, out
from gateway.cli.console import fail as _fail

HELP = "Operators' reports from Prometheus."


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
    from gateway.report.markdown import render_markdown
    from gateway.report.promql import PromError

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


COMMANDS: tuple[Command, ...] = (Command("weekly", report_weekly_cmd),)
