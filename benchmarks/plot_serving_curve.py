"""The serving curve (issue 46): output tokens/s against requests in flight, one line per
server and config, from `sparse-framework bench-serve --max-concurrency N N ...` reports.

    python benchmarks/plot_serving_curve.py serve_curve_runs/*.json \\
        --png docs/serving_curve/h200.png --md docs/serving_curve/h200.md --json benchmarks/results/serving_curve_h200.json

Inputs: bench-serve JSON reports of concurrency sweeps (each names its line with --label), or
curve files this script wrote (--json), so curves measured in different device calls join into
one. Outputs, each optional:
- --png: output tok/s against concurrency (log2 axis), one line per label; a point with failed
  requests is drawn as an x; a dotted vertical line in the line's colour marks the requests the
  server runs at once by its memory plan, where its report says it (bench-serve --meta
  max_running=N, else memory_max=N);
- --md: a markdown page: the workload, a table of output tok/s (one row per concurrency, one
  column per label), then per label TTFT and TPOT p50/p99 and failures; the PNG embedded
  (path relative to the page) when both are written;
- --json: the joined curve file: per label its points (concurrency, requests, failures, tok/s,
  TTFT, TPOT), the command, commit and meta of the run that measured it.

The plot is drawn here (matplotlib), not on the GPU machine, which may not have it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

POINT_KEYS = ("sent", "completed", "failed", "max_in_flight", "duration_s", "output_throughput", "request_throughput")


class CurveError(Exception):
    """A bad input or argument: printed as `error: ...` (exit 2), never as a traceback."""


def series_of(doc: dict[str, Any], source: str) -> list[dict[str, Any]]:
    """The curves in one input: a curve file's series as they are, or one series made of a
    bench-serve concurrency sweep's runs."""
    if isinstance(doc.get("series"), list):
        return [{**s, "source": f"{s['source']} (in {source})" if s.get("source") else source} for s in doc["series"]]
    if "runs" not in doc:
        raise CurveError(f"{source}: neither a bench-serve report (no 'runs') nor a curve file (no 'series')")
    if doc.get("mode") != "concurrency":
        raise CurveError(f"{source}: a rate sweep (mode {doc.get('mode', 'rate')!r}); the curve needs a concurrency "
                         "sweep: sparse-framework bench-serve --max-concurrency 1 2 4 ... --label NAME")
    points = []
    for run in doc["runs"]:
        points.append({"concurrency": run["max_concurrency"], **{k: run.get(k) for k in POINT_KEYS},
                       "ttft_ms": {q: run["ttft_ms"].get(q) for q in ("p50", "p99")},
                       "tpot_ms": {q: run["tpot_ms"].get(q) for q in ("p50", "p99")},
                       "errors": {kind: e["count"] for kind, e in run.get("errors", {}).items()}})
    points.sort(key=lambda p: p["concurrency"])
    return [{"label": doc.get("label") or doc.get("model") or Path(source).stem, "source": source,
             "model": doc.get("model"), "base_url": doc.get("base_url"), "commit": doc.get("commit"),
             "command": doc.get("command"), "started_at": doc.get("started_at"), "meta": doc.get("meta") or {},
             "input_len": doc.get("input_len"), "output_len": doc.get("output_len"),
             "prompts_per_concurrency": doc.get("prompts_per_concurrency"), "min_prompts": doc.get("min_prompts"),
             "points": points}]


