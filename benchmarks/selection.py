"""Selection benchmark: the scoring hot path of each algorithm (Triton and torch) and the
top-k that turns its scores into a selection, per context length.

Shapes: Quest and PQCache Llama-3-8B-like (32 query / 8 KV heads, head dim 128, bf16 KV;
Quest pages of 16 tokens, PQCache 2 sub-vectors x 64 centroids); SnapKV the prefill votes of a
window of 32 queries over one prompt of length L (and, at decode, the top-k over the stored
votes); DSA's lightning indexer with 64 heads x 128 dims, bf16 or fp8 keys (then the bf16
queries quantised by the scoring function, ue8m0, as DSA runs it), one selection per request.
The budget is 2048 tokens (Quest: 128 pages) plus 16 sink and 64 recent tokens.

Per row: the bytes the scoring must read (the representation that grows with L), the
achieved GB/s of the scoring and its share of the HBM ceiling (common/hardware.py
"Measured ceilings"). CUDA times are medians of CUDA-event timings after warm-up, with the
L2 cache flushed before every timed call; on the CPU (smoke runs) time.perf_counter medians.

    python benchmarks/selection.py                                   # CUDA, writes the JSON
    python benchmarks/selection.py --device cpu --contexts 4096 --batch 2 --impl torch
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from sparse_framework.algorithms.base import topk_selection
from sparse_framework.common import hardware
from sparse_framework.algorithms.base import group_probabilities
from sparse_framework.common.tables import new_table
from sparse_framework.kernels import scoring
from timing import Timer

HBM_GBPS = hardware.hbm_bytes_per_s() / 1e9  # the GPU's measured copy ceiling (common/hardware.py)
DEFAULT_JSON = "benchmarks/results/selection_h100.json"
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE, PQ_M, PQ_K = 16, 2, 64
WINDOW = 32
DSA_HEADS, DSA_DIM = 64, 128
TOP_K, SINK, RECENT = 2048, 16, 64
FUNCTIONS = {"quest": "quest_scores", "pqcache": "pqcache_scores", "snapkv": "snapkv_window_mass",
             "dsa-bf16": "dsa_index_scores", "dsa-fp8": "dsa_index_scores_fp8q"}
ALGORITHMS = tuple(FUNCTIONS)


def select(scores: torch.Tensor, lens: torch.Tensor, unit: int):  # type: ignore[no-untyped-def]
    """ScoringAlgorithm.select's top-k with the benchmark's budget."""
    width = -(-SINK // unit) + TOP_K // unit + -(-RECENT // unit) + 1
    return topk_selection(scores, lens, unit=unit, budget_units=TOP_K // unit, sink_tokens=SINK,
                          recent_tokens=RECENT, width_units=width, impl="auto")


def setup(algo: str, impl: str, ctx: int, batch: int, device: torch.device, gen: torch.Generator) -> dict:
    """One case: `score` (the scoring call), `topk` (scores -> selection), `decode` (what a
    decode step runs: score and top-k), `bytes` (representation bytes the scoring reads)."""
    fn = getattr(scoring, f"{FUNCTIONS[algo]}_{impl}")
    bf16 = torch.bfloat16

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    slots = torch.randperm(batch, device=device, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = randn(batch, Q_HEADS, HEAD_DIM, dtype=bf16)
    if algo == "quest":
        pages = ctx // PAGE
        x, y = randn(batch, KV_HEADS, pages, HEAD_DIM), randn(batch, KV_HEADS, pages, HEAD_DIM)
        lo, hi = torch.minimum(x, y).to(bf16), torch.maximum(x, y).to(bf16)
        del x, y

        def score() -> torch.Tensor:
            return fn(q, lo, hi, slots, pages, "max")

        def topk(s: torch.Tensor):  # type: ignore[no-untyped-def]
            return select(s, lens, PAGE)

        return {"score": score, "topk": topk, "decode": lambda: topk(score()),
                "bytes": 2 * batch * KV_HEADS * pages * HEAD_DIM * 2}
    if algo == "pqcache":
        books = randn(batch, KV_HEADS, PQ_M, PQ_K, HEAD_DIM // PQ_M)
        codes = torch.randint(0, PQ_K, (batch, KV_HEADS, ctx, PQ_M), device=device, generator=gen, dtype=torch.uint8)

        def score() -> torch.Tensor:  # what PQCache.score runs: per-head logits, softmax, group sum
            return group_probabilities(fn(q, books, codes, slots, ctx, "none"), lens, HEAD_DIM, "sum")

        def topk(s: torch.Tensor):  # type: ignore[no-untyped-def]
            return select(s, lens, 1)

        return {"score": score, "topk": topk, "decode": lambda: topk(score()), "bytes": batch * KV_HEADS * ctx * PQ_M,
                "note": "codes read; the per-head logits and softmax add 3 x B x Hq x L x 4 B of float32 traffic"}
    if algo == "snapkv":
        # prefill: the votes of one prompt; decode: SnapKV.score over the stored votes (+inf
        # from the window on), then the top-k
        keys = randn(ctx, KV_HEADS, HEAD_DIM, dtype=bf16)
        q_window = randn(WINDOW, Q_HEADS, HEAD_DIM, dtype=bf16)
        pool = randn(batch, KV_HEADS, ctx).abs()
        start = torch.full((batch, 1, 1), ctx - WINDOW, device=device)
        later = torch.arange(ctx, device=device).view(1, 1, -1)

        def stored() -> torch.Tensor:
            return pool[slots, :, :ctx].masked_fill(later >= start, float("inf"))

        votes = stored()
        return {"score": lambda: fn(q_window, keys), "topk": lambda _: select(votes, lens, 1),
                "decode": lambda: select(stored(), lens, 1), "bytes": ctx * KV_HEADS * HEAD_DIM * 2, "batch": 1}
    # DSA lightning indexer: one selection per request
    iq = randn(batch, DSA_HEADS, DSA_DIM, dtype=bf16)
    weights = randn(batch, DSA_HEADS)
    raw = randn(batch, ctx, DSA_DIM, dtype=bf16)
    if algo == "dsa-fp8":
        keys, scale = scoring.quantize_fp8_blocks(raw)
        nbytes = batch * ctx * DSA_DIM + batch * ctx * (DSA_DIM // 128) * 4
    else:
        keys, scale = raw, None
        nbytes = batch * ctx * DSA_DIM * 2

    def score() -> torch.Tensor:
        return fn(iq, weights, keys, scale, slots, ctx)

    def topk(s: torch.Tensor):  # type: ignore[no-untyped-def]
        return select(s.unsqueeze(1), lens, 1)

    return {"score": score, "topk": topk, "decode": lambda: topk(score()), "bytes": nbytes}


def bench(algo: str, impl: str, ctx: int, args: argparse.Namespace, timer: Timer) -> dict:
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(ctx)
    case = setup(algo, impl, ctx, args.batch, device, gen)
    scores = case["score"]()
    out = {"algorithm": algo, "impl": impl, "context": ctx, "batch": case.get("batch", args.batch), "note": case.get("note", ""),
           "decode_batch": args.batch, "score_phase": "prefill, one prompt" if algo == "snapkv" else "decode step",
           "bytes": case["bytes"], "ceiling_gbps": HBM_GBPS}
    for name, fn in (("score", case["score"]), ("topk", lambda: case["topk"](scores)), ("score_topk", case["decode"])):
        out[f"{name}_us"] = timer(fn)
        out[f"{name}_graph_us"] = None if args.no_graph else timer.graph(fn)
    best = out["score_graph_us"] or out["score_us"]  # the GPU's time where a graph could be captured
    out["gbps"] = case["bytes"] / best / 1e3
    out["ceiling_pct"] = 100.0 * out["gbps"] / HBM_GBPS
    return out


def pair(r: dict, name: str) -> str:
    """Eager µs, and " / graph µs" where a CUDA graph was captured."""
    graph = r[f"{name}_graph_us"]
    return f"{r[f'{name}_us']:.1f}" + ("" if graph is None else f" / {graph:.1f}")


def results_table(results: list[dict], device: torch.device | str, batch: int) -> Table:
    """A row per (context, algorithm, impl), sized for a 100-column terminal."""
    table = new_table(f"selection: scoring + top-{TOP_K} ({device}, decode batch {batch}): µs eager / CUDA-graph replay",
                      tight=True)
    for col in ("algorithm", "impl", "context", "rows", "score", "top-k", "score+top-k", "MB", "GB/s", "% of\nHBM"):
        table.add_column(col, justify="left" if col in ("algorithm", "impl") else "right",
                         no_wrap=col in ("score", "top-k", "score+top-k"))
    for r in results:
        table.add_row(r["algorithm"], r["impl"], str(r["context"]), str(r["batch"]), pair(r, "score"), pair(r, "topk"),
                      pair(r, "score_topk"), f"{r['bytes'] / 1e6:.2f}", f"{r['gbps']:.4g}", f"{r['ceiling_pct']:.3g}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", default="32768,131072", help="comma-separated context lengths")
    parser.add_argument("--batch", type=int, default=8, help="requests per decode step")
    parser.add_argument("--impl", default="triton,torch", help="comma-separated: triton, torch")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset of " + ", ".join(ALGORITHMS))
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=None, help="timed runs per figure (default 50 on CUDA, 5 on CPU)")
    parser.add_argument("--no-flush", action="store_true", help="do not flush the L2 cache before each timed call")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay timings")
    parser.add_argument("--json", default=None, help=f"write results here (default on CUDA: {DEFAULT_JSON}; "
                        "on the CPU only when given)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    impls = [x for x in args.impl.split(",") if x]
    algos = [x for x in args.algorithms.split(",") if x]
    bad = [x for x in impls if x not in ("triton", "torch")] + [x for x in algos if x not in ALGORITHMS]
    if bad:
        parser.error(f"unknown impl or algorithm: {', '.join(bad)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available (use --device cpu --impl torch for a smoke run)")
    if device.type != "cuda" and "triton" in impls and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("the Triton kernels need CUDA (or TRITON_INTERPRET=1): use --impl torch on the CPU")
    if args.iters is None:
        args.iters = 50 if device.type == "cuda" else 5
    if device.type != "cuda":
        args.warmup = min(args.warmup, 2)
    json_path = args.json if args.json is not None else (DEFAULT_JSON if device.type == "cuda" else None)
    contexts = [int(x) for x in args.contexts.split(",")]
    timer = Timer(device, args.warmup, args.iters, flush=not args.no_flush)

    console = Console(width=None if sys.stdout.isatty() else 100)
    results = []
    for ctx in contexts:
        for algo in algos:
            for impl in impls:
                r = bench(algo, impl, ctx, args, timer)
                results.append(r)
                console.print(f"{algo:9} {impl:6} L={ctx:<7} score {pair(r, 'score')} µs  top-k {pair(r, 'topk')} µs"
                              f"  both {pair(r, 'score_topk')} µs  {r['gbps']:.4g} GB/s ({r['ceiling_pct']:.3g}%)",
                              highlight=False)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    console.print(results_table(results, device, args.batch))
    console.print("GB/s: the representation bytes over the scoring time (CUDA-graph replay where captured). "
                  "SnapKV: 'score' is the prefill vote computation of one prompt; 'top-k' the decode top-k over "
                  "stored votes, 'score+top-k' SnapKV's decode step (gather, +inf from the window, top-k).")
    if json_path:
        import triton

        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__, "ceiling_gbps": HBM_GBPS,
                "top_k": TOP_K, "sink_tokens": SINK, "recent_tokens": RECENT, "warmup": args.warmup,
                "iters": args.iters, "l2_flush": device.type == "cuda" and not args.no_flush,
                "timing": "median µs; *_us eager (includes host launch time where the host is slower than the GPU), "
                          "*_graph_us CUDA-graph replay; gbps from the graph time where captured"}
        with open(json_path, "w") as f:
            json.dump({**meta, "results": results}, f, indent=2)
        console.print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
