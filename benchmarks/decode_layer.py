"""Decode-layer benchmark: one layer's select + adapt + attend through the coordinator, next to
dense attention and the byte floor, in the same run.

Shapes (issue 6): bf16, 32 query / 8 KV heads, head dim 128 ("mha"), or DeepSeek-V3.2-like
MLA, 128 query heads over one 576-dim latent, V its first 512 ("mla"); top-2048 (Quest in pages
of 16, DSA's lightning indexer token by token, FP8 keys), 16 sink + 64 recent tokens; every
request's KV resident on the GPU (store "resident"), one layer.

Per cell:
  select      the algorithm's select (scoring + top-k)
  attend      the backend's kernel over the adaptor's metadata
  step        attention_begin + attend: write the new token, select, slots, adapt, attend;
              as an engine runs it eagerly (µs of wall time) and replayed from a CUDA graph
  dense       torch SDPA over contiguous K/V (where it fits in memory), our Triton paged
              kernel and flash-attn over every token (where installed): the best is the baseline
  floor       bytes that must be read ÷ the GPU's HBM ceiling (common/hardware.py): the representation the scoring
              reads + the selected K/V rows (sparse), or every K/V row (dense)
Times are medians of CUDA-event timings (L2 flushed before each, by reading a 256 MB buffer:
see timing.py) after warm-up.

    python benchmarks/decode_layer.py                       # the full table, writes the JSON
    python benchmarks/decode_layer.py --contexts 32768 --batches 8 --algorithms quest
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from rich.console import Console
from rich.table import Table

from sparse_framework import Batch, KVLayout, Request, registry
from sparse_framework.common import hardware
from sparse_framework.common.tables import new_table
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.kernels import pdl
from timing import FLUSH_MODES, Timer, write_results

HBM_GBPS = hardware.hbm_bytes_per_s() / 1e9  # the GPU's measured copy ceiling (common/hardware.py)
DEFAULT_JSON = "benchmarks/results/decode_layer_h100.json"
DENSE_COPY_LIMIT = 24 << 30  # bytes: a contiguous K/V copy for SDPA only below this
SHAPES = {
    "mha": {"q_heads": 32, "layout": dict(num_layers=1, num_kv_heads=8, head_dim=128)},
    "mla": {"q_heads": 128, "layout": dict(num_layers=1, num_kv_heads=1, head_dim=576, kind="mla", v_head_dim=512)},
}
ALGORITHMS = {
    "quest": {"algorithm": "quest", "extra": {"dense_first_layers": 0}},
    "dsa": {"algorithm": "dsa", "extra": {"key_dtype": "fp8_e4m3"}},
}
# sparse_policy "always": a cell times the sparse layer at every context and batch. Under the cost
# default the coordinator admits a request dense where sparse could never pay (a resident store at
# max_seq_len = context), so cells below the break-even timed the dense path: the H200 run of
# stop 50 (decode_layer_short_h200.json) did, in 21-24 of its 36 cells (docs/defaults.md)
COMMON = {"top_k": 2048, "page_size": 16, "sink_tokens": 16, "recent_tokens": 64, "min_sparse_prompt_len": 0,
          "store": "resident", "sparse_policy": "always"}
# backend -> adaptor used with it; MLA adds the FlashMLA-indices path of the Triton kernel
BACKENDS = {"mha": [("triton", None), ("flash_attn", None), ("torch_ref", None)],
            "mla": [("triton", None), ("triton", "flashmla"), ("flashmla", None), ("torch_ref", None)]}


def available(backend: str, adaptor: str | None, layout: KVLayout) -> str | None:
    """Why this backend cannot run this layout here, or None."""
    try:
        cls = registry.load("backend", backend)
        cls.check_layout(layout)
        if adaptor is not None:
            registry.load("adaptor", adaptor)
    except Exception as exc:  # a missing library, an unsupported layout
        return str(exc).splitlines()[0]
    return None


class Cell:
    """One (shape, algorithm, context, batch): a coordinator with every request prefilled and
    one decode step prepared, whose layer call can be timed with any backend."""

    def __init__(self, shape: str, algo: str, ctx: int, batch: int, device: torch.device, seed: int,
                 graphs: bool = False) -> None:
        spec = SHAPES[shape]
        self.layout = KVLayout(**spec["layout"], dtype=torch.bfloat16, device=device)
        self.q_heads, self.ctx, self.batch = spec["q_heads"], ctx, batch
        self.config = {**COMMON, **ALGORITHMS[algo], "backend": "torch_ref"}
        self.coord = SparseCoordinator(self.config, self.layout, max_requests=batch, max_seq_len=ctx + 8,
                                       decode_graphs=graphs)
        self.coord.store.timing = False  # no timing events inside a CUDA graph
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        lay = self.layout
        reqs = [Request(f"r{i}", ctx - 1) for i in range(batch)]
        for r in reqs:  # prefill one request at a time: the prompt's K/V is generated, stored, freed
            self.coord.on_request_begin(r)
            pre = Batch([r], is_prefill=True)
            self.coord.forward_begin(pre)
            n = ctx - 1
            k = self.randn(n, lay.num_kv_heads, lay.head_dim)
            v = None if lay.is_mla else self.randn(n, lay.num_kv_heads, lay.head_dim)
            q = self.randn(1, self.q_heads, lay.head_dim).expand(n, -1, -1)  # not read at prefill
            self.coord.attention_begin(0, q, k, v, pre, self.inputs(n, prefill=True))
            self.coord.attention_end(0, None, pre)
            self.coord.forward_end(pre)
            del k, v
        self.requests = reqs
        self.step_batch = Batch(reqs)
        self.coord.forward_begin(self.step_batch)
        if self.step_batch.num_sparse != batch or self.coord.dense_layers:
            raise RuntimeError(f"decode_layer cell {algo} {ctx}x{batch}: {batch - self.step_batch.num_sparse} of "
                               f"{batch} requests (dense layers {sorted(self.coord.dense_layers)}) would decode "
                               "densely; the cell times the sparse layer")
        self.q = self.randn(batch, self.q_heads, lay.head_dim)
        self.k = self.randn(batch, lay.num_kv_heads, lay.head_dim)
        self.v = None if lay.is_mla else self.randn(batch, lay.num_kv_heads, lay.head_dim)
        self.step_inputs = self.inputs(batch, prefill=False)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, generator=self.gen, dtype=torch.bfloat16)

    def inputs(self, tokens: int, prefill: bool) -> dict[str, torch.Tensor]:
        algo = self.coord.algorithm
        specs = algo.prefill_inputs if prefill else algo.decode_inputs
        return {name: self.randn(tokens, *shape) for name, shape in specs.items()}

    def use(self, backend: str, adaptor: str | None) -> None:
        """Swap the coordinator's backend and adaptor (same stored KV and representations)."""
        cls = registry.load("backend", backend)
        self.coord.backend = cls()
        self.coord.adaptor = registry.load("adaptor", adaptor or cls.metadata_formats[0])()

    def step(self) -> torch.Tensor:
        self.coord.steps.rewind(0)  # the same layer call, timed again and again on one step
        meta = self.coord.attention_begin(0, self.q, self.k, self.v, self.step_batch, self.step_inputs)
        return self.coord.attend(0, self.q, meta)

    def select(self):  # type: ignore[no-untyped-def]
        b = self.step_batch
        return self.coord.algorithm.select(0, self.q, b, inputs=self.step_inputs)

    def floors_us(self) -> tuple[float, float]:
        """(sparse, dense) byte floors in µs."""
        cfg = self.coord.config
        algo = type(self.coord.algorithm)
        per_token = self.layout.bytes_per_token_per_layer
        rep = algo.representation_bytes_per_token(self.layout, cfg) * self.ctx
        width = min(algo.max_selected_tokens(cfg), self.ctx)
        sparse = self.batch * (rep + width * per_token)
        dense = self.batch * self.ctx * per_token
        return sparse / HBM_GBPS / 1e3, dense / HBM_GBPS / 1e3

    def dense_baselines(self, timer: Timer) -> dict[str, float]:
        """Dense decode over every token: our Triton kernel and flash-attn over the resident
        pages (the metadata the coordinator's dense path builds), and SDPA over a contiguous
        copy where it fits in memory."""
        from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor
        from sparse_framework.coordinator.core import _dense_selection

        out: dict[str, float] = {}
        lay, store, batch = self.layout, self.coord.store, self.step_batch
        everything = _dense_selection(batch, self.coord._heads, store.page_size)
        slots = store.resident_slots(0, batch, everything)
        meta = FlashAttentionAdaptor().plan(slots, everything.lengths, page_size=store.page_size, num_slots=store.num_slots)
        k_cache, v_cache = store.paged_view(0, store.page_size)
        for name in ("triton", "flash_attn"):
            if available(name, None, lay) is None:
                backend = registry.load("backend", name)()

                def paged() -> torch.Tensor:
                    return backend.run(self.q, k_cache, v_cache, meta)

                out[f"{name} paged"] = timer.graph(paged) or timer(paged)
        if self.batch * self.ctx * lay.bytes_per_token_per_layer <= DENSE_COPY_LIMIT:
            rows = [store.read(0, r) for r in self.requests]  # [L, Hk, D] per tensor, synchronising
            k = torch.stack([r[0] for r in rows]).transpose(1, 2).contiguous()  # [B, Hk, L, D]
            v = k[..., : lay.v_head_dim] if lay.is_mla else torch.stack([r[1] for r in rows]).transpose(1, 2).contiguous()
            del rows
            sdpa = torch.nn.functional.scaled_dot_product_attention
            # MLA is MQA over one latent head: its Hq query heads go in as Hq query positions of
            # one head (no causal mask), so SDPA never repeats the latent per head
            q = self.q.unsqueeze(1) if lay.is_mla else self.q.unsqueeze(2)  # [B, 1, Hq, D] / [B, Hq, 1, D]
            gqa = not lay.is_mla

            def dense() -> torch.Tensor:
                return sdpa(q, k, v, enable_gqa=gqa)

            out["torch SDPA"] = timer.graph(dense) or timer(dense)
            del k, v
        return out