def load(paths: list[str]) -> list[dict[str, Any]]:
    """Every input's series, in order; a label given twice is refused (two lines would share a name)."""
    series: list[dict[str, Any]] = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CurveError(f"{path}: no such file") from None
        except json.JSONDecodeError as exc:
            raise CurveError(f"{path}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise CurveError(f"{path}: not a bench-serve report or a curve file")
        for s in series_of(doc, path):
            twin = next((t for t in series if t["label"] == s["label"]), None)
            if twin is not None:
                raise CurveError(f"label {s['label']!r} is in both {twin['source']} and {s['source']}: give each run "
                                 "its own bench-serve --label")
            series.append(s)
    if not series:
        raise CurveError("no curves in the inputs")
    return series


def max_running(s: dict[str, Any]) -> int | None:
    """The requests the server runs at once by its memory plan, from the run's --meta
    max_running=N (else memory_max=N), if it says."""
    meta = s.get("meta") or {}
    for key in ("max_running", "memory_max"):
        try:
            return int(float(meta[key]))
        except (KeyError, TypeError, ValueError):
            continue
    return None


def workloads(series: list[dict[str, Any]]) -> list[str]:
    """The distinct workloads, as text: one where every line ran the same prompts and outputs."""
    seen: dict[str, list[str]] = {}
    for s in series:
        text = (f"{s.get('input_len')}-token prompts, {s.get('output_len')} output tokens, "
                f"{s.get('prompts_per_concurrency')} x N requests at concurrency N (at least {s.get('min_prompts')})")
        seen.setdefault(text, []).append(s["label"])
    if len(seen) == 1:
        return list(seen)
    return [f"{text} ({', '.join(labels)})" for text, labels in seen.items()]


def plot(series: list[dict[str, Any]], png: Path, title: str) -> None:
    """Output tok/s against concurrency, one line per label (module docstring)."""
    try:
        import matplotlib
    except ImportError:
        raise CurveError("--png needs matplotlib (pip install matplotlib); leave --png out to write only the "
                         "tables") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    ticks: set[int] = set()
    failed_shown = False
    for i, s in enumerate(series):
        pts = [p for p in s["points"] if p.get("output_throughput") is not None]
        color = f"C{i % 10}"
        xs, ys = [p["concurrency"] for p in pts], [p["output_throughput"] for p in pts]
        ticks.update(xs)
        top = max_running(s)
        name = s["label"] + (f" (runs {top} at once)" if top else "")
        ax.plot(xs, ys, "-o", color=color, label=name, markersize=4)
        bad = [p for p in pts if p.get("failed")]
        if bad:
            ax.plot([p["concurrency"] for p in bad], [p["output_throughput"] for p in bad], "x", color="black",
                    markersize=9, label=None if failed_shown else "some requests failed at this point")
            failed_shown = True
        if top:
            ax.axvline(top, color=color, linestyle=":", alpha=0.7)
    ax.set_xscale("log", base=2)
    if ticks:
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([str(t) for t in sorted(ticks)])
    ax.set_xlabel("concurrency (requests in flight at most)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.text(0.01, 0.01, "; ".join(workloads(series)), fontsize=7, alpha=0.8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(png)
    plt.close(fig)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(series: list[dict[str, Any]], title: str, png: Path | None, md: Path) -> str:
    """The page (module docstring)."""
    lines = [f"# {title}", ""]
    lines += [f"Workload: {w}." for w in workloads(series)] + [""]
    if png is not None:
        lines += [f"![serving curve]({os.path.relpath(png, md.parent)})", ""]
    labels = [s["label"] for s in series]
    by = {s["label"]: {p["concurrency"]: p for p in s["points"]} for s in series}
    conc = sorted({c for points in by.values() for c in points})
    lines += ["Output tokens/s (first send to last answer of each point; `*`: some requests failed):", "",
              "| N | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for c in conc:
        cells = []
        for label in labels:
            p = by[label].get(c)
            cells.append("-" if p is None else _num(p.get("output_throughput"), ",.1f") + ("*" if p.get("failed") else ""))
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "Per line: requests completed / sent, TTFT and TPOT p50 / p99 (ms):", "",
              "| line | N | ok | in flight | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in series:
        for p in s["points"]:
            lines.append(f"| {s['label']} | {p['concurrency']} | {p.get('completed')}/{p.get('sent')} | "
                         f"{p.get('max_in_flight', '-')} | {_num(p.get('output_throughput'), ',.1f')} | "
                         + " | ".join(_num(p[k][q], ",.1f") for k in ("ttft_ms", "tpot_ms") for q in ("p50", "p99"))
                         + " |")
    lines += ["", "Runs:", ""]
    for s in series:
        top = max_running(s)
        facts = [f"commit `{s.get('commit') or '?'}`"] + ([f"runs at most {top} requests at once"] if top else [])
        lines.append(f"- {s['label']}: {', '.join(facts)}; `{s.get('command') or '?'}`")
    return "\n".join(lines) + "\n"


def current_commit() -> str | None:
    """HEAD's commit ($SF_COMMIT where set): `bench-serve`'s own lookup."""
    from sparse_framework.bench.online import source_commit

    return source_commit()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="JSON", help="bench-serve concurrency-sweep reports or curve files")
    p.add_argument("--png", help="the plot (a .png path)")
    p.add_argument("--md", help="the markdown page")
    p.add_argument("--json", help="the joined curve file")
    p.add_argument("--title", default="Serving curve: output tokens/s against concurrency", help="of the plot and page")
    args = p.parse_args(argv)
    try:
        if not (args.png or args.md or args.json):
            raise CurveError("nothing to write: give --png, --md and/or --json")
        if args.png and not args.png.endswith(".png"):
            raise CurveError(f"--png {args.png!r}: the path must end in .png")
        for flag in ("png", "md", "json"):
            path = getattr(args, flag)
            if path and not Path(path).resolve().parent.is_dir():
                raise CurveError(f"--{flag} {path!r}: the directory {str(Path(path).resolve().parent)!r} does not exist")
        series = load(args.inputs)
        png = Path(args.png) if args.png else None
        if png is not None:
            plot(series, png, args.title)
            print(f"wrote {png}")
        if args.md:
            Path(args.md).write_text(markdown(series, args.title, png, Path(args.md)))
            print(f"wrote {args.md}")
        if args.json:
            doc = {"command": "python benchmarks/plot_serving_curve.py " + " ".join(argv), "commit": current_commit(),
                   "series": series}
            Path(args.json).write_text(json.dumps(doc, indent=1))
            print(f"wrote {args.json}")
    except CurveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for s in series:
        print(f"{s['label']:<28} " + "  ".join(f"N={p['concurrency']}: {_num(p.get('output_throughput'), ',.0f')}"
                                          for p in s["points"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
