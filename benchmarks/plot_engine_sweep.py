"""Plots and a markdown page of an engine sweep (benchmarks/engine_sweep.py's JSON).

    python benchmarks/plot_engine_sweep.py results.json --out-dir docs/engine_sweep --markdown docs/engine_sweep.md

PNGs (one panel per prompt length, one line per config, x = the concurrency asked):
throughput.png (output tokens/s of the whole run), decode_throughput.png (decode tokens/s
of the full decode step: its rows / its median time), tpot.png (TPOT p50, ms), memory.png (peak GPU memory, solid,
and the host pool, dashed, GiB). The page tables every row, failed cells with their error,
and embeds the plots (paths relative to the page). Only figures in the JSON are shown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sparse_framework.bench.offline import fmt_or_dash, gib_or_dash  # noqa: E402


def decode_tokens_per_s(r: dict[str, Any]) -> float | None:
    """Output tokens/s of the decode step with the most requests decoding (its rows / its
    median time): the decode throughput, without the prefill that dominates a whole run of
    long prompts and few output tokens."""
    if not r.get("decode_step_ms"):
        return None
    return 1e3 * r["decode_step_rows"] / r["decode_step_ms"]


PLOTS = {
    "throughput.png": ("output tokens/s (whole run)", lambda r: r["output_tokens_per_s"]),
    "decode_throughput.png": ("decode tokens/s (full decode step)", decode_tokens_per_s),
    "tpot.png": ("TPOT p50 (ms)", lambda r: r["tpot_p50_ms"]),
    "memory.png": ("GiB: peak GPU (solid), host pool (dashed)", None),
}


def _series(rows: list[dict[str, Any]]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """length -> config name -> measured rows by concurrency."""
    out: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if "error" not in r:
            out[r["length"]][r["config_name"]].append(r)
    for by_config in out.values():
        for series in by_config.values():
            series.sort(key=lambda r: r["concurrency"])
    return out


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """The three PNGs (module docstring); their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = _series(rows)
    lengths = sorted(data) or [0]
    # one colour per config in every panel and plot
    names = sorted({name for by_config in data.values() for name in by_config})
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}
    paths = []
    for name, (ylabel, value) in PLOTS.items():
        fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.4), squeeze=False)
        for ax, length in zip(axes[0], lengths):
            for config, series in sorted(data.get(length, {}).items()):
                x = [r["concurrency"] for r in series]
                if value is not None:
                    ax.plot(x, [value(r) for r in series], marker="o", label=config, color=colour[config])
                    continue
                gpu = [None if r["peak_gpu_bytes"] is None else r["peak_gpu_bytes"] / 2**30 for r in series]
                (line,) = ax.plot(x, [g if g is not None else float("nan") for g in gpu], marker="o", label=config,
                                  color=colour[config])
                ax.plot(x, [r["host_pool_bytes"] / 2**30 for r in series], marker="x", linestyle="--",
                        color=line.get_color())
            ax.set_title(f"prompt {length:,} tokens" if length else "no measured cells")
            ax.set_xlabel("concurrency")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def markdown(rows: list[dict[str, Any]], source: str, images: list[str]) -> str:
    """The page: what the columns are, a row per cell, the errors, the plots."""
    head = ("| prompt | config | conc | admitted / max (bound) | tok/s | decode tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
            "| step / floor ms | prefill TFLOP/s (% of 790) | hit rate | PCIe GB/s (floor ms) | GPU peak GiB | host pool GiB "
            "| preempt |")
    lines = [
        "# Engine sweep", "",
        f"Rows of `{source}` (benchmarks/engine_sweep.py; every figure measured in that run). "
        "*admitted*: the most requests running at once; *max*: the memory-bound maximum of the engine's "
        "memory plan (`plan --engine`) for the cell's config and context, and what bounds it (device or host). "
        "*tok/s*: output tokens over the whole run (prefill included); *decode tok/s*: the rows of the "
        "full decode step over its median time. *step / floor*: the median "
        "decode step with the most requests decoding and no prefill, beside its HBM floor (weights + the "
        "bytes it must read, ÷ the GPU's HBM ceiling: common/hardware.py). *prefill*: prompt FLOPs over the wall time of the steps with "
        "prefill. *hit rate*, *PCIe*: the hierarchical store's device-buffer hits and host→device bytes "
        "over the decode steps' time ('-': a resident store), and in brackets the swap-in's own floor: "
        "the host→device bytes per decode step ÷ 55 GB/s (PCIe).", "",
        head, "|" + "---|" * (head.count("|") - 1),
    ]
    failed = []
    for r in sorted(rows, key=lambda r: (r["length"], r["config_name"], r.get("concurrency") or 0)):
        if "error" in r:
            failed.append(r)
            continue
        bound = "-" if r["memory_bound_max"] is None else f"{r['memory_bound_max']} ({r['memory_bound']})"
        tf = r["prefill_tflops"]
        prefill = "-" if tf is None else f"{tf:,.1f} ({100 * tf / r['peak_tflops']:.1f}%)"
        lines.append(
            f"| {r['length']:,} | {r['config_name']} | {r['concurrency']} | {r['admitted_concurrency']} / {bound} "
            f"| {fmt_or_dash(r['output_tokens_per_s'])} | {fmt_or_dash(decode_tokens_per_s(r))} | {fmt_or_dash(r['ttft_p50_ms'], ',.0f')} / {fmt_or_dash(r['ttft_p99_ms'], ',.0f')} "
            f"| {fmt_or_dash(r['tpot_p50_ms'])} / {fmt_or_dash(r['tpot_p99_ms'])} "
            f"| {fmt_or_dash(r['decode_step_ms'])} / {fmt_or_dash(r['decode_step_floor_ms'])} | {prefill} | {fmt_or_dash(r['hit_rate'], '.1%')} "
            f"| {fmt_or_dash(r['h2d_gb_per_s'], ',.2f')} ({fmt_or_dash(r.get('decode_step_pcie_floor_ms'))}) | {gib_or_dash(r['peak_gpu_bytes'])} | {gib_or_dash(r['host_pool_bytes'])} "
            f"| {r['preemptions']} |")
    if failed:
        lines += ["", "Cells that failed (the sweep went on):", ""]
        lines += [f"- {r['cell']}: {' '.join(r['error'].split())}" for r in failed]
    lines.append("")
    for image in images:
        lines += [f"![{Path(image).stem}]({image})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="engine_sweep.py's JSON")
    p.add_argument("--out-dir", default="docs/engine_sweep", help="where the PNGs go")
    p.add_argument("--markdown", help="write the page here")
    args = p.parse_args(argv)
    rows = json.loads(Path(args.results).read_text())
    paths = plot(rows, Path(args.out_dir))
    print("\n".join(str(path) for path in paths))
    if args.markdown:
        page = Path(args.markdown)
        images = [os.path.relpath(path, page.resolve().parent) for path in (x.resolve() for x in paths)]
        page.write_text(markdown(rows, args.results, images))
        print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
