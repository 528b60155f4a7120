"""Sweep the launch shape of the Triton sparse decode kernel (`kernels/sparse_decode.py`,
CUDA) on decode_layer.py's cells at 128K context, batch 8: the split count (through
TARGET_WARPS_PER_SM), the tokens per loop step (MAX_BLOCK_N), the pipeline depth
(NUM_STAGES) and the warps per program. Each shape is timed twice, in two sweeps of shuffled
order, as CUDA-graph replays of the backend call alone with the L2 flushed before each call
(medians of CUDA events after warm-up), next to the byte floor of the selected K/V at the GPU's HBM ceiling,
and checked against the default shape's output.

    python benchmarks/tune_sparse_decode.py --json benchmarks/results/tune_sparse_decode_h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys

import torch

from decode_layer import HBM_GBPS, Cell
from sparse_framework.kernels import sparse_decode as sd
from timing import FLUSH_MODES, Timer

# the swept knobs: their names in the results (the module constants) -> `sd.DecodeShape`'s fields
KNOBS = {"TARGET_WARPS_PER_SM": "target_warps_per_sm", "MAX_BLOCK_N": "max_block_n", "NUM_STAGES": "num_stages",
         "WARPS_OVERRIDE": "warps", "KV_TILE_BYTES": "kv_tile_bytes"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="mha:dsa,mha:quest,mla:dsa", help="shape:algorithm,...")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--targets", default="8,16,32,64", help="TARGET_WARPS_PER_SM values (more: more splits)")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--flush", default="read", choices=FLUSH_MODES, help="how the L2 is flushed (timing.py)")
    parser.add_argument("--json", default=None, help="write the sweep here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_sparse_decode.py needs a CUDA device", file=sys.stderr)
        return 2
    timer = Timer(torch.device("cuda"), 5, args.iters, args.flush)
    base = sd.default_shape()
    default = {name: getattr(base, field) for name, field in KNOBS.items()}
    result: dict = {"device": torch.cuda.get_device_name(), "default": default, "l2_flush": args.flush, "cells": {}}
    for spec in args.cells.split(","):
        shape, algo = spec.split(":")
        cell = Cell(shape, algo, args.context, args.batch, torch.device("cuda"), seed=args.context + args.batch)
        cell.use("triton", None)
        meta = cell.coord.attention_begin(0, cell.q, cell.k, cell.v, cell.step_batch, cell.step_inputs)
        width = min(type(cell.coord.algorithm).max_selected_tokens(cell.coord.config), args.context)
        floor = args.batch * width * cell.layout.bytes_per_token_per_layer / HBM_GBPS / 1e3

        def run() -> torch.Tensor:
            return cell.coord.attend(0, cell.q, meta)

        ref = run().float()
        default_us = timer.graph(run)
        shapes = list(itertools.product(*([int(x) for x in v.split(",")] for v in (args.targets, args.block_n, args.stages, args.warps))))
        times: dict[tuple, list[float]] = {s: [] for s in shapes}
        errors: dict[tuple, str] = {}
        for sweep in range(2):
            random.Random(sweep).shuffle(shapes)
            for s in shapes:
                if s in errors:
                    continue
                target, block_n, stages, warps = s
                shape = dataclasses.replace(base, target_warps_per_sm=target, max_block_n=block_n, num_stages=stages,
                                            warps=warps, kv_tile_bytes=1 << 30)  # let max_block_n decide
                try:
                    with sd.launch_shape(shape):  # the backend's calls inside (it passes no shape)
                        err = float((run().float() - ref).norm() / ref.norm())
                        us = timer.graph(run)
                except Exception as exc:  # out of shared memory / registers for this shape
                    errors[s] = str(exc).splitlines()[0][:120]
                    continue
                times[s].append(us if err < 1e-2 else float("nan"))
        rows = [{"target_warps_per_sm": s[0], "block_n": s[1], "stages": s[2], "warps": s[3], "us": t,
                 "error": errors.get(s)} for s, t in sorted(times.items())]
        ok = [r for r in rows if len(r["us"]) == 2]
        ok.sort(key=lambda r: max(r["us"]))
        print(f"== {spec} L={args.context} B={args.batch}: default {default_us:.1f} us, floor {floor:.1f} us; best (worse of two sweeps):", flush=True)
        for r in ok[:12]:
            print(f"   target {r['target_warps_per_sm']:2} block_n {r['block_n']:3} stages {r['stages']} warps {r['warps']}: "
                  + "  ".join(f"{t:6.1f}" for t in r["us"]) + " us", flush=True)
        print(f"   ({len(errors)} shapes did not launch)", flush=True)
        result["cells"][spec] = {"default_us": default_us, "floor_us": floor, "sweep": rows}
        del cell, meta
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
