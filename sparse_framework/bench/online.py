"""`sparse-framework bench-serve`: an online benchmark of a running OpenAI-compatible server.

`bench` measures the engine alone; this measures what a client sees through HTTP (queueing,
tokenization, streaming, the event loop) under a controlled load, in the shape of vLLM's
`bench serve`, against this server or any other that speaks /v1/completions:

- load: requests arrive as a Poisson process at each `--request-rate` (`inf`: all at once),
  optionally at most `--max-concurrency` in flight; every rate of a sweep sends the same
  prompts, so rates compare. Or a concurrency sweep (the serving curve, issue 46): several
  `--max-concurrency` values, each a run of every request offered at once with at most N in
  flight and K x N of the same prompts (`--prompts-per-concurrency` K, at least
  `--min-prompts`), so that a point stays near N in flight for several requests' lifetimes;
- prompts: synthetic, of exact token counts drawn from a length distribution and built with the
  served model's own tokenizer (text that re-tokenizes to exactly that count, else the token
  ids themselves, which /v1/completions takes), or a JSONL file of {"prompt", "max_tokens"};
  `ignore_eos` (vLLM's field, this server's too) pins each output to its max_tokens;
- per request, over a streamed completion (this server sends one chunk per token): TTFT from
  the send to the first token chunk, ITL between token chunks, latency to the end of the
  stream, TPOT = (latency - TTFT) / (output tokens - 1), output tokens from the server's usage;
- per rate: mean, p50 and p99 of each, request and token throughput over the rate's duration
  (first send to last answer), and goodput (vLLM's): requests meeting every SLO given
  (--slo-ttft-ms, --slo-tpot-ms) per second;
- failures (connection refused, timeouts, HTTP 4xx/5xx, an error event inside a stream) are
  counted per rate and kind with the first message, never raised: a benchmark that overloads
  a server should say how, not stop;
- the JSON report carries the command, the commit of the code that ran (`$SF_COMMIT` where the
  tree travelled without .git, else `git rev-parse`), a `--label` and `--meta KEY=VALUE` facts,
  so that curves of several servers can be joined later (benchmarks/plot_serving_curve.py); with
  `--out` it is rewritten after every point, so a run cut short keeps the points it finished.

The parts, by what each owns: serve_spec.py the options and the sweep's points, serve_load.py the
arrivals and prompts, serve_client.py the HTTP requests and their timing, serve_report.py the
figures and tables; this module runs the sweep (`benchmark`) and is the `bench-serve` command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.errors import ConfigError
from .offline import LENGTH_DISTRIBUTIONS
from .serve_client import RequestResult, run_point, served_model
from .serve_load import dataset_requests, load_tokenizer_for, synthetic_requests
from .serve_report import curve_tables, error_lines, rate_text, report_tables, request_row, summarize
from .serve_spec import PROMPT_FORMATS, Point, ServeBenchSpec

if TYPE_CHECKING:
    from rich.console import Console

BENCH_SERVE_HELP = """\
Drive a running OpenAI-compatible server (sparse-framework serve, or any other) with streamed
completions arriving as a Poisson process, and report TTFT, ITL, TPOT and latency (mean, p50,
p99), request and output-token throughput, and goodput under SLOs, per request rate
(docs/serve.md, "Online benchmark").

  sparse-framework serve --model reference --port 8000 &
  sparse-framework bench-serve --base-url http://127.0.0.1:8000 --request-rate 2 8 inf \\
      --num-prompts 50 --input-len 256 --output-len 32 --slo-ttft-ms 500 --slo-tpot-ms 50 --out bench.json

A concurrency sweep (the serving curve: output tok/s against requests in flight): several
--max-concurrency values; each is a run at --request-rate inf with at most N in flight and
K x N prompts (--prompts-per-concurrency K, at least --min-prompts), the same prompts at every N:

  sparse-framework bench-serve --max-concurrency 1 2 4 8 16 --prompts-per-concurrency 4 \\
      --input-len 256 --output-len 64 --label mine --out curve.json
  python benchmarks/plot_serving_curve.py curve.json other.json --png docs/serving_curve/curve.png

