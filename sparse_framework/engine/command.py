"""`sparse-framework generate` and `sparse-framework bench`: the engine from the command line.

generate  prompts from a file (one per line, or JSON lines with a "prompt" field) or stdin;
          with no --model and no --prompts, a demonstration on the shipped reference model:
          passkeys hidden in long prompts, retrieved by sparse decoding.
bench     offline throughput and latency: N random prompts of a given length, all queued at
          once, at most --concurrency running; output tokens/s, TTFT and TPOT percentiles,
          memory of the store's pools.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..common.errors import ConfigError
from ..cli_tables import new_table
from ..config import load_config
from .engine import RequestOutput
from .llm import LLM
from .models import ModelConfig, random_model
from .sampling import SamplingParams

HBM_BYTES_PER_S = 3.0e12  # the H100's measured copy rate (DESIGN.md)
DEMO_MAX_MODEL_LEN = 8192  # the reference model was trained to 8K
DEMO_CONFIG = {"algorithm": "quest", "top_k": 256, "min_sparse_prompt_len": 1024, "extra": {"dense_first_layers": 0}}
RANDOM_MODELS = {
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0},
    "tiny": {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
}

GENERATE_HELP = """\
Generate text (or token ids) for prompts through the engine: continuous batching, chunked
prefill, sparse decode over the hierarchical KV store.

  sparse-framework generate                                   # demo: the shipped reference model
  sparse-framework generate --model DIR --prompts prompts.txt --max-tokens 64 --device cuda
  echo "Tell me about sparse attention" | sparse-framework generate --model DIR --prompts -

--prompts: a text file (one prompt per line), a .jsonl file ({"prompt": "..."} per line) or -
for stdin. The reference model's prompts are token ids separated by spaces.
"""

BENCH_HELP = """\
Offline throughput and latency of the engine: --num-prompts random prompts of --input-len
tokens, each generating --output-len tokens (no early stop), all queued at once with at most
--concurrency running. Prints output tokens/s, TTFT and TPOT (p50/p99) and the store's memory.

  sparse-framework bench                                      # the reference model, CPU
  sparse-framework bench --random llama-3-8b --device cuda --input-len 16384 --num-prompts 8 \\
      --config '{"algorithm": "quest", "backend": "triton"}' --json bench.json
"""


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate for prompts with the engine (continuous batching, sparse decode)",
                       description=GENERATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(g)
    g.add_argument("--prompts", metavar="PATH", help="prompts: a text file, a .jsonl file, or - for stdin")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--seed", type=int, help="per-request seed (reproducible whatever the batch)")

    b = sub.add_parser("bench", help="offline throughput and latency of the engine (tokens/s, TTFT, TPOT)",
                       description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(b)
    b.add_argument("--random", choices=sorted(RANDOM_MODELS), help="random weights of this shape instead of --model")
    b.add_argument("--num-prompts", type=int, default=8, help="requests (default 8)")
    b.add_argument("--input-len", type=int, default=2048, help="prompt tokens each (default 2048)")
    b.add_argument("--output-len", type=int, default=32, help="generated tokens each (default 32)")
    b.add_argument("--concurrency", type=int, help="requests running at once (default: all)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="a Hugging Face checkpoint directory (default: the shipped reference model)")
    p.add_argument("--config", default=None, help="sparse config: JSON object or file (default: Quest, see the demo)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests running at once (default 8)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default 2048)")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens per request (default: the model's; "
                   f"the reference model: {DEMO_MAX_MODEL_LEN})")
    p.add_argument("--decode-graphs", action="store_true",
                   help="CUDA: replay each decode layer's sparse attention from a CUDA graph (the coordinator's)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: replay whole decode-only steps (every layer, model and attention) from CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="size the pools from this fraction (0 < u <= 1) of the GPU's memory less weights, activations "
                   "and staging; --max-num-seqs becomes an upper bound (docs/engine.md, Memory)")
    p.add_argument("--host-memory-gib", type=float, help="host budget for the host KV pool, GiB, with "
                   "--gpu-memory-utilization (default: 0.8 x MemAvailable)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _memory_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's memory-plan options from --gpu-memory-utilization / --host-memory-gib."""
    if args.host_memory_gib is not None and args.host_memory_gib <= 0:
        raise ConfigError(f"--host-memory-gib must be > 0, got {args.host_memory_gib:g}")
    host = None if args.host_memory_gib is None else int(args.host_memory_gib * 2**30)
    return {"gpu_memory_utilization": args.gpu_memory_utilization, "host_memory_bytes": host}


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _progress(console: Console, enabled: bool, what: str):  # type: ignore[no-untyped-def]
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, disable=not enabled, transient=True)


def _check_device(device: str) -> None:
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible on this machine; use --device cpu")


