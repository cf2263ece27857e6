"""The CLI's two consoles and its one way to fail a command (a red message on stderr, then exit)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 2) -> typer.Exit:
    """The ``typer.Exit`` to raise after printing ``message`` as an error."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)