Prompts are built with the served model's tokenizer (--tokenizer, default the served model's
name: a catalog model, a checkpoint directory or `reference`) to exact token counts; or read
from --dataset, a JSONL file of {"prompt": "..." or [ids], "max_tokens": N}.
"""


# -- the sweep ------------------------------------------------------------------------------------
def benchmark(spec: ServeBenchSpec, on_start: Callable[[Point], None] | None = None,
              on_done: Callable[[RequestResult], None] | None = None,
              on_point: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole sweep: the requests built once (as many as the largest point sends; each point
    sends the first of them), then each point in turn (`on_start(point)` before it, `on_done`
    after each request, `on_point(report so far)` after it); the JSON-ready report."""
    model = spec.model or served_model(spec)
    wanted = max(p.num_prompts for p in spec.points()) if spec.concurrencies else spec.num_prompts
    if spec.dataset is not None:
        requests, tokenizer_name = dataset_requests(spec.dataset, wanted, spec.output_len), None
    else:
        tokenizer_name = spec.tokenizer or model
        requests = synthetic_requests(spec, load_tokenizer_for(tokenizer_name), wanted)
    report: dict[str, Any] = {
        "label": spec.label or model, "mode": spec.mode, "commit": source_commit(), "command": None,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "meta": dict(spec.meta),
        "base_url": spec.root, "model": model, "tokenizer": tokenizer_name, "dataset": spec.dataset,
        "num_prompts": len(requests), "input_len": spec.input_len, "output_len": spec.output_len,
        "input_len_dist": spec.input_len_dist, "output_len_dist": spec.output_len_dist or spec.input_len_dist,
        "range_ratio": spec.range_ratio, "prompt_format": spec.prompt_format, "ignore_eos": spec.ignore_eos,
        "temperature": spec.temperature, "max_concurrency": spec.max_concurrency,
        "concurrencies": list(spec.concurrencies) or None,
        "prompts_per_concurrency": spec.prompts_per_concurrency if spec.concurrencies else None,
        "min_prompts": spec.min_prompts if spec.concurrencies else None, "seed": spec.seed,
        "slo_ttft_ms": spec.slo_ttft_ms, "slo_tpot_ms": spec.slo_tpot_ms, "runs": [],
    }
    for point in spec.points(len(requests)):
        if on_start is not None:
            on_start(point)
        sent = requests[:point.num_prompts]
        results, duration, in_flight = asyncio.run(run_point(spec, sent, point, model, on_done))
        report["runs"].append({
            "request_rate": "inf" if math.isinf(point.rate) else point.rate, "max_concurrency": point.max_concurrency,
            "max_in_flight": in_flight, **summarize(results, duration, spec.slo_ttft_ms, spec.slo_tpot_ms),
            "requests": [request_row(r) for r in results]})
        if on_point is not None:
            on_point(report)
    return report


