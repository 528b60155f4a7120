"""The tables the CLI prints (`run`, `plan`, `plugins`; `bench`, `generate` and `eval` build theirs
with `new_table` / `FitTable`), readable from an 80-column terminal up.

Each table holds only columns that have something to say, batch-level figures (time per step,
bytes moved, buffer hit rate) appear once per batch in the table's caption rather than on
every request's row, and every row says what it is. Left to itself rich fits a wide table by
cutting cells ("1.06e-…") or folding them mid-word; `FitTable` fits them at print time instead
by wrapping headers and text at spaces and, where even that is too wide, leaving out the
columns its builder named as least important, saying so under the table.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from . import registry
from .dense_fallback import COST_POLICY, DENSE_LAYER, DENSE_REQUEST
from .engine.loop import RequestResult
from .capacity import CapacityPlan


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


def mode_label(r: RequestResult) -> str:
    """How a request decoded: "sparse", "sparse, 2/32 layers dense", "dense: prompt < 2048",
    "dense: cost policy" (sparse_policy "cost" judged dense cheaper at admission), or "dense:
    every layer dense"."""
    if r.dense_reason is not None:
        if _cost_policy(r):
            return "dense: cost policy"
        return f"dense: prompt < {r.config.get('min_sparse_prompt_len', '?')}"
    dense = len(r.dense_layers)
    if r.num_layers and dense >= r.num_layers:
        return "dense: every layer dense"
    return f"sparse, {dense}/{r.num_layers} layers dense" if dense else "sparse"


def _cost_policy(r: RequestResult) -> bool:
    """Whether the run's config decides dense by the cost model (min_sparse_prompt_len unused)."""
    return r.config.get("sparse_policy") == "cost"


def run_table(results: list[RequestResult]) -> Table:
    """One experiment (one config, one batch): a row per request, the batch's figures below."""
    first = results[0]
    cfg = first.config
    title = (f"{first.algorithm} top_k={first.top_k} on {first.backend} "
             f"(page {cfg.get('page_size')}, buffer {cfg.get('device_buffer_tokens')} tokens)")
    table = new_table(title, _batch_caption(results), drop=("dev KV", "needles", "selected"))
    headings = ("context", "mode", "selected", "rel err", "recall", "needles", "KV read", "dev KV")
    for name in headings:  # the mode is words (it may wrap), the rest are figures
        table.add_column(name, justify="left" if name == "mode" else "right", no_wrap=name != "mode")
    for r in results:
        needles = "-" if r.needle_hit_rate is None else f"{r.needle_hit_rate:.1%}"
        mode = Text(mode_label(r), style="yellow" if r.sparse_fraction < 1 else "")
        table.add_row(
            str(r.context), mode, f"{r.selected_tokens:.0f}", f"{r.rel_error:.2e}", f"{r.recall:.3f}",
            needles, f"{r.kv_read_fraction:.1%}", f"{r.device_kv_fraction:.1%}",
        )
    return table


def _batch_caption(results: list[RequestResult]) -> str:
    """The batch's time, traffic and hit rate, and how much of it went dense and why."""
    r = results[0]
    hits = [x.hit_rate for x in results if x.hit_rate is not None]
    hit = f"{hits[0]:.1%}" if hits else "- (no sparse request)"
    steps = sum(x.layer_steps for x in results)
    by_reason: dict[str, int] = {}
    for x in results:
        for reason, n in x.dense_layer_steps.items():
            by_reason[reason] = by_reason.get(reason, 0) + n
    dense = sum(by_reason.values())
    lines = [
        f"batch of {len(results)}: {r.ms_per_step:.1f} ms/step, {r.swap_in_kib_per_step:.0f} KiB/step host->device, "
        f"buffer hit rate {hit}",
        f"dense decode layer-steps: {dense} of {steps}"
        + (" (" + ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) + ")" if by_reason else ""),
    ]
    if by_reason.get(DENSE_REQUEST) and _cost_policy(r):
        lines.append(f"  {DENSE_REQUEST}: the cost policy (sparse_policy \"cost\") found dense cheaper at "
                     "admission: decoded densely")
    elif by_reason.get(DENSE_REQUEST):
        lines.append(f"  {DENSE_REQUEST}: prompt shorter than min_sparse_prompt_len "
                     f"({r.config.get('min_sparse_prompt_len')}): decoded densely")
    if by_reason.get(COST_POLICY):
        lines.append(f"  {COST_POLICY}: requests or decode steps the cost model found cheaper dense "
                     "(docs/engine.md, 'Sparse only when it pays')")
    if by_reason.get(DENSE_LAYER):
        lines.append(f"  {DENSE_LAYER}: layers {r.dense_layers} attend densely (config dense_layers "
                     "and the algorithm's own, e.g. Quest's extra.dense_first_layers)")
    return "\n".join(lines)


def plan_table(title: str, rows: list[tuple[CapacityPlan, str]]) -> Table:
    """Per context: the resident store, then the hierarchical store at each buffer size
    (`rows`: the plan and what its buffer is: "config" or "min")."""
    table = new_table(title, (
        "resident: every token on the device. buffer N: the hierarchical store, a device buffer of N tokens "
        "per request and sparse layer (config: device_buffer_tokens; min: the smallest that holds the "
        "largest selection), full KV on the host. gain: concurrent requests over resident; KV-only gain: "
        "device KV bytes per request, resident over hierarchical."
    ), drop=("KV-only gain", "host/req"))
    for col in ("context", "store", "device/req", "host/req", "requests", "limited by", "gain", "KV-only\ngain"):
        words = col in ("store", "limited by")  # these may wrap at their spaces; figures never
        table.add_column(col, justify="left" if col == "store" else "right", no_wrap=not words)
    last_context = None
    for plan, which in rows:
        if plan.context_len != last_context:
            if last_context is not None:
                table.add_section()
            fits = plan.resident_requests > 0
            table.add_row(f"{plan.context_len:,}", "resident", size_text(plan.resident_device_bytes), "-",
                          str(plan.resident_requests), "device", "1.00x" if fits else "-", "1.00x")
            last_context = plan.context_len
        table.add_row("", f"buffer {plan.device_buffer_tokens:,} ({which})",
                      size_text(plan.hierarchical_device_bytes), size_text(plan.hierarchical_host_bytes),
                      str(plan.hierarchical_requests), plan.limited_by,
                      f"{plan.gain:.2f}x" if plan.resident_requests else "-", f"{plan.kv_only_gain:.2f}x")
    return table


def plugins_table() -> Table:
    """Every registered plugin: its distribution, whether it loads, and for backends whether
    it can run on this machine (and why not). Load errors name the plugin's module."""
    table = new_table("registered plugins")
    for name in ("kind", "name", "distribution", "status"):
        table.add_column(name)
    for kind in registry.GROUPS:
        for info in registry.describe(kind):
            dist = "built-in" if info.distribution == registry.BUILTIN else info.distribution
            if info.error is not None:
                status = Text("error: " + info.error, style="red")
            elif kind == "backend":
                ok, reason = registry.load(kind, info.name).availability()
                status = Text("runs here" if ok else f"cannot run here: {reason}", style="green" if ok else "yellow")
            else:
                status = Text("ok", style="green")
            table.add_row(kind, info.name, dist, status)
    return table


def size_text(n: int) -> str:
    """Bytes for a person: MiB below 10 GiB, GiB above."""
    return f"{n / 2**20:,.0f} MiB" if n < 10 * 2**30 else f"{n / 2**30:,.1f} GiB"
