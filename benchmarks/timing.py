"""Timing shared by the benchmarks (DESIGN.md / the device METHOD: warm-up, medians of CUDA
events, the L2 cache flushed before each timed call, CUDA-graph replays for launch-free GPU
time)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch


class Timer:
    """Median wall time of a callable in µs: CUDA events (L2 flushed before each call) or perf_counter."""

    def __init__(self, device: torch.device, warmup: int, iters: int, flush: bool) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.cuda = device.type == "cuda"
        self.scratch = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda and flush else None

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for _ in range(self.iters):
                if self.scratch is not None:
                    self.scratch.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000.0)
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    def graph(self, fn: Callable[[], object]) -> float | None:
        """Median time of replaying `fn` captured in a CUDA graph (no host launch overhead,
        as an engine that captures its decode step sees it); None where capture fails."""
        if not self.cuda:
            return None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except RuntimeError as e:  # e.g. an op that syncs with the host
            print(f"  (CUDA graph capture failed: {str(e).splitlines()[0]})", file=sys.stderr)
            return None
        try:
            return self(graph.replay)
        finally:
            del graph
