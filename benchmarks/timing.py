"""Timing shared by the benchmarks (DESIGN.md / the device METHOD: warm-up, medians of CUDA
events, the L2 cache flushed before each timed call, CUDA-graph replays for launch-free GPU
time).

How the L2 is flushed matters for kernels that read about as many bytes as the L2 holds
(50 MB on an H100). Writing a 256 MB buffer (`zero_`, as triton.testing.do_bench does) leaves
the whole L2 full of *dirty* lines, which the timed kernel then pays for: each line it brings
in first writes 128 bytes of the flush buffer back to HBM. A decode step does not run after
50 MB of fresh writes (the layer before it writes a few activations), so the default flush
*reads* the buffer: it evicts the kernel's inputs just the same and leaves clean lines.
FLUSH_MODES: "read" (default), "write" (the old way, kept to compare), "none"."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


FLUSH_MODES = ("read", "write", "none")


def warm_up_aside(work: Callable[[], object]) -> None:
    """Run `work` on a side stream, ordered after and before the current one: the warm-up
    before a CUDA-graph capture (lazy initialisation, compilation and the allocator's first
    blocks happen outside the capture, as torch.cuda.graphs asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        work()
    torch.cuda.current_stream().wait_stream(side)


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`fn` captured in a CUDA graph (warm it up first: `warm_up_aside`)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class Timer:
    """Median wall time of a callable in µs: CUDA events (L2 flushed before each call, see the
    module docstring) or perf_counter. flush: True (= "read"), False (= "none") or a FLUSH_MODES name."""

    def __init__(self, device: torch.device, warmup: int, iters: int, flush: bool | str) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.cuda = device.type == "cuda"
        mode = ("read" if flush else "none") if isinstance(flush, bool) else flush
        if mode not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
        self.flush = mode if self.cuda else "none"
        self.scratch = torch.zeros(64 << 20, dtype=torch.float32, device=device) if self.flush != "none" else None

    def _flush(self) -> None:
        if self.scratch is None:
            return
        if self.flush == "write":
            self.scratch.zero_()
        else:
            self.scratch.amax()  # reads 256 MB, writes one float

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            for _ in range(self.iters):
                self._flush()
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
        with torch.cuda.device(self.device):
            warm_up_aside(lambda: [fn() for _ in range(3)])
            try:
                graph = capture(fn)
            except RuntimeError as e:  # e.g. an op that syncs with the host
                print(f"  (CUDA graph capture failed: {str(e).splitlines()[0]})", file=sys.stderr)
                return None
        try:
            return self(graph.replay)
        finally:
            del graph


def current_commit() -> str | None:
    """The checkout's commit: $SF_COMMIT where the tree travelled without .git (the GPU machine),
    else `git rev-parse HEAD`; None when neither says (`bench-serve`'s own lookup)."""
    from sparse_framework.bench.online import source_commit

    return source_commit()


def gpu_name() -> str | None:
    """The first GPU's name from nvidia-smi (no CUDA context opened), None where it says none."""
    import subprocess

    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def provenance(script: str, argv: list[str] | None) -> dict[str, Any]:
    """The command line (`argv`, None: this process's; quoted where an argument needs it, so
    that it runs again as written) and the commit a results JSON records (benchmarks/FIGURES.md)."""
    args = argv if argv is not None else sys.argv[1:]
    return {"command": shlex.join(["python", f"benchmarks/{script}", *args]), "commit": current_commit()}


def write_results(path: str, meta: dict[str, Any], results: list, script: str, argv: list[str] | None) -> None:
    """Write a benchmark's {"meta", "results"} JSON to `path` (its folder made if missing),
    with its `provenance` in meta."""
    meta = {**meta, **provenance(script, argv)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta, "results": results}, indent=1, default=str) + "\n")
