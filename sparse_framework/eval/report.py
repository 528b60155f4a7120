"""Plots (matplotlib PNGs) and a markdown results page from the records of a sweep."""

from __future__ import annotations

import json
from collections import defaultdict
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..common.errors import SparseFrameworkError
from .runner import METRICS, CellRecord
from .sweep import COLUMNS, budget_label, fmt, series_name

PLOTS = {
    "accuracy_vs_budget": ("accuracy", "task accuracy"),
    "recall_vs_budget": ("recall", "attention recall"),
}


MARKERS = "osD^vP*X"  # series that coincide stay visible


def _ok(records: list[CellRecord]) -> list[CellRecord]:
    return [r for r in records if r.status == "ok"]


def make_plots(records: list[CellRecord], directory: Path) -> list[Path]:
    """accuracy and recall vs budget (one panel per workload and context, a line per
    algorithm, dense dashed), time per token vs context; returns the files written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SparseFrameworkError('--plots needs matplotlib: pip install -e ".[eval]" (in a checkout of the repository)') from exc
    directory.mkdir(parents=True, exist_ok=True)
    ok = _ok(records)
    written = []
    ruler = ruler_accuracy_plot(plt, ok, directory)
    if ruler is not None:
        written.append(ruler)
    panels = sorted({(r.workload, r.context) for r in ok})
    for name, (metric, ylabel) in PLOTS.items():
        shown = [p for p in panels if any(r.metrics.get(metric) is not None and (r.workload, r.context) == p for r in ok)]
        if not shown:
            continue
        grid_rows = sorted({w for w, _ in shown})
        grid_cols = sorted({c for _, c in shown})
        fig, axes = plt.subplots(
            len(grid_rows), len(grid_cols), figsize=(4.2 * len(grid_cols), 3.4 * len(grid_rows)), squeeze=False
        )
        for ax in axes.flat:
            ax.set_visible(False)
        for workload, context in shown:
            ax = axes[grid_rows.index(workload)][grid_cols.index(context)]
            ax.set_visible(True)
            lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
            for r in ok:
                if (r.workload, r.context) != (workload, context) or r.metrics.get(metric) is None:
                    continue
                if r.top_k is None:
                    ax.axhline(r.metrics[metric], color="black", linestyle="--", linewidth=1, label="dense")
                else:
                    lines[series_name(r)].append((r.top_k / context, r.metrics[metric]))
            for n, (label, points) in enumerate(sorted(lines.items())):
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker=MARKERS[n % len(MARKERS)], markersize=8 - n % 4, alpha=0.85, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (top_k / context)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{workload}, {context} tokens", fontsize=9)
            ax.grid(alpha=0.3)
        for row in axes:
            next(ax for ax in row if ax.get_visible()).legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, directory / f"{name}.png"))
        plt.close(fig)
    # time per token vs context, at each algorithm's smallest budget
    timed = [r for r in ok if r.metrics.get("ms_per_token") is not None]
    if timed:
        workloads = sorted({r.workload for r in timed})
        fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.4), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            smallest: dict[tuple[str, int], CellRecord] = {}
            for r in timed:
                if r.workload != workload:
                    continue
                k = (series_name(r), r.context)
                if k not in smallest or (r.top_k or 1 << 62) < (smallest[k].top_k or 1 << 62):
                    smallest[k] = r
            lines = defaultdict(list)
            for (label, context), r in smallest.items():
                lines[label].append((context, r.metrics["ms_per_token"]))
            for label, points in sorted(lines.items()):
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=label, linestyle="--" if label == "dense" else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("ms per decode step")
            ax.set_title(f"{workload} (smallest budget)", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, directory / "time_vs_context.png"))
        plt.close(fig)
    return written


RULER_PREFIX = "ruler/"
CONTEXT_STYLES = ["-", "--", ":", "-."]


def ruler_accuracy_plot(plt: Any, ok: list[CellRecord], directory: Path) -> Path | None:
    """RULER accuracy vs budget, one panel per task: a colour per algorithm, a line style per
    context, dense as a grey horizontal line per context (its style). None without ruler cells."""
    rows = [r for r in ok if r.workload.startswith(RULER_PREFIX) and r.metrics.get("accuracy") is not None]
    if not rows:
        return None
    tasks = sorted({r.workload for r in rows})
    contexts = sorted({r.context for r in rows})
    algorithms = sorted({series_name(r) for r in rows if r.top_k is not None})
    colors = {a: f"C{i % 10}" for i, a in enumerate(algorithms)}
    cols = min(3, len(tasks))
    grid = -(-len(tasks) // cols)
    fig, axes = plt.subplots(grid, cols, figsize=(4.4 * cols, 3.5 * grid), squeeze=False)
    for ax in axes.flat[len(tasks):]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks):
        for c_index, context in enumerate(contexts):
            style = CONTEXT_STYLES[c_index % len(CONTEXT_STYLES)]
            here = [r for r in rows if r.workload == task and r.context == context]
            for r in here:
                if r.top_k is None:
                    ax.axhline(r.metrics["accuracy"], color="0.45", linestyle=style, linewidth=1.2, label=f"dense {context}")
            for n, algorithm in enumerate(algorithms):
                points = sorted((r.top_k / context, r.metrics["accuracy"]) for r in here
                                if r.top_k is not None and series_name(r) == algorithm)
                if points:
                    xs, ys = zip(*points)
                    # shrinking markers keep series that coincide (common at 0 and 1) visible
                    ax.plot(xs, ys, linestyle=style, marker=MARKERS[n % len(MARKERS)], markersize=10 - 1.5 * (n % 5),
                            alpha=0.8, color=colors[algorithm], label=f"{algorithm} {context}" if len(contexts) > 1 else algorithm)
        ax.set_xscale("log", base=2)
        ticks = sorted({r.top_k / r.context for r in rows if r.workload == task and r.top_k is not None})
        ax.set_xticks(ticks, [_fraction_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("budget (top_k / context)")
        ax.set_ylabel("accuracy (string-match-all)")
        ax.set_title(task[len(RULER_PREFIX):], fontsize=10)
        ax.grid(alpha=0.3)
    # one legend for the figure: a panel's own would list only the series that panel has
    handles: dict[str, Any] = {}
    for ax in axes.flat[: len(tasks)]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(list(handles.values()), list(handles), loc="lower center", fontsize=7,
               ncol=min(4, len(handles)), bbox_to_anchor=(0.5, 0.0))
    rows_of_legend = -(-len(handles) // min(4, max(1, len(handles))))
    fig.tight_layout(rect=(0, 0.04 * rows_of_legend / grid + 0.02, 1, 1))
    path = _save(fig, directory / "ruler_accuracy.png")
    plt.close(fig)
    return path


def _fraction_label(x: float) -> str:
    """1/8 rather than 2^-3 on a budget axis (the nearest simple fraction)."""
    f = Fraction(x).limit_denominator(1024)
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def ruler_summary(records: list[CellRecord]) -> list[str]:
    """RULER's own table, per context: a row per algorithm and budget, a column per task and
    their mean (accuracy in percent). Markdown lines; none without ruler cells."""
    rows = [r for r in _ok(records) if r.workload.startswith(RULER_PREFIX) and r.metrics.get("accuracy") is not None]
    if not rows:
        return []
    tasks = sorted({r.workload for r in rows})
    lines = ["## RULER summary", "",
             "Each sample is one greedy request to the engine (all of a cell's samples submitted at once), its "
             "prompt lm-eval's RULER input (in the model's chat template unless the workload sets `chat_template` "
             "false: the experiment file says which) with the task's `gen_prefix` opening the answer; `dense` is "
             "the same engine with every token resident and every request dense. Accuracy "
             "(string-match-all, %) per task; `mean` over the tasks measured in that row. Few samples make "
             "coarse steps: one sample of a single-answer task scores 0 or 100.", ""]
    for context in sorted({r.context for r in rows}):
        here = [r for r in rows if r.context == context]
        keys = sorted({(r.top_k is not None, series_name(r), r.top_k or 0, budget_label(r)) for r in here})
        head = ["algorithm", "budget"] + [t[len(RULER_PREFIX):] for t in tasks] + ["mean"]
        lines += [f"### {context} tokens", "", "| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(tasks) + 1)]
        for _, name, top_k, label in keys:
            found = {r.workload: r.metrics["accuracy"] for r in here
                     if series_name(r) == name and (r.top_k or 0) == top_k and budget_label(r) == label}
            values = [found.get(t) for t in tasks]
            present = [v for v in values if v is not None]
            mean = sum(present) / len(present) if present else None
            cells = ["–" if v is None else f"{100 * v:.0f}" for v in values + [mean]]
            lines.append("| " + " | ".join([name, label, *cells]) + " |")
        lines.append("")
    return lines


def ruler_examples(records: list[CellRecord], per_cell: int = 2) -> list[str]:
    """A few predictions per RULER workload and context (dense, then each algorithm at its
    smallest budget), folded away: to see whether a zero is the model or the prompt."""
    rows = [r for r in _ok(records) if r.workload.startswith(RULER_PREFIX) and r.metrics.get("examples")]
    if not rows:
        return []
    lines = ["## RULER predictions", ""]
    for workload, context in sorted({(r.workload, r.context) for r in rows}):
        here = [r for r in rows if (r.workload, r.context) == (workload, context)]
        smallest: dict[str, CellRecord] = {}
        for r in sorted(here, key=lambda r: (r.top_k is not None, r.top_k or 0)):
            smallest.setdefault(series_name(r), r)
        lines += [f"<details><summary>{workload}, {context} tokens</summary>", "", "| cell | expected | prediction | score |",
                  "|---|---|---|---:|"]
        for name, r in smallest.items():
            for ex in r.metrics["examples"][:per_cell]:
                expected = ", ".join(ex["answer"])
                prediction = ex["prediction"].replace("|", "\\|")
                lines.append(f"| {name} {budget_label(r)} #{ex['index']} | {expected} | {prediction} | {ex['score']:.2f} |")
        lines += ["", "</details>", ""]
    return lines


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110, metadata={"Software": None})  # no version stamp: stable files
    return path


def markdown_page(
    records: list[CellRecord], experiment: dict[str, Any], command: str, plots: list[Path], page: Path, notes: str = ""
) -> str:
    """A self-contained results page: how to reproduce, what each metric means, one table per
    workload and metric (rows: algorithm, columns: context x budget), the plots."""
    ok = _ok(records)
    lines = [
        f"# Accuracy of sparse decode: experiment `{experiment.get('name', 'experiment')}`",
        "",
        "<!-- generated by `sparse-framework eval --markdown`; do not edit by hand -->",
        "",
        "Reproduce (from the repository root):",
        "",
        "```bash",
        command,
        "```",
        "",
        "Cells already in the results file are not measured again: add `--fresh` to re-measure them all.",
        "",
    ]
    if notes:
        lines += [notes.strip(), ""]
    lines += ["Metrics (dense is the baseline every cell is compared with):", ""]
    lines += [f"- `{key}`: {text}" for key, text in METRICS.items()]
    lines += ["", "The experiment file:", "", "```json", json.dumps(experiment, indent=1), "```", ""]
    failed = [r for r in records if r.status != "ok"]
    if failed:
        lines += ["Failed cells:", ""]
        lines += [f"- {r.workload} {r.context} {r.algorithm} {r.backend} {r.budget}: `{r.error}`" for r in failed]
        lines.append("")
    lines += ruler_summary(records)
    for workload in sorted({r.workload for r in ok}):
        lines += [f"## {workload}", ""]
        rows = [r for r in ok if r.workload == workload]
        shown = [(key, heading, spec) for key, heading, spec in COLUMNS if any(r.metrics.get(key) is not None for r in rows)]
        for context in sorted({r.context for r in rows}):
            here = sorted(
                (r for r in rows if r.context == context),
                key=lambda r: (r.top_k is not None, series_name(r), r.top_k or 0),
            )
            head = ["algorithm", "budget (top_k)"] + [heading.replace("\n", " ") for _, heading, _ in shown]
            lines += [f"### {workload}, {context} tokens", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for r in here:
                values = [fmt(r.metrics.get(key), spec, key) for key, _, spec in shown]
                lines.append("| " + " | ".join([series_name(r), budget_label(r), *values]) + " |")
            lines.append("")
    lines += ruler_examples(records)
    if plots:
        lines += ["## Plots", ""]
        for p in plots:
            rel = Path(_relative(p, page.parent))
            lines += [f"![{p.stem}]({rel.as_posix()})", ""]
    return "\n".join(lines) + "\n"


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())