def source_commit() -> str | None:
    """The commit of the code that runs: $SF_COMMIT where the tree travelled without .git (the
    GPU machine's packed tree), else `git rev-parse HEAD` beside this file; None when neither
    says (an installed wheel)."""
    import subprocess

    if os.environ.get("SF_COMMIT"):
        return os.environ["SF_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None


# -- the command ------------------------------------------------------------------------------------
def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench-serve", help="online benchmark of a running server: Poisson load, TTFT/ITL/TPOT, "
                       "throughput, goodput", description=BENCH_SERVE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    b.add_argument("--api-key", metavar="KEY", help="sent as 'Authorization: Bearer KEY' (also SPARSE_FRAMEWORK_API_KEY)")
    b.add_argument("--model", help="the model field of requests (default: the server's, GET /v1/models)")
    b.add_argument("--tokenizer", metavar="NAME|DIR", help="builds the prompts: a catalog model, a checkpoint directory "
                   "or 'reference' (default: the model's name)")
    b.add_argument("--request-rate", nargs="+", default=["inf"], metavar="RATE",
                   help="Poisson arrivals per second; several (or comma-separated) make a sweep; inf = all at once "
                   "(default inf)")
    b.add_argument("--max-concurrency", nargs="+", metavar="N",
                   help="requests in flight at most (default: no limit). One value caps every rate of the rate sweep; "
                   "several (or comma-separated, or one with --prompts-per-concurrency) make a concurrency sweep: "
                   "each N a run of every request offered at once, at most N in flight, the same prompts")
    b.add_argument("--prompts-per-concurrency", type=int, metavar="K",
                   help="a concurrency sweep sends K x N prompts at concurrency N (default 4), so that each point "
                   "stays near N in flight for K requests' lifetimes")
    b.add_argument("--min-prompts", type=int, metavar="M",
                   help="a concurrency sweep sends at least M prompts at any N (default 8)")
    b.add_argument("--num-prompts", type=int, help="requests per rate of a rate sweep (default 100; with --dataset: "
                   "its lines)")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens, the mean (default 256)")
    b.add_argument("--output-len", type=int, default=32, help="max_tokens, the mean (default 32)")
    b.add_argument("--input-len-dist", choices=LENGTH_DISTRIBUTIONS, default="fixed",
                   help="fixed (default), uniform in [L(1-R), L(1+R)], normal (sd L*R/2, clipped)")
    b.add_argument("--output-len-dist", choices=LENGTH_DISTRIBUTIONS, help="default: as --input-len-dist")
    b.add_argument("--range-ratio", type=float, default=0.0, help="R of the length distributions, in [0, 1) (default 0)")
    b.add_argument("--dataset", metavar="JSONL", help='requests from a file: {"prompt": text or [ids], "max_tokens": N} '
                   "a line")
    b.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="text",
                   help="synthetic prompts as text of the exact token count (default) or as token ids")
    b.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop at its end token (default: ignore_eos, outputs of exactly max_tokens)")
    b.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)")
    b.add_argument("--seed", type=int, default=0, help="lengths, prompts and arrivals (default 0)")
    b.add_argument("--slo-ttft-ms", type=float, help="goodput's TTFT bound (ms)")
    b.add_argument("--slo-tpot-ms", type=float, help="goodput's TPOT bound (ms)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    b.add_argument("--label", help="the report's name for this server and config, the line's name in "
                   "benchmarks/plot_serving_curve.py (default: the served model's name)")
    b.add_argument("--meta", action="append", default=[], metavar="KEY=VALUE",
                   help="a fact to keep in the report's 'meta' (repeatable), e.g. memory_max=23 (the server's "
                   "memory-bound maximum of requests, which the plot marks) or config='{...}'")
    b.add_argument("--out", metavar="PATH", help="write the report as JSON (rewritten after every point)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_concurrencies(values: Sequence[str] | None) -> tuple[int, ...]:
    """--max-concurrency's values, space- or comma-separated, as whole numbers."""
    out = []
    for text in (v.strip() for value in values or () for v in value.split(",") if v.strip()):
        try:
            out.append(int(text))
        except ValueError:
            raise ConfigError(f"--max-concurrency takes whole numbers >= 1 of requests in flight, got {text!r}") from None
    return tuple(out)


def parse_meta(values: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """--meta KEY=VALUE pairs, in order (a key given again: the last value)."""
    pairs: dict[str, str] = {}
    for text in values:
        key, eq, value = text.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--meta takes KEY=VALUE, got {text!r}")
        pairs[key.strip()] = value
    return tuple(pairs.items())


def parse_rates(values: Sequence[str]) -> tuple[float, ...]:
    rates = []
    for text in (v for value in values for v in value.split(",") if v.strip()):
        try:
            rates.append(float(text))
        except ValueError:
            raise ConfigError(f"--request-rate takes numbers of requests per second or inf, got {text!r}") from None
    return tuple(rates)


def run(args: argparse.Namespace, console: Console) -> int:
    """The `bench-serve` subcommand."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise ConfigError("bench-serve needs httpx: pip install httpx") from None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    caps = parse_concurrencies(args.max_concurrency)
    sweep = len(caps) > 1 or args.prompts_per_concurrency is not None or args.min_prompts is not None
    if sweep and not caps:
        raise ConfigError("--prompts-per-concurrency and --min-prompts belong to a concurrency sweep: give the "
                          "concurrencies with --max-concurrency N [N ...]")
    spec = ServeBenchSpec(
        base_url=args.base_url, rates=parse_rates(args.request_rate), num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, input_len_dist=args.input_len_dist,
        output_len_dist=args.output_len_dist, range_ratio=args.range_ratio, dataset=args.dataset, model=args.model,
        tokenizer=args.tokenizer, api_key=args.api_key or os.environ.get("SPARSE_FRAMEWORK_API_KEY"),
        prompt_format=args.prompt_format, max_concurrency=None if sweep or not caps else caps[0],
        ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, timeout=args.timeout, concurrencies=caps if sweep else (),
        prompts_per_concurrency=4 if args.prompts_per_concurrency is None else args.prompts_per_concurrency,
        min_prompts=8 if args.min_prompts is None else args.min_prompts, label=args.label,
        meta=parse_meta(args.meta))
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise ConfigError(f"--out {args.out!r}: the directory {str(Path(args.out).resolve().parent)!r} does not exist")
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[failed]} failed"), console=console, disable=args.no_progress,
                        transient=True)
    bar: dict[str, Any] = {"task": None, "failed": 0}

    def on_start(point: Point) -> None:  # one bar per point, moved by each answer
        if bar["task"] is not None:
            progress.remove_task(bar["task"])
        what = f"concurrency {point.max_concurrency}" if spec.concurrencies else f"rate {rate_text(point.rate)} req/s"
        bar.update(task=progress.add_task(what, total=point.num_prompts, failed=0), failed=0)

    def on_done(r: RequestResult) -> None:
        bar["failed"] += not r.ok
        progress.update(bar["task"], advance=1, failed=bar["failed"])

    command = command_line(args)

    def on_point(report: dict[str, Any]) -> None:  # a run cut short keeps the points it finished
        report["command"] = command
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    with progress:
        report = benchmark(spec, on_start, on_done, on_point)
    report["command"] = command
    for table in (curve_tables if spec.concurrencies else report_tables)(report):
        console.print(table)
    for line in error_lines(report):
        console.print(line, highlight=False, markup=False)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
        console.print(f"report written to {args.out}")
    return 0 if any(run["completed"] for run in report["runs"]) else 1  # 1: nothing was measured


def command_line(args: argparse.Namespace) -> str:
    """The command as typed (sys.argv) when run from the shell, else rebuilt from the parsed
    options that differ from their defaults (called from Python: `main([...])`)."""
    if sys.argv[1:2] == ["bench-serve"]:
        return " ".join(["sparse-framework", *map(shlex.quote, sys.argv[1:])])
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    defaults = vars(parser.parse_args(["bench-serve"]))
    words = ["sparse-framework", "bench-serve"]
    for key, value in vars(args).items():
        flag = "--" + key.replace("_", "-")
        if key not in defaults or value == defaults[key] or key == "command":
            continue
        if isinstance(value, bool):  # store_true / store_false flags
            words.append({"ignore_eos": "--no-ignore-eos"}.get(key, flag))
        elif key == "meta":  # repeated: one flag per pair
            words += [w for pair in value for w in (flag, pair)]
        elif isinstance(value, list):
            words += [flag, *map(str, value)]
        else:
            words += [flag, str(value)]
    return " ".join(map(shlex.quote, words))
