"""Swap-in benchmark of the hierarchical KV store (CUDA): missed rows per second vs PCIe.

For MHA rows (8 KV heads x 128 dims, bf16: K + V = 4 KiB per token) and MLA rows (576
dims, bf16: 1152 B) it selects 2048 tokens per request and layer, of which a fixed fraction
is missing from the device buffer (a sliding window over a random permutation of the
context, so every call misses exactly that many tokens), and times `ensure_resident` —
the whole decode-path step: map look-ups, LRU victim choice, map updates and the zero-copy
gather from pinned host memory — eagerly and replayed from a CUDA graph, plus the copy
kernel alone. Medians over `--iters` calls after warm-up, with the ceiling beside them.

    python benchmarks/swap_in.py --json results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys

import torch

from sparse_framework import Batch, KVLayout, Request, Selection
from sparse_framework.kv_store.copy import copy_rows
from sparse_framework.kv_store.hierarchical import HierarchicalKVStore

PCIE_GBPS = 55.0  # measured pinned host -> device, contiguous (DESIGN.md)
LAYOUTS = {
    "mha": lambda: KVLayout(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda"),
    "mla": lambda: KVLayout.mla(1, dtype=torch.bfloat16, device="cuda"),
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


def time_calls(fn, calls: int) -> list[float]:
    times = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)  # µs
    return times


def bench(kind: str, batch: int, fraction: float, args: argparse.Namespace) -> dict:
    layout = LAYOUTS[kind]()
    sel_n, context = args.selected, args.context
    store = HierarchicalKVStore(
        layout, page_size=64, device_buffer_tokens=sel_n + 64, sink_tokens=0, recent_tokens=0,
        unit=1, max_requests=batch, max_seq_len=context + 1,
        device_capacity_tokens=batch * (sel_n + 64), host_capacity_tokens=batch * context,
    )
    reqs = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(batch):
        r = Request(f"r{i}", context, seq_len=context, slot=i)
        store.admit(r)
        k = torch.randn(context, layout.num_kv_heads, layout.head_dim, device="cuda", generator=g).to(layout.dtype)
        store.write_prefill(0, r, k, None if layout.is_mla else k.roll(1, 0))
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
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            store.ensure_resident(0, b, Selection(static, lengths))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store.ensure_resident(0, b, Selection(static, lengths))

    def replay(i: int) -> None:
        static.copy_(sels[calls + 2 + i])
        graph.replay()

    graph_us = time_calls(replay, calls)[args.warmup :]
    # without misses: `--graph-layers` calls captured in one graph, as the layers of one decode
    # step are (the selection, made inside the step's graph, needs no copy), per call
    per_layer_us = None
    if miss == 0 and args.graph_layers > 0:
        many = torch.cuda.CUDAGraph()
        with torch.cuda.graph(many):
            for _ in range(args.graph_layers):
                store.ensure_resident(0, b, Selection(static, lengths))
        per_layer_us = [t / args.graph_layers for t in time_calls(lambda i: many.replay(), calls)[args.warmup :]]
    # the copy kernel alone: `miss` random host rows per request into device slots
    n = batch * miss
    host_rows = torch.randint(0, store.host_slots, (max(n, 1),), device="cuda")[:n]
    dev_rows = torch.randperm(store.device_slots, device="cuda")[:n]
    src = store.host_pool.offsets(0, host_rows)
    dst = store._dev_off(0, dev_rows)

    def kernel(i: int) -> None:
        for dev_buf, host_buf in zip(store.dev, store.host):
            copy_rows(host_buf, dev_buf, src, dst, store.row_elems)

    kernel_us = time_calls(kernel, calls)[args.warmup :] if n else [0.0]
    moved = misses_per_call * row_bytes
    med = statistics.median
    res = {
        "layout": kind, "row_bytes": row_bytes, "batch": batch, "selected": sel_n, "miss_fraction": fraction,
        "misses_per_call": misses_per_call, "expected_misses_per_call": batch * miss,
        "eager_us": med(eager_us), "graph_us": med(graph_us), "kernel_us": med(kernel_us),
        "graph_per_layer_us": med(per_layer_us) if per_layer_us else None, "graph_layers": args.graph_layers,
        "moved_bytes": moved,
        "eager_gbps": moved / med(eager_us) / 1e3 if miss else 0.0,
        "graph_gbps": moved / med(graph_us) / 1e3 if miss else 0.0,
        "kernel_gbps": moved / med(kernel_us) / 1e3 if miss else 0.0,
        "pcie_ceiling_gbps": PCIE_GBPS,
    }
    return res


def sweep_kernel(rows: int = 16384) -> list[dict]:
    """Time the copy kernel's launch parameters on random pinned-host rows (MHA K rows of
    1024 bf16 and MLA latents of 576 bf16)."""
    import sparse_framework.kv_store.copy as copy_mod

    out = []
    saved = copy_mod.TUNING
    for row in (1024, 576):
        host = torch.randn(200_000 * row // 64, 64).to(torch.bfloat16).flatten().pin_memory()
        n_host = host.numel() // row
        dev = torch.empty(rows * row, dtype=torch.bfloat16, device="cuda")
        src = torch.randperm(n_host, device="cuda")[:rows] * row
        dst = torch.arange(rows, device="cuda") * row
        for rpp in (1, 2, 4, 8, 16):
            for cols in (128, 256, 512, 1024):
                for warps in (2, 4, 8):
                    copy_mod.TUNING = (rpp, cols, warps)
                    us = statistics.median(time_calls(lambda i: copy_rows(host, dev, src, dst, row), 25)[5:])
                    out.append({"row_elems": row, "rows_per_program": rpp, "cols": cols, "warps": warps,
                                "us": us, "gbps": rows * row * 2 / us / 1e3})
        best = max((r for r in out if r["row_elems"] == row), key=lambda r: r["gbps"])
        print(f"row {row * 2} B: best {best}", flush=True)
    copy_mod.TUNING = saved
    return out


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
                        help="at 0%% misses, also time this many calls captured in one CUDA graph (per call)")
    parser.add_argument("--json", help="write results to this JSON file")
    parser.add_argument("--sweep-kernel", action="store_true", help="only tune the copy kernel's launch parameters")
    parser.add_argument("--copy-shapes", default=None,
                        help="compare launch shapes of the copy kernel: 'programs:cols:warps,...'")
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
        import sparse_framework.kv_store.hierarchical as hier

        for shape in args.copy_shapes.split(","):
            hier.COPY_PROGRAMS, hier.COPY_COLS, hier.COPY_WARPS = (int(x) for x in shape.split(":"))
            for kind in args.layouts.split(","):
                for batch in [int(x) for x in args.batches.split(",")]:
                    for fraction in [float(x) for x in args.misses.split(",")]:
                        r = bench(kind, batch, fraction, args)
                        gc.collect()
                        torch.cuda.empty_cache()
                        print(f"copy {shape} {kind} B={batch} miss={fraction}: graph {r['graph_us']:.1f}us "
                              f"{r['graph_gbps']:.1f}GB/s eager {r['eager_us']:.1f}us", flush=True)
        return 0
    for kind in args.layouts.split(","):
        for batch in [int(x) for x in args.batches.split(",")]:
            for fraction in [float(x) for x in args.misses.split(",")]:
                r = bench(kind, batch, fraction, args)
                gc.collect()  # free the last store's pinned host pool before the next one
                torch.cuda.empty_cache()
                results.append(r)
                print(
                    f"{kind} {r['row_bytes']:>5}B B={batch:<3} miss={fraction:<4} misses/call={r['misses_per_call']:.0f}"
                    f" (want {r['expected_misses_per_call']}) eager {r['eager_us']:8.1f}us {r['eager_gbps']:5.1f}GB/s"
                    f" | graph {r['graph_us']:8.1f}us {r['graph_gbps']:5.1f}GB/s | kernel {r['kernel_us']:8.1f}us"
                    f" {r['kernel_gbps']:5.1f}GB/s | ceiling {PCIE_GBPS} GB/s"
                    + (f" | {r['graph_layers']} calls in one graph: {r['graph_per_layer_us']:.1f}us per call"
                       if r["graph_per_layer_us"] is not None else ""),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
