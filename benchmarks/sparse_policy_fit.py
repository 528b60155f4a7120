"""Fit the cost policy's constants (sparse_framework/coordinator/policy.py) from the committed H100
measurements, print the fit and write benchmarks/results/sparse_policy_fit.json.

The policy charges a sparse layer-step its bytes at HBM bandwidth plus a fixed overhead
o(b) = o1 + g·(b − 1) µs for a batch of b requests that select (scoring and top-k launches,
residency, adaptor, the glue around them). What that overhead is, per source:

  decode_layer_h100.json   one layer's whole sparse decode (write, select, slots, adapt, attend)
                           replayed from a CUDA graph, L2 flushed, beside its byte floor and the
                           best dense kernel beside its own floor: overhead = (graph − sparse
                           floor) − max(0, dense − dense floor), Quest, 8 KV heads x 128 (the
                           Llama-3-8B layer), Triton backend, 32K and 128K, batch 1 / 8 / 64.
                           THE FIT: the 32K cells (the context nearest the break-evens; at 128K
                           the top-k over 8K pages per request adds a cost that grows with the
                           context, which the two-constant model does not have), least squares.
  engine_sweep_*_h100.json whole engine steps (Llama-3-8B shape, whole-step graphs): per pair of
                           dense and Quest-resident cells of the same context and rows,
                           ((quest step − floor) − (dense step − floor)) / sparse layers (30:
                           Quest's first 2 are dense). A difference of two ~10-30 ms steps spread
                           over 30 layers: noisy (±10 µs); shown as a check, and fitted apart.
                           The current sweeps (fused, async) only; the first sweep predates the
                           fused kernels.
  selection_h100.json      the scoring + top-k alone (graph) beside the representation's bytes,
  tune_sparse_decode_h100  the attention kernel alone beside its selected rows' bytes: the two
                           largest parts of the layer's overhead, shown as a breakdown.

  decode_layer_short_h100  the same layer measurement at 1K-32K x batch 1-32 (benchmarks/
                           policy_gpu_runs.sh): THE CHECK of the break-evens. Per batch, the
                           contexts where the layer's sparse decode (graph) was slower and faster
                           than the best dense kernel bracket the measured break-even; the
                           model's must fall inside (printed, and in the JSON's "check").

    python benchmarks/sparse_policy_fit.py               # print, write the JSON
    python benchmarks/sparse_policy_fit.py --no-write
    python benchmarks/sparse_policy_fit.py --gpu h200    # sparse_policy_fit_h200.json

--gpu h200 (issue 43): the H200's constants from decode_layer_short_h200.json alone (benchmarks/
defaults_gpu_runs.sh), fitted on its cells up to 16K (the contexts where the batch-1..32 break-evens
fall), least squares as above, and checked against the same file's brackets (in-sample: no other
H200 layer measurement exists). common/hardware.py's H200 figures are this fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = RESULTS / "sparse_policy_fit.json"
sys.path.insert(0, str(ROOT))
from sparse_framework.common.hardware import H100, H200  # noqa: E402

HBM_TB_S = H100.hbm_tb_s  # the H100's measured copy ceiling (DESIGN.md), every floor's bandwidth
H200_SHORT, H200_FIT_MAX_CONTEXT = "decode_layer_short_h200.json", 16384
ENGINE_SWEEPS = ("engine_sweep_fused_h100.json", "engine_sweep_async_h100.json")
LLAMA3_8B_LAYERS = 32  # benchmarks/engine_sweep.py --random llama-3-8b
FIT_CONTEXT = 32768


def least_squares(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(o1, g) minimising Σ (o1 + g·(b − 1) − o)² over (b, o) points."""
    n = len(points)
    xs = [b - 1 for b, _ in points]
    ys = [o for _, o in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    g = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - g * mx, g


def layer_points(source: str = "decode_layer_h100.json") -> list[dict[str, Any]]:
    """Per-layer overhead of the whole sparse decode of one layer (decode_layer_h100.json)."""
    data = json.loads((RESULTS / source).read_text())
    rows = []
    for r in data["results"]:
        if (r["shape"], r["algorithm"], r["backend"]) != ("mha", "quest", "triton") or not r.get("step_graph_us"):
            continue
        sparse_excess = r["step_graph_us"] - r["sparse_floor_us"]
        dense_excess = max(0.0, r["dense_best_us"] - r["dense_floor_us"])
        rows.append({"source": source, "context": r["context"], "batch": r["batch"],
                     "sparse_excess_us": sparse_excess, "dense_excess_us": dense_excess,
                     "overhead_us": sparse_excess - dense_excess})
    return rows


def engine_points() -> list[dict[str, Any]]:
    """Per sparse layer-step overhead implied by dense vs Quest-resident engine steps."""
    rows = []
    for name in ENGINE_SWEEPS:
        cells = {}
        for r in json.loads((RESULTS / name).read_text()):
            if not r.get("error") and r.get("decode_step_ms") is not None:
                cells[(r["length"], r["decode_step_rows"], r["config_name"])] = r
        for (length, batch, config), quest in sorted(cells.items()):
            dense = cells.get((length, batch, "dense"))
            if config != "quest-resident" or dense is None:
                continue
            first_dense = quest["config"].get("extra", {}).get("dense_first_layers", 2)
            sparse_layers = LLAMA3_8B_LAYERS - first_dense
            q_excess = quest["decode_step_ms"] - quest["decode_step_floor_ms"]
            d_excess = dense["decode_step_ms"] - dense["decode_step_floor_ms"]
            rows.append({"source": name, "context": length, "batch": batch,
                         "quest_step_ms": quest["decode_step_ms"], "quest_floor_ms": quest["decode_step_floor_ms"],
                         "dense_step_ms": dense["decode_step_ms"], "dense_floor_ms": dense["decode_step_floor_ms"],
                         "sparse_layers": sparse_layers,
                         "overhead_us": 1000 * (q_excess - d_excess) / sparse_layers})
    return rows


def breakdown() -> list[dict[str, Any]]:
    """Scoring + top-k (selection_h100.json) and attention (tune_sparse_decode_h100.json) of
    Quest beside their byte floors: where a layer's overhead goes."""
    rows = []
    sel = json.loads((RESULTS / "selection_h100.json").read_text())
    for r in sel["results"]:
        if r["algorithm"] == "quest" and r["impl"] == "triton":
            floor = r["bytes"] / (HBM_TB_S * 1e6)
            rows.append({"part": "score + top-k (graph)", "source": "selection_h100.json", "context": r["context"],
                         "batch": r["batch"], "us": r["score_topk_graph_us"], "floor_us": floor,
                         "excess_us": r["score_topk_graph_us"] - floor})
    tune = json.loads((RESULTS / "tune_sparse_decode_h100.json").read_text())
    cell = tune["cells"].get("mha:quest")
    if cell:
        rows.append({"part": "attention over the selection (graph)", "source": "tune_sparse_decode_h100.json",
                     "context": 131072, "batch": 8, "us": cell["default_us"], "floor_us": cell["floor_us"],
                     "excess_us": cell["default_us"] - cell["floor_us"]})
    return rows


SHORT = "decode_layer_short_h100.json"
CHECK_BATCHES = (1, 2, 4, 8, 16, 32)


def measured_brackets(source: str = SHORT) -> dict[int, dict[str, Any]]:
    """Per batch, from decode_layer_short_h100.json: the longest context at which one layer's
    sparse decode (graph replay) was slower than the best dense kernel, and the shortest at
    which it was faster — the measured break-even lies between."""
    data = json.loads((RESULTS / source).read_text())
    by_batch: dict[int, dict[str, Any]] = {}
    for r in sorted(data["results"], key=lambda r: r["context"]):
        if (r["shape"], r["algorithm"], r["backend"]) != ("mha", "quest", "triton") or not r.get("step_graph_us"):
            continue
        cell = by_batch.setdefault(r["batch"], {"dense_faster_at": None, "sparse_faster_at": None, "cells": []})
        cell["cells"].append({"context": r["context"], "sparse_us": r["step_graph_us"], "dense_us": r["dense_best_us"]})
        if r["step_graph_us"] >= r["dense_best_us"]:
            cell["dense_faster_at"] = r["context"]
        elif cell["sparse_faster_at"] is None:
            cell["sparse_faster_at"] = r["context"]
    return by_batch


def break_evens(o1: float, g: float, hbm_tb_s: float = HBM_TB_S) -> dict[str, Any]:
    """Break-even contexts the constants imply for Llama-3-8B (8 KV heads x 128, bf16), Quest
    top_k 2048, page 16, sink 16, recent 64, at batch 1 / 8 / 32."""
    import torch

    from sparse_framework import KVLayout
    from sparse_framework.config import load_config
    from sparse_framework.coordinator.policy import CostModel

    config = load_config({"algorithm": "quest", "top_k": 2048, "page_size": 16, "sink_tokens": 16,
                          "recent_tokens": 64, "sparse_policy": "cost", "policy_hbm_tb_s": hbm_tb_s,
                          "policy_overhead_us": o1, "policy_overhead_growth_us": g})
    model = CostModel.for_config(config, KVLayout(1, 8, 128, torch.bfloat16))
    return {"shape": "Llama-3-8B layer: 8 KV heads x 128, bf16; Quest top_k 2048, page 16, sink 16, recent 64",
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "representation_bytes_per_token": model.representation_bytes_per_token,
            "selected_tokens": model.selected_tokens,
            "by_batch": {str(b): model.break_even(b) for b in CHECK_BATCHES}}


def check_rows(even: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The model's break-even per batch against the measured bracket of `source` (printed)."""
    check = []
    print(f"check against {source} (one layer, graph replays): the measured break-even lies between")
    print(f"{'batch':>5} {'dense faster at':>15} {'sparse faster at':>16} {'model':>7}  inside")
    for batch, cell in sorted(measured_brackets(source).items()):
        model = even["by_batch"].get(str(batch))
        lo, hi = cell["dense_faster_at"], cell["sparse_faster_at"]
        inside = model is not None and (lo is None or model >= lo) and (hi is None or model <= hi)
        check.append({"batch": batch, "dense_faster_up_to": lo, "sparse_faster_from": hi, "model": model,
                      "inside": inside, "cells": cell["cells"]})
        print(f"{batch:>5} {lo or '-':>15} {hi or '-':>16} {model if model is not None else '-':>7}  "
              f"{'yes' if inside else 'NO'}")
    return check


def source_meta(name: str) -> dict[str, Any]:
    """The measurement file's meta (its command and commit): what the fit stands on."""
    return json.loads((RESULTS / name).read_text()).get("meta", {})


def h200(args: argparse.Namespace) -> int:
    """--gpu h200: the fit and check from decode_layer_short_h200.json (module docstring)."""
    layer = [p for p in layer_points(H200_SHORT) if p["context"] <= H200_FIT_MAX_CONTEXT]
    points = [(p["batch"], p["overhead_us"]) for p in layer]
    o1, g = least_squares(points)
    print(f"H200: o1 = {o1:.1f} µs, g = {g:.2f} µs per extra request (fitted on {len(points)} cells of "
          f"{H200_SHORT} up to {H200_FIT_MAX_CONTEXT} tokens)")
    even = break_evens(round(o1, 1), round(g, 2), H200.hbm_tb_s)
    print("break-even contexts (" + even["shape"] + "): "
          + ", ".join(f"batch {b}: {c}" for b, c in even["by_batch"].items()))
    result = {"command": "python benchmarks/sparse_policy_fit.py --gpu h200", "gpu": "H200",
              "model": "overhead per sparse layer-step of a batch of b selecting requests: o1 + g * (b - 1) µs",
              "hbm_tb_s": H200.hbm_tb_s, "overhead_us": round(o1, 1), "overhead_growth_us": round(g, 2),
              "fit": {"source": H200_SHORT, "source_commit": source_meta(H200_SHORT).get("commit"),
                      "max_context": H200_FIT_MAX_CONTEXT, "points": points, "o1": o1, "g": g},
              "layer_points": layer, "break_even": even,
              "check": {"source": H200_SHORT, "in_sample": True, "by_batch": check_rows(even, H200_SHORT)}}
    if not args.no_write:
        out = RESULTS / "sparse_policy_fit_h200.json" if args.out == OUT else args.out
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--gpu", choices=("h100", "h200"), default="h100",
                        help="whose measurements to fit (default h100: the committed H100 set)")
    args = parser.parse_args(argv)
    if args.gpu == "h200":
        return h200(args)
    layer, engine, parts = layer_points(), engine_points(), breakdown()
    fit_points = [(p["batch"], p["overhead_us"]) for p in layer if p["context"] == FIT_CONTEXT]
    o1, g = least_squares(fit_points)
    e1, eg = least_squares([(p["batch"], p["overhead_us"]) for p in engine])
    print(f"per-layer sparse overhead beyond dense's, µs (o1 + g·(b-1) fitted on the {FIT_CONTEXT} cells)")
    print(f"{'source':32} {'context':>8} {'batch':>5} {'measured':>9} {'model':>7}")
    for p in layer + engine:
        model = o1 + g * (p["batch"] - 1)
        print(f"{p['source']:32} {p['context']:>8} {p['batch']:>5} {p['overhead_us']:9.1f} {model:7.1f}")
    print(f"fit (decode_layer, {FIT_CONTEXT}): o1 = {o1:.1f} µs, g = {g:.2f} µs per extra request")
    print(f"engine-step estimates alone:   o1 = {e1:.1f} µs, g = {eg:.2f} µs per extra request (noisy)")
    print("where it goes (Quest, graph replays):")
    for p in parts:
        print(f"  {p['part']:38} {p['context']:>7} x {p['batch']:<3} {p['us']:7.1f} µs, floor {p['floor_us']:6.1f}, "
              f"excess {p['excess_us']:6.1f}")
    even = break_evens(round(o1, 1), round(g, 2))
    print("break-even contexts (" + even["shape"] + "): "
          + ", ".join(f"batch {b}: {c}" for b, c in even["by_batch"].items()))
    check = check_rows(even, SHORT)
    result = {
        "command": "python benchmarks/sparse_policy_fit.py",
        "model": "overhead per sparse layer-step of a batch of b selecting requests: o1 + g * (b - 1) µs",
        "hbm_tb_s": HBM_TB_S,
        "overhead_us": round(o1, 1),
        "overhead_growth_us": round(g, 2),
        "fit": {"source": "decode_layer_h100.json", "context": FIT_CONTEXT, "points": fit_points,
                "o1": o1, "g": g},
        "engine_fit": {"sources": list(ENGINE_SWEEPS), "o1": e1, "g": eg},
        "layer_points": layer,
        "engine_points": engine,
        "breakdown": parts,
        "break_even": even,
        "check": {"source": SHORT, "by_batch": check},
    }
    if not args.no_write:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
