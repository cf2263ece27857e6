"""The CLI's two consoles, its one way to fail a command (a red message on stderr, then exit), and its one way to
describe a command for registration (``Command``: every module of commands lists its own in ``COMMANDS``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

err = Console(stderr=True)
out = Console()


def fail(message: str, code: int = 2) -> typer.Exit:
    """The ``typer.Exit`` to raise after printing ``message`` as an error."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


@dataclass(frozen=True, slots=True)
class Command:
    """A command as ``gateway.cli.main`` registers it: its name, its function (options from the signature) and its
    help (None: the function's docstring)."""

    name: str
    run: Callable[..., None]
    help: str | None = None
    context_settings: Mapping[str, Any] | None = None
