"""Where an engine prefill step's time goes: the GPU kernels and host ops of one request's prefill.

Runs a warm-up request through the engine (random weights of a preset shape; Triton compiles,
the allocator), then profiles with torch.profiler the steps that prefill one request of
--context tokens and prints the kernels and host ops by total time, beside the steps' wall
time. With --prefix-hit the profiled request shares all but its last --question tokens with a
request that ran before it, with the prefix cache on: the steps then show what a cache hit
costs (the cached pages' copy to the device and the question's prefill over them). CUDA only.

    python benchmarks/profile_prefill_step.py --shape deepseek-v3.2-mini --context 16384
    python benchmarks/profile_prefill_step.py --shape llama-3-8b --context 16384 --prefix-hit \\
        --config '{"algorithm": "quest", "store": "resident", "sparse_policy": "always", "min_sparse_prompt_len": 1000000000}'
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sparse_framework.engine.models.random_shapes import RANDOM_MODELS, random_model_config
from sparse_framework.engine.engine import Engine
from sparse_framework.engine.engine_config import EngineConfig
from sparse_framework.engine.models import ModelConfig, random_model
from sparse_framework.engine.sampling import SamplingParams


def _run(engine: Engine, rid: str, ids: list[int]) -> int:
    """Queue one request (one output token) and step until it is done; the steps taken."""
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(RANDOM_MODELS), default="deepseek-v3.2-mini", help="model preset")
    p.add_argument("--config", help="sparse config (JSON; default: bench --random's for the shape, else Quest)")
    p.add_argument("--context", type=int, default=16384, help="the profiled request's prompt tokens (default 16384)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="tokens per step (default 16384)")
    p.add_argument("--prefix-hit", action="store_true", help="the prefix cache on; the profiled request shares "
                   "its prompt but the last --question tokens with the one before")
    p.add_argument("--question", type=int, default=512, help="--prefix-hit: the tokens not shared (default 512)")
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("--json", help="write the tables as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill_step.py needs CUDA")
    config = json.loads(args.config) if args.config else (random_model_config(args.shape, "cuda")
                                                          or {"algorithm": "quest", "backend": "triton"})
    model = random_model(ModelConfig.from_hf(RANDOM_MODELS[args.shape]), "bfloat16", "cuda")
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    options = EngineConfig(max_num_seqs=2, max_num_batched_tokens=args.max_num_batched_tokens,
                           max_model_len=args.context + 64, host_capacity_tokens=4 * (args.context + 64),
                           enable_prefix_caching=args.prefix_hit)
    engine = Engine(model, model.config, config, options)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, vocab, (args.context - args.question,), generator=g).tolist()
    prompts = [shared + torch.randint(0, vocab, (args.question,), generator=g).tolist() for _ in range(3)]
    _run(engine, "warm", prompts[0])  # compiles; with --prefix-hit it also caches the shared part
    if args.prefix_hit:
        _run(engine, "warm-hit", prompts[1])  # a hit's path compiled too
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        steps = _run(engine, "profiled", prompts[2])
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in events if e.self_device_time_total > 0),
                 key=lambda r: -r[1])
    host = sorted(((e.key, e.cpu_time_total / 1e3, e.count) for e in events if not e.key.startswith("cuda")),
                  key=lambda r: -r[1])
    stats = engine.prefix_cache.stats.as_dict() if engine.prefix_cache is not None else None
    print(f"{args.shape}, {args.context} tokens, {steps} step(s), wall {wall * 1e3:,.1f} ms, "
          f"GPU kernels {sum(r[1] for r in gpu):,.1f} ms; cache: {stats}")
    for title, rows in (("GPU kernels (self time)", gpu), ("host ops (total time, nested)", host)):
        print(f"\n{title}\n{'ms':>10} {'calls':>6}  name")
        for name, ms, count in rows[:args.top]:
            print(f"{ms:10.2f} {count:6d}  {name[:80]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "context": args.context, "config": config, "steps": steps,
                       "wall_ms": wall * 1e3, "prefix_cache": stats, "gpu": gpu[:50], "host": host[:50]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
