"""A prefill chunk's attention: SDPA against flash-attn's varlen kernel, by chunk shape.

The engine prefills a prompt in chunks; chunk i of n queries attends to the m staged keys of
its prompt so far (causal, bottom-right aligned). SDPA takes its flash kernel only for a whole
prompt (n == m, `is_causal`); a later chunk (n < m) needs an [n, m] mask, and with a mask SDPA
falls back to its memory-efficient or math kernel. flash-attn's varlen kernel takes both
without a mask (engine/prefill_attention.py). Per (n, m): median time (CUDA events, L2 flushed)
and TFLOP/s of the causal part actually computed (4 · Hq · D per query-key pair), beside the
790 TFLOP/s bf16 matmul peak. CUDA only; flash-attn rows where it is installed.

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill_attention_h100.json

`--window W`: a sliding-window layer's chunk instead (keys in (t - W, t]), one SDPA call over
the whole [n, m] mask against the engine's blocks over each block's band of keys; TFLOP/s
count the pairs the window keeps. Gemma 3's layers:
    python benchmarks/prefill_attention.py --window 512 --heads 4,1 --head-dim 256 \
        --shapes 8192x8192,32768x32768 --out benchmarks/results/prefill_sliding_h200.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from timing import Timer, write_results

PEAK_TFLOPS = 790.0
SHAPES = "16384x16384,8192x8192,4096x16384,2048x16384,4096x32768,8192x131072"


def causal_pairs(n: int, m: int) -> int:
    """Query-key pairs a bottom-right causal chunk computes: query i sees m - n + i + 1 keys."""
    return n * (m - n) + n * (n + 1) // 2


def window_pairs(n: int, m: int, window: int) -> int:
    """The pairs a sliding chunk computes: query i sees min(window, m - n + i + 1) keys."""
    full = max(0, min(n, window - (m - n)))  # the first queries, which see fewer than `window`
    return sum(m - n + i + 1 for i in range(full)) + (n - full) * window


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=SHAPES, help=f"chunk queries x staged keys, comma separated (default {SHAPES})")
    p.add_argument("--heads", default="32,8", help="query heads, KV heads (default 32,8: Llama-3-8B)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--window", type=int, default=None, help="a sliding layer's window: one masked call vs blocks")
    p.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (float32; --window comparisons only)")
    p.add_argument("--out", help="write the results as JSON")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("prefill_attention.py: no CUDA GPU here (--device cpu runs the --window comparison)", file=sys.stderr)
        return 2
    if dev.type == "cpu" and args.window is None:
        print("prefill_attention.py: on the CPU only --window compares anything (no flash-attn)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    from sparse_framework.engine import prefill_attention as pa
    from sparse_framework.engine.staging import chunk_attention

    hq, hkv = (int(x) for x in args.heads.split(","))
    d = args.head_dim
    found = pa.find_varlen()
    kernels = {"sdpa": chunk_attention}
    if args.window is not None:
        w = args.window
        kernels = {"sdpa one call": lambda q, k, v: chunk_attention(q, k, v, window=w, block=None),
                   "sdpa blocks": lambda q, k, v: chunk_attention(q, k, v, window=w)}
    elif isinstance(found, tuple):
        label, fn = found
        kernels[label] = lambda q, k, v: pa.flash_chunk_attention(fn, q, k, v)
    else:
        print(f"flash-attn: {found}", file=sys.stderr)
    timer = Timer(dev, warmup=1 if dev.type == "cpu" else 3, iters=args.iters, flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'n x m':>14} {'kernel':<14} {'ms':>8} {'TFLOP/s':>8} {'of peak':>8}")
    for shape in args.shapes.split(","):
        n, m = (int(x) for x in shape.split("x"))
        q = torch.randn(n, hq, d, generator=g, device=dev).to(dtype)
        k, v = (torch.randn(m, hkv, d, generator=g, device=dev).to(dtype) for _ in range(2))
        pairs = causal_pairs(n, m) if args.window is None else window_pairs(n, m, args.window)
        flops = 4 * hq * d * pairs
        for name, kernel in kernels.items():
            us = timer(lambda: kernel(q, k, v))
            tflops = flops / us / 1e6
            peak = tflops / PEAK_TFLOPS if dev.type == "cuda" else None  # the GPU's peak: nothing on a CPU
            rows.append({"n": n, "m": m, "kernel": name, "ms": us / 1e3, "tflops": tflops, "fraction_of_peak": peak})
            of_peak = "–" if peak is None else f"{100 * peak:.1f}%"
            print(f"{shape:>14} {name:<14} {us / 1e3:8.2f} {tflops:8.2f} {of_peak:>8}")
        del q, k, v
    if args.out:
        name = torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
        write_results(args.out, {"device": name, "heads": [hq, hkv], "head_dim": d,
                                 "dtype": str(dtype).removeprefix("torch."), "peak_tflops": PEAK_TFLOPS,
                                 "window": args.window}, rows, "prefill_attention.py", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
