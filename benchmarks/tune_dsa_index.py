"""Sweep the launch shape of DSA's fused FP8 indexer kernel (`DSA_TUNING["fp8q"]`, CUDA).

8 requests x 131072 tokens, 64 indexer heads x 128 dims, FP8 keys with ue8m0 scales, bf16
queries quantised in the kernel. Medians of CUDA-event timings after warm-up with the L2
flushed before every call, next to the byte floor (keys + scales at the GPU's HBM ceiling, common/hardware.py), and
the error against the torch twin. Also times the best shape with the FP8 tensor-core dot off.

    python benchmarks/tune_dsa_index.py --json benchmarks/results/tune_dsa_index_h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from sparse_framework.kernels import dsa_index as dsa, scoring as sc
from sparse_framework.common import hardware
from timing import Timer

HBM_GBPS = hardware.hbm_bytes_per_s() / 1e9  # common/hardware.py


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--block-n", default="64,128,256", help="comma-separated tokens per step")
    parser.add_argument("--steps", default="1,2,4,8", help="comma-separated steps per program")
    parser.add_argument("--stages", default="1,2", help="comma-separated software-pipelining depths")
    parser.add_argument("--warps", default="4,8", help="comma-separated warps per program")
    parser.add_argument("--json", default=None, help="write the sweep here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_dsa_index.py needs a CUDA device", file=sys.stderr)
        return 2
    b, n, h, d = args.batch, args.context, 64, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    bits, scale = sc.quantize_fp8_blocks(torch.randn(b, n, d, device="cuda", generator=g))
    q = torch.randn(b, h, d, device="cuda", generator=g).bfloat16()
    w = torch.randn(b, h, device="cuda", generator=g).bfloat16()
    slots = torch.arange(b, device="cuda")
    ref = sc.dsa_index_scores_fp8q_torch(q, w, bits, scale, slots, n, pow2_scales=True)
    timer = Timer(torch.device("cuda"), 5, args.iters, True)
    floor = b * n * (d + 4 * d // dsa.FP8_BLOCK) / HBM_GBPS / 1e3

    def run(tuning: dict[str, int] | None = None, fp8_dot: str | None = None) -> torch.Tensor:
        return sc.dsa_index_scores_fp8q_triton(q, w, bits, scale, slots, n, pow2_scales=True, tuning=tuning,
                                               fp8_dot=fp8_dot)

    rows = []
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    for bn, steps, stages, warps in itertools.product(ints(args.block_n), ints(args.steps), ints(args.stages),
                                                      ints(args.warps)):
        tuning = {"block_n": bn, "steps": steps, "stages": stages, "warps": warps}
        err = float(((run(tuning) - ref).abs().max() / ref.abs().max()).item())
        us = timer(lambda tuning=tuning: run(tuning))
        rows.append({**tuning, "us": us, "floor_us": floor, "rel_err": err})
        print(f"block_n {bn:>3} steps {steps} stages {stages} warps {warps}: {us:7.1f} us (floor {floor:.1f}) "
              f"rel err {err:.1e}", flush=True)
    best = min(rows, key=lambda r: r["us"])
    best_tuning = {k: best[k] for k in ("block_n", "steps", "stages", "warps")}
    no_dot = timer(lambda: run(best_tuning, fp8_dot="off"))
    print(f"best {best_tuning}: {best['us']:.1f} us; with the FP8 dot off: {no_dot:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sweep": rows, "best": best, "best_without_fp8_dot_us": no_dot}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
