"""Sweep the launch shape of the Triton top-k selection (`kernels/topk.py`, CUDA) on the
scores a decode step really ranks: DSA's indexer scores (8 requests x 131072 tokens, top
2048 tokens) and Quest's page scores (8 requests x 8 KV heads x 8192 pages, top 128 pages),
both from decode_layer.py's cells. Every shape is timed twice, in two sweeps of shuffled
order, as CUDA-graph replays (medians of CUDA events after warm-up), and checked against the
default shape's selection. Also prints each kernel's GPU time for the default shape
(torch.profiler), so the passes can be compared. The sweep runs the five kernels
(`fused="off"`); the default shape is then timed both ways: five kernels, and one
cooperative kernel where its programs fit on the GPU at once (`fused="auto"`).

    python benchmarks/tune_topk.py --json benchmarks/results/tune_topk_h100.json
    python benchmarks/tune_topk.py --no-sweep            # only the default shape, fused or not
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from decode_layer import Cell
from sparse_framework.algorithms.base import _max_units
from sparse_framework.kernels import topk as tk
from timing import Timer


def _case(algo: str, ctx: int, batch: int):  # type: ignore[no-untyped-def]
    cell = Cell("mha", algo, ctx, batch, torch.device("cuda"), seed=ctx + batch)
    a = cell.coord.algorithm
    scores = a.score(0, cell.q, cell.step_batch, inputs=cell.step_inputs).float().contiguous()
    kw = dict(unit=a.unit, budget_units=a.budget_units(a.config), sink_tokens=a.config.sink_tokens,
              recent_tokens=a.config.recent_tokens, width_units=_max_units(a.config, a.unit, a.budget_units(a.config)))
    lens = cell.step_batch.seq_lens
    return scores, lens, kw


def _per_kernel(run) -> list[tuple[str, float]]:  # type: ignore[no-untyped-def]
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = len(kernels) // 10
    out = []
    for i in range(per_call):  # the i-th kernel of each call, averaged over the 10 calls
        same = kernels[i::per_call]
        out.append((same[0].name[:40], sum(e.time_range.elapsed_us() for e in same) / len(same)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--blocks", default="512,1024,2048,4096")
    parser.add_argument("--warps", default="4,8,16")
    parser.add_argument("--no-sweep", action="store_true", help="time the default shape only (five kernels and fused)")
    parser.add_argument("--json", default=None, help="write the sweep here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_topk.py needs a CUDA device", file=sys.stderr)
        return 2
    timer = Timer(torch.device("cuda"), 5, args.iters, False)  # the scores sit in L2 in a decode step too
    result: dict = {"device": torch.cuda.get_device_name(), "cases": {}}
    for algo in ("dsa", "quest"):
        scores, lens, kw = _case(algo, args.context, args.batch)

        def run(block: int | None = None, warps: int | None = None, fused: str = "off") -> object:
            return tk.topk_selection_triton(scores, lens, **kw, block=block, warps=warps, fused=fused)

        ref = run()
        rows_n, n_units = scores.shape[0] * scores.shape[1], scores.shape[2]
        per_kernel = _per_kernel(run)
        print(f"== {algo}: scores {tuple(scores.shape)}, default block {tk._block(rows_n, n_units)}", flush=True)
        for name, us in per_kernel:
            print(f"   {name:40} {us:6.1f} us", flush=True)
        shapes = [(bl, w) for bl, w in itertools.product([int(x) for x in args.blocks.split(",")],
                                                      [int(x) for x in args.warps.split(",")]) if bl <= n_units and not args.no_sweep]
        times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
        for sweep in range(2):
            random.Random(sweep).shuffle(shapes)
            for bl, w in shapes:
                sel = run(bl, w)
                same = bool(torch.equal(sel.indices, ref.indices) and torch.equal(sel.lengths, ref.lengths))
                us = timer.graph(lambda bl=bl, w=w: run(bl, w))
                times[(bl, w)].append(us if same else float("nan"))
        default_us = timer.graph(run)
        fused = run(fused="auto")
        assert torch.equal(fused.indices, ref.indices) and torch.equal(fused.lengths, ref.lengths), "fused != five kernels"
        fused_us = timer.graph(lambda: run(fused="auto"))
        key = next((k for k in tk._FUSED_SHAPES if k[1:3] == (rows_n, n_units)), None)
        fused_shape = tk._FUSED_SHAPES.get(key) if key else None
        rows = [{"block": bl, "warps": w, "us": t} for (bl, w), t in sorted(times.items())]
        for r in rows:
            print(f"   block {r['block']:5} warps {r['warps']:2}: " + "  ".join(f"{t:6.1f}" for t in r["us"]) + " us", flush=True)
        print(f"   default: {default_us:.1f} us as five kernels; FUSED auto: {fused_us:.1f} us "
              f"({'one cooperative kernel, block %d, %d warps' % fused_shape if fused_shape else 'does not fit: five kernels'})",
              flush=True)
        result["cases"][algo] = {"scores_shape": list(scores.shape), **kw, "default_block": tk._block(rows_n, n_units),
                                 "default_us": default_us, "fused_auto_us": fused_us, "fused_shape": fused_shape,
                                 "per_kernel_us": per_kernel, "sweep": rows}
        del scores
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
