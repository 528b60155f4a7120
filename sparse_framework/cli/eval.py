"""`sparse-framework eval`: parse the arguments, run the sweep, print and write the results."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from rich.console import Console

from ..common.errors import ConfigError
from ..eval.experiment import DEFAULT_EXPERIMENT, expand, load_experiment
from ..eval.report import make_plots, markdown_page
from ..eval.ruler import RULER_TASKS
from ..eval.runner import METRICS
from ..eval.sweep import results_table, run_sweep

DEFAULT_OUT = "eval-results.jsonl"

DESCRIPTION = """\
Sweep sparse-attention settings and compare each with dense decoding.

An experiment file (JSON or TOML) lists what to sweep; every algorithm x backend x budget x
context x workload is one cell, and each (workload, context) also runs dense as the baseline:

  {"name": "mine",
   "algorithms": ["quest", {"algorithm": "dsa", "label": "dsa-keys", "extra": {"source": "keys"}}],
   "backends": ["torch_ref"],
   "budgets": ["1/16", "1/4", 512],          # a fraction of the context, or top_k tokens
   "contexts": [2048, 4096],
   "workloads": [{"kind": "reference", "task": "mqar"},          # the shipped model: mqar, passkey
                 {"kind": "synthetic", "options": {"decode_steps": 8}},
                 {"kind": "hf", "model": "/path/to/model", "prompts": "prompts.txt"},
                 {"kind": "ruler", "task": "niah_single_1", "samples": 4}],
   "base": {"sink_tokens": 16, "recent_tokens": 64},   # shared config options
   "device": "cpu", "dtype": "float32", "seed": 0}

Workload kinds:
  reference  a retrieval task on the shipped reference model, decoded teacher-forced
             (task: mqar, passkey; sequences)
  synthetic  the engine's synthetic attention workload: random keys with needles, no model
             (options: WorkloadConfig fields)
  hf         a local Hugging Face model and a prompts file, decoded teacher-forced along the
             dense model's greedy continuation (model, prompts, max_new_tokens, limit)
  ruler      a RULER task answered by a real model through the engine, greedy, scored by
             string-match-all; the contexts are the RULER lengths. task: one of
             """ + ", ".join(RULER_TASKS) + """;
             model: a catalog name or checkpoint directory (default smollm2-135m-instruct);
             samples, max_new_tokens, chat_template, max_num_seqs, max_num_batched_tokens,
             engine: other EngineConfig options, examples: predictions kept per cell)

With no file it runs a small embedded sweep on the shipped reference model (a few minutes
on a CPU). Results go to JSON lines (--out), one per finished cell: run the same command
again after an interruption and finished cells are skipped. A failing cell is recorded with
its error and the sweep goes on.

metrics:
""" + "\n".join(f"  {k}: {v}" for k, v in METRICS.items())


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "eval", help="sweep algorithms x backends x budgets x contexts; accuracy and speed vs dense",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("experiment", nargs="?", help="experiment file (.json or .toml); default: the embedded sweep")
    p.add_argument("--device", help="override the experiment's device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="PATH", help=f"results, JSON lines (default {DEFAULT_OUT})")
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out instead of resuming")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots (accuracy/recall vs budget, RULER accuracy per task, time vs context) to DIR")
    p.add_argument("--markdown", metavar="PATH", help="write a results page (tables, plots) to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: tables, plots and page from the cells already in --out (a sweep measured "
                   "on another machine, or cut short)")
    p.add_argument("--shard", metavar="I/N", type=parse_shard,
                   help="measure only share I of N (0-based) of the cells not yet in --out, dealt algorithm by "
                   "algorithm (dense first): N processes, one per GPU, each with its own copy of --out, then "
                   "concatenate the files (finished cells are recognised by their ids)")
    p.add_argument("--show-default", action="store_true", help="print the embedded experiment as JSON and exit")


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` with 0 <= I < N; anything else names the flag and the form."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N, got {text!r}")
    return index, count


def run(args: argparse.Namespace, console: Console) -> int:
    if args.show_default:
        print(json.dumps(DEFAULT_EXPERIMENT, indent=1))
        return 0
    data: dict[str, Any] | str = DEFAULT_EXPERIMENT if args.experiment is None else args.experiment
    exp = load_experiment(data)
    if args.device:
        exp = load_experiment({**exp.model_dump(exclude_unset=True), "device": args.device})
    for flag, path in (("--out", args.out), ("--markdown", args.markdown)):
        if path and not Path(path).resolve().parent.is_dir():
            raise ConfigError(f"{flag}: directory {str(Path(path).parent)!r} does not exist")
    out = Path(args.out)
    if args.report_only and args.fresh:
        raise ConfigError("--report-only reads the cells in --out; --fresh would discard them: give one of the two")
    if args.report_only and not out.is_file():
        raise ConfigError(f"--report-only: results file {str(out)!r} does not exist")
    records = run_sweep(exp, out, progress=not args.no_progress, fresh=args.fresh, console=console,
                        measure=not args.report_only, shard=args.shard)
    if not records:
        raise ConfigError(f"no cell of experiment {exp.name!r} is in {str(out)!r}")
    total = len(expand(exp))
    console.print(results_table(records, title=f"experiment {exp.name!r} on {exp.device} (results: {out})"))
    plots = make_plots(records, Path(args.plots)) if args.plots else []
    if plots:
        console.print("plots: " + ", ".join(str(p) for p in plots))
    if args.markdown:
        page = Path(args.markdown)
        command = "sparse-framework eval " + shlex.join(
            ([args.experiment] if args.experiment else [])
            + (["--device", args.device] if args.device else [])
            + ["--out", args.out] + (["--plots", args.plots] if args.plots else []) + ["--markdown", args.markdown]
            + (["--report-only"] if args.report_only else [])
        )
        missing = total - len(records)
        notes = (f"**Partial: {len(records)} of {total} cells of this experiment were measured; the other {missing} "
                 "are not in the results file (nothing below stands in for them).**") if missing else ""
        experiment = exp.model_dump(exclude_unset=True)
        page.write_text(markdown_page(records, experiment, command, plots, page, notes=notes))
        console.print(f"results page: {page}")
    failed = sum(r.status != "ok" for r in records)
    if failed:
        console.print(f"[red]{failed} of {len(records)} cells failed[/red] (errors in {out})")
    return 1 if failed == len(records) else 0
