"""The `sparse-framework` command: run or evaluate experiments, print the config schema, list plugins, plan capacity."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from .. import __version__
from ..common.tables import new_table
from .tables import plan_table, plugins_table, run_table, size_text
from ..config import config_schema, dense_layer_set, load_config, read_json_object, validate
from ..eval.loop import RequestResult, run_experiment
from ..eval.workload import WorkloadConfig
from ..eval.workload import DTYPES as LAYOUT_DTYPES
from ..common.errors import CapacityError, SparseFrameworkError, closest
from . import engine as engine_command
from ..engine.memory import HOST_MEMORY_FRACTION, host_budget, plan_engine_memory
from ..engine.models import ModelConfig
from . import eval as eval_command
from . import serve as serve_command
from ..bench import online as serve_bench
from ..coordinator.capacity import PRESETS, CapacityPlan, plan_capacity
from ..common.layout import KVLayout

# The embedded default experiment: Quest at two budgets on a needle workload where one prompt
# is short enough to take the dense path. The synthetic layers are all alike (no early layers
# that need dense attention), so Quest's dense first layers are turned off to measure it.
ALL_SPARSE: dict[str, Any] = {"dense_first_layers": 0}
# `run` measures sparse attention against dense: sparse from min_sparse_prompt_len on ("always"),
# where the cost policy (the default) would keep the CPU's short synthetic contexts dense
DEFAULT_CONFIGS: list[dict[str, Any]] = [
    {"algorithm": "quest", "top_k": 256, "page_size": 16, "device_buffer_tokens": 1024, "sparse_policy": "always",
     "extra": ALL_SPARSE},
    {"algorithm": "quest", "top_k": 1024, "page_size": 16, "device_buffer_tokens": 2048, "sparse_policy": "always",
     "extra": ALL_SPARSE},
]
# `plan` without --config: Quest at top-2048 with every layer sparse (the headline comparison)
PLAN_DEFAULT: dict[str, Any] = {"top_k": 2048, "extra": {"dense_first_layers": 0}}
# The workload of `run` is WorkloadConfig's defaults (one place: `--help-workload` prints them)

console = Console()
if not console.is_terminal and not os.environ.get("COLUMNS"):  # piped or captured: 100 columns unless COLUMNS says
    console = Console(width=100)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparse-framework",
        description="Pluggable decode-time sparse attention: run experiments, inspect configs and plugins.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a sparse-attention experiment on a synthetic needle workload",
        description=(
            "Prefill one request per context length, decode them together, and compare every "
            "step's sparse attention with dense attention. With no arguments it runs the "
            "embedded default (Quest, top_k 256 and 1024, contexts 1024/4096/8192) on the CPU."
        ),
    )
    run.add_argument(
        "--config",
        action="append",
        metavar="JSON|PATH",
        help="sparse config as a JSON object or a JSON file; repeat to compare several "
        "(see `sparse-framework schema`)",
    )
    run.add_argument("--workload", metavar="JSON|PATH", help="workload options as JSON (see --help-workload)")
    run.add_argument("--contexts", metavar="N,N,...", help="prompt lengths, one request each")
    run.add_argument("--steps", type=int, metavar="N", help="decode steps")
    run.add_argument("--device", help="torch device for KV and attention (default cpu)")
    run.add_argument("--dtype", help="KV dtype: float32, float16, bfloat16")
    run.add_argument("--seed", type=int, help="workload seed")
    run.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    run.add_argument("--decode-graphs", action="store_true",
                     help="replay each decode layer from a CUDA graph (CUDA devices; see docs/performance.md)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--help-workload", action="store_true", help="print the workload options and exit")

    schema = sub.add_parser("schema", help="print the JSON Schema of the config, with every algorithm's extra-config")
    schema.add_argument("--output", metavar="PATH", help="write to PATH instead of stdout")

    sub.add_parser("plugins", help="list registered algorithms, adaptors and backends: load errors, "
                   "and whether each backend can run on this machine")

    eval_command.add_parser(sub)
    engine_command.add_parsers(sub)
    serve_command.add_parser(sub)
    serve_bench.add_parser(sub)

    plan = sub.add_parser(
        "plan",
        help="how many concurrent requests fit: resident vs hierarchical KV store",
        description=(
            "Capacity planning for a model's KV layout: requests of a context length that fit "
            "in a device (and host) memory budget with every token resident vs with the "
            "hierarchical store (a fixed device buffer per request and sparse layer, full KV "
            "on the host). Device bytes count the buffer, dense layers, slot maps and the "
            "algorithm's representation. A row with the smallest buffer that holds the "
            "config's largest selection is printed too."
        ),
    )
    plan.add_argument("--model", default="llama-3-8b", help="layout preset: " + ", ".join(PRESETS))
    plan.add_argument("--layout", metavar="JSON", help="custom layout, e.g. "
                      '\'{"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16"}\'')
    plan.add_argument("--context", default="16384", metavar="N,N,...", help="context lengths (default 16384)")
    plan.add_argument("--gpu-gb", type=float, default=60.0, help="device memory for KV, GiB (default 60)")
    plan.add_argument("--host-gb", type=float, default=1024.0, help="pinned host memory for KV, GiB (default 1024)")
    plan.add_argument(
        "--config",
        metavar="JSON|PATH",
        help="sparse config (default: " + json.dumps(PLAN_DEFAULT) + ", every layer sparse; Quest's own recipe "
        "keeps its first two layers dense: drop the extra to plan for that)",
    )
    plan.add_argument("--json", metavar="PATH", help="write the plan as JSON to PATH")
    eng = plan.add_argument_group(
        "engine plan (--engine)",
        "the serving engine's memory plan for a model shape of `bench --random` (its weights counted): the "
        "function the engine runs with gpu_memory_utilization (docs/engine.md, Memory)")
    eng.add_argument("--engine", action="store_true", help="print the engine's plan per --context (max_model_len)")
    eng.add_argument("--enable-prefix-caching", action="store_true",
                     help="plan with the prefix cache on: its host copies beside the host pool (indexer keys, "
                          "sliding windows) and the ring's page of slack")
    eng.add_argument("--gpu-memory-gib", type=float, default=80.0, help="the device's memory, GiB (default 80)")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of it (default 0.9)")
    eng.add_argument("--host-memory-gib", type=float,
                     help=f"host budget, GiB (default: {HOST_MEMORY_FRACTION:g} x this host's MemAvailable)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default 2048)")
    eng.add_argument("--max-num-seqs", type=int, default=256, help="upper bound on request rows (default 256)")
    eng.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                     help="weights and KV dtype (default bfloat16)")
    eng.add_argument("--cuda-graphs", action="store_true",
                     help="reserve what the engine's captured whole-step graphs take (as `bench --cuda-graphs`)")
    eng.add_argument("--decode-graphs", action="store_true",
                     help="reserve what the coordinator's per-layer decode graphs take")
    eng.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="plan one rank of N (default 1): its weight shard (embeddings and head whole), its "
                          "num_kv_heads / N, 1/N of the host budget; admitted requests are the same on every rank")
    return parser


def _workload(args: argparse.Namespace) -> WorkloadConfig:
    data: dict[str, Any] = {}
    if args.workload:
        workload = read_json_object(args.workload, "--workload")
        if not isinstance(workload, dict):
            raise SparseFrameworkError(f"--workload must be a JSON object, got {type(workload).__name__}")
        data.update(workload)
    if args.contexts:
        data["contexts"] = _int_list(args.contexts, "--contexts")
    for key, value in (("decode_steps", args.steps), ("device", args.device), ("dtype", args.dtype), ("seed", args.seed)):
        if value is not None:
            data[key] = value
    return validate(WorkloadConfig, data, "workload")


def workload_help() -> Table:
    """The workload options with the defaults `run` uses (WorkloadConfig's own)."""
    table = new_table("workload options (--workload JSON; --contexts, --steps, --device, --dtype, --seed "
                      "set some of them)")
    for name in ("option", "default", "meaning"):
        table.add_column(name, overflow="fold")
    for name, field in WorkloadConfig.model_fields.items():
        table.add_row(name, json.dumps(field.default), field.description or "")
    return table


def _run(args: argparse.Namespace) -> int:
    if args.help_workload:
        console.print(workload_help())
        return 0
    configs = [load_config(c) for c in args.config] if args.config else [load_config(c) for c in DEFAULT_CONFIGS]
    workload = _workload(args)
    if args.json:
        _check_parent(args.json, "--json")
    for cfg in configs:
        dense = dense_layer_set(cfg, workload.num_layers)
        if len(dense) == workload.num_layers:
            console.print(
                f"[yellow]note:[/] {cfg.algorithm} top_k={cfg.top_k}: every layer of the {workload.num_layers}-layer "
                f"workload attends densely (dense_layers {sorted(cfg.dense_layers)} plus the algorithm's own: "
                f"{sorted(dense)}); for Quest set extra.dense_first_layers to 0, or raise num_layers in --workload"
            )
    results: list[list[RequestResult]] = []
    total = len(configs) * workload.decode_steps
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=args.no_progress, transient=True,
    ) as progress:
        task = progress.add_task("decode steps", total=total)
        for cfg in configs:
            progress.update(task, description=f"{cfg.algorithm} top_k={cfg.top_k}")
            results.append(
                run_experiment(cfg, workload, on_step=lambda: progress.advance(task), decode_graphs=args.decode_graphs)
            )
    console.print(f"sparse attention vs dense: means over {workload.decode_steps} decode steps and "
                  f"{workload.num_layers} layers of a synthetic needle workload (--help-workload)")
    for batch in results:
        console.print(run_table(batch))
    if args.json:
        payload = {"workload": workload.model_dump(), "results": [r.as_dict() for batch in results for r in batch]}
        Path(args.json).write_text(json.dumps(payload, indent=2))
        console.print(f"results written to {args.json}")
    return 0


