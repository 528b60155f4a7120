"""Run a whole experiment: cells in order with a progress bar, one JSON line per finished cell
(so an interrupted sweep resumes where it stopped), a terminal table, plots and a markdown page.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterable
from fractions import Fraction
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from ..common.errors import ConfigError
from .workload import DTYPES
from ..common.layout import KVLayout, check_device
from .experiment import Cell, Experiment, expand
from .runner import METRICS, CellRecord, Runner, finite

# (metric, column heading, format) of the terminal table and the markdown page (where a line
# break in a heading becomes a space: the terminal table breaks long headings to fit 100 columns)
COLUMNS: list[tuple[str, str, str]] = [
    ("sparse_fraction", "sparse", "{:.0%}"),
    ("accuracy", "acc", "{:.3f}"),
    ("recall", "recall", "{:.3f}"),
    ("rel_error", "rel\nerr", "{:.3f}"),
    ("kl", "KL", "{:.1e}"),
    ("needle_hit_rate", "needle", "{:.3f}"),
    ("hit_rate", "dev\nhits", "{:.0%}"),
    ("device_kv_fraction", "dev\nKV", "{:.3f}"),
    ("moved_kib_per_token", "moved\nKiB/tok", "{:.1f}"),
    ("ms_per_token", "ms/\ntok", "{:.1f}"),
]


def read_results(path: Path) -> dict[str, CellRecord]:
    """Finished cells of an earlier run (status ok) by id; unreadable lines are skipped (a
    line cut by an interruption)."""
    done: dict[str, CellRecord] = {}
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            record = CellRecord(**json.loads(line))
        except (json.JSONDecodeError, TypeError):
            continue
        if record.status == "ok":
            done[record.id] = record
    return done


def run_cell(runner: Runner, exp: Experiment, cell: Cell) -> CellRecord:
    """One cell; an exception becomes a record with the error (the sweep goes on)."""
    start = time.perf_counter()
    record = CellRecord(
        id=cell.id, experiment=exp.name, workload=cell.workload.label, context=cell.context,
        algorithm=cell.algorithm, backend=cell.backend, budget=cell.budget,
        top_k=cell.config.top_k if cell.config is not None else None, status="ok",
        config=cell.config.key() if cell.config is not None else None,
    )
    try:
        record.metrics = {k: finite(v) if isinstance(v, float) else v for k, v in runner.run(cell).items()}
    except Exception as exc:  # noqa: BLE001 - a failing cell is recorded, the sweep goes on
        record.status = "error"
        record.error = f"{type(exc).__name__}: {exc}"
        last = traceback.extract_tb(exc.__traceback__)[-1:]
        if last:
            record.error += f" (at {Path(last[0].filename).name}:{last[0].lineno})"
    record.seconds = round(time.perf_counter() - start, 2)
    return record


def preflight(exp: Experiment, cells: list[Cell]) -> None:
    """Fail before the first cell when the device or a backend cannot run here at all (e.g.
    `triton` on a CPU, flash-attn not installed), instead of recording the same error for
    every cell. Shape-specific limits are still found per cell."""
    try:
        check_device(exp.device)
    except ValueError as exc:
        raise ConfigError(f"experiment `device`: {exc}") from None
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype=DTYPES[exp.dtype], device=exp.device)
    checked = set()
    for cell in cells:
        if cell.config is None or cell.backend in checked:
            continue
        checked.add(cell.backend)
        try:
            cell.config.backend_class.check_layout(layout)
        except ConfigError as exc:
            raise ConfigError(f"experiment `backends`: backend {cell.backend!r} {exc}") from None


def shard_cells(cells: list[Cell], done: dict[str, CellRecord], shard: tuple[int, int]) -> list[Cell]:
    """Shard `index` of `count`: the cells not yet in `done`, ordered algorithm-major (the dense
    baselines first, then each algorithm of the experiment in its order, over every workload,
    context and budget), dealt round-robin. Every shard computes the same list from the same
    results file, so `count` processes (one per GPU) share a sweep without talking to each
    other, and a sweep cut short by a time limit has covered the first algorithms everywhere
    instead of every algorithm on the first workloads only."""
    index, count = shard
    order = {"dense": -1}
    for c in cells:
        order.setdefault(c.algorithm, len(order))
    todo = [c for c in cells if c.id not in done]
    todo.sort(key=lambda c: order[c.algorithm])  # stable: workload, context, budget order kept
    return todo[index::count]


def run_sweep(
    exp: Experiment, out: Path | None, *, progress: bool = True, fresh: bool = False, console: Console | None = None,
    measure: bool = True, shard: tuple[int, int] | None = None,
) -> list[CellRecord]:
    """Every cell of `exp`; finished ones found in `out` are kept (unless `fresh`), new ones
    appended to `out` as they finish. `measure=False`: only the finished ones (a report of a
    sweep measured elsewhere, e.g. on a GPU machine, without running the rest). `shard`
    (index, count): measure only that share of the unfinished cells (`shard_cells`); the
    records returned are this shard's cells and the finished ones."""
    console = console or Console()
    cells = expand(exp)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        if fresh and out.exists():
            out.unlink()
    done = read_results(out) if out is not None else {}
    if shard is not None:
        cells = [c for c in cells if c.id in done] + shard_cells(cells, done, shard)
    skipped = sum(c.id in done for c in cells)
    if not measure:
        console.print(f"report only: {skipped} of {len(cells)} cells are in {out}; the others are not measured")
        return [done[c.id] for c in cells if c.id in done]
    if skipped < len(cells):  # (a finished sweep renders its tables and plots anywhere)
        preflight(exp, [c for c in cells if c.id not in done])
    if skipped:
        console.print(f"resuming: {skipped} of {len(cells)} cells already in {out}")
    runner = Runner(exp.device, exp.dtype, exp.seed, dense_backend=exp.backends[0])
    records = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not progress, transient=True) as bar:
        task = bar.add_task("cells", total=len(cells))
        for cell in cells:
            bar.update(task, description=f"{cell.workload.label} {cell.context} {cell.algorithm} {cell.backend} {cell.budget}")
            if cell.id in done:
                records.append(done[cell.id])
            else:
                record = run_cell(runner, exp, cell)
                records.append(record)
                if out is not None:
                    with out.open("a") as f:
                        f.write(json.dumps(asdict(record), sort_keys=True) + "\n")
                if record.status != "ok":
                    console.print(f"[red]cell failed[/red] {cell.algorithm} {cell.backend} {cell.budget} @ {cell.context}: {record.error}")
            bar.advance(task)
    return records


