"""Where one eager decode layer spends its time: torch.profiler over a few
attention_begin + attend calls of a decode_layer.py cell, with the CPU-side cost of each op
(the eager launch overhead) and the GPU kernels it launches.

--graph: instead, the kernel timeline of the layer replayed from a CUDA graph (the L2 flushed
before each replay): per kernel its start, duration and end after the first kernel's start,
medians over the replays. With PDL a kernel starts while its predecessor runs and waits
inside, so its duration overlaps; where a kernel *ends* after its predecessor ended is its
share of the critical path.

    python benchmarks/profile_decode_layer.py --algorithm dsa --context 131072 --batch 8
    python benchmarks/profile_decode_layer.py --algorithm dsa --context 131072 --batch 8 --graph
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from decode_layer import ALGORITHMS, SHAPES, Cell
from timing import capture, warm_up_aside


def graph_timeline(cell: Cell, replays: int) -> None:
    """Print the kernel timeline of `replays` CUDA-graph replays of the cell's layer."""
    warm_up_aside(cell.step)
    graph = capture(cell.step)
    flush = torch.empty(64 << 20, device="cuda")
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    groups = []
    for _ in range(replays):  # one profiled replay at a time: its kernels are exactly one group
        flush.amax()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.profiler.kineto_results.events() if e.device_type() == torch.autograd.DeviceType.CUDA]
        groups.append(sorted(kernels, key=lambda e: e.start_ns()))
    counts = {len(g) for g in groups}
    if len(counts) != 1:
        raise RuntimeError(f"replays recorded different kernel counts {sorted(counts)}: cannot align them")
    print(f"kernel              start   duration      end   ends after the previous end  (µs, median of {replays} replays)")
    prev_end = None
    for i in range(counts.pop()):
        t0 = [g[0].start_ns() for g in groups]
        start = statistics.median((g[i].start_ns() - s) / 1e3 for g, s in zip(groups, t0))
        dur = statistics.median(g[i].duration_ns() / 1e3 for g in groups)
        end = statistics.median((g[i].start_ns() + g[i].duration_ns() - s) / 1e3 for g, s in zip(groups, t0))
        after = "" if prev_end is None else f"{end - prev_end:8.1f}"
        print(f"{groups[0][i].name()[:40]:40} {start:7.1f} {dur:8.1f} {end:8.1f} {after}")
        prev_end = end


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
    parser.add_argument("--graph", action="store_true", help="the kernel timeline of CUDA-graph replays instead")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.graph and device.type != "cuda":
        parser.error("--graph needs a CUDA GPU")
    cell = Cell(args.shape, args.algorithm, args.context, args.batch, device, seed=0)
    cell.use(args.backend, None)
    if args.graph:
        cell.step()
        graph_timeline(cell, args.steps)
        return 0
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