def _plugins() -> int:
    console.print(plugins_table())
    return 0


def _layout(args: argparse.Namespace) -> tuple[str, KVLayout]:
    if not args.layout:
        if args.model not in PRESETS:
            raise SparseFrameworkError(f"unknown --model {args.model!r}; presets: {', '.join(PRESETS)}{closest(args.model, PRESETS)}")
        return args.model, PRESETS[args.model]
    data = read_json_object(args.layout, "--layout")
    if not isinstance(data, dict):
        raise SparseFrameworkError(f"--layout must be a JSON object, got {type(data).__name__}")
    dtype = data.pop("dtype", "bfloat16")
    if dtype not in LAYOUT_DTYPES:
        raise SparseFrameworkError(f"--layout dtype must be one of {', '.join(LAYOUT_DTYPES)}, got {dtype!r}")
    try:
        return "custom", KVLayout(**data, dtype=LAYOUT_DTYPES[dtype])
    except (TypeError, ValueError) as exc:
        raise SparseFrameworkError(f"invalid --layout: {exc}") from None


def _plan(args: argparse.Namespace) -> int:
    if args.engine:
        return _engine_plan(args)
    name, layout = _layout(args)
    contexts = _int_list(args.context, "--context")
    base = load_config(args.config) if args.config else load_config(PLAN_DEFAULT)
    smallest = base.algorithm_class.max_selected_tokens(base)
    configs = [base]
    if smallest < base.device_buffer_tokens:
        configs.append(base.model_copy(update={"device_buffer_tokens": smallest}))
    if args.gpu_gb <= 0 or args.host_gb <= 0:
        raise SparseFrameworkError(f"--gpu-gb and --host-gb must be > 0, got {args.gpu_gb:g} and {args.host_gb:g}")
    gpu, host = int(args.gpu_gb * 2**30), int(args.host_gb * 2**30)
    title = (f"{name}: {layout.num_layers} layers, {layout.bytes_per_token_per_layer} B/token/layer, "
             f"{args.gpu_gb:g} GiB device, {args.host_gb:g} GiB host, {base.algorithm} top_k={base.top_k}")
    plans, rows = [], []
    for context in contexts:
        for cfg, which in zip(configs, ("config", "min")):
            p = plan_capacity(layout, gpu, host, context, cfg)
            _check_fits(context, p, args)
            plans.append({"model": name, "buffer": which, **p.as_dict()})
            rows.append((p, which))
    console.print(plan_table(title, rows))
    if args.json:
        _check_parent(args.json, "--json")
        Path(args.json).write_text(json.dumps(plans, indent=2))
        console.print(f"plan written to {args.json}")
    return 0


