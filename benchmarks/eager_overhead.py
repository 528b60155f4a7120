"""Host time and overhead of eager decode layers (attention_begin + attend + attention_end of
a decode_layer.py cell): what the Python side costs when the engine does not capture its step
in a CUDA graph, and what the coordinator's own decode graphs (`decode_graphs=True`) leave.

Host time: each call starts on an idle GPU (synchronised first), so the time measured is the
host's alone: the coordinator, the algorithm, the store and the adaptor's Python, the torch
ops and the kernel launches. Three modes, alternating call by call in one process, so that the
comparison does not depend on the host's load, which drifts (and varies between machines of
one kind by tens of percent): "direct" (kernels/launch.py re-launches compiled kernels
directly), "triton" (every kernel through Triton's `kernel[grid](...)`) and "graphs" (the
coordinator replays the layer from its CUDA graph: inputs copied in, one graph launch).

Overhead: an engine runs its layers back to back without waiting, so the host's time hides
behind the GPU's wherever it is shorter. `--layers` calls in a row (one layer called L times:
the same work each time), then one synchronisation: wall µs per call, eager ("direct") and with
decode graphs, next to L bare replays of the captured graph (the GPU's time alone). Overhead
per layer = wall per call - bare replay per call. Medians over --loops loops.

    python benchmarks/eager_overhead.py                        # the default cells, writes the JSON
    python benchmarks/eager_overhead.py --cells mha:dsa:131072:8 --layers 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import triton
from rich.console import Console
from rich.table import Table

from decode_layer import ALGORITHMS, SHAPES, Cell
from sparse_framework.common.tables import new_table
from sparse_framework.kernels import launch
from timing import write_results

DEFAULT_CELLS = "mha:dsa:131072:8,mha:quest:131072:8,mha:dsa:32768:8,mla:dsa:32768:8"
DEFAULT_JSON = "benchmarks/results/eager_overhead_h100.json"


MODES = ("direct", "triton", "graphs")


class Layer:
    """One layer call of a cell in a chosen mode: eager (direct re-launch or Triton's launch)
    or replayed from the coordinator's decode graph."""

    def __init__(self, cell: Cell) -> None:
        self.cell, self.graphs = cell, cell.coord.graphs
        assert self.graphs is not None, "the cell's coordinator must have decode_graphs=True"

    def set(self, mode: str) -> None:
        launch.FAST = "off" if mode == "triton" else "auto"
        self.cell.coord.graphs = self.graphs if mode == "graphs" else None

    def __call__(self) -> torch.Tensor:
        c = self.cell
        c.coord.steps.rewind(0)  # the same layer call, timed again and again on one step
        meta = c.coord.attention_begin(0, c.q, c.k, c.v, c.step_batch, c.step_inputs)
        out = c.coord.attend(0, c.q, meta)
        c.coord.attention_end(0, out, c.step_batch)
        return out

    def captured(self):  # type: ignore[no-untyped-def]
        """The coordinator's one captured graph of this call (it has run twice in graph mode)."""
        (entry,) = self.graphs.captured_entries()
        return entry


def host_us(layer: Layer, steps: int) -> dict[str, list[float]]:
    """Host µs of `steps` layer calls per mode, the modes alternating, each call started on an
    idle GPU."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for i in range(len(MODES) * steps):
            mode = MODES[i % len(MODES)]
            layer.set(mode)
            torch.cuda.synchronize()
            start = time.perf_counter()
            layer()
            times[mode].append((time.perf_counter() - start) * 1e6)
    finally:
        layer.set("direct")
    torch.cuda.synchronize()
    return times


def row_us(fn: Callable[[], object], layers: int) -> float:
    """Wall µs per call of `layers` calls of `fn` in a row, started on an idle GPU and ended
    by one synchronisation."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(layers):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / layers


def loop_us(layer: Layer, layers: int, loops: int) -> dict[str, float]:
    """Median wall µs per call of `layers` calls in a row (one sync at the end): eager (direct
    re-launch), with decode graphs, and bare replays of the captured graph."""
    runs: dict[str, Callable[[], object]] = {"direct": layer, "graphs": layer, "replay": layer.captured().graph.replay}
    times: dict[str, list[float]] = {m: [] for m in runs}
    try:
        for i in range(len(runs) * loops):
            mode = list(runs)[i % len(runs)]
            layer.set("graphs" if mode == "graphs" else "direct")
            times[mode].append(row_us(runs[mode], layers))
    finally:
        layer.set("direct")
    return {m: statistics.median(t) for m, t in times.items()}


def parse_cell(text: str) -> tuple[str, str, int, int]:
    try:
        shape, algo, ctx, batch = text.split(":")
        cell = (shape, algo, int(ctx), int(batch))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is shape:algorithm:context:batch, e.g. mha:dsa:131072:8; got {text!r}")
    if shape not in SHAPES or algo not in ALGORITHMS:
        raise argparse.ArgumentTypeError(f"cell {text!r}: shape one of {sorted(SHAPES)}, algorithm one of {sorted(ALGORITHMS)}")
    return cell


def results_table(results: list[dict], layers: int) -> Table:
    """Host time per call, and per call of `layers` calls in a row, in a 100-column terminal."""
    table = new_table("decode layer: host µs per call, median (min)", (
        f"in a row: µs per call over {layers} calls in a row, and the overhead over the bare graph replay "
        "in brackets. host: the host's time per call: direct (eager), through Triton's launcher, and "
        "with decode graphs"))
    for col in ("shape", "algo", "L", "B", "host:\ndirect", "host:\nTriton", "host:\ngraphs",
                "in a row:\nreplay", "in a row:\neager", "in a row:\ngraphs"):
        table.add_column(col, justify="left" if col in ("shape", "algo") else "right")
    for r in results:
        table.add_row(r["shape"], r["algorithm"], str(r["context"]), str(r["batch"]),
                      *(f"{r[f'host_us_{m}']:.0f} ({r[f'host_us_{m}_min']:.0f})" for m in MODES),
                      f"{r['loop_us_replay']:.0f}", f"{r['loop_us_direct']:.0f} ({r['overhead_us_direct']:+.0f})",
                      f"{r['loop_us_graphs']:.0f} ({r['overhead_us_graphs']:+.0f})")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--cells", default=DEFAULT_CELLS, help="comma-separated shape:algorithm:context:batch cells")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--steps", type=int, default=300, help="timed host-time calls per cell and mode")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--layers", type=int, default=32, help="layer calls in a row for the overhead (a model's depth)")
    parser.add_argument("--loops", type=int, default=30, help="timed loops of --layers calls per mode")
    parser.add_argument("--json", default=DEFAULT_JSON, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: the eager host time of the CPU path says nothing about the GPU path's")
    if min(args.steps, args.layers, args.loops) < 1 or args.warmup < 2:
        parser.error("--steps, --layers and --loops must be >= 1 and --warmup >= 2 (a graph is captured on its second call)")
    cells = [parse_cell(c) for c in args.cells.split(",")]
    console = Console(width=None if sys.stdout.isatty() else 100)
    results = []
    for shape, algo, ctx, batch in cells:
        cell = Cell(shape, algo, ctx, batch, torch.device("cuda"), seed=ctx + batch, graphs=True)
        cell.use(args.backend, None)
        layer = Layer(cell)
        row: dict[str, object] = {"shape": shape, "algorithm": algo, "context": ctx, "batch": batch, "backend": args.backend}
        host_us(layer, args.warmup)
        for mode, times in host_us(layer, args.steps).items():
            row[f"host_us_{mode}"] = statistics.median(times)
            row[f"host_us_{mode}_min"] = min(times)
        loop = loop_us(layer, args.layers, args.loops)
        row.update({f"loop_us_{m}": t for m, t in loop.items()})
        row["overhead_us_direct"] = loop["direct"] - loop["replay"]
        row["overhead_us_graphs"] = loop["graphs"] - loop["replay"]
        results.append(row)
        console.print(f"{shape} {algo} L={ctx} B={batch}: host {row['host_us_direct']:.0f} µs direct, "
                      f"{row['host_us_triton']:.0f} through Triton, {row['host_us_graphs']:.0f} with decode graphs; "
                      f"{args.layers} layers in a row: {loop['direct']:.0f} / {loop['graphs']:.0f} µs per layer "
                      f"(eager / graphs), bare replay {loop['replay']:.0f}", highlight=False)
        del cell, layer
        torch.cuda.empty_cache()
    console.print(results_table(results, args.layers))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "steps": args.steps, "warmup": args.warmup, "layers": args.layers, "loops": args.loops}
    write_results(args.json, meta, results, "eager_overhead.py", argv)
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