def run_cell(shape: str, algo: str, ctx: int, batch: int, args: argparse.Namespace, timer: Timer, console: Console) -> list[dict]:
    cell = Cell(shape, algo, ctx, batch, torch.device(args.device), seed=ctx + batch)
    sparse_floor, dense_floor = cell.floors_us()
    dense = cell.dense_baselines(timer)
    best_name, best = min(dense.items(), key=lambda kv: kv[1]) if dense else ("none", float("nan"))
    select_us = timer.graph(cell.select) or timer(cell.select)
    rows = []
    reference = cell.step().float()  # the coordinator starts on torch_ref: the source of truth
    for backend, adaptor in BACKENDS[shape]:
        if backend not in args.backends.split(","):
            continue
        why = available(backend, adaptor, cell.layout)
        label = backend + (f"+{adaptor}" if adaptor else "")
        row = {"shape": shape, "algorithm": algo, "context": ctx, "batch": batch, "backend": label,
               "q_heads": cell.q_heads, "sparse_floor_us": sparse_floor, "dense_floor_us": dense_floor,
               "dense_us": dense, "dense_best": best_name, "dense_best_us": best, "select_us": select_us}
        if why:
            row["skipped"] = why
            console.print(f"  {label}: skipped ({why})", highlight=False, markup=False)
            rows.append(row)
            continue
        cell.use(backend, adaptor)
        out = cell.step()
        err = float((out.float() - reference).norm() / reference.norm())
        cell.coord.steps.rewind(0)
        meta = cell.coord.attention_begin(0, cell.q, cell.k, cell.v, cell.step_batch, cell.step_inputs)
        attend = timer.graph(lambda: cell.coord.attend(0, cell.q, meta)) or timer(lambda: cell.coord.attend(0, cell.q, meta))
        eager = timer(cell.step)
        graph = timer.graph(cell.step)
        best_step = graph if graph is not None else eager
        row.update(attend_us=attend, step_eager_us=eager, step_graph_us=graph, rel_err_vs_torch_ref=err,
                   speedup_vs_dense=best / best_step, x_floor=best_step / sparse_floor,
                   eager_overhead_us=None if graph is None else eager - graph)
        rows.append(row)
        console.print(f"  {label:18} select {select_us:8.1f}  attend {attend or float('nan'):8.1f}  step eager {eager:8.1f}"
                      f"  graph {graph or float('nan'):8.1f} µs | dense {best_name} {best:8.1f} µs -> {row['speedup_vs_dense']:.1f}x"
                      f" | floor {sparse_floor:.1f} µs -> {row['x_floor']:.2f}x | rel.err {err:.1e}", highlight=False)
    return rows


