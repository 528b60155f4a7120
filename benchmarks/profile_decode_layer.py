"""Where one eager decode layer spends its time: torch.profiler over a few
attention_begin + attend calls of a decode_layer.py cell, with the CPU-side cost of each op
(the eager launch overhead) and the GPU kernels it launches.

    python benchmarks/profile_decode_layer.py --algorithm dsa --context 131072 --batch 8
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from decode_layer import ALGORITHMS, SHAPES, Cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="dsa", choices=sorted(ALGORITHMS))
    parser.add_argument("--shape", default="mha", choices=sorted(SHAPES))
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=30, help="rows of each table")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cell = Cell(args.shape, args.algorithm, args.context, args.batch, device, seed=0)
    cell.use(args.backend, None)
    for _ in range(3):
        cell.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            cell.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    print(f"== {args.shape} {args.algorithm} L={args.context} B={args.batch} {args.backend}: per step, over {args.steps} steps")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if device.type == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"GPU kernels per step: {kernels / args.steps:.0f}")
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
