"""How fast can the selected K rows of a sparse decode step be read at all? A plain Triton
gather (load the rows, sum them; no attention) over the layout the decode kernel reads: a
token-major bf16 cache of 8 KV heads x 128 dims (2 KB per token), batch 8 x 2128 selected
tokens out of 131072 per request, K only (35 MB; K and V double it).

Two ways to cut the work: one program per (request, KV head) block of tokens, each reading
256-byte head rows (as `_decode_split_kernel` does), or one program per request block reading
the token's whole 2 KB row. Each over a sweep of tokens per step, steps per program and
pipeline stages; medians of CUDA events with the L2 flushed before each call. The attention
kernel's time is then compared with the best gather of the same bytes, not only with the
streaming floor (the GPU's HBM ceiling, common/hardware.py).

    python benchmarks/gather_bandwidth.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from sparse_framework.common import hardware
import triton
import triton.language as tl

from timing import Timer

DEFAULT_JSON = "benchmarks/results/gather_bandwidth_h100.json"


@triton.jit
def gather_kernel(src, idx, out, n_sel, ROW: tl.constexpr, ROW_STRIDE: tl.constexpr, HEADS: tl.constexpr,
                  BLOCK_N: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr):
    """Program (request x head group, block): sum of the ROW-element rows of its tokens."""
    bh = tl.program_id(0)
    b = bh // HEADS
    h = bh % HEADS
    first = tl.program_id(1) * BLOCK_N * STEPS
    acc = tl.zeros([BLOCK_N, ROW], tl.float32)
    for s in tl.range(0, STEPS, num_stages=STAGES):
        t = first + s * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = t < n_sel
        slot = tl.load(idx + b * n_sel + t, mask=ok, other=0).to(tl.int64)
        x = tl.load(src + slot[:, None] * ROW_STRIDE + h * ROW + tl.arange(0, ROW)[None, :], mask=ok[:, None], other=0.0)
        acc += x.to(tl.float32)
    tl.store(out + (bh * tl.num_programs(1) + tl.program_id(1)) * ROW + tl.arange(0, ROW), tl.sum(acc, 0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--selected", type=int, default=2128, help="tokens read per request (top-2048 + sink + recent)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json", default=DEFAULT_JSON, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    hk, d = 8, 128
    b, n, sel = args.batch, args.context, args.selected
    cache = torch.randn(b * n, hk * d, device="cuda", dtype=torch.bfloat16)  # token-major: 2 KB per token
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.stack([torch.randperm(n, device="cuda", generator=g)[:sel].sort().values + i * n for i in range(b)]).int()
    mb = b * sel * hk * d * 2 / 1e6
    timer = Timer(torch.device("cuda"), 5, args.iters, flush="read")
    results = []
    for heads_per_program, block_n, steps, stages in itertools.product((1, 8), (16, 32, 64), (2, 4, 8), (2, 3, 4)):
        row = d * heads_per_program
        groups = hk // heads_per_program
        blocks = triton.cdiv(sel, block_n * steps)
        out = torch.empty(b * groups * blocks * row, device="cuda", dtype=torch.float32)

        def run() -> None:
            gather_kernel[(b * groups, blocks)](cache, idx, out, sel, ROW=row, ROW_STRIDE=hk * d, HEADS=groups,
                                               BLOCK_N=block_n, STEPS=steps, STAGES=stages, num_warps=4)

        try:
            us = timer(run)
        except Exception as exc:  # a tile that does not fit in shared memory
            print(f"row {row * 2} B, block_n {block_n}, steps {steps}, stages {stages}: {str(exc).splitlines()[0][:80]}")
            continue
        results.append({"row_bytes": row * 2, "block_n": block_n, "steps": steps, "stages": stages,
                         "programs": b * groups * blocks, "us": us, "tb_per_s": mb / us})
    results.sort(key=lambda r: r["us"])
    tb_s = hardware.hbm_bytes_per_s() / 1e12
    print(f"gather of {mb:.0f} MB of selected K rows ({b} x {sel} tokens x {hk} heads x {d} bf16), floor at "
          f"{tb_s:.2f} TB/s {mb / tb_s:.1f} µs; fastest shapes:")
    for r in results[:10]:
        print(f"  {r['row_bytes']:5d}-byte rows, {r['block_n']:3d} tokens x {r['steps']} steps, {r['stages']} stages, "
              f"{r['programs']:5d} programs: {r['us']:6.1f} µs = {r['tb_per_s']:.2f} TB/s")
    for size in (256, 2048):
        best = min((r for r in results if r["row_bytes"] == size), key=lambda r: r["us"], default=None)
        if best:
            print(f"best with {size}-byte rows: {best['us']:.1f} µs ({best['tb_per_s']:.2f} TB/s)")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "megabytes": mb, "command": "python benchmarks/gather_bandwidth.py " + " ".join(argv or sys.argv[1:])}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