DENSE_SHORT = {"torch SDPA": "sdpa", "flash_attn paged": "fa", "triton paged": "triton"}


def results_table(results: list[dict]) -> Table:
    """The cells' figures in a 100-column terminal: a section per (shape, algorithm, context,
    batch) whose own figures (dense best, floor) appear once, then a row per backend."""
    table = new_table("one decode layer, bf16, top-2048: µs (CUDA-graph replay; eager in brackets)", (
        "select: scoring + top-k; attend: the backend; step: the whole layer; dense: the fastest dense "
        "attention (sdpa: torch SDPA, fa: flash_attn paged, triton: triton paged); speedup: dense / step; "
        "floor: the sparse layer's bytes at the HBM ceiling; x floor: step / floor"), tight=True)
    for col in ("cell", "L", "B", "dense", "floor", "backend", "select", "attend", "step", "speedup", "x floor"):
        table.add_column(col, justify="left" if col in ("cell", "backend", "dense") else "right")
    last = None
    for r in results:
        if "step_eager_us" not in r:
            continue
        key = (r["shape"], r["algorithm"], r["context"], r["batch"])
        first = key != last
        if first and last is not None:
            table.add_section()
        last = key
        step = r["step_graph_us"] if r["step_graph_us"] is not None else float("nan")
        dense = f"{r['dense_best_us']:.0f} {DENSE_SHORT.get(r['dense_best'], r['dense_best'])}"
        own = [f"{r['shape']} {r['algorithm']}", str(r["context"]), str(r["batch"]), dense, f"{r['sparse_floor_us']:.0f}"]
        table.add_row(*(own if first else [""] * len(own)), r["backend"], f"{r['select_us']:.0f}",
                      f"{r['attend_us'] or float('nan'):.0f}", f"{step:.0f} ({r['step_eager_us']:.0f})",
                      f"{r['speedup_vs_dense']:.1f}x", f"{r['x_floor']:.2f}")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda for real figures; cpu runs a smoke test (torch_ref, small contexts)")
    parser.add_argument("--contexts", default="32768,131072", help="comma-separated context lengths")
    parser.add_argument("--batches", default="1,8,64", help="comma-separated decode batch sizes")
    parser.add_argument("--algorithms", default="quest,dsa", help="comma-separated subset of " + ", ".join(ALGORITHMS))
    parser.add_argument("--shapes", default="mha,mla", help="comma-separated subset of mha, mla (MLA runs DSA only)")
    parser.add_argument("--backends", default="triton,flash_attn,flashmla,torch_ref", help="comma-separated backends to time")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--flush", default="read", choices=FLUSH_MODES,
                        help="how the L2 is flushed before each timed call (timing.py): read a 256 MB buffer (clean "
                             "lines left), write it (dirty lines left, each costs the timed kernel a write-back), or not")
    parser.add_argument("--pdl", default="auto", choices=pdl.MODES,
                        help="programmatic dependent launch of the decode path's kernels (kernels/pdl.py): auto = on "
                             "sm_90+ GPUs; off to compare")
    parser.add_argument("--json", default=None, help=f"write the results here (default on CUDA: {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    pdl.PDL = args.pdl
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here (use --device cpu for a smoke run)")
    json_path = args.json or (DEFAULT_JSON if cuda else None)
    bad = [a for a in args.algorithms.split(",") if a not in ALGORITHMS] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        parser.error(f"unknown algorithm or shape: {', '.join(bad)}")
    timer = Timer(torch.device(args.device), args.warmup, args.iters, flush=args.flush)
    console = Console(width=None if sys.stdout.isatty() else 100)
    results: list[dict] = []
    for shape in args.shapes.split(","):
        for algo in args.algorithms.split(","):
            if shape == "mla" and algo != "dsa":
                continue
            for ctx in (int(x) for x in args.contexts.split(",")):
                for batch in (int(x) for x in args.batches.split(",")):
                    console.print(f"{shape} {algo} L={ctx} B={batch}", highlight=False)
                    try:
                        results.extend(run_cell(shape, algo, ctx, batch, args, timer, console))
                    except torch.OutOfMemoryError as exc:
                        console.print(f"  out of memory: {str(exc).splitlines()[0]}")
                        results.append({"shape": shape, "algorithm": algo, "context": ctx, "batch": batch, "skipped": "out of memory"})
                    gc.collect()  # free the cell's pools before the next one
                    if cuda:
                        torch.cuda.empty_cache()
    console.print(results_table(results))
    if not json_path:
        return 0
    import triton

    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "triton": triton.__version__,
            "hbm_ceiling_gbps": HBM_GBPS, "pdl": args.pdl, "iters": args.iters, "warmup": args.warmup, "l2_flush": timer.flush}
    write_results(json_path, meta, results, "decode_layer.py", argv)  # with the command and the commit
    console.print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
