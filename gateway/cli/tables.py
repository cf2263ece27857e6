"""Tables of the admin CLI that fit the terminal: ids and numbers are never split, free text wraps at words, and
when the table is wider than the terminal, the columns that matter least go first.

Designed for 100 columns: every table shows all its columns there with the ids the admin API names; at 80 it
drops its least useful columns (each table says which), and above 100 it gives the room to the free text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.table import Table
from rich.text import Text

CellKind = Literal["id", "number", "text"]
TEXT_MIN = 14  # the narrowest a free-text column gets before columns are dropped


@dataclass(frozen=True, slots=True)
class Column:
    """A table column. ``kind``: ``id`` (never split, left), ``number`` (never split, right), ``text`` (wraps at
    words). ``drop``: 0 always shown; otherwise the column is left out when the table does not fit, highest first."""

    header: str
    kind: CellKind = "id"
    drop: int = 0


def _width(markup: str) -> int:
    return max((Text.from_markup(line).cell_len for line in markup.split("\n")), default=0)


def _longest_word(markup: str) -> int:
    return max((len(w) for w in Text.from_markup(markup).plain.split()), default=0)


def _frame(n: int) -> int:
    """The cells a table of ``n`` columns takes besides its columns: an edge on each side, and between two columns
    their padding and the divider."""
    return 2 + 3 * (n - 1)


def fit_columns(columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> list[int]:
    """The indices of the columns shown at ``width`` terminal cells, in order."""
    need: list[int] = []
    for i, col in enumerate(columns):
        natural = max([_width(col.header), *(_width(r[i]) for r in rows)])
        if col.kind == "text":
            words = max([len(col.header), *(_longest_word(r[i]) for r in rows)])
            natural = max(min(natural, TEXT_MIN), min(words, TEXT_MIN))
        need.append(natural)
    shown = list(range(len(columns)))
    droppable = sorted((i for i, c in enumerate(columns) if c.drop), key=lambda i: -columns[i].drop)
    while sum(need[i] for i in shown) + _frame(len(shown)) > width and droppable:
        shown.remove(droppable.pop(0))
    return shown


def fit_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], width: int) -> Table:
    """A table of ``rows`` (cells as rich markup) for a terminal ``width`` cells wide."""
    shown = fit_columns(columns, rows, width)
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for i in shown:
        col = columns[i]
        if col.kind == "text":
            t.add_column(col.header, overflow="fold")
        else:
            natural = max([_width(col.header), *(_width(r[i]) for r in rows)])
            justify: Literal["left", "right"] = "right" if col.kind == "number" else "left"
            t.add_column(col.header, justify=justify, no_wrap=True, min_width=natural)
    for r in rows:
        t.add_row(*(r[i] for i in shown))
    return t
