"""What a prefix-cache hit still costs: the algorithm's build, recomputed from the staged prefix.

The prefix cache (engine/prefix_cache.py) keeps only K/V host pages (and an indexer's keys) in
its tree; on a hit the algorithm's representations (Quest's page bounds, PQCache's codes and
codebooks, SnapKV's votes, DSA's keys) are rebuilt from the staged prefix at the hand-over.
This prices that choice per layer of a prompt: the median time of `algorithm.build` against
the K projection of the same tokens ([tokens, hidden] x [hidden, kv_heads x head_dim]), the
smallest piece of the prefill work a hit saves in that layer, and against the layer's
projections and MLP (the K projection's time scaled by their FLOPs: q, k, v, o and the three
MLP matmuls; attention comes on top). A build well below these means recomputing is cheap.

    python benchmarks/prefix_cache_build_cost.py                       # CPU, float32
    python benchmarks/prefix_cache_build_cost.py --device cuda --dtype bfloat16 --tokens 16384 \\
        --out benchmarks/results/prefix_cache_build_cost_h100.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from timing import Timer, write_results

ALGORITHMS = {
    "quest": {"algorithm": "quest", "page_size": 16},
    "pqcache": {"algorithm": "pqcache", "page_size": 16},
    "snapkv": {"algorithm": "snapkv", "page_size": 16, "extra": {"window": 32}},
    "dsa-keys": {"algorithm": "dsa", "page_size": 16, "extra": {"source": "keys"}},
}


def build_timer(name: str, tokens: int, heads: int, head_dim: int, q_heads: int, dtype: torch.dtype,
                device: torch.device, timer: Timer) -> float:
    """Median µs of one layer's `build` of a `tokens` prompt (with its last queries where the
    algorithm reads them)."""
    from sparse_framework.common.batch import Request
    from sparse_framework.common.layout import KVLayout
    from sparse_framework.config import load_config
    from sparse_framework.coordinator.core import SparseCoordinator

    layout = KVLayout(num_layers=1, num_kv_heads=heads, head_dim=head_dim, dtype=dtype, device=device)
    config = load_config({**ALGORITHMS[name], "top_k": 256, "min_sparse_prompt_len": 0,
                          "device_buffer_tokens": 1024})
    coord = SparseCoordinator(config, layout, max_requests=1, max_seq_len=tokens + 64)
    algo = coord.algorithm
    request = Request("r", tokens)
    coord.on_request_begin(request)
    request.seq_len = tokens
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(tokens, heads, head_dim, generator=g, device=device).to(dtype)
    rows = algo.prefill_query_rows
    q = None if rows == 0 else torch.randn(tokens if rows is None else min(rows, tokens), q_heads, head_dim,
                                           generator=g, device=device).to(dtype)
    return timer(lambda: algo.build(0, request, k, q, inputs={}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens of the layer (default 4096)")
    p.add_argument("--shape", default="4096,32,8,128",
                   help="hidden, query heads, KV heads, head_dim (default 4096,32,8,128: Llama-3-8B)")
    p.add_argument("--intermediate", type=int, default=14336, help="MLP width (default 14336: Llama-3-8B)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma separated, of {', '.join(ALGORITHMS)}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        hidden, q_heads, heads, head_dim = (int(x) for x in args.shape.split(","))
    except ValueError:
        print(f"--shape: four integers hidden,q_heads,kv_heads,head_dim, got {args.shape!r}", file=sys.stderr)
        return 2
    names = args.algorithms.split(",")
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        print(f"--algorithms: unknown {unknown}; choose from {', '.join(ALGORITHMS)}", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    timer = Timer(device, warmup=2, iters=args.iters, flush=False)
    x = torch.randn(args.tokens, hidden, device=device).to(dtype)
    w = torch.randn(hidden, heads * head_dim, device=device).to(dtype)
    project = timer(lambda: x @ w)
    kv, q = heads * head_dim, q_heads * head_dim
    layer = project * (2 * q + 2 * kv + 3 * args.intermediate) / kv  # FLOPs-scaled: q, k, v, o, MLP
    print(f"{args.tokens} tokens, {heads} KV heads x {head_dim}, {args.dtype} on {device}: "
          f"K projection {project / 1e3:.2f} ms, layer matmuls ~{layer / 1e3:.0f} ms (FLOPs-scaled)")
    print(f"{'algorithm':<10} {'build ms':>9} {'/ K proj':>9} {'/ layer':>8}")
    rows = []
    for name in names:
        us = build_timer(name, args.tokens, heads, head_dim, q_heads, dtype, device, timer)
        rows.append({"algorithm": name, "build_us": us, "k_projection_us": project, "layer_matmuls_us_est": layer,
                     "ratio_k_projection": us / project, "ratio_layer": us / layer})
        print(f"{name:<10} {us / 1e3:>9.2f} {us / project:>9.2f} {us / layer:>8.3f}")
    if args.out:
        meta = {"tokens": args.tokens, "shape": args.shape, "device": str(device), "dtype": args.dtype,
                "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
        write_results(args.out, meta, rows, "prefix_cache_build_cost.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
