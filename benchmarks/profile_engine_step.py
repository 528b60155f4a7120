"""Where an engine decode step's GPU time goes: the kernels of a few decode-only steps.

Runs the engine (random weights of a preset shape) until every request is decoding, then
profiles `--steps` decode steps with torch.profiler and prints the kernels by total GPU time
per step, beside the step's wall time. CUDA only.

    python benchmarks/profile_engine_step.py --config '{"algorithm": "quest", "backend": "triton"}' \\
        --batch 8 --context 16384 --cuda-graphs

Under torchrun (`torchrun --nproc-per-node 2 benchmarks/profile_engine_step.py ...`) every rank
runs its shard of the model with tensor parallelism and rank 0 prints its own kernels (the
all-reduces among them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections import Counter

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default='{"algorithm": "quest", "backend": "triton"}', help="sparse config (JSON)")
    p.add_argument("--shape", default="llama-3-8b", help="a preset of `sparse-framework bench --random`")
    p.add_argument("--batch", type=int, default=8, help="requests, all decoding (default 8)")
    p.add_argument("--context", type=int, default=16384, help="prompt tokens each (default 16384)")
    p.add_argument("--steps", type=int, default=4, help="decode steps profiled (default 4)")
    p.add_argument("--top", type=int, default=20, help="kernels listed (default 20)")
    p.add_argument("--cuda-graphs", action="store_true", help="whole decode steps replayed from CUDA graphs")
    p.add_argument("--decode-graphs", action="store_true", help="the coordinator's per-layer decode graphs")
    p.add_argument("--pdl", choices=["auto", "on", "off"], default="off",
                   help="programmatic dependent launch of our kernels (default off: with it a kernel's time "
                   "includes waiting for its predecessor, so the per-kernel times overlap)")
    p.add_argument("--fused-ops", choices=["on", "off"], default="on",
                   help="the model's fused projections and layer kernels (default on, the engine's CUDA default)")
    p.add_argument("--prefill-attention", choices=["auto", "flash_attn", "sdpa"], default="auto",
                   help="prefill chunks' attention (default auto: flash-attn's varlen kernel where installed)")
    p.add_argument("--timed-steps", type=int, default=20,
                   help="decode steps timed without the profiler first: their median is the step time (default 20)")
    p.add_argument("--async-scheduling", choices=["on", "off"], default="on",
                   help="build the next step while the GPU runs this one (default on, the engine's CUDA default)")
    p.add_argument("--sync-debug", action="store_true",
                   help="list where the timed steps synchronise with the GPU (torch's sync debug mode, by source line)")
    p.add_argument("--json", default=None, help="also write the step times and the kernel table (every kernel) here")
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile the host side of the profiled steps (functions by own time)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_engine_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    from sparse_framework.engine import Engine, EngineConfig, SamplingParams
    from sparse_framework.kernels import pdl

    pdl.PDL = args.pdl
    from sparse_framework.bench.floors import prefill_flops
    from sparse_framework.engine.models.random_shapes import RANDOM_MODELS
    from sparse_framework.engine.models import ModelConfig, random_model

    from sparse_framework.engine import parallel

    ctx = parallel.init_tp_from_env() if "WORLD_SIZE" in os.environ else None
    tp = ctx.world_size if ctx is not None else 1
    if ctx is not None:
        torch.cuda.set_device(ctx.device)
        if ctx.rank != 0:  # one table: rank 0's (every rank runs the same steps)
            sys.stdout = open(os.devnull, "w")
    model_config = ModelConfig.from_hf(RANDOM_MODELS[args.shape])
    model = random_model(model_config, "bfloat16", ctx.device if ctx is not None else "cuda", seed=0,
                         tp=ctx.shard if ctx is not None else None)
    # the first request decodes while the others prefill (a step each per 16384 tokens): its
    # output must outlast that, or the batch never decodes all together
    max_tokens = args.timed_steps + 2 * args.steps + 16 + args.batch * -(-args.context // 16384)
    engine = Engine(model, model_config, json.loads(args.config), EngineConfig(
        max_num_seqs=args.batch, max_num_batched_tokens=16384, max_model_len=args.context + max_tokens,
        decode_graphs=args.decode_graphs, cuda_graphs=args.cuda_graphs, fused_ops=args.fused_ops == "on",
        prefill_attention=args.prefill_attention, tensor_parallel_size=tp,
        async_scheduling=(args.async_scheduling == "on") if ctx is None else None))  # TP: off, as bench
    g = torch.Generator().manual_seed(0)
    # one short request first: kernel compilation (Triton, flash-attn's JIT) stays out of the figures
    engine.add_request("warm-up", torch.randint(0, model_config.vocab_size, (min(args.context, 4096),),
                                                generator=g).tolist(), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_to_completion()
    engine.step_log.clear()
    for i in range(args.batch):
        engine.add_request(f"r{i}", torch.randint(0, model_config.vocab_size, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ended = []
    while not engine.step_log or engine.step_log[-1][1] or engine.step_log[-1][0] < args.batch:
        if not engine.has_unfinished():
            why = "; ".join(sorted({f"{o.finish_reason}: {o.error}" for o in ended})[:3])
            print(f"profile_engine_step.py: the requests ended before all of them decoded together ({why})",
                  file=sys.stderr)
            return 1
        ended += engine.step()  # prefill, until a step decodes every request and prefills nothing
    prefill = [(tokens, sec) for _, tokens, _, sec in engine.step_log if tokens]
    tokens, sec = sum(t for t, _ in prefill), sum(s for _, s in prefill)
    flops = prefill_flops(model_config, [args.context] * args.batch)  # bench's count (MLA: what DSA needs)
    print(f"prefill: {tokens} tokens in {sec:.2f} s over {len(prefill)} steps, {tokens / sec:,.0f} tok/s, "
          f"{flops / sec / 1e12:.0f} TFLOP/s ({engine.runner.prefill_attention_label})")
    for _ in range(3):
        engine.step()  # warm-up (first sighting and capture of the graphs)
    torch.cuda.synchronize()
    times = []
    syncs: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        for _ in range(args.timed_steps):
            start = time.perf_counter()
            engine.step()  # with async scheduling it returns once the step before is read
            times.append(time.perf_counter() - start)
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            syncs[f"{w.filename}:{w.lineno}"] += 1
    if args.sync_debug:
        print(f"synchronising calls in {args.timed_steps} steps (source line: count):")
        for where, n in syncs.most_common(20):
            print(f"  {where}: {n}")
    if times:
        times.sort()
        print(f"decode step (no profiler): {1e3 * sum(times) / len(times):.2f} ms per step over {len(times)} steps "
              f"(median call {1e3 * times[len(times) // 2]:.2f} ms, min {1e3 * times[0]:.2f} ms; fused ops "
              f"{args.fused_ops}, async scheduling {'on' if engine.async_scheduling else 'off'}: with it a call "
              "returns once the step before is read, so the steps' mean, not a call's, is the step time)")
    before = _hits(engine)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / args.steps
    after = _hits(engine)
    if args.host_profile:
        import cProfile
        import pstats

        torch.cuda.synchronize()
        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        prof_host.disable()
        pstats.Stats(prof_host).sort_stats("tottime").print_stats(30)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / args.steps
    launches = sum(e.count for e in events) // args.steps
    print(f"decode step: {wall * 1e3:.2f} ms wall, {total / 1e3:.2f} ms of GPU kernels in {launches} launches "
          f"({args.batch} x {args.context}, {args.config}{', cuda graphs' if args.cuda_graphs else ''})")
    if after is not None:
        hits, misses, bytes_in = (a - b for a, b in zip(after, before))
        print(f"device-buffer hit rate {hits / max(1, hits + misses):.3f}, {bytes_in / args.steps / 1e6:.1f} MB "
              "host -> device per step")
    print(f"{'kernel':<60} {'ms/step':>8} {'calls':>6} {'share':>6}")
    for e in events[: args.top]:
        ms = e.device_time_total / args.steps / 1e3
        print(f"{e.key[:60]:<60} {ms:8.3f} {e.count // args.steps:6d} {100 * e.device_time_total / args.steps / total:5.1f}%")
    if args.json:
        hits = None if after is None else dict(zip(("hits", "misses", "bytes_in"), (a - b for a, b in zip(after, before))))
        record = {
            "tensor_parallel_size": tp, "config": json.loads(args.config), "shape": args.shape, "batch": args.batch,
            "context": args.context,
            "cuda_graphs": args.cuda_graphs, "pdl": args.pdl, "fused_ops": args.fused_ops,
            "async_scheduling": engine.async_scheduling, "device": torch.cuda.get_device_name(),
            "step_ms_mean": 1e3 * sum(times) / len(times) if times else None,
            "step_ms_median_call": 1e3 * times[len(times) // 2] if times else None,
            "profiled_wall_ms": wall * 1e3, "kernel_ms": total / 1e3, "launches_per_step": launches, "buffer": hits,
            "kernels": [{"name": e.key, "ms_per_step": e.device_time_total / args.steps / 1e3,
                         "calls_per_step": e.count / args.steps} for e in events],
        }
        if ctx is None or ctx.rank == 0:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    if ctx is not None:  # the engine (its graphs hold NCCL all-reduces) goes before the group
        del engine, model
        parallel.destroy_tp()
    return 0


def _hits(engine) -> tuple[int, int, int] | None:  # type: ignore[no-untyped-def]
    """(hits, misses, bytes in) of the hierarchical store so far, summed over layers; None for another store."""
    store = engine.runner.coord.store
    if not hasattr(store, "hits"):
        return None
    torch.cuda.synchronize()
    stats = store.stats()
    return (sum(s["hits"] for s in stats), sum(s["misses"] for s in stats), sum(s["bytes_in"] for s in stats))


if __name__ == "__main__":
    raise SystemExit(main())
