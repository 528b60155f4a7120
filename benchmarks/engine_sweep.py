"""The engine's benchmark grid of issue 20: prompt length x sparse config x concurrency.

One process, the model built once; per cell a fresh engine (`LLM.from_model`) runs
`sparse_framework.bench.offline.run_benchmark`, and its result dict is the cell's row. Cells:

  --lengths       prompt lengths (default 16384,32768,131072), each request --output-len more
  --configs       names of CONFIGS below (default all):
                    dense           resident store, every request in the algorithm's dense mode
                                    (min_sparse_prompt_len 1e9): the baseline every token is read by
                    defaults        {"algorithm": "quest"} as a user writes it (backend auto, the
                                    resident store, the cost policy, top_k 2048: not --top-k)
                    quest-resident  Quest over a resident store (sparse reads, every token on the device)
                    dsa-resident    DSA scoring the attention keys (extra.source "keys"), resident
                    quest-hier      Quest over the hierarchical store (full KV on the host, a buffer)
                    pqcache-hier    PQCache over the hierarchical store
                    dsa-indexer-hier  DSA fed by the model's lightning indexer over the hierarchical
                                    store, as the model selects (DeepSeek-V3.2 presets only:
                                    command.random_model_config; HiSparse's case)
  --concurrency   requests running at once: numbers and "max". A 'max' cell's engine is built with
                  --gpu-memory-utilization (and --device-memory-gib / --host-memory-gib) and
                  --max-num-seqs as the upper bound, so it takes the rows of its own memory plan
                  (engine/memory.py, what `sparse-framework plan --engine` prints) and admits by
                  it: the cell's concurrency is min(--max-num-seqs, the plan's max_requests). A
                  numbered cell's engine has that many rows (no plan); its memory-bound maximum is
                  the plan an engine of its settings would make (bench.memory_plan).

Each cell runs --num-prompts requests (default: its concurrency, one wave) queued at once.
A cell that fails (out of memory, a CapacityError, no request fits) is a row with its error;
the sweep goes on. Rows are written to --out as each cell finishes; --resume skips the cells
already there; --time-limit-s stops starting new cells after that many seconds (a device
call stays within its limit, the next call resumes; the first cell always starts, so each
call makes progress).

    python benchmarks/engine_sweep.py --random llama-3-8b --device cuda --cuda-graphs \\
        --lengths 16384 --concurrency 8,16,max --time-limit-s 480 --out benchmarks/results/engine_sweep_h100.json
    python benchmarks/plot_engine_sweep.py benchmarks/results/engine_sweep_h100.json \\
        --out-dir docs/engine_sweep --markdown docs/engine_sweep.md
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from sparse_framework.common.errors import ConfigError
from sparse_framework.config import DENSE_CONFIG, load_config
from sparse_framework.bench import offline as bench
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS, random_model_config
from sparse_framework.engine.llm import LLM
from sparse_framework.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, HOST_MEMORY_FRACTION
from sparse_framework.engine.models import ModelConfig, random_model

CONFIG_NAMES = ("dense", "defaults", "quest-resident", "dsa-resident", "quest-hier", "pqcache-hier", "dsa-indexer-hier")


def sweep_configs(backend: str, top_k: int, device_buffer_tokens: int, min_sparse_prompt_len: int,
                  quest_dense_first_layers: int) -> dict[str, dict[str, Any]]:
    """The sparse configs of the grid (JSON objects), by name (see the module docstring)."""
    # the sweep measures each store's sparse path from --min-sparse-prompt-len on: the "always" rule
    common = {"backend": backend, "top_k": top_k, "sparse_policy": "always", "min_sparse_prompt_len": min_sparse_prompt_len}
    quest = {"algorithm": "quest", "extra": {"dense_first_layers": quest_dense_first_layers}}
    return {
        "dense": {**DENSE_CONFIG, "backend": backend},
        "defaults": {"algorithm": "quest"},  # as a user writes it: every other option the library's default
        "quest-resident": {**common, **quest, "store": "resident"},
        "dsa-resident": {**common, "algorithm": "dsa", "store": "resident", "extra": {"source": "keys"}},
        "quest-hier": {**common, **quest, "store": "hierarchical", "device_buffer_tokens": device_buffer_tokens},
        "pqcache-hier": {**common, "algorithm": "pqcache", "store": "hierarchical",
                         "device_buffer_tokens": device_buffer_tokens},
    }


def _list(text: str, flag: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{flag} needs a comma-separated list, got {text!r}")
    for item in items:
        if allowed is not None and item not in allowed:
            raise ConfigError(f"{flag}: unknown {item!r}; choose from {', '.join(allowed)}")
        if allowed is None and item != "max" and not (item.isdigit() and int(item) >= 1):
            raise ConfigError(f"{flag}: {item!r} is neither a positive integer nor 'max'")
    return items


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random", choices=sorted(RANDOM_MODELS), default="llama-3-8b", help="model shape (random weights)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lengths", default="16384,32768,131072", help="prompt lengths, comma-separated")
    p.add_argument("--configs", default=",".join(CONFIG_NAMES), help="config names, comma-separated")
    p.add_argument("--concurrency", default="8,16,32,max", help="requests running at once: numbers and 'max'")
    p.add_argument("--output-len", type=int, default=256, help="tokens generated per request (default 256)")
    p.add_argument("--num-prompts", type=int, help="requests per cell (default: the cell's concurrency)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default 16384 on CUDA, 2048 on the CPU)")
    p.add_argument("--top-k", type=int, default=2048, help="top_k of the sparse configs (default 2048)")
    p.add_argument("--device-buffer-tokens", type=int, default=4096, help="buffer of the hierarchical configs")
    p.add_argument("--min-sparse-prompt-len", type=int, default=2048, help="of the sparse configs (default 2048)")
    p.add_argument("--quest-dense-first-layers", type=int, default=2, help="Quest's dense first layers (default 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   help=f"the memory plan's fraction of the device (default {DEFAULT_GPU_MEMORY_UTILIZATION:g})")
    p.add_argument("--device-memory-gib", type=float, help="the device memory of the plan, GiB (default: the CUDA "
                   "device's; required for 'max' on the CPU)")
    p.add_argument("--host-memory-gib", type=float, help="the plan's host budget, GiB (default: "
                   f"{HOST_MEMORY_FRACTION:g} x MemAvailable)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="upper bound on a 'max' cell's rows (default 256, "
                   "as `plan --engine`)")
    p.add_argument("--cuda-graphs", action="store_true", help="whole decode steps replayed from CUDA graphs")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the KV store's rows: auto (the model's dtype) or fp8 (MLA: FlashMLA's 656-byte rows)")
    p.add_argument("--prefill-attention", choices=["auto", "flash_attn", "sdpa"], default="auto",
                   help="prefill chunks' attention (default auto: flash-attn's varlen kernel where installed)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up run of each config (Triton compiles, allocator) before its cells")
    p.add_argument("--time-limit-s", type=float, help="start no new cell after this many seconds (the first always starts)")
    p.add_argument("--resume", action="store_true", help="skip the cells already in --out")
    p.add_argument("--out", default="engine_sweep.json", help="the rows, JSON (written after every cell)")
    args = p.parse_args(argv)
    args.length_list = [int(x) for x in _list(args.lengths, "--lengths", None) if x != "max"]
    args.config_list = _list(args.configs, "--configs", CONFIG_NAMES)
    args.concurrency_list = _list(args.concurrency, "--concurrency", None)
    if args.output_len < 1 or args.max_num_seqs < 1 or (args.num_prompts is not None and args.num_prompts < 1):
        raise ConfigError("--output-len, --max-num-seqs and --num-prompts must be >= 1")
    for flag in ("device_memory_gib", "host_memory_gib"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag):g}")
    args.memory = {"gpu_memory_utilization": args.gpu_memory_utilization,
                   "device_memory_bytes": _bytes(args.device_memory_gib), "host_memory_bytes": _bytes(args.host_memory_gib)}
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = 16384 if torch.device(args.device).type == "cuda" else 2048
    return args


def _bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


def cell_key(length: int, config: str, concurrency: str) -> str:
    return f"{length}/{config}/{concurrency}"


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(path)


def _free_memory(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_cell(model: torch.nn.Module, args: argparse.Namespace, length: int, name: str, config: dict[str, Any],
             label: str, *, num_prompts: int | None = None, output_len: int | None = None) -> dict[str, Any]:
    """One cell's row: bench's result dict, or the error that stopped it (num_prompts and
    output_len override the arguments' for a warm-up run)."""
    output_len = output_len or args.output_len
    row: dict[str, Any] = {"cell": cell_key(length, name, label), "length": length, "config_name": name,
                           "concurrency_label": label, "model": args.random}
    max_model_len = length + output_len
    try:
        bench.reset_peak_memory(args.device)
        plan = None
        if label == "max":  # the engine's own memory plan sizes it (CapacityError: not one request fits)
            llm = LLM.from_model(model, config, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
                                 cuda_graphs=args.cuda_graphs, prefill_attention=args.prefill_attention,
                                 kv_cache_dtype=args.kv_cache_dtype, **args.memory)
            concurrency = llm.engine.num_seqs
        else:
            concurrency = int(label)
            tokens = max(args.max_num_batched_tokens, concurrency)
            plan = bench.memory_plan(model, load_config(config), args.device, max_model_len=max_model_len,
                                     max_num_batched_tokens=tokens, max_num_seqs=concurrency,
                                     kv_cache_dtype=args.kv_cache_dtype, **args.memory)
            llm = LLM.from_model(model, config, max_num_seqs=concurrency, max_num_batched_tokens=tokens,
                                 max_model_len=max_model_len, cuda_graphs=args.cuda_graphs,
                                 prefill_attention=args.prefill_attention, kv_cache_dtype=args.kv_cache_dtype)
        row["concurrency"] = concurrency
        spec = bench.BenchSpec(num_prompts=num_prompts or args.num_prompts or concurrency, input_len=length,
                               output_len=output_len, concurrency=concurrency)
        try:
            row.update(bench.run_benchmark(llm, spec, plan))
        finally:
            del llm
    except Exception as exc:  # any failure is the cell's result, never the sweep's end  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"
    _free_memory(args.device)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    rows: list[dict[str, Any]] = json.loads(out.read_text()) if args.resume and out.exists() else []
    done = {r["cell"] for r in rows}
    cells = [(n, c, k) for n in args.length_list for c in args.config_list for k in args.concurrency_list]
    todo = [cell for cell in cells if cell_key(*cell) not in done]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} already in {out}, {len(todo)} to run", flush=True)
    if not todo:
        return 0
    backend = "triton" if torch.device(args.device).type == "cuda" else "torch_ref"
    configs = sweep_configs(backend, args.top_k, args.device_buffer_tokens, args.min_sparse_prompt_len,
                            args.quest_dense_first_layers)
    indexer = random_model_config(args.random, args.device, args.kv_cache_dtype)
    if indexer is not None:  # the model's own DSA, with the sweep's buffer
        configs["dsa-indexer-hier"] = {**indexer, "device_buffer_tokens": args.device_buffer_tokens}
    elif "dsa-indexer-hier" in args.config_list:
        raise ConfigError(f"--configs dsa-indexer-hier needs a model with a lightning indexer (deepseek-v3.2-*), "
                          f"not {args.random}")
    dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    model = random_model(ModelConfig.from_hf(RANDOM_MODELS[args.random]), dtype, args.device)
    start = time.monotonic()
    warm: set[str] = set()
    for i, (length, name, label) in enumerate(todo):
        if i and args.time_limit_s is not None and time.monotonic() - start > args.time_limit_s:
            print(f"time limit {args.time_limit_s:g} s: {len(todo) - i} cells left; rerun with --resume", flush=True)
            break
        if name not in warm and not args.no_warmup:
            warm.add(name)
            # four prompts that overflow one step's token budget: the last is split, so the
            # kernels of a partial chunk (flash-attn's varlen JIT) compile here too
            warm_len = min(length, args.max_num_batched_tokens // 3 + 1)
            warmup = run_cell(model, args, warm_len, name, configs[name], "4", num_prompts=4, output_len=8)
            print(f"[{time.monotonic() - start:7.1f} s] warm-up of {name}: {warmup.get('error') or 'done'}", flush=True)
        row = run_cell(model, args, length, name, configs[name], label)
        rows.append(row)
        _write(out, rows)
        what = row.get("error") or (f"{row['output_tokens_per_s']:,.1f} tok/s, TPOT p50 {row['tpot_p50_ms']:,.1f} ms, "
                                    f"admitted {row['admitted_concurrency']}/{row['concurrency']}")
        print(f"[{time.monotonic() - start:7.1f} s] {row['cell']}: {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
