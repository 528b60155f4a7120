"""Host time of one eager decode layer (attention_begin + attend of a decode_layer.py cell):
what the Python side costs when a layer is not replayed from a CUDA graph.

Each step starts on an idle GPU (synchronised first), so the time measured is the host's
alone: the coordinator, the algorithm, the store and the adaptor's Python, the torch ops, and
the kernel launches. Every cell is run with kernels/launch.py's direct re-launch ("auto") and
without it ("off", every kernel through Triton's `kernel[grid](...)`), alternating step by
step in the same process, so that the comparison does not depend on the host's load, which
drifts (and varies between machines of one kind by tens of percent). Medians and minima over
--steps steps of each.

    python benchmarks/eager_overhead.py                        # the default cells, writes the JSON
    python benchmarks/eager_overhead.py --cells mha:dsa:131072:8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from rich.console import Console
from rich.table import Table

from decode_layer import ALGORITHMS, SHAPES, Cell
from sparse_framework.kernels import launch

DEFAULT_CELLS = "mha:dsa:131072:8,mha:quest:131072:8,mha:dsa:32768:8,mla:dsa:32768:8"
DEFAULT_JSON = "benchmarks/results/eager_overhead_h100.json"


def host_us(cell: Cell, steps: int) -> dict[str, list[float]]:
    """Host µs of `steps` eager layer calls per launch mode, the modes alternating, each call
    started on an idle GPU."""
    times: dict[str, list[float]] = {"auto": [], "off": []}
    try:
        for i in range(2 * steps):
            mode = ("auto", "off")[i % 2]
            launch.FAST = mode
            torch.cuda.synchronize()
            start = time.perf_counter()
            cell.step()
            times[mode].append((time.perf_counter() - start) * 1e6)
    finally:
        launch.FAST = "auto"
    torch.cuda.synchronize()
    return times


def parse_cell(text: str) -> tuple[str, str, int, int]:
    try:
        shape, algo, ctx, batch = text.split(":")
        cell = (shape, algo, int(ctx), int(batch))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is shape:algorithm:context:batch, e.g. mha:dsa:131072:8; got {text!r}")
    if shape not in SHAPES or algo not in ALGORITHMS:
        raise argparse.ArgumentTypeError(f"cell {text!r}: shape one of {sorted(SHAPES)}, algorithm one of {sorted(ALGORITHMS)}")
    return cell


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="comma-separated shape:algorithm:context:batch cells")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per cell and launch mode")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default=DEFAULT_JSON, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the eager host time of the CPU path says nothing about the GPU path's")
    cells = [parse_cell(c) for c in args.cells.split(",")]
    console = Console(width=None if sys.stdout.isatty() else 160)
    results = []
    for shape, algo, ctx, batch in cells:
        cell = Cell(shape, algo, ctx, batch, torch.device("cuda"), seed=ctx + batch)
        cell.use(args.backend, None)
        row = {"shape": shape, "algorithm": algo, "context": ctx, "batch": batch, "backend": args.backend}
        host_us(cell, args.warmup)
        for mode, times in host_us(cell, args.steps).items():
            row[f"host_us_{mode}"] = statistics.median(times)
            row[f"host_us_{mode}_min"] = min(times)
        results.append(row)
        console.print(f"{shape} {algo} L={ctx} B={batch}: host {row['host_us_auto']:.0f} µs with the direct "
                      f"re-launch, {row['host_us_off']:.0f} µs through Triton's launch", highlight=False)
        del cell
        torch.cuda.empty_cache()
    table = Table(title="eager decode layer: host µs per call (median; min in brackets)")
    for col in ("shape", "algo", "L", "B", "direct re-launch", "Triton's launch"):
        table.add_column(col)
    for r in results:
        table.add_row(r["shape"], r["algorithm"], str(r["context"]), str(r["batch"]),
                      f"{r['host_us_auto']:.0f} ({r['host_us_auto_min']:.0f})", f"{r['host_us_off']:.0f} ({r['host_us_off_min']:.0f})")
    console.print(table)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "steps": args.steps, "warmup": args.warmup,
            "command": "python benchmarks/eager_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
