"""Accuracy sweep of the sparse-attention algorithms on the synthetic needle workload.

For every context length x budget fraction x algorithm config it runs one experiment of the
engine's decode loop (`sparse_framework.engine.loop.run_experiment`) on a single-context
workload, with top_k = context * fraction, and records per cell the attention recall against
the exact top-k oracle, the output error against dense attention, the needle hit rate and the
selected tokens. The cells go to a JSON file and to a self-contained markdown page (by default
docs/accuracy.md) whose numbers are all generated from the measurement.

    python benchmarks/accuracy.py                                   # the full default sweep
    python benchmarks/accuracy.py --algorithms quest,snapkv,pqcache --contexts 4096 --steps 4
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
try:
    import sparse_framework  # noqa: F401
except ModuleNotFoundError:  # not installed (or a stale editable install): use this checkout
    sys.path.insert(0, str(ROOT))

from sparse_framework.config import SparseConfig, load_config, validate
from sparse_framework.engine.loop import run_experiment
from sparse_framework.engine.workload import DTYPES, WorkloadConfig
from sparse_framework.errors import SparseFrameworkError

SCRIPT = "benchmarks/accuracy.py"

# (label, algorithm part of the config); the fixed part is in `cell_config`. The synthetic
# layers are all alike, so Quest's recipe of dense first layers is turned off (as in the CLI's
# default experiment): every layer of every cell must select, or the rows would not compare.
ALGORITHMS: list[tuple[str, dict[str, Any]]] = [
    ("quest", {"algorithm": "quest", "extra": {"dense_first_layers": 0}}),
    ("snapkv", {"algorithm": "snapkv"}),
    ("pqcache", {"algorithm": "pqcache"}),
    ("dsa-bf16", {"algorithm": "dsa", "extra": {"source": "indexer", "key_dtype": "bfloat16"}}),
    ("dsa-fp8", {"algorithm": "dsa", "extra": {"source": "indexer", "key_dtype": "fp8_e4m3"}}),
    ("exact-topk", {"algorithm": "dsa", "extra": {"source": "keys"}}),
]
LABELS = [label for label, _ in ALGORITHMS]

# Options every cell shares (top_k and device_buffer_tokens are set per cell).
FIXED: dict[str, Any] = {"backend": "torch_ref", "sink_tokens": 16, "recent_tokens": 64, "page_size": 16}
HUGE_BUFFER = 1 << 40  # only for the first config, whose largest selection sizes the real buffer

DEFAULT_CONTEXTS = "4096,8192,16384,32768"
DEFAULT_FRACTIONS = "1/64,1/32,1/16,1/8,1/4"
DEFAULT_STEPS = 8
DEFAULT_NEEDLE_STRENGTH = 1.25  # as the CLI's DEFAULT_WORKLOAD
DEFAULT_DTYPE = "float32"
DEFAULT_DEVICE = "cpu"
DEFAULT_SEED = 0
DEFAULT_JSON = "benchmarks/results/accuracy.json"
DEFAULT_MARKDOWN = "docs/accuracy.md"

# (key in a cell, heading, what it means, format)
METRICS: list[tuple[str, str, str, str]] = [
    (
        "recall",
        "Attention recall",
        "attention mass (dense softmax, float64) on the selected tokens divided by the mass of the exact "
        "top-k of the same size, per query head; 1.0 means the selection is as good as the oracle top-k. "
        "Higher is better.",
        "{:.3f}",
    ),
    (
        "rel_error",
        "Output relative error",
        "‖o_sparse − o_dense‖ / ‖o_dense‖ (Frobenius norm over the query heads) of the attention output "
        "against dense attention over the full-precision K/V. Lower is better.",
        "{:.3f}",
    ),
    (
        "needle_hit_rate",
        "Needle hit rate",
        "fraction of (needle token, query head) pairs in which the needle is among the selected tokens. "
        "Higher is better.",
        "{:.3f}",
    ),
    (
        "selected_tokens",
        "Selected tokens",
        "tokens attended per selection row (one row per KV head), including the sink tokens and the "
        "recent window, so it is somewhat above top_k.",
        "{:.1f}",
    ),
]


# -- argument parsing ---------------------------------------------------------------------
def _contexts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every context must be a positive integer (>= 1), got {text!r}")
    return list(dict.fromkeys(values))


def _fractions(text: str) -> list[Fraction]:
    values = []
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        try:
            value = Fraction(part)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(
                f"must be comma-separated fractions in (0, 1] such as 1/64 or 0.25, got {part!r}"
            ) from None
        if not 0 < value <= 1:
            raise argparse.ArgumentTypeError(f"every fraction must be in (0, 1] (0 < f <= 1), got {part!r}")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"needs at least one fraction in (0, 1], got {text!r}")
    return list(dict.fromkeys(values))


def _labels(text: str) -> list[str]:
    labels = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in labels if x not in LABELS]
    if bad or not labels:
        what = f"unknown label(s) {', '.join(repr(b) for b in bad)}" if bad else f"no label in {text!r}"
        raise argparse.ArgumentTypeError(f"{what}; allowed labels: {', '.join(LABELS)}")
    return list(dict.fromkeys(labels))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    algos = "\n".join(f"  {label:<11} {json.dumps(cfg)}" for label, cfg in ALGORITHMS)
    parser = argparse.ArgumentParser(
        prog="python " + SCRIPT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Sweep the synthetic needle workload over contexts x budget fractions x algorithms and report,\n"
            "per cell, attention recall vs the exact top-k oracle, output relative error vs dense attention,\n"
            "needle hit rate and selected tokens. Each cell is one run_experiment call with one context and\n"
            "top_k = max(page_size, round(context * fraction)); the workload (same seed) is identical for\n"
            "every algorithm and budget at a context, so rows are comparable.\n\n"
            f"fixed config: {json.dumps(FIXED)},\n"
            "device_buffer_tokens = the algorithm's largest selection rounded up to whole pages.\n\n"
            "algorithm labels (--algorithms):\n" + algos
        ),
        epilog="Outputs: JSON with every cell and a markdown page (tables per metric, per-algorithm means).",
    )
    parser.add_argument("--contexts", type=_contexts, default=_contexts(DEFAULT_CONTEXTS), metavar="N,N,...",
                        help=f"prompt lengths (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--fractions", type=_fractions, default=_fractions(DEFAULT_FRACTIONS), metavar="F,F,...",
                        help=f"budget fractions in (0, 1], top_k = context * fraction (default {DEFAULT_FRACTIONS})")
    parser.add_argument("--algorithms", type=_labels, default=list(LABELS), metavar="LABEL,...",
                        help=f"algorithm labels to run (default all: {','.join(LABELS)})")
    parser.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS, metavar="N",
                        help=f"decode steps per cell (default {DEFAULT_STEPS})")
    parser.add_argument("--dtype", choices=list(DTYPES), default=DEFAULT_DTYPE,
                        help=f"KV dtype of the workload (default {DEFAULT_DTYPE})")
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=f"torch device (default {DEFAULT_DEVICE})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"workload seed (default {DEFAULT_SEED})")
    parser.add_argument("--json", default=DEFAULT_JSON, metavar="PATH",
                        help=f"write every cell's metrics here (default {DEFAULT_JSON}, relative to the repository)")
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN, metavar="PATH",
                        help=f"write the markdown page here (default {DEFAULT_MARKDOWN}, relative to the repository)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def fraction_label(f: Fraction) -> str:
    return str(f)  # "1/64", "1"


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line (from the repository root) that reproduces this run's outputs: every
    option that differs from its default, in a canonical form; --no-progress is left out."""
    parts = ["python", SCRIPT]
    if args.contexts != _contexts(DEFAULT_CONTEXTS):
        parts += ["--contexts", ",".join(map(str, args.contexts))]
    if args.fractions != _fractions(DEFAULT_FRACTIONS):
        parts += ["--fractions", ",".join(map(fraction_label, args.fractions))]
    if args.algorithms != LABELS:
        parts += ["--algorithms", ",".join(args.algorithms)]
    for flag, value, default in (
        ("--steps", args.steps, DEFAULT_STEPS),
        ("--dtype", args.dtype, DEFAULT_DTYPE),
        ("--device", args.device, DEFAULT_DEVICE),
        ("--seed", args.seed, DEFAULT_SEED),
        ("--json", args.json, DEFAULT_JSON),
        ("--markdown", args.markdown, DEFAULT_MARKDOWN),
    ):
        if value != default:
            parts += [flag, str(value)]
    return shlex.join(parts)