def _engine_plan(args: argparse.Namespace) -> int:
    """`plan --engine`: `plan_engine_memory` per context, with the inputs an engine of the
    `bench --random` model shape would give it (weights: its parameter count x the dtype)."""
    models = engine_command.RANDOM_MODELS
    if args.layout or args.model not in models:
        raise SparseFrameworkError(f"--engine plans a model shape of `bench --random`: --model one of {', '.join(models)} "
                                   f"(got {args.layout and '--layout' or repr(args.model)}){closest(args.model, models)}")
    if args.gpu_memory_gib <= 0 or (args.host_memory_gib is not None and args.host_memory_gib <= 0):
        raise SparseFrameworkError(f"--gpu-memory-gib and --host-memory-gib must be > 0, got {args.gpu_memory_gib:g} "
                                   f"and {args.host_memory_gib}")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise SparseFrameworkError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization:g}")
    if args.max_num_batched_tokens < 1 or args.max_num_seqs < 1:
        raise SparseFrameworkError("--max-num-batched-tokens and --max-num-seqs must be >= 1")
    if args.tensor_parallel_size < 1:
        raise SparseFrameworkError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    from ..engine.models.tensor_parallel import local_config

    model = local_config(ModelConfig.from_hf(models[args.model]), args.tensor_parallel_size)  # one rank's
    dtype = LAYOUT_DTYPES[args.dtype]
    config = load_config(args.config) if args.config else load_config(PLAN_DEFAULT)
    host = None if args.host_memory_gib is None else int(args.host_memory_gib * 2**30)
    if args.tensor_parallel_size > 1:  # the ranks share the host: each plans with 1/N, as the Engine does
        host = host_budget(host)[0] // args.tensor_parallel_size
    plans = []
    for context in _int_list(args.context, "--context"):
        layout = model.kv_layout(dtype, max_model_len=context)  # the store's layers: full attention at this context
        p = plan_engine_memory(
            model, layout, config, weight_bytes=model.num_parameters() * dtype.itemsize, max_model_len=context,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization, device_total_bytes=int(args.gpu_memory_gib * 2**30),
            host_memory_bytes=host, prefix_caching=args.enable_prefix_caching,
            cuda_graphs=args.cuda_graphs, decode_graphs=args.decode_graphs,
        )
        console.print(p.describe(), highlight=False)
        p.check()  # not one request fits: the engine's own error
        plans.append({"model": args.model, "tensor_parallel_size": args.tensor_parallel_size,
                      "config": config.model_dump(mode="json"), **p.as_dict()})
    if args.json:
        _check_parent(args.json, "--json")
        Path(args.json).write_text(json.dumps(plans, indent=2))
        console.print(f"plan written to {args.json}")
    return 0


