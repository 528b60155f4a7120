"""Swap-in benchmark of the hierarchical KV store (CUDA): missed rows per second vs PCIe.

For MHA rows (8 KV heads x 128 dims, bf16: K + V = 4 KiB per token) and MLA rows (576
dims, bf16: 1152 B) it selects 2048 tokens per request and layer, of which a fixed fraction
is missing from the device buffer (a sliding window over a random permutation of the
context, so every call misses that many tokens), and times `ensure_resident` — the whole
decode-path step: map look-ups, LRU victim choice, map updates and the zero-copy gather
from pinned host memory — eagerly and replayed from a CUDA graph, plus the copy kernel
alone. Medians over `--iters` calls after warm-up, with the ceiling beside them.

Two graph figures:
  graph_us            one call (layer 0) per graph, the new selection copied into the
                      graph's input before each replay: it carries the graph launch and
                      that copy (~20-40 µs) in full, which a decode step pays once.
  graph_per_layer_us  one call for each of L layers (each with its own selections)
                      captured in one graph, as the layers of one decode step are, one copy
                      of all L selections before each replay; the replay time / L, so the
                      launch and the copy are amortised over the layers as in a step.
                      L = `--graph-layers`, fewer where the host pool of L layers would
                      exceed `--host-gib`.

    python benchmarks/swap_in.py --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from collections.abc import Callable

import torch

from sparse_framework import Batch, KVLayout, Request, Selection
from sparse_framework.kv_store.copy import RowCopyShape, copy_rows
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore
from sparse_framework.kv_store.residency import CopyShapes
from timing import capture, warm_up_aside, write_results

PCIE_GBPS = 55.0  # measured pinned host -> device, contiguous (DESIGN.md)
LAYOUTS: dict[str, Callable[[int], KVLayout]] = {  # by number of layers
    "mha": lambda n: KVLayout(num_layers=n, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"),
    "mla": lambda n: KVLayout.mla(n, dtype=torch.bfloat16, device="cuda"),
}


def windows(context: int, selected: int, miss: int, calls: int, batch: int, seed: int) -> list[torch.Tensor]:
    """Per call an int32 [batch, 1, selected] sorted selection; consecutive calls share
    `selected - miss` tokens (so each call misses exactly `miss` per request)."""
    g = torch.Generator().manual_seed(seed)
    pool = context - 1  # the newest token is pinned; select among the others
    perms = [torch.randperm(pool, generator=g) for _ in range(batch)]
    out = []
    for i in range(calls):
        pos = (torch.arange(selected) + i * miss) % pool
        out.append(torch.stack([p[pos].sort().values for p in perms]).unsqueeze(1).to(torch.int32))
    return out


def time_calls(fn: Callable[[int], object], calls: int, before: Callable[[], object] | None = None) -> list[float]:
    """µs of each of `calls` calls fn(i), from CUDA events; `before` runs untimed ahead of each."""
    times = []
    for i in range(calls):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)  # µs
    return times


def layers_within(args: argparse.Namespace, kind: str, batch: int) -> int:
    """Layers of the multi-layer graph: `--graph-layers`, fewer where the pinned host pool
    (every token of every request in every layer) would exceed `--host-gib`; at least 1."""
    per_layer = batch * args.context * LAYOUTS[kind](1).bytes_per_token_per_layer
    return max(1, min(args.graph_layers, int(args.host_gib * 2**30 // per_layer)))


def time_layers_graph(
    store: HierarchicalKVStore, b: Batch, lengths: torch.Tensor, layers: int, miss: int, args: argparse.Namespace,
) -> tuple[list[float], list[float]]:
    """One decode step's swap-ins: `ensure_resident` of layers 0..layers-1 captured in one CUDA
    graph, each replay after one copy of every layer's next selection into the graph's input.
    Returns the replay times (µs, after `--warmup`) and, per layer, the misses per call that
    the store counted over all timed replays.

    Each layer slides over its own windows (seed 2 + layer). Before each step the recency
    clock advances, untimed (`begin_step`, as in decode), so the LRU victims are the units
    held longest: the few units a selection leaves in a buffer are those its last window
    dropped, never ones the next window asks for, and every call misses exactly `miss` per
    request. The warm-up slides far enough that units left from earlier calls (layer 0's
    single-call windows, which never advanced the clock) are evicted before timing."""
    sel_n, calls = args.selected, args.warmup + args.iters
    spare = store.buffer_tokens - sel_n  # buffer units a selection leaves over
    rounds = 2 + (-(-spare // miss) if miss else 0)
    per_layer = [torch.stack(windows(args.context, sel_n, miss, rounds + calls, len(b), seed=2 + layer))
                 for layer in range(layers)]
    steps = torch.stack(per_layer, dim=1).cuda()  # [rounds + calls, L, B, 1, W], stacked before timing
    static = steps[0].clone()

    def step() -> None:
        for layer in range(layers):
            store.ensure_resident(layer, b, Selection(static[layer], lengths))

    def warm_up() -> None:
        for r in range(rounds):
            static.copy_(steps[r])
            store.begin_step(b)
            step()

    store.timing = False  # no timing events inside a graph
    warm_up_aside(warm_up)
    graph = capture(step)  # records only: the buffers still hold steps[rounds - 1]

    def replay(i: int) -> None:
        static.copy_(steps[rounds + i])
        graph.replay()

    torch.cuda.synchronize()
    m0 = store.misses[:layers].clone()
    times = time_calls(replay, calls, before=lambda: store.begin_step(b))
    torch.cuda.synchronize()
    misses = ((store.misses[:layers] - m0) / calls).tolist()
    return times[args.warmup :], misses


def bench(kind: str, batch: int, fraction: float, args: argparse.Namespace, shapes: CopyShapes | None = None) -> dict:
    """One configuration's figures (the store's copy launch shapes: `shapes`, None for the
    defaults); its store (pinned host pool above all) and graphs are freed before the next one
    is built."""
    res = measure(kind, batch, fraction, args, shapes)
    gc.collect()  # the store, its graphs and closures went with measure's frame
    torch.cuda.empty_cache()
    return res


def measure(kind: str, batch: int, fraction: float, args: argparse.Namespace, shapes: CopyShapes | None = None) -> dict:
    layers = layers_within(args, kind, batch)
    layout = LAYOUTS[kind](layers)
    sel_n, context = args.selected, args.context
    store = HierarchicalKVStore(
        layout, page_size=64, device_buffer_tokens=sel_n + 64, sink_tokens=0, recent_tokens=0,
        unit=1, max_requests=batch, max_seq_len=context + 1,
        device_capacity_tokens=batch * (sel_n + 64), host_capacity_tokens=batch * context, copy_shapes=shapes,
    )
    reqs = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(batch):
        r = Request(f"r{i}", context, seq_len=context, slot=i)
        store.admit(r)
        k = torch.randn(context, layout.num_kv_heads, layout.head_dim, device="cuda", generator=g).to(layout.dtype)
        for layer in range(layers):  # the same rows in every layer: only where they live matters
            store.write_prefill(layer, r, k, None if layout.is_mla else k.roll(1, 0))
        reqs.append(r)
    b = Batch(reqs)
    b.prepare("cuda")
    miss = round(fraction * sel_n)
    calls = args.warmup + args.iters
    sels = [s.cuda() for s in windows(context, sel_n, miss, 3 * calls + 1, batch, seed=1)]
    lengths = torch.full((batch, 1), sel_n, dtype=torch.int32, device="cuda")
    row_bytes = layout.bytes_per_token_per_layer

    # eager
    def eager(i: int) -> None:
        store.ensure_resident(0, b, Selection(sels[i], lengths))

    eager(0)
    torch.cuda.synchronize()
    m0 = int(store.misses[0])
    eager_us = time_calls(lambda i: eager(i + 1), calls)[args.warmup :]
    torch.cuda.synchronize()
    misses_per_call = (int(store.misses[0]) - m0) / calls
    # CUDA graph of the same step
    store.timing = False
    static = sels[calls + 1].clone()

    def call() -> None:
        store.ensure_resident(0, b, Selection(static, lengths))

    warm_up_aside(lambda: [call() for _ in range(2)])
    graph = capture(call)

    def replay(i: int) -> None:
        static.copy_(sels[calls + 2 + i])
        graph.replay()

    graph_us = time_calls(replay, calls)[args.warmup :]
    # every layer's call in one graph, as in a decode step: launch and selection copy amortised
    step_us, layer_misses = time_layers_graph(store, b, lengths, layers, miss, args)
    if any(m != batch * miss for m in layer_misses):
        print(f"warning: {kind} B={batch} miss={fraction}: {layers}-layer graph missed {layer_misses} "
              f"per layer call, want {batch * miss}", file=sys.stderr, flush=True)
    # the copy kernel alone: `miss` random host rows per request into device slots
    n = batch * miss
    host_rows = torch.randint(0, store.host_slots, (max(n, 1),), device="cuda")[:n]
    dev_rows = torch.randperm(store.layer_slots(0), device="cuda")[:n]
    src = store.host_pool.offsets(0, host_rows)
    dst = store.device_rows.offsets(0, dev_rows)

    def kernel(i: int) -> None:
        for dev_buf, host_buf in zip(store.pool_of(0).tensors, store.host):
            copy_rows(host_buf, dev_buf, src, dst, store.row_elems)

    kernel_us = time_calls(kernel, calls)[args.warmup :] if n else [0.0]
    moved = misses_per_call * row_bytes
    med = statistics.median
    per_layer_us = med(step_us) / layers
    graph_misses = statistics.fmean(layer_misses)
    per_layer_gbps = graph_misses * row_bytes / per_layer_us / 1e3 if miss else 0.0
    return {
        "layout": kind, "row_bytes": row_bytes, "batch": batch, "selected": sel_n, "miss_fraction": fraction,
        "misses_per_call": misses_per_call, "expected_misses_per_call": batch * miss,
        "eager_us": med(eager_us), "graph_us": med(graph_us), "kernel_us": med(kernel_us),
        "graph_layers": layers, "graph_per_layer_us": per_layer_us,
        "graph_misses_per_layer_call": graph_misses, "graph_per_layer_gbps": per_layer_gbps,
        "graph_per_layer_pct_of_ceiling": 100 * per_layer_gbps / PCIE_GBPS,
        "moved_bytes": moved,
        "eager_gbps": moved / med(eager_us) / 1e3 if miss else 0.0,
        "graph_gbps": moved / med(graph_us) / 1e3 if miss else 0.0,
        "kernel_gbps": moved / med(kernel_us) / 1e3 if miss else 0.0,
        "pcie_ceiling_gbps": PCIE_GBPS,
    }


def sweep_kernel(rows: int = 16384) -> list[dict]:
    """Time the copy kernel's launch parameters on random pinned-host rows (MHA K rows of
    1024 bf16 and MLA latents of 576 bf16)."""
    out = []
    for row in (1024, 576):
        host = torch.randn(200_000 * row // 64, 64).to(torch.bfloat16).flatten().pin_memory()
        n_host = host.numel() // row
        dev = torch.empty(rows * row, dtype=torch.bfloat16, device="cuda")
        src = torch.randperm(n_host, device="cuda")[:rows] * row
        dst = torch.arange(rows, device="cuda") * row
        for rpp in (1, 2, 4, 8, 16):
            for cols in (128, 256, 512, 1024):
                for warps in (2, 4, 8):
                    shape = RowCopyShape(rpp, cols, warps)
                    us = statistics.median(
                        time_calls(lambda i: copy_rows(host, dev, src, dst, row, shape=shape), 25)[5:])
                    out.append({"row_elems": row, "rows_per_program": rpp, "cols": cols, "warps": warps,
                                "us": us, "gbps": rows * row * 2 / us / 1e3})
        best = max((r for r in out if r["row_elems"] == row), key=lambda r: r["gbps"])
        print(f"row {row * 2} B: best {best}", flush=True)
    return out


def copy_shape(text: str) -> tuple[int, int, int, int]:
    """A `--copy-shapes` entry 'programs:cols:warps[:rows]' -> (programs, cols, warps, rows)."""
    fields = [int(x) for x in text.split(":")]
    if len(fields) not in (3, 4):
        raise SystemExit(f"--copy-shapes: want programs:cols:warps[:rows], got {text!r}")
    programs, cols, warps, rows = fields if len(fields) == 4 else (*fields, 1)
    if rows < 1 or rows & (rows - 1):
        raise SystemExit(f"--copy-shapes: rows must be a power of two, got {text!r}")
    return programs, cols, warps, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="mha,mla")
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--misses", default="0,0.2,0.5,1.0")
    parser.add_argument("--selected", type=int, default=2048)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--graph-layers", type=int, default=8,
                        help="most layers whose calls are captured in one CUDA graph, as in a decode step "
                             "(reported per layer); fewer where their host pool would exceed --host-gib")
    parser.add_argument("--host-gib", type=float, default=8.0,
                        help="upper bound of the pinned host pool (GiB), which bounds the graph's layers")
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--sweep-kernel", action="store_true", help="only tune the copy kernel's launch parameters")
    parser.add_argument("--copy-shapes", default=None,
                        help="compare launch shapes of the decode path's copy kernel: "
                             "'programs:cols:warps[:rows],...', rows = missed rows per loop iteration "
                             "of a program (BLOCK_R, a power of two; default 1)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("swap_in.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.sweep_kernel:
        sweep = sweep_kernel()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(sweep, f, indent=2)
        return 0
    results = []
    if args.copy_shapes:
        # the decode path's (wide rows') copy, given to each store; its other shapes keep their defaults
        fields = ("copy_programs", "copy_cols", "copy_warps", "copy_rows")
        shapes = {shape: CopyShapes(**dict(zip(fields, copy_shape(shape))))
                  for shape in args.copy_shapes.split(",")}  # all checked first
        for shape, launch_shape in shapes.items():
            for kind in args.layouts.split(","):
                for batch in [int(x) for x in args.batches.split(",")]:
                    for fraction in [float(x) for x in args.misses.split(",")]:
                        r = bench(kind, batch, fraction, args, launch_shape)
                        print(f"copy {shape} {kind} B={batch} miss={fraction}: graph {r['graph_us']:.1f}us "
                              f"{r['graph_gbps']:.1f}GB/s eager {r['eager_us']:.1f}us | {r['graph_layers']}-layer "
                              f"graph {r['graph_per_layer_us']:.1f}us/layer {r['graph_per_layer_gbps']:.1f}GB/s",
                              flush=True)
        return 0
    for kind in args.layouts.split(","):
        for batch in [int(x) for x in args.batches.split(",")]:
            for fraction in [float(x) for x in args.misses.split(",")]:
                r = bench(kind, batch, fraction, args)
                results.append(r)
                print(
                    f"{kind} {r['row_bytes']:>5}B B={batch:<3} miss={fraction:<4} misses/call={r['misses_per_call']:.0f}"
                    f" (want {r['expected_misses_per_call']}) eager {r['eager_us']:8.1f}us {r['eager_gbps']:5.1f}GB/s"
                    f" | graph: 1 call {r['graph_us']:8.1f}us {r['graph_gbps']:5.1f}GB/s,"
                    f" {r['graph_layers']} layers {r['graph_per_layer_us']:8.1f}us/layer {r['graph_per_layer_gbps']:5.1f}GB/s"
                    f" ({r['graph_per_layer_pct_of_ceiling']:.0f}%, misses/layer call {r['graph_misses_per_layer_call']:.0f})"
                    f" | kernel {r['kernel_us']:8.1f}us {r['kernel_gbps']:5.1f}GB/s | ceiling {PCIE_GBPS} GB/s",
                    flush=True,
                )
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ceiling_gbps": PCIE_GBPS}
        write_results(args.json, meta, results, "swap_in.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