# -- configs and workload -----------------------------------------------------------------
def top_k_for(context: int, fraction: Fraction, page_size: int) -> int:
    return max(page_size, round(context * fraction))


def cell_config(algorithm: dict[str, Any], context: int, fraction: Fraction) -> SparseConfig:
    """The validated config of one cell: the algorithm's part, the fixed part, top_k, and a
    device buffer just large enough for the algorithm's largest selection (whole pages)."""
    page = FIXED["page_size"]
    data = {**FIXED, **algorithm, "top_k": top_k_for(context, fraction, page)}
    first = load_config({**data, "device_buffer_tokens": HUGE_BUFFER})
    need = first.algorithm_class.max_selected_tokens(first)
    return load_config({**data, "device_buffer_tokens": -(-need // page) * page})


def _dense_layers(cfg: SparseConfig, num_layers: int) -> list[int]:
    """Layers below num_layers that a config keeps dense: `dense_layers` and the algorithm's own."""
    own_fn = getattr(cfg.algorithm_class, "own_dense_layers", None)
    own = set(own_fn(cfg, num_layers)) if own_fn is not None else set()
    return sorted(layer for layer in {*cfg.dense_layers, *own} if layer < num_layers)


def workload_for(args: argparse.Namespace, context: int) -> WorkloadConfig:
    """The engine's default workload except steps, needle strength, dtype, device and seed."""
    data = {
        "contexts": [context],
        "decode_steps": args.steps,
        "needle_strength": DEFAULT_NEEDLE_STRENGTH,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
    }
    return validate(WorkloadConfig, data, "workload")


def _output_path(text: str, default: str) -> Path:
    """Defaults are relative to the repository; a path given on the command line to the cwd."""
    return ROOT / text if text == default else Path(text)


# -- the sweep ------------------------------------------------------------------------------
def run_sweep(args: argparse.Namespace, json_path: Path, header: dict[str, Any]) -> list[dict[str, Any]]:
    algorithms = dict(ALGORITHMS)
    plan = []
    # every config is validated before the first cell runs (an unregistered algorithm fails here)
    num_layers = workload_for(args, args.contexts[0]).num_layers
    for context in args.contexts:
        for label in args.algorithms:
            for fraction in args.fractions:
                try:
                    cfg = cell_config(algorithms[label], context, fraction)
                except SparseFrameworkError as exc:
                    raise SystemExit(
                        f"error: --algorithms: the config of {label!r} ({json.dumps(algorithms[label])}) is not "
                        f"usable here:\n  {exc}\nif its algorithm is not registered (`sparse-framework plugins`), "
                        f"leave the label out, e.g. --algorithms quest,snapkv,pqcache; "
                        f"allowed labels: {', '.join(LABELS)}"
                    ) from None
                dense = _dense_layers(cfg, num_layers)
                if dense:
                    raise SystemExit(
                        f"error: --algorithms: {label!r} ({json.dumps(algorithms[label])}) attends densely in "
                        f"layer(s) {dense} of the {num_layers}-layer workload; this sweep measures selection, so "
                        f"every layer must be sparse (turn the algorithm's dense layers off in its label config)"
                    )
                plan.append((context, label, fraction, cfg))

    cells: list[dict[str, Any]] = []
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), console=console, disable=args.no_progress, transient=True,
    ) as progress:
        task = progress.add_task("cells", total=len(plan))
        for context, label, fraction, cfg in plan:
            progress.update(task, description=f"{label} context={context} budget={fraction_label(fraction)}")
            start = time.perf_counter()
            try:
                (result,) = run_experiment(cfg, workload_for(args, context))
            except SparseFrameworkError as exc:
                raise SystemExit(f"error: cell {label} context={context} fraction={fraction}: {exc}") from None
            r = result.as_dict()
            cells.append(
                {
                    "label": label,
                    "context": context,
                    "fraction": fraction_label(fraction),
                    "fraction_value": float(fraction),
                    "top_k": cfg.top_k,
                    "device_buffer_tokens": cfg.device_buffer_tokens,
                    "mode": r["mode"],
                    "recall": r["recall"],
                    "rel_error": r["rel_error"],
                    "needle_hit_rate": r["needle_hit_rate"],
                    "selected_tokens": r["selected_tokens"],
                    "kv_read_fraction": r["kv_read_fraction"],
                    "ms_per_step": r["ms_per_step"],
                    "seconds": time.perf_counter() - start,
                    "config": r["config"],
                }
            )
            # written after every cell, so a stopped sweep keeps what it measured
            _write_json(json_path, {**header, "complete": False, "cells": cells})
            progress.advance(task)
    return cells


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n")


# -- markdown -------------------------------------------------------------------------------
def _fmt(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_markdown(args: argparse.Namespace, cells: list[dict[str, Any]], command: str, workload: dict[str, Any]) -> str:
    algorithms = dict(ALGORITHMS)
    labels = [label for label in args.algorithms if any(c["label"] == label for c in cells)]
    fractions = [fraction_label(f) for f in args.fractions]
    index = {(c["label"], c["context"], c["fraction"]): c for c in cells}
    any_dense = any(c["mode"] == "dense" for c in cells)
    page = FIXED["page_size"]

    out = [
        "# Accuracy of the sparse-attention algorithms on the synthetic needle workload",
        "",
        "<!-- generated by benchmarks/accuracy.py; do not edit by hand -->",
        "",
        "Reproduce (from the repository root):",
        "",
        "```bash",
        command,
        "```",
        "",
        "## What is measured",
        "",
        "The workload is the engine's synthetic decode workload (`sparse_framework.engine.workload`): each "
        "request's prompt has random standard-normal keys, values and queries, and in every layer a few "
        "*needle* tokens whose keys point along a random direction per KV head (scaled by `needle_strength`). "
        "The decode queries follow that direction plus unit noise, so dense attention puts much of its mass "
        "on the needles and a selection that misses them shows it. Each cell below is one run of the engine's "
        "decode loop (`run_experiment`) with one request of the given context, prefilled and then decoded for "
        f"{args.steps} steps; every step and layer is compared with dense attention, and the metrics are means "
        "over steps and layers. The workload (same seed) is identical for every algorithm and budget at a "
        "context.",
        "",
        "Metrics:",
        "",
    ]
    out += [f"- **{title}** (`{key}`): {text}" for key, title, text, _ in METRICS]
    out += [
        "",
        "Budget: `top_k = max(page_size, round(context × fraction))`; the column headers give the fraction "
        "and, in parentheses, top_k. Every config uses "
        + ", ".join(f"`{k}={v}`" for k, v in FIXED.items())
        + f" and `device_buffer_tokens` = the algorithm's largest selection rounded up to a multiple of {page}.",
        "",
        "Algorithms:",
        "",
        _row(["label", "config (merged into the fixed options above)"]),
        _row(["---", "---"]),
    ]
    out += [_row([label, f"`{json.dumps(algorithms[label])}`"]) for label in labels]
    out += ["", "Workload:", "", _row(["option", "value"]), _row(["---", "---"])]
    out += [_row([f"`{k}`", f"`{json.dumps(v)}`"]) for k, v in workload.items()]
    out += ["", f"Environment: torch {torch.__version__}, Python {platform.python_version()}.", ""]
    if any_dense:
        out += [
            "Cells marked † decoded densely (the prompt is shorter than `min_sparse_prompt_len`).",
            "",
        ]

    for key, title, text, fmt in METRICS:
        out += [f"## {title}", "", text, ""]
        for context in args.contexts:
            heads = [f"{f} ({top_k_for(context, Fraction(f), page)})" for f in fractions]
            out += [f"Context {context}:", "", _row(["algorithm", *heads, "mean"]),
                    _row(["---", *["---:"] * (len(heads) + 1)])]
            for label in labels:
                row_cells = [index.get((label, context, f)) for f in fractions]
                shown = []
                for c in row_cells:
                    if c is None:
                        shown.append("–")
                    else:
                        shown.append(_fmt(c[key], fmt) + (" †" if c["mode"] == "dense" else ""))
                mean = _mean([c[key] for c in row_cells if c is not None])
                out.append(_row([label, *shown, _fmt(mean, fmt)]))
            out.append("")

    out += [
        "## Summary: per-algorithm means",
        "",
        "Means over every cell of an algorithm (all contexts × budget fractions above).",
        "",
        _row(["algorithm", "cells", *[f"mean {key}" for key, *_ in METRICS]]),
        _row(["---", "---:", *["---:"] * len(METRICS)]),
    ]
    for label in labels:
        mine = [c for c in cells if c["label"] == label]
        out.append(_row([label, str(len(mine)), *[_fmt(_mean([c[key] for c in mine]), fmt) for key, _, _, fmt in METRICS]]))
    out.append("")
    return "\n".join(out)


def _print_summary(cells: list[dict[str, Any]], labels: list[str]) -> None:
    table = Table(title="per-algorithm means")
    for name in ("algorithm", "cells", *[key for key, *_ in METRICS]):
        table.add_column(name, justify="left" if name == "algorithm" else "right")
    for label in labels:
        mine = [c for c in cells if c["label"] == label]
        table.add_row(label, str(len(mine)), *[_fmt(_mean([c[key] for c in mine]), fmt) for key, _, _, fmt in METRICS])
    Console().print(table)


# -- entry point ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    json_path = _output_path(args.json, DEFAULT_JSON)
    md_path = _output_path(args.markdown, DEFAULT_MARKDOWN)
    for flag, path in (("--json", json_path), ("--markdown", md_path)):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            parser.error(f"argument {flag}: cannot create the directory of {str(path)!r}: {exc}")
    try:
        base_workload = workload_for(args, args.contexts[0])
    except SparseFrameworkError as exc:  # e.g. --device cuda without CUDA
        parser.error(f"argument --device/--dtype: {exc}")
    workload = {**base_workload.model_dump(), "contexts": args.contexts}
    command = reproduce_command(args)
    header = {
        "command": command,
        "argv": [SCRIPT, *(sys.argv[1:] if argv is None else argv)],
        "workload": workload,
        "fractions": [fraction_label(f) for f in args.fractions],
        "algorithms": {label: dict(ALGORITHMS)[label] for label in args.algorithms},
        "fixed_config": FIXED,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    start = time.perf_counter()
    cells = run_sweep(args, json_path, header)
    total = time.perf_counter() - start
    _write_json(json_path, {**header, "complete": True, "seconds": total, "cells": cells})
    md_path.write_text(render_markdown(args, cells, command, workload))
    _print_summary(cells, args.algorithms)
    print(f"{len(cells)} cells in {total:.1f} s; wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
