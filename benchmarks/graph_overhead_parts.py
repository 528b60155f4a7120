"""Where a decode-graphs layer's overhead goes: 32 calls in a row (one synchronisation at the
end, µs per call, medians of 30 loops) of, cumulatively, the bare replay of the captured
layer, + refilling its inputs (`Staging.fill`: one `torch.cat` per dtype, what the
coordinator does), the same with `torch._foreach_copy_` instead (what it did first), + the
output's copy, and the whole coordinator call (attention_begin + attend + attention_end).

    python benchmarks/graph_overhead_parts.py
    python benchmarks/graph_overhead_parts.py --cells mha:dsa:131072:8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from decode_layer import Cell
from eager_overhead import Layer, parse_cell, row_us
from sparse_framework.common.tables import new_table
from sparse_framework.coordinator.graphs import _flat
from timing import write_results

DEFAULT_JSON = "benchmarks/results/graph_overhead_parts_h100.json"


def results_table(rows: list[dict], names: list[str], layers: int) -> Table:
    """µs per layer of each part, a column per part (its name broken at spaces to fit 100 columns)."""
    table = new_table(f"decode graphs: µs per layer, {layers} calls in a row")
    for col in ("shape", "algo", "L", "B", *(n.replace(" (", "\n(").replace(" + ", "\n+ ") for n in names)):
        table.add_column(col, justify="left" if col in ("shape", "algo") else "right")
    for r in rows:
        table.add_row(r["shape"], r["algorithm"], str(r["context"]), str(r["batch"]), *(f"{r[n]:.1f}" for n in names))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="mha:dsa:131072:8,mha:dsa:32768:8", help="shape:algorithm:context:batch, comma-separated")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--loops", type=int, default=30)
    parser.add_argument("--json", default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (CUDA graphs)")
    console = Console(width=None if sys.stdout.isatty() else 100)
    rows = []
    for shape, algo, ctx, batch in (parse_cell(c) for c in args.cells.split(",")):
        cell = Cell(shape, algo, ctx, batch, torch.device("cuda"), seed=ctx + batch, graphs=True)
        cell.use("triton", None)
        layer = Layer(cell)
        layer.set("graphs")
        for _ in range(3):  # first call eager, second captured
            layer()
        entry = layer.captured()
        src = _flat(cell.q, cell.k, cell.v, cell.step_inputs)
        graph, staging, out = entry.graph, entry.inputs, entry.output
        parts: dict[str, Callable[[], object]] = {
            "replay": graph.replay,
            "+ inputs (cat)": lambda: (staging.fill(src), graph.replay()),
            "+ inputs (foreach_copy_)": lambda: (torch._foreach_copy_(staging.views, src), graph.replay()),
            "+ inputs (cat) + output copy": lambda: (staging.fill(src), graph.replay(), out.clone()),
            "coordinator call": layer,
        }
        row = {"shape": shape, "algorithm": algo, "context": ctx, "batch": batch,
               **{name: statistics.median(row_us(fn, args.layers) for _ in range(args.loops)) for name, fn in parts.items()}}
        rows.append(row)
        del cell, layer, entry, graph, staging, out
        torch.cuda.empty_cache()
    console.print(results_table(rows, list(parts), args.layers))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers, "loops": args.loops}
    write_results(args.json, meta, rows, "graph_overhead_parts.py", argv)
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
