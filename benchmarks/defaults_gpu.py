"""The defaults as a user writes them, from outside (issue 43): whole `LLM.generate` calls on the
Llama-3-8B shape (random bf16 weights), each config beside the engine's dense path and its floor.

    python benchmarks/defaults_gpu.py --out benchmarks/results/defaults_h200.json

Per config and shape (context x batch), on a fresh `LLM` (its start-up warm-up included):
- `first`: the first `generate` of 1 token after `LLM(...)` returned (start-up costs a user
  still pays: compilation, graph capture of the prefill path);
- `prefill`: a later `generate` of 1 token (the prompts' prefill and one token);
- `step`: (generate of N+1 tokens - generate of 1) / N: one decode step of the whole batch;
  medians of --repeats after one warm generate of N+1 (its decode graphs captured: a first
  generate of N+1 also captures the graphs of the contexts it decodes at, +1.5-2.5 s at 16K x 8);
- `floor`: (weights + the K/V and Quest page bounds a step reads) / the GPU's HBM ceiling
  (common/hardware.py); sparse layers read top_k + sink + recent rows per KV head.

Configs: `dense` (every request dense: Quest never selects), `defaults` ({"algorithm": "quest"}:
backend auto, store resident, the cost policy, range_weight 0), `tuned` (the hand-tuned resident
Quest of round 3: backend triton, sparse at any length), `hierarchical` (the same over the
hierarchical store, host tier always on, a device buffer of 8192 tokens); `dense-fa` and
`tuned-fa`: dense and tuned through the `flash_attn` backend (FlashAttention's paged decode over
the page table: flash-attn 4/3, or vLLM's FA3 where vLLM is installed). Shapes: --shapes CTXxBATCH,...
(default 16384x8 and batch 1 at 1K, 4K, 8K: the cost policy must never be slower than dense).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparse_framework.common import hardware  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from timing import current_commit  # noqa: E402
from sparse_framework.engine import LLM, SamplingParams  # noqa: E402
from sparse_framework.cli.engine import RANDOM_MODELS, random_setup  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {"algorithm": "quest", "sparse_policy": "always", "min_sparse_prompt_len": 1 << 30},
    "defaults": {"algorithm": "quest"},
    "tuned": {"algorithm": "quest", "backend": "triton", "store": "resident", "sparse_policy": "always",
              "min_sparse_prompt_len": 0, "extra": {"range_weight": 0.0}},
    "hierarchical": {"algorithm": "quest", "backend": "triton", "store": "hierarchical", "sparse_policy": "always",
                     "min_sparse_prompt_len": 0, "device_buffer_tokens": 8192, "extra": {"range_weight": 0.0}},
}
# the hybrid store (issue 46) with tuned's settings: while every request fits nothing spills
CONFIGS["hybrid"] = {**CONFIGS["tuned"], "store": "hybrid"}
# ... with fp8 host rows: about twice the requests the host tier holds (a serving curve's maximum)
CONFIGS["hybrid-fp8"] = {**CONFIGS["hybrid"], "host_kv_dtype": "fp8_e4m3"}
CONFIGS.update({f"{name}-fa": {**CONFIGS[name], "backend": "flash_attn"} for name in ("dense", "tuned")})
SHAPES = "16384x8,1024x1,4096x1,8192x1"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help=f"CTXxBATCH, comma-separated (default {SHAPES})")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--output-len", type=int, default=129, help="N+1: tokens of the long generate (default 129)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats of each generate after a warm one "
                   "(median; default 3)")
    p.add_argument("--out", help="JSON of every cell")
    p.add_argument("--random", default="llama-3-8b", choices=sorted(RANDOM_MODELS),
                   help="model shape, random weights (default llama-3-8b; tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda", help="cuda (the figures), or cpu for a smoke run")
    args = p.parse_args(argv)
    for name in args.configs.split(","):
        if name not in CONFIGS:
            p.error(f"--configs: unknown config {name!r}; allowed: {', '.join(CONFIGS)}")
    try:
        args.shape_list = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes: give CTXxBATCH pairs such as 16384x8, got {args.shapes!r}")
    return args


def floor_ms(figures: hardware.GpuFigures, shape: str, ctx: int, batch: int, sparse: bool, top_k: int = 2048,
             weights: float = 0.0) -> float:
    """(weights + K/V read by one decode step) / HBM, bf16 rows; Quest's first two layers dense,
    the others its selection (sink 16 + top_k + recent 64) and its page bounds (page 16)."""
    raw = RANDOM_MODELS[shape]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    layers, row = raw["num_hidden_layers"], raw["num_key_value_heads"] * head_dim * 2
    if not sparse:
        kv = batch * ctx * layers * 2 * row
    else:
        selected = min(ctx, 16 + top_k + 64)
        kv = batch * (2 * ctx * 2 * row + (layers - 2) * (selected * 2 * row + 2 * -(-ctx // 16) * row))
    return figures.floor_ms(weights + kv)


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    sync = torch.cuda.synchronize if llm.engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    sync()
    return time.perf_counter() - start


def run_cell(name: str, ctx: int, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    model, config = random_setup(args.random, CONFIGS[name], args.device, "bfloat16" if args.device == "cuda" else None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(ctx * 31 + batch)
    vocab = RANDOM_MODELS[args.random]["vocab_size"]
    prompts = [torch.randint(0, vocab, (ctx,), generator=gen).tolist() for _ in range(batch)]
    started = time.perf_counter()
    llm = LLM.from_model(model, config, max_num_seqs=batch, max_model_len=ctx + args.output_len + 8,
                         max_num_batched_tokens=16384 if args.device == "cuda" else 2048,
                         cuda_graphs=args.device == "cuda")
    startup = time.perf_counter() - started
    coord = llm.engine.runner.coord
    first = timed(llm, prompts, 1)
    warm_n = timed(llm, prompts, args.output_len)  # captures the decode graphs of these widths (not timed)
    ones, longs = [], []
    for _ in range(args.repeats):
        ones.append(timed(llm, prompts, 1))
        longs.append(timed(llm, prompts, args.output_len))
    one, long = statistics.median(ones), statistics.median(longs)
    step_ms = (long - one) / (args.output_len - 1) * 1e3
    figures = hardware.gpu_figures(args.device) or hardware.DEFAULT
    tally = coord.dense_tally
    sparse_steps = not name.startswith("dense") and (coord.config.sparse_policy == "always" or
                                        coord.policy.model.step_pays([ctx + args.output_len // 2] * batch))
    floor = floor_ms(figures, args.random, ctx, batch, sparse_steps, coord.config.top_k, weights)
    row = {"config": name, "config_as_written": CONFIGS[name], "resolved": coord.config.key(),
           "context": ctx, "batch": batch, "startup_s": startup, "first_generate_1_s": first,
           "warm_generate_n_s": warm_n, "generate_1_s": one, "generate_n_s": long, "generate_1_all_s": ones, "generate_n_all_s": longs,
           "n": args.output_len, "step_ms": step_ms, "floor_ms": floor, "floor_is_sparse": sparse_steps,
           "prefill_attention": llm.engine.runner.prefill_attention_label,
           "policy": coord.policy.describe(), "dense_requests": dict(tally.dense_requests),
           "layer_steps": tally.layer_steps, "dense_layer_steps": dict(tally.dense_layer_steps)}
    del llm, model, coord
    gc.collect()
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    dense = {(r["context"], r["batch"]): r["step_ms"] for r in rows if r["config"] == "dense" and "step_ms" in r}
    lines = [f"{'config':<9} {'shape':>9} {'first s':>8} {'prefill s':>9} {'step ms':>8} {'floor':>6} "
             f"{'x floor':>7} {'vs dense':>8}"]
    for r in rows:
        shape = f"{r['context'] / 1024:g}Kx{r['batch']}"
        if "error" in r:
            lines.append(f"{r['config']:<9} {shape:>9} error: {r['error'][:50]}")
            continue
        base = dense.get((r["context"], r["batch"]))
        ratio = "-" if base is None else f"{base / r['step_ms']:.2f}x"
        lines.append(f"{r['config']:<9} {shape:>9} {r['first_generate_1_s']:8.2f} {r['generate_1_s']:9.2f} "
                     f"{r['step_ms']:8.2f} {r['floor_ms']:6.2f} {r['step_ms'] / r['floor_ms']:7.2f} "
                     f"{ratio:>8}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("defaults_gpu.py needs a CUDA GPU (--device cpu --random tiny: a smoke run)", file=sys.stderr)
        return 2
    rows = []
    for ctx, batch in args.shape_list:
        for name in args.configs.split(","):
            try:
                rows.append(run_cell(name, ctx, batch, args))
            except Exception as exc:  # a failed cell is reported; the others run  # noqa: BLE001
                rows.append({"config": name, "context": ctx, "batch": batch, "error": f"{type(exc).__name__}: {exc}"})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    figures = hardware.gpu_figures(args.device)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"\n{device}; {hardware.describe(figures)}; step = (generate {args.output_len} - "
          "generate 1) / N, medians; first = the first generate after LLM(...)\n" + table(rows))
    if args.out:
        commit = current_commit()  # $SF_COMMIT on the GPU machine, whose copy has no .git
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/defaults_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": commit or None, "device": device, "shape": args.random,
            "hbm_tb_s": (figures or hardware.DEFAULT).hbm_tb_s, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