def run_generate(args: argparse.Namespace, console: Console) -> int:
    _positive(args, "max_tokens", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
    _check_device(args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    if args.model is not None and not Path(args.model).is_dir():  # before reading prompts from stdin
        raise ConfigError(f"model directory not found: {args.model}")
    expected: list[list[int]] | None = None
    if args.prompts is not None:
        prompts: list[Any] = _read_prompts(args.prompts)
    elif args.model is None:
        prompts, expected = _demo_prompts(args.max_tokens)
    else:
        raise ConfigError("give --prompts (a file, or - for stdin) with --model")
    config = load_config(args.config) if args.config else (DEMO_CONFIG if args.model is None else None)
    max_model_len = args.max_model_len or (DEMO_MAX_MODEL_LEN if args.model is None else None)
    llm = LLM(args.model, config, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
              decode_graphs=args.decode_graphs, cuda_graphs=args.cuda_graphs, **_memory_options(args))
    with _progress(console, not args.no_progress, "generating") as bar:
        task = bar.add_task("generate", total=len(prompts))
        outs = llm.generate(prompts, params, on_step=lambda done, total: bar.update(task, completed=done))
    _print_outputs(console, outs, expected)
    _summary(console, llm)
    if args.json:
        Path(args.json).write_text(json.dumps([o.as_dict() for o in outs], indent=1))
        console.print(f"outputs written to {args.json}")
    return 0


def _read_prompts(path: str) -> list[str]:
    if path == "-":
        lines = sys.stdin.read().splitlines()
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--prompts {path}: no such file" + (" (it is a directory)" if p.is_dir() else ""))
        lines = p.read_text().splitlines()
    if path.endswith(".jsonl"):
        prompts = []
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                prompts.append(json.loads(line)["prompt"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(f"--prompts {path}, line {i}: expected a JSON object with a \"prompt\" field") from None
    else:
        prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts (empty lines are skipped)")
    return prompts


def _demo_prompts(max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Passkey prompts of the shipped model's tasks, and the tokens that should follow."""
    from ..reference.tasks import TASKS, TaskConfig, draw

    prompts, expected = [], []
    for i, context in enumerate((2048, 3072, 4096, 6144)):
        task = TaskConfig(context=context, **TASKS["passkey"])
        seq = draw(task, torch.Generator().manual_seed(i))
        prompts.append(seq.tokens[: seq.prompt_len + 1].tolist())  # haystack, QUERY, the key of a passkey
        answer = min(max_tokens, task.passkey_len)  # after the passkey the next key asked is anyone's guess
        expected.append(seq.tokens[seq.prompt_len + 1 : seq.prompt_len + 1 + answer].tolist())
    return prompts, expected


def _print_outputs(console: Console, outs: list[RequestOutput], expected: list[list[int]] | None) -> None:
    table = new_table("generated", "TTFT: time to the first token; TPOT: time per later token")
    for col in ("request", "prompt", "output", "finish", "TTFT ms", "TPOT ms", *(["passkey"] if expected else [])):
        table.add_column(col, justify="left" if col in ("request", "finish") else "right", no_wrap=True)
    for i, o in enumerate(outs):
        ms = lambda s: "-" if s is None else f"{s * 1e3:,.1f}"  # noqa: E731
        extra = []
        if expected:
            want = expected[i][: len(o.token_ids)]
            extra = [f"{sum(a == b for a, b in zip(o.token_ids, want))}/{len(want)}"]
        table.add_row(o.rid, str(len(o.prompt_token_ids)), str(len(o.token_ids)), o.finish_reason, ms(o.ttft), ms(o.tpot), *extra)
    console.print(table)
    for o in outs:
        text = o.error if o.error else (o.text if o.text is not None else " ".join(map(str, o.token_ids)))
        console.print(f"[bold]{o.rid}[/bold] ({o.finish_reason}): {text}", highlight=False)
    if expected:
        console.print("passkey: the first output tokens equal to the passkey hidden in the prompt (the demo's answer)")


def _summary(console: Console, llm: LLM) -> None:
    coord = llm.engine.runner.coord
    report = coord.dense_report()
    pools = coord.memory_stats()
    sizes = ", ".join(f"{p['kind']} {p['bytes'] / 2**20:,.1f} MiB" for p in pools)
    console.print(f"steps {llm.engine.steps}, preemptions {llm.engine.scheduler.num_preemptions}; pools: {sizes}")
    if llm.engine.memory_plan is not None:
        console.print(llm.engine.memory_plan.describe(), highlight=False)
    dense = report["dense_requests"]
    if dense:
        console.print(f"decoded densely: {', '.join(f'{k}: {v}' for k, v in dense.items())} "
                      f"(prompts shorter than min_sparse_prompt_len {report['min_sparse_prompt_len']})")


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def run_bench(args: argparse.Namespace, console: Console) -> int:
    _positive(args, "num_prompts", "input_len", "output_len", "concurrency", "max_num_seqs", "max_num_batched_tokens",
              "max_model_len")
    _check_device(args.device)
    if args.model and args.random:
        raise ConfigError("give --model or --random, not both")
    concurrency = args.concurrency or args.num_prompts
    max_model_len = args.max_model_len or args.input_len + args.output_len
    config = load_config(args.config) if args.config else DEMO_CONFIG
    options = dict(dtype=args.dtype, device=args.device, max_num_seqs=concurrency,
                   max_num_batched_tokens=max(args.max_num_batched_tokens, concurrency), max_model_len=max_model_len,
                   decode_graphs=args.decode_graphs, cuda_graphs=args.cuda_graphs, **_memory_options(args))
    if args.random:
        model_config = ModelConfig.from_hf(RANDOM_MODELS[args.random])
        dtype = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")
        model = random_model(model_config, dtype, args.device)
        llm = LLM.from_model(model, config, **{k: v for k, v in options.items() if k not in ("dtype", "device")})
    else:
        llm = LLM(args.model, config, **options)
    vocab = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    with _progress(console, not args.no_progress, "benchmark") as bar:
        task = bar.add_task("bench", total=len(prompts))
        outs = llm.generate(prompts, params, on_step=lambda done, total: bar.update(task, completed=done))
    if torch.device(args.device).type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    failed = [o for o in outs if o.finish_reason == "error"]
    if failed:
        raise ConfigError(f"{len(failed)} request(s) failed, e.g. {failed[0].rid}: {failed[0].error}")
    decode_steps = [(rows, ctx, sec) for rows, prefill, ctx, sec in llm.engine.step_log if rows and not prefill]
    full = [(ctx, sec) for rows, ctx, sec in decode_steps if rows == concurrency]  # every request decoding
    step_ms = None if not full else 1e3 * statistics.median(sec for _, sec in full)
    floor_ms = None if not full else 1e3 * _decode_floor_bytes(llm, statistics.median(c for c, _ in full)) / HBM_BYTES_PER_S
    ttft = [o.ttft for o in outs if o.ttft is not None]
    tpot = [o.tpot for o in outs if o.tpot is not None]
    tokens = sum(len(o.token_ids) for o in outs)
    pools = llm.engine.runner.coord.memory_stats()
    result = {
        "requests": len(outs), "input_len": args.input_len, "output_len": args.output_len, "concurrency": concurrency,
        "elapsed_s": elapsed, "output_tokens_per_s": tokens / elapsed,
        "ttft_p50_ms": 1e3 * _percentile(ttft, 50), "ttft_p99_ms": 1e3 * _percentile(ttft, 99),
        "tpot_p50_ms": None if not tpot else 1e3 * _percentile(tpot, 50),
        "tpot_p99_ms": None if not tpot else 1e3 * _percentile(tpot, 99),
        "steps": llm.engine.steps, "preemptions": llm.engine.scheduler.num_preemptions,
        "decode_step_ms": step_ms, "decode_step_floor_ms": floor_ms, "full_decode_steps": len(full),
        "device_pool_bytes": sum(p["bytes"] for p in pools if p["kind"] != "host"),
        "host_pool_bytes": sum(p["bytes"] for p in pools if p["kind"] == "host"),
        "config": load_config(config).model_dump(mode="json"), "device": str(args.device),
        "decode_graphs": args.decode_graphs, "cuda_graphs": args.cuda_graphs, "command": " ".join(["sparse-framework", *sys.argv[1:]]),
        "model": args.model or args.random or "reference",
    }
    title = (f"bench: {result['model']}, {len(outs)} x ({args.input_len} in, {args.output_len} out), "
             f"concurrency {concurrency}")
    caption = ("tok/s: output tokens per second over the whole run; TTFT, TPOT (time to the first token, per "
               "later token) in ms; step: median decode step (ms) with every request decoding and no prefill, "
               "floor: its HBM floor (weights + the KV and representations it reads, at 3.0 TB/s); pool MiB: the "
               "store's device pools")
    table = new_table(title, caption)
    for col in ("tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "step", "floor", "preempted", "pool MiB"):
        table.add_column(col, justify="right", no_wrap=True)
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"  # noqa: E731
    table.add_row(fmt(result["output_tokens_per_s"]), fmt(result["ttft_p50_ms"]), fmt(result["ttft_p99_ms"]),
                  fmt(result["tpot_p50_ms"]), fmt(result["tpot_p99_ms"]), fmt(step_ms), fmt(floor_ms),
                  str(result["preemptions"]), f"{result['device_pool_bytes'] / 2**20:,.0f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        console.print(f"results written to {args.json}")
    return 0


def _decode_floor_bytes(llm: LLM, context_tokens: float) -> float:
    """Bytes a decode step must read at least: the weights, then per layer the K/V rows it
    attends (every context token in a dense layer or a dense-mode run; at most the
    algorithm's largest selection per request in a sparse one) and the algorithm's
    representation of the whole context (what its scoring reads)."""
    model, coord = llm.model, llm.engine.runner.coord
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    layout, config, store = coord.layout, coord.config, coord.store
    rows = llm.engine.config.max_num_seqs
    per_token = layout.bytes_per_token_per_layer
    dense = config.store == "resident" or store.min_sparse_prompt_len > context_tokens / rows
    selected = min(context_tokens, rows * coord.algorithm.max_selected_tokens(config))
    total = 0.0
    for layer in range(layout.num_layers):
        if dense or layer in coord.dense_layers:
            total += context_tokens * per_token
        else:
            total += selected * per_token + context_tokens * coord.algorithm.representation_bytes_per_token(layout, config)
    return weights + total
