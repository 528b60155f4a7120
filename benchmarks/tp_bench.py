"""Tensor-parallel engine benchmark: `bench.run_benchmark` on every rank of a torchrun group,
random weights of a `--random` shape, plus the all-reduce time of one decode step.

    # TP=2 on one host (every process needs NVLink multicast off)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
      torchrun --nproc-per-node 2 benchmarks/tp_bench.py --random llama-3-8b --input-len 16384 \
      --output-len 64 --num-prompts 8 --cuda-graphs --out tp2.json
    # TP=1 for comparison: the same command with --nproc-per-node 1 (or plain python)

Every rank draws the same requests (the workload's seed) and queues them all at once (no
request rate: arrival times would differ between processes), builds its shard of the model
(`random_model(..., tp=ctx.shard)`) and its Engine with tensor_parallel_size = WORLD_SIZE, and
steps in lockstep. Rank 0 writes the JSON: `run_benchmark`'s figures (the decode step's floor is
rank 0's: its weight shard and its KV heads, i.e. one GPU's bytes; prefill TFLOP/s counts the
whole model's FLOPs over the wall time, so divide by N for one GPU's share), with
`allreduce_step_ms`: 2 x num_layers all-reduces of [rows, hidden] in the model's dtype, as one
decode step of the measured rows does them, timed alone (CUDA events, median of --allreduce-iters).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sparse_framework.config import load_config
from sparse_framework.engine import parallel
from sparse_framework.bench.offline import BenchSpec, draw_workload, run_benchmark
from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
from sparse_framework.engine.llm import LLM
from sparse_framework.engine.models import ModelConfig, random_model

# the Triton kernels on a GPU (the framework's default backend, torch_ref, is the plain reference:
# the first H200 runs took it by mistake, benchmarks/results/tp_bench_h200x2.json says which)
DEFAULT_CONFIG = {"algorithm": "quest", "top_k": 2048, "backend": "triton" if torch.cuda.is_available() else "torch_ref"}


def allreduce_step_ms(ctx: parallel.TPContext | None, rows: int, hidden: int, layers: int, dtype: torch.dtype,
                      iters: int) -> float | None:
    """Median time of one decode step's all-reduces (2 per layer of [rows, hidden])."""
    if ctx is None or ctx.device.type != "cuda":
        return None
    x = torch.randn(rows, hidden, dtype=dtype, device=ctx.device)
    times = []
    for i in range(iters + 3):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(2 * layers):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def allreduce_bus_gbs(ctx: parallel.TPContext | None, mib: int = 256, iters: int = 10) -> float | None:
    """NVLink's measured all-reduce bus bandwidth, GB/s (nccl-tests' busbw: 2(N-1)/N x bytes /
    time, median of `iters`) on a large bf16 message, where the link's bandwidth, not its
    latency, bounds the time: the scale for a decode step's small all-reduces."""
    if ctx is None or ctx.device.type != "cuda" or ctx.world_size < 2:
        return None
    x = torch.empty(mib * 2**19, dtype=torch.bfloat16, device=ctx.device).normal_()
    times = []
    for i in range(iters + 3):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    n = ctx.world_size
    return 2 * (n - 1) / n * x.numel() * x.element_size() / statistics.median(times) / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--random", default="llama-3-8b", help="shape: " + ", ".join(RANDOM_MODELS) + " or a config.json path")
    p.add_argument("--config", default=json.dumps(DEFAULT_CONFIG), help="sparse config (JSON or a file)")
    p.add_argument("--input-len", type=int, default=16384)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cuda-graphs", action="store_true", help="whole-step CUDA graphs (with NCCL: untested)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--host-memory-gib", type=float, default=None, help="the whole host's budget (split by the ranks)")
    p.add_argument("--allreduce-iters", type=int, default=20)
    p.add_argument("--async-scheduling", action="store_true",
                   help="async scheduling (opt-in under TP: rank 0's tokens broadcast on the device, plans "
                        "checked over a host-side gloo group)")
    p.add_argument("--out", default=None, help="JSON written by rank 0")
    args = p.parse_args()

    ctx = parallel.init_tp_from_env() if "WORLD_SIZE" in os.environ else None
    device = ctx.device if ctx is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tp = ctx.world_size if ctx is not None else 1
    shape = RANDOM_MODELS.get(args.random)
    config = ModelConfig.from_hf(shape if shape is not None else Path(args.random))
    model = random_model(config, args.dtype, device, seed=0, tp=ctx.shard if ctx is not None else None)
    spec = BenchSpec(num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len)
    work = draw_workload(spec, config.vocab_size)
    memory = {}
    if args.gpu_memory_utilization is not None:
        memory = {"gpu_memory_utilization": args.gpu_memory_utilization}
        if args.host_memory_gib is not None:
            memory["host_memory_bytes"] = int(args.host_memory_gib * 2**30)
    llm = LLM.from_model(model, load_config(args.config), max_num_seqs=spec.running,
                         max_num_batched_tokens=max(args.max_num_batched_tokens, spec.running),
                         max_model_len=work.max_model_len, cuda_graphs=args.cuda_graphs, tensor_parallel_size=tp,
                         async_scheduling=args.async_scheduling or None, **memory)
    result = run_benchmark(llm, spec, work=work)
    rows = result["decode_step_rows"] or spec.running
    result["allreduce_step_ms"] = allreduce_step_ms(ctx, rows, config.hidden_size, config.num_layers, model.lm_head.weight.dtype,
                                                    args.allreduce_iters)
    result["allreduce_bus_gbs"] = allreduce_bus_gbs(ctx)
    result.update({"tensor_parallel_size": tp, "model": args.random, "command": " ".join(sys.argv),
                   "async_scheduling": llm.engine.async_scheduling,
                   "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")})
    if ctx is None or ctx.rank == 0:
        keys = ("tensor_parallel_size", "decode_step_rows", "decode_step_ms", "decode_step_floor_ms", "allreduce_step_ms", "allreduce_bus_gbs",
                "output_tokens_per_s", "tpot_p50_ms", "admitted_concurrency", "memory_bound_max", "prefill_tflops")
        print(json.dumps({k: result.get(k) for k in keys}, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    if ctx is not None:
        # the engine (its CUDA graphs hold captured NCCL all-reduces) goes before the group: on
        # four H100s ranks that tore the group down with it alive hung after writing their JSON,
        # while tp_equality.py, which drops its engines first, exited cleanly (not yet re-run)
        del llm, model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        parallel.destroy_tp()
        parallel.exit_rank(0)  # skips NCCL's teardown, which hung the ranks after their work was done
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
