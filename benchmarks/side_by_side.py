"""vLLM and this project on the same GPU, timed the same way (issue 45): one table of every path
beside vLLM dense and beside its HBM floor.

    python benchmarks/side_by_side.py --group vllm   --out vllm.json     # vLLM 0.26 installed
    python benchmarks/side_by_side.py --group engine --out engine.json
    python benchmarks/side_by_side.py --merge vllm.json engine.json --out benchmarks/results/side_by_side_h200.json

(benchmarks/gpu/side_by_side_runs.sh carries and runs the groups on the lent H200, one device
call each; `--group all` runs both in one process tree where time allows.)

Paths (each in its own process, so that no two share GPU memory or a CUDA context):
  vllm-dense            vLLM 0.26, its defaults (FlashAttention 3, full CUDA graphs, prefix caching)
  vllm-plugin           the same with this project's plugin: Quest, top_k 2048, page = block 16
  vllm-plugin-defaults  the plugin with `{"algorithm": "quest"}` as a user writes it (--paths only:
                        the vllm group's call has no room for a third vLLM start)
  engine-dense          the engine, every request dense (Quest never selects)
  engine-defaults       the engine, `{"algorithm": "quest"}` as a user writes it (step 16's defaults)
  engine-resident       the engine, Quest 2048 on the resident store, sparse at any length
  engine-hierarchical   the same on the hierarchical store (host tier always on)
  engine-hybrid         the same on the hybrid store (host tier under pressure only; none here)
  engine-hybrid-fp8     the same with fp8 host rows (twice the requests the host tier holds)
  engine-dense-fa       engine-dense through the `flash_attn` backend (FlashAttention's paged
  engine-resident-fa    decode; vLLM's FA3 where vLLM is installed), and engine-resident so

Timing, the same for every path, from outside (whole `generate` calls, warm run first):
  step     = (generate of N+1 tokens - generate of 1) / N, the median over --repeats;
  prefill  = a generate of 1 token over the prompts (vLLM: over prompts it has never seen, since
             its prefix cache keeps the timed ones; the engine caches no prefix by default);
  floor    = (weights + the K/V (and Quest page bounds) one step reads) / the GPU's HBM
             bandwidth (common/hardware.py: H200 4.3 TB/s).
Ratios: `vs vLLM` = vLLM dense's time / this path's (above 1: faster than vLLM dense).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from timing import current_commit, gpu_name  # noqa: E402

VLLM_PATHS = {"vllm-dense": "dense", "vllm-plugin": "quest",
              "vllm-plugin-defaults": "defaults"}  # vllm_gpu.py perf's config names
ENGINE_PATHS = {"engine-dense": "dense", "engine-defaults": "defaults", "engine-resident": "tuned",
                "engine-hierarchical": "hierarchical", "engine-dense-fa": "dense-fa",
                "engine-resident-fa": "tuned-fa", "engine-hybrid": "hybrid",
                "engine-hybrid-fp8": "hybrid-fp8"}  # defaults_gpu.py's config names
PATHS = {**VLLM_PATHS, **ENGINE_PATHS}
GROUPS = {"vllm": ["vllm-dense", "vllm-plugin"], "engine": ["engine-dense", "engine-defaults", "engine-resident",
                                                 "engine-hierarchical"], "all": list(PATHS)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", choices=sorted(GROUPS), help="which paths to run (vllm: needs vLLM 0.26 importable)")
    p.add_argument("--paths", help=f"comma list instead of --group, of: {', '.join(PATHS)}")
    p.add_argument("--contexts", default="16384,32768", help="prompt lengths (default 16384,32768)")
    p.add_argument("--batches", default="8", help="requests per generate (default 8)")
    p.add_argument("--output-len", type=int, default=128, help="N: decode steps timed per generate (default 128)")
    p.add_argument("--repeats", type=int, default=2, help="timed repeats after the warm run (median; default 2)")
    p.add_argument("--timeout", type=int, default=540, help="seconds per path's process (default 540)")
    p.add_argument("--log-dir", help="the children's logs (default: OUT.logs, or a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="engine paths on the CPU with a tiny random model: "
                   "checks the plumbing, measures nothing")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="print one table of these group results "
                   "(and write them merged to --out) instead of running anything")
    p.add_argument("--out", help="JSON: command, commit, device and every row")
    args = p.parse_args(argv)
    if args.merge:
        return args
    if bool(args.group) == bool(args.paths):
        p.error("give one of --group or --paths (or --merge)")
    args.path_list = GROUPS[args.group] if args.group else args.paths.split(",")
    for name in args.path_list:
        if name not in PATHS:
            p.error(f"--paths: unknown path {name!r}; allowed: {', '.join(PATHS)}")
    try:
        args.context_list = [int(x) for x in args.contexts.split(",")]
        args.batch_list = [int(x) for x in args.batches.split(",")]
    except ValueError:
        p.error("--contexts and --batches take comma-separated integers")
    if args.output_len < 2 or args.repeats < 1:
        p.error("--output-len must be >= 2 and --repeats >= 1")
    return args


def _child(command: list[str], log: Path, timeout: int) -> int | str:
    with log.open("w") as fh:
        try:
            return subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT.parent,
                                  env=os.environ.copy()).returncode
        except subprocess.TimeoutExpired:
            return f"over --timeout {timeout} s"


def run_vllm(names: list[str], args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """vLLM's paths through benchmarks/vllm_gpu.py perf (one child process per config)."""
    out = tmp / "vllm.json"
    command = [sys.executable, str(ROOT / "vllm_gpu.py"), "perf", "--contexts", args.contexts, "--batches",
               args.batches, "--configs", ",".join(VLLM_PATHS[n] for n in names), "--output-len",
               str(args.output_len), "--repeats", str(args.repeats), "--prefill-repeats", str(args.repeats),
               "--out", str(out), "--log-dir", str(tmp / "vllm_logs"), "--timeout", str(args.timeout)]
    status = _child(command, tmp / "vllm.log", args.timeout * len(names) + 60)
    print((tmp / "vllm.log").read_text(errors="replace")[-3000:], flush=True)
    if not out.is_file():
        return [{"path": n, "error": f"vllm_gpu.py perf exited {status}"} for n in names]
    by_config = {c: n for n, c in VLLM_PATHS.items()}
    result = json.loads(out.read_text())
    rows = []
    for cell in result.get("cells", []):
        steps = [(tn - t1) / cell["output_len"] * 1e3 for tn, t1 in zip(cell["tn_s"], cell["t1_s"])]
        rows.append({"path": by_config[cell["config"]], "context": cell["context"], "batch": cell["batch"],
                     "step_ms": statistics.median(steps), "steps_ms": steps, "floor_ms": cell["floor_ms"],
                     "prefill_s": statistics.median(cell["prefill_s"]) if cell.get("prefill_s") else None,
                     "at_once": cell["at_once"], "raw": {k: cell[k] for k in ("t1_s", "tn_s", "warm_s", "prefill_s")}})
    for name, config in result.get("configs", {}).items():
        if not config.get("ok"):
            rows.append({"path": by_config[name], "error": config.get("error", "failed")})
    return rows


