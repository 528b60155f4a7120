"""Tensor parallelism on real GPUs: do TP=N's outputs equal TP=1's? (issue 32)

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      torchrun --nproc-per-node 4 benchmarks/tp_equality.py --out tp4_equality.json

Two parts, each run by the TP group (NCCL, one GPU per rank) and then, on rank 0 alone, by one
unsplit engine over the same random weights (TP=1):

- `tiny`: the CPU test's scenarios (tests/test_engine_parallel.py: dense, Quest at a binding
  budget, DSA over the keys, biases, preemption, seeded sampling, async scheduling, the prefix
  cache; the hierarchical store) on a float32 tiny Llama with 8 query / 4 KV heads (so that 4
  ranks divide it), on the GPU. In float32 the greedy tokens must be equal.
- `8b`: the Llama-3-8B shape in bf16, random weights, `--prompts` requests of `--prompt-len`
  random tokens, `--output-len` greedy tokens, dense and Quest (hierarchical, top_k 1/8 of the
  prompt), CUDA graphs on. A bf16 sum split over N ranks rounds differently from one GPU's, so
  a greedy token may flip where two logits are within rounding; after a flip the two sequences
  go their own ways. The report counts, per config, the requests whose tokens are all equal
  and, for the others, the first position that differs; TP=1 run twice gives the run-to-run
  baseline of one GPU, and TP=1 dense vs Quest the scale of a real change.

Rank 0 writes the JSON (--out) and prints one line per scenario.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sparse_framework.config import DENSE_CONFIG  # noqa: E402
from sparse_framework.engine import parallel  # noqa: E402
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS  # noqa: E402
from sparse_framework.engine.engine import Engine  # noqa: E402
from sparse_framework.engine.engine_config import EngineConfig  # noqa: E402
from sparse_framework.engine.models import ModelConfig, random_model  # noqa: E402
from sparse_framework.engine.sampling import SamplingParams  # noqa: E402

# 8 query / 4 KV heads: TP=4 keeps one KV head per rank
TINY4 = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4}


def tiny_runs(ctx: parallel.TPContext | None, device: torch.device) -> dict[str, Any]:
    """Every CPU-test scenario on this group (ctx) or unsplit (None), on `device`."""
    import test_engine_parallel as cpu  # the scenario table of the CPU tests

    tp = ctx.world_size if ctx is not None else 1
    shard = ctx.shard if ctx is not None else None
    out: dict[str, Any] = {}
    for name, (config, *_) in cpu.SCENARIOS.items():
        raw = {**cpu.TINY, **TINY4}
        if config.attention_bias:
            raw.update(attention_bias=True, mlp_bias=True)
        cfg = ModelConfig.from_hf(raw)
        got, (preemptions, hits) = cpu._run(cpu._model(cfg, shard, device), name, tp, model_config=cfg)
        out[name] = {"tokens": {rid: tokens for rid, (tokens, _) in got.items()},
                     "finish": {rid: reason for rid, (_, reason) in got.items()},
                     "preemptions": preemptions, "prefix_hit_tokens": hits}
    return out


def big_runs(ctx: parallel.TPContext | None, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """The 8B shape, bf16: dense and Quest, greedy; unsplit (ctx None) dense runs twice, so that
    run-to-run differences of one GPU are told apart from those of the split."""
    cfg = ModelConfig.from_hf(RANDOM_MODELS["llama-3-8b"])
    model = random_model(cfg, torch.bfloat16, device, seed=0, tp=ctx.shard if ctx is not None else None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    quest = {"algorithm": "quest", "top_k": args.prompt_len // 8, "backend": "triton", "store": "hierarchical",
             "sparse_policy": "always", "device_buffer_tokens": args.prompt_len // 4}
    dense = {**quest, **DENSE_CONFIG, "backend": "triton"}
    out: dict[str, Any] = {}
    runs = [("dense", dense), ("quest", quest)] + ([("dense_again", dense)] if ctx is None else [])
    for label, sparse in runs:
        engine = Engine(model, cfg, sparse, EngineConfig(
            max_num_seqs=args.prompts, max_model_len=args.prompt_len + args.output_len + 64,
            max_num_batched_tokens=16384, cuda_graphs=True, tensor_parallel_size=ctx.world_size if ctx else 1))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.output_len, temperature=0.0))
        start = time.perf_counter()
        outs = engine.run_to_completion()
        out[label] = {"tokens": {o.request_id: o.token_ids for o in outs}, "seconds": time.perf_counter() - start}
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return out


def compare(want: dict[str, list[int]], got: dict[str, list[int]]) -> dict[str, Any]:
    """Equal requests, and where the others first differ."""
    first = {rid: next((j for j, (a, b) in enumerate(zip(toks, got[rid])) if a != b), min(len(toks), len(got[rid])))
             for rid, toks in want.items() if got.get(rid) != toks}
    return {"requests": len(want), "equal": len(want) - len(first), "first_difference": first}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="tiny,8b", help="tiny, 8b or both (comma-separated)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out", default=None, help="JSON written by rank 0")
    args = p.parse_args()
    parts = args.parts.split(",")
    ctx = parallel.init_tp_from_env()
    device = ctx.device
    result: dict[str, Any] = {"tensor_parallel_size": ctx.world_size, "command": " ".join(sys.argv),
                              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    group = {"tiny": tiny_runs(ctx, device) if "tiny" in parts else None,
             "8b": big_runs(ctx, device, args) if "8b" in parts else None}
    parallel.destroy_tp()
    if ctx.rank == 0:
        gc.collect()
        torch.cuda.empty_cache()
        alone = {"tiny": tiny_runs(None, device) if "tiny" in parts else None,
                 "8b": big_runs(None, device, args) if "8b" in parts else None}
        if group["tiny"] is not None:
            result["tiny"] = {}
            for name, got in group["tiny"].items():
                want = alone["tiny"][name]
                row = compare(want["tokens"], got["tokens"])
                row.update(same_finish=want["finish"] == got["finish"],
                           preemptions=(want["preemptions"], got["preemptions"]),
                           prefix_hit_tokens=(want["prefix_hit_tokens"], got["prefix_hit_tokens"]))
                result["tiny"][name] = row
                print(f"tiny {name:20s} TP={ctx.world_size}: {row['equal']}/{row['requests']} equal, "
                      f"preemptions {row['preemptions']}, prefix hits {row['prefix_hit_tokens']}")
        if group["8b"] is not None:
            result["8b"] = {"prompt_len": args.prompt_len, "output_len": args.output_len, "prompts": args.prompts,
                            "tp1_repeat": compare(alone["8b"]["dense"]["tokens"], alone["8b"]["dense_again"]["tokens"])}
            for label in ("dense", "quest"):
                row = compare(alone["8b"][label]["tokens"], group["8b"][label]["tokens"])
                row["seconds"] = {"tp1": alone["8b"][label]["seconds"], "tpN": group["8b"][label]["seconds"]}
                result["8b"][label] = row
                print(f"8b bf16 {label:6s} TP={ctx.world_size}: {row['equal']}/{row['requests']} equal; "
                      f"first differences {row['first_difference']}")
            # dense vs quest at TP=1: how much the sparse budget itself changes (a scale for the above)
            result["8b"]["quest_vs_dense_tp1"] = compare(alone["8b"]["dense"]["tokens"], alone["8b"]["quest"]["tokens"])
            print(f"8b bf16 TP=1 twice: {result['8b']['tp1_repeat']['equal']}/{args.prompts} equal; "
                  f"TP=1 quest vs dense: {result['8b']['quest_vs_dense_tp1']['equal']}/{args.prompts} equal")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    parallel.exit_rank(0)


if __name__ == "__main__":
    raise SystemExit(main())