NEVER_SPARSE = "never"


def fmt(value: Any, spec: str, key: str = "") -> str:
    """A metric for a table cell: '–' where the workload could not measure it; a cell whose
    decoding never attended sparsely says "never" in its `sparse_fraction`."""
    if value is None:
        return "–"
    if key == "sparse_fraction" and value == 0:
        return NEVER_SPARSE
    return spec.format(value)


def series_name(r: CellRecord) -> str:
    """The algorithm, with its backend unless that is the reference (or dense)."""
    return r.algorithm if r.backend in ("torch_ref", "dense") else f"{r.algorithm} [{r.backend}]"


def budget_label(r: CellRecord) -> str:
    """"dense", top_k, or "1/16 (128)" for a budget given as a fraction of the context."""
    if r.top_k is None:
        return "dense"
    if r.budget == "default":  # an as-written entry (experiment.AS_WRITTEN): the library's top_k
        return f"default ({r.top_k})"
    try:
        frac = Fraction(r.budget)
        return f"{r.budget} ({r.top_k})" if frac < 1 or "/" in r.budget else str(r.top_k)
    except ValueError:
        return str(r.top_k)


# the metrics a narrow terminal leaves out first (costs before quality; --json and the page keep them)
DROP_FIRST = ("moved_kib_per_token", "hit_rate", "ms_per_token", "kl", "device_kv_fraction", "needle_hit_rate")


def results_table(records: Iterable[CellRecord], title: str = "") -> Group:
    """The sweep, readable from an 80-column terminal up: a table per workload (a row per cell:
    context, algorithm, budget, then the metrics that workload measures; where they do not fit,
    the metrics of DROP_FIRST go first, named under the table), failed cells listed below with
    their whole error, and a note when a cell never attended sparsely."""
    from ..common.tables import FitTable

    records = list(records)
    parts: list[Any] = [Text(title, style="bold")] if title else []
    ok = [r for r in records if r.status == "ok"]
    for workload in dict.fromkeys(r.workload for r in ok):
        rows = sorted((r for r in ok if r.workload == workload),
                      key=lambda r: (r.context, r.top_k is not None, series_name(r), r.top_k or 0))
        shown = [(k, h, f) for k, h, f in COLUMNS if any(r.metrics.get(k) is not None for r in rows)]
        # one space between columns and headings on two lines: 12 columns fit in 100
        drop = [h for key in DROP_FIRST for k, h, _ in shown if k == key]
        table = FitTable(title=workload, box=box.SIMPLE_HEAD, padding=0, pad_edge=False, title_justify="left",
                         drop=drop)
        for heading in ("context", "algorithm", "budget"):  # names and budgets ("1/16 (256)") may wrap at spaces
            table.add_column(heading, justify="right" if heading == "context" else "left", no_wrap=heading == "context")
        for _, heading, _ in shown:
            table.add_column(heading, justify="right", no_wrap=True)
        last = None
        for r in rows:
            if last is not None and r.context != last:
                table.add_section()
            cells = [fmt(r.metrics.get(k), f, k) for k, _, f in shown]
            style = "yellow" if r.metrics.get("sparse_fraction") == 0 else ""
            # Text: "dsa [triton]" as a str would be read as markup and lose its backend
            table.add_row("" if r.context == last else str(r.context), Text(series_name(r)), budget_label(r), *cells,
                          style=style)
            last = r.context
        parts.append(table)
    if any(r.metrics.get("sparse_fraction") == 0 for r in ok):
        parts.append(Text(f"sparse {NEVER_SPARSE}: the cell decoded densely throughout (prompts below "
                          "min_sparse_prompt_len, or every layer dense), so its figures are dense attention's",
                          style="yellow"))
    for r in records:
        if r.status != "ok":
            parts.append(Text(f"failed: {r.workload} {r.context} {r.algorithm} {r.backend} {r.budget}: {r.error}",
                              style="red"))
    return Group(*parts)


def metric_help() -> list[str]:
    return [f"{key}: {text}" for key, text in METRICS.items()]