def run_engine(name: str, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One engine path through benchmarks/defaults_gpu.py, in a process of its own."""
    out = tmp / f"{name}.json"
    shapes = ",".join(f"{c}x{b}" for c in args.context_list for b in args.batch_list)
    command = [sys.executable, str(ROOT / "defaults_gpu.py"), "--configs", ENGINE_PATHS[name], "--shapes", shapes,
               "--output-len", str(args.output_len + 1), "--repeats", str(args.repeats), "--out", str(out)]
    if args.smoke:
        command += ["--device", "cpu", "--random", "tiny"]
    status = _child(command, tmp / f"{name}.log", args.timeout)
    print((tmp / f"{name}.log").read_text(errors="replace")[-1500:], flush=True)
    if not out.is_file():
        return [{"path": name, "error": f"defaults_gpu.py exited {status}"}]
    rows = []
    for r in json.loads(out.read_text())["rows"]:
        if "error" in r:
            rows.append({"path": name, "context": r["context"], "batch": r["batch"], "error": r["error"]})
            continue
        n = r["n"] - 1
        steps = [(tn - t1) / n * 1e3 for tn, t1 in zip(r["generate_n_all_s"], r["generate_1_all_s"])]
        rows.append({"path": name, "context": r["context"], "batch": r["batch"], "step_ms": r["step_ms"],
                     "steps_ms": steps, "floor_ms": r["floor_ms"], "prefill_s": r["generate_1_s"],
                     "first_generate_s": r["first_generate_1_s"], "resolved": r["resolved"],
                     "prefill_attention": r["prefill_attention"], "policy": r["policy"],
                     "floor_is_sparse": r["floor_is_sparse"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """One line per path and shape, 80 columns: step and prefill beside vLLM dense and the floor."""
    base = {(r["path"], r["context"], r["batch"]): r for r in rows if "step_ms" in r}
    lines = [f"{'path':<20}{'shape':>8}{'step ms':>9}{'floor':>7}{'x floor':>8}{'vs vLLM':>8}"
             f"{'prefill s':>10}{'vs vLLM':>8}"]
    shapes = sorted({(r["context"], r["batch"]) for r in rows if "context" in r})
    for ctx, batch in shapes:
        ref = base.get(("vllm-dense", ctx, batch))
        for name in PATHS:
            r = next((x for x in rows if x["path"] == name and x.get("context") == ctx and x.get("batch") == batch), None)
            if r is None:
                continue
            shape = f"{ctx / 1024:g}Kx{batch}"
            if "error" in r:
                lines.append(f"{name:<20}{shape:>8}  error: {r['error'][:40]}")
                continue
            vs = f"{ref['step_ms'] / r['step_ms']:.2f}x" if ref else "-"
            pre = f"{r['prefill_s']:.2f}" if r.get("prefill_s") else "-"
            pvs = f"{ref['prefill_s'] / r['prefill_s']:.2f}x" if ref and ref.get("prefill_s") and r.get("prefill_s") else "-"
            lines.append(f"{name:<20}{shape:>8}{r['step_ms']:>9.2f}{r['floor_ms']:>7.2f}"
                         f"{r['step_ms'] / r['floor_ms']:>8.2f}{vs:>8}{pre:>10}{pvs:>8}")
    for r in rows:
        if "error" in r and "context" not in r:
            lines.append(f"{r['path']:<20}  error: {r['error'][:52]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = "python benchmarks/side_by_side.py " + " ".join(argv)
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        rows = [r for part in parts for r in part["rows"]]
        doc = {"command": command, "commit": current_commit() or None, "parts": [
            {k: v for k, v in part.items() if k != "rows"} for part in parts], "rows": rows}
    else:
        rows = []
        with tempfile.TemporaryDirectory() as name:
            tmp = Path(args.log_dir or (args.out + ".logs" if args.out else name))
            tmp.mkdir(parents=True, exist_ok=True)
            vllm_names = [n for n in args.path_list if n in VLLM_PATHS]
            if vllm_names:
                rows += run_vllm(vllm_names, args, tmp)
            for n in args.path_list:
                if n in ENGINE_PATHS:
                    rows += run_engine(n, args, tmp)
        doc = {"command": command, "commit": current_commit() or None, "device": gpu_name() or "unknown (no nvidia-smi)",
               "output_len": args.output_len, "repeats": args.repeats, "rows": rows}
    print("\n" + table(rows))
    print("step = (generate N+1 - generate 1) / N, median; floor = (weights + KV read) / HBM; "
          "vs vLLM = vLLM dense / this (above 1: faster)")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
