"""Tables readable from an 80-column terminal up: `FitTable` and `new_table`.

Left to itself rich fits a wide table by cutting cells ("1.06e-…") or folding them mid-word;
`FitTable` fits them at print time instead by wrapping headers and text at spaces and, where
even that is too wide, leaving out the columns its builder named as least important, saying so
under the table. Every command's tables (cli/tables.py, bench/, eval/) are built with it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text


class FitTable(Table):
    """A rich Table that fits the width it is printed at without breaking a word or a number.

    `drop`: column headings, least important first, that may be left out when the table does
    not fit even with every heading and text cell wrapped at its spaces. Columns added with
    `no_wrap=True` (figures) are never wrapped; their headings are. Fitting happens at render
    time, on a copy: the same table prints whole on a wide console and fitted on a narrow one."""

    def __init__(self, *args: object, drop: Sequence[str] = (), **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.drop = tuple(drop)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        fitted, dropped = fit_table(self, console, options.max_width)
        if dropped:
            note = (f"not shown at {options.max_width} columns: {', '.join(dropped)} "
                    "(a wider terminal shows them)")
            fitted.caption = f"{fitted.caption}\n{note}" if fitted.caption else note
            fitted.caption_justify = "left"
        return Table.__rich_console__(fitted, console, options)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Table.__rich_measure__(fit_table(self, console, options.max_width)[0], console, options)


def heading(column: Column | str) -> str:
    """A column's heading on one line ("rel\nerr" -> "rel err", "ms/\ntok" -> "ms/tok")."""
    text = column if isinstance(column, str) else column.header
    text = text.plain if isinstance(text, Text) else str(text)
    return " ".join(text.split()).replace("/ ", "/")


def fit_table(table: Table, console: Console, width: int) -> tuple[Table, list[str]]:
    """`table` as it prints within `width` columns, and the headings of the columns left out.

    The table itself when it fits as it is. Else a copy whose every column has a fixed width
    between its narrowest (its longest word, or its longest figure for a `no_wrap` column) and
    its natural width: headings and text wrap at spaces, never inside a word or a figure. When
    the narrowest widths do not fit either, the columns named in `drop` (a FitTable's) go,
    least important first, until they do; with none left to drop, rich's own fitting."""
    order = [heading(name) for name in getattr(table, "drop", ())]
    kept, dropped = list(table.columns), []
    natural = console.options.update_width(10_000)  # measured unbounded: the natural widths
    spans = {id(c): _content_span(console, natural, c, table.show_header) for c in kept}
    while True:  # rich's own padding and border arithmetic (private helpers, there since rich 10)
        candidate = _with_columns(table, kept)
        pads = [candidate._get_padding_width(i) for i in range(len(kept))]
        lo = [spans[id(c)][0] + p for c, p in zip(kept, pads)]
        hi = [spans[id(c)][1] + p for c, p in zip(kept, pads)]
        room = width - candidate._extra_width
        if sum(hi) <= room:
            return (candidate if dropped else table), dropped
        if sum(lo) <= room:
            break
        names = [heading(c) for c in kept]
        droppable = [n for n in order if n in names and len(kept) > 1]
        if not droppable:
            return candidate, dropped  # nothing left to leave out: rich shrinks it as it can
        index = names.index(droppable[0])
        dropped.append(names[index])
        del kept[index]
    widths = list(lo)
    slack = room - sum(lo)
    for i in sorted(range(len(kept)), key=lambda i: hi[i] - lo[i]):  # unwrap as many columns as fit
        grow = min(slack, hi[i] - lo[i])
        widths[i] += grow
        slack -= grow
    for column, w, pad, full in zip(candidate.columns, widths, pads, hi):
        column.width = w - pad
        if w < full:
            column.no_wrap = False  # a figure column: only its heading wraps (its figures fit)
    return candidate, dropped


def _content_span(console: Console, options: ConsoleOptions, column: Column, header: bool) -> tuple[int, int]:
    """The narrowest and the natural width of a column's content (padding not counted): its
    heading may wrap at spaces; its cells too unless the column is `no_wrap`."""
    if column.width is not None:
        return column.width, column.width
    cells = [Measurement.get(console, options, cell) for cell in column.cells]
    cell_max = max((m.maximum for m in cells), default=0)
    cell_min = cell_max if column.no_wrap else max((m.minimum for m in cells), default=0)
    head = Measurement.get(console, options, column.header) if header else Measurement(0, 0)
    return max(head.minimum, cell_min, 1), max(head.maximum, cell_max, 1)


def _with_columns(table: Table, columns: Iterable[Column]) -> Table:
    """A shallow copy of `table` with these columns (copies, renumbered; rows shared)."""
    new = copy.copy(table)
    new.columns = []
    for i, column in enumerate(columns):
        column = copy.copy(column)
        column._index = i
        new.columns.append(column)
    return new


def new_table(title: str, caption: str | None = None, tight: bool = False, drop: Sequence[str] = ()) -> FitTable:
    """A table in the style of every CLI table: a rule under the header, two spaces between
    columns (one when `tight`, for tables of many numeric columns), the caption left-aligned
    under it; fitted to the terminal at print time (`FitTable`; `drop`: its least important
    columns, first to go)."""
    return FitTable(title=title, caption=caption, caption_justify="left", box=box.SIMPLE_HEAD,
                    padding=0 if tight else (0, 1, 0, 0), pad_edge=False, drop=drop)