def _check_fits(context: int, p: CapacityPlan, args: argparse.Namespace) -> None:
    """A context of which not one request fits either way is an error, not a row of zeros."""
    if p.resident_requests == 0 and p.hierarchical_requests == 0:
        raise CapacityError(
            f"--context {context}: not one request fits: resident, one needs {size_text(p.resident_device_bytes)} "
            f"of device memory, hierarchical {size_text(p.hierarchical_device_bytes)} of device and "
            f"{size_text(p.hierarchical_host_bytes)} of host memory, for --gpu-gb {args.gpu_gb:g} and --host-gb "
            f"{args.host_gb:g}; lower --context or raise --gpu-gb / --host-gb"
        )


def _check_parent(path: str, flag: str) -> None:
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise SparseFrameworkError(f"{flag} {path!r}: the directory {str(parent)!r} does not exist")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SparseFrameworkError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SparseFrameworkError(f"{flag} needs positive integers, got {text!r}")
    return values


def _schema(args: argparse.Namespace) -> int:
    text = json.dumps(config_schema(), indent=2)
    if args.output:
        _check_parent(args.output, "--output")
        Path(args.output).write_text(text + "\n")
    else:
        print(text)
    return 0


INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)
INTERRUPT_NOTES = {"eval": "; finished cells are in --out: the same command resumes"}


def main(argv: list[str] | None = None) -> int:
    """Run a command. A user's mistake (SparseFrameworkError), a file that is not text and
    Ctrl-C each end with one line saying so and a non-zero status (2; 130 for Ctrl-C), never a
    traceback: tracebacks are for the framework's own bugs."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "schema":
            return _schema(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "eval":
            return eval_command.run(args, console)
        if args.command == "generate":
            return engine_command.run_generate(args, console)
        if args.command == "bench":
            return engine_command.run_bench(args, console)
        if args.command == "serve":
            return serve_command.run(args)
        if args.command == "bench-serve":
            return serve_bench.run(args, console)
        return _plugins()
    except SparseFrameworkError as exc:
        console.print(Text("error: ", style="red") + Text(str(exc)), highlight=False)
        return 2
    except UnicodeDecodeError as exc:  # a --config, --workload or experiment path to a binary or UTF-16 file
        console.print(Text("error: ", style="red") + Text(
            f"a file given to `{args.command}` is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as "
            "UTF-8"), highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print(Text("interrupted", style="red") + Text(
            f" (Ctrl-C): `{args.command}` stopped{INTERRUPT_NOTES.get(args.command, '')}"), highlight=False,
            soft_wrap=True)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
