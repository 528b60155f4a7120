"""The hierarchical KV store on a real model's attention: buffer hit rate, traffic, answers.

Every other store benchmark feeds the store random keys; here SmolLM2-135M-Instruct (a Llama:
30 layers, 3 KV heads, `smollm2-135m-instruct` of the model catalog) answers RULER prompts
through the engine, so the selections the store serves are the ones real attention makes. Per
sparse config (an algorithm at a top_k) the prompts run once over the resident store (every
token on the device: the reference answers), then over the hierarchical store with device
buffers of --buffers x top_k tokens, and once dense (the accuracy baseline). Prompts run one
at a time (max_num_seqs 1, synchronous steps) and the script calls `engine.step()` itself,
reading the store's cumulative counters (`HierarchicalKVStore.stats()`) after every step, so
each decode step's hits, misses, host->device bytes and swap-in time are its own deltas.

What it reports (tables at 80 columns, everything in --json):
  hit rate    selected tokens (per KV head stream) already in the buffer, over every decode
              layer-step of the sparse layers; the first decode step apart (the buffer then
              holds the prompt's sink and recent window only) and the later ones; per layer
              min / median / max; by decode step. HiSparse (DESIGN.md) reports ~20% of the
              selected KV fetched per layer (~80% hits) on DeepSeek-V3.2 at 16K.
  traffic     host->device bytes per decode step; the measured swap-in time (CUDA events on a
              GPU; perf_counter of torch copies on the CPU, not a GPU figure); the PCIe floor
              (bytes / 55 GB/s, pinned host->device as measured, DESIGN.md).
  answers     RULER's string-match-all score; "same": prompts whose generated tokens equal
              the resident store's under the same config, device_buffer_tokens included
              (SnapKV's selection grows with the buffer: a reference per buffer), greedy.
On CUDA each engine first serves an unrecorded request, so that Triton compiles outside the
timed swap-ins. A grid too long for one device call splits by --configs / --top-k with
--append (the rows of the earlier calls stay in --json; the tables show them all).

Buffers: a multiple m gives max(m x top_k, the least device_buffer_tokens the config accepts)
rounded up to whole pages. The least accepted is the algorithm's widest selection (top_k +
sink + recent, in whole pages for Quest): so "1x" is that minimum, slightly above top_k.

On the H100 (benchmarks/gpu/smollm2_gpu.sh carries the model there, README_gpu_model.md):
    python benchmarks/real_model_store.py --device cuda --context 8192 --samples 4 \\
        --tasks niah_single_1,ruler_vt --configs quest,dsa --top-k 512,1024 --buffers 1,2,4 \\
        --json benchmarks/results/real_model_store_h100.json
On the CPU (float32, small):
    python benchmarks/real_model_store.py --device cpu --context 2048 --samples 2 --top-k 128 \\
        --json benchmarks/results/real_model_store_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import write_results  # noqa: E402

from sparse_framework.common.tables import new_table  # noqa: E402
from sparse_framework.common.errors import ConfigError  # noqa: E402
from sparse_framework.config import DENSE_CONFIG, load_config  # noqa: E402
from sparse_framework.bench.offline import fmt_or_dash  # noqa: E402
from sparse_framework.engine.llm import LLM, decode_text  # noqa: E402
from sparse_framework.engine.sampling import SamplingParams  # noqa: E402
from sparse_framework.eval.ruler import RULER_TASKS, check_task, prompt_text, ruler_samples, score  # noqa: E402

MODEL = "smollm2-135m-instruct"
CONFIGS: dict[str, dict[str, Any]] = {  # the algorithms, with their papers' defaults
    "quest": {"algorithm": "quest"},  # dense_first_layers 2: layers 0 and 1 attend densely
    "dsa": {"algorithm": "dsa", "extra": {"source": "keys"}},  # exact top-k over the real keys
    "pqcache": {"algorithm": "pqcache"},
    "snapkv": {"algorithm": "snapkv"},
}
PCIE_GBPS = 55.0  # pinned host -> device, contiguous (DESIGN.md; benchmarks/swap_in.py)
HISPARSE_HIT_RATE = 0.80  # ~20% of the selected KV fetched per layer (DESIGN.md)
BUCKETS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, None))  # decode steps


@dataclass(frozen=True)
class Prompt:
    """One prompt: token ids, the strings a right answer contains (none: unscored), and the
    tokens to generate at most."""

    task: str
    index: int
    ids: list[int]
    outputs: tuple[str, ...]
    max_tokens: int


def load_prompts(model_dir: Path, tokenizer: Any, tasks: list[str], context: int, samples: int,
                 seed: int) -> list[Prompt]:
    """RULER prompts (eval/ruler.py: cached JSON lines, or lm-eval's generators), chat template on."""
    return [Prompt(task, s.index, list(tokenizer.encode(prompt_text(s, tokenizer, True))), s.outputs,
                   RULER_TASKS[task].max_new_tokens)
            for task in tasks for s in ruler_samples(model_dir, task, context, samples, seed, tokenizer)]


def min_buffer(config: dict[str, Any]) -> int:
    """The least device_buffer_tokens `config` accepts (whole pages, from top_k up): the
    algorithm's widest selection, which its check_config demands."""
    page = load_config({**config, "store": "resident"}).page_size
    tokens = -(-config["top_k"] // page) * page
    for _ in range(1 << 16):
        try:
            load_config({**config, "store": "hierarchical", "device_buffer_tokens": tokens})
            return tokens
        except ConfigError:
            tokens += page
    raise ConfigError(f"no device_buffer_tokens up to {tokens} accepted by {config}")


def buffer_tokens(config: dict[str, Any], multiple: float) -> int:
    """max(multiple x top_k, `min_buffer`) in whole pages."""
    page = load_config({**config, "store": "resident"}).page_size
    return max(min_buffer(config), -(-int(multiple * config["top_k"]) // page) * page)


def _counters(store: Any) -> list[list[float]]:
    """Per layer the store's cumulative [hits, misses, bytes_in, swap_seconds] (syncs)."""
    return [[s["hits"], s["misses"], s["bytes_in"], s["swap_seconds"]] for s in store.stats()]


def run_engine(llm: LLM, prompts: list[Prompt], *, ignore_eos: bool = False, warmup: bool = False) -> dict[str, Any]:
    """Every prompt through `llm`'s engine, one at a time, greedy. Per prompt: its tokens,
    text, score and per decode step [hits, misses, bytes_in, swap_s, step_s] summed over the
    layers (deltas of the store's counters; zeros for the resident store); per sparse layer
    its decode [hits, misses]; and the store's totals over the prompts, which the steps'
    deltas (prefill steps included) add up to. `warmup`: first an unrecorded request (the
    first prompt, 4 tokens), so that Triton's compilation is not timed as a swap-in."""
    engine = llm.engine
    coord = engine.runner.coord
    store = coord.store
    hier = coord.config.store == "hierarchical"
    if warmup:
        engine.add_request("warm-up", prompts[0].ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.run_to_completion()
    sparse = [layer for layer in range(coord.layout.num_layers) if layer not in coord.dense_layers]
    layers = [[0, 0] for _ in sparse]
    answers, other = [], [0.0, 0.0, 0.0, 0.0]  # deltas of the steps without a decode row
    zeros = [[0, 0, 0, 0.0] for _ in range(coord.layout.num_layers)]
    first = before = _counters(store) if hier else zeros
    for n, p in enumerate(prompts):
        engine.add_request(f"p{n}", p.ids, SamplingParams(max_tokens=p.max_tokens, temperature=0.0,
                                                          ignore_eos=ignore_eos))
        steps, outs = [], []
        while engine.has_unfinished():
            outs.extend(engine.step())
            decode_rows, _, _, seconds = engine.step_log[-1]
            now = _counters(store) if hier else zeros
            delta = [[a - b for a, b in zip(x, y)] for x, y in zip(now, before)]
            before = now
            total = [sum(d[i] for d in delta) for i in range(4)]
            if decode_rows:
                steps.append([*total, seconds])
                for row, layer in zip(layers, sparse):
                    row[0] += delta[layer][0]
                    row[1] += delta[layer][1]
            else:
                other = [a + b for a, b in zip(other, total)]
        (out,) = outs
        if out.finish_reason == "error":
            raise ConfigError(f"prompt {p.task}#{p.index} failed: {out.error}")
        text = decode_text(llm.tokenizer, out.token_ids) if llm.tokenizer is not None else None
        answers.append({"task": p.task, "index": p.index, "prompt_tokens": len(p.ids), "token_ids": out.token_ids,
                        "text": text, "score": score(text, p.outputs) if text is not None and p.outputs else None,
                        "steps": steps})
    totals = [sum(x[i] - y[i] for x, y in zip(_counters(store), first)) for i in range(4)] if hier else None
    return {"answers": answers, "sparse_layers": sparse, "layers": layers, "non_decode": other, "totals": totals}


def _rate(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The figures of the tables, from `run_engine`'s record: hit rates overall, first decode
    step, later steps, per bucket of decode steps and per layer; bytes and times per step."""
    scores = [a["score"] for a in run["answers"] if a["score"] is not None]
    steps = [(k, s) for a in run["answers"] for k, s in enumerate(a["steps"])]
    out: dict[str, Any] = {"score": statistics.mean(scores) if scores else None, "decode_steps": len(steps),
                           "step_ms": 1e3 * sum(s[4] for _, s in steps) / max(1, len(steps))}
    if run["totals"] is None:
        return out
    hm = lambda sel: _rate(sum(s[0] for k, s in steps if sel(k)), sum(s[1] for k, s in steps if sel(k)))  # noqa: E731
    layer_rates = [r for r in (_rate(h, m) for h, m in run["layers"]) if r is not None]
    n, later = max(1, len(steps)), [s for k, s in steps if k > 0]
    nbytes = sum(s[2] for _, s in steps)
    out.update({
        "hit_rate": hm(lambda k: True), "hit_rate_first": hm(lambda k: k == 0), "hit_rate_later": hm(lambda k: k > 0),
        "hit_rate_by_bucket": {f"{lo}" if lo == hi else f"{lo}+" if hi is None else f"{lo}-{hi}": hm(
            lambda k, lo=lo, hi=hi: lo <= k and (hi is None or k <= hi)) for lo, hi in BUCKETS},
        "layer_hit_rate": {"min": min(layer_rates), "median": statistics.median(layer_rates), "max": max(layer_rates)}
        if layer_rates else None,
        "bytes_per_step": nbytes / n, "bytes_first_step": statistics.mean(s[2] for k, s in steps if k == 0),
        "bytes_later_step": statistics.mean(s[2] for s in later) if later else None, "swap_ms_per_step": 1e3 * sum(s[3] for _, s in steps) / n,
        "pcie_floor_ms_per_step": 1e3 * nbytes / n / (PCIE_GBPS * 1e9),
    })
    return out


def run_grid(model: Any, tokenizer: Any, prompts: list[Prompt], configs: dict[str, dict[str, Any]], top_ks: list[int],
             multiples: list[float], *, backend: str, dense: bool = True, ignore_eos: bool = False,
             warmup: bool = False, log: Callable[[str], None] = lambda text: None) -> list[dict[str, Any]]:
    """Rows: dense (if asked), then per config and top_k the resident store and the
    hierarchical store at each buffer multiple, each with `summarize`'s figures, `same`
    (prompts whose tokens equal the resident run's) and the run's record. The resident
    reference has the same config, device_buffer_tokens included: where the buffer changes
    what the algorithm selects (SnapKV keeps as many decoded tokens as it leaves room for),
    each buffer gets its own reference."""
    shortest = min(len(p.ids) for p in prompts)  # every prompt decodes sparsely
    max_len = max(len(p.ids) + p.max_tokens for p in prompts)
    start = time.monotonic()

    def one(name: str, config: dict[str, Any], **row: Any) -> dict[str, Any]:
        llm = LLM.from_model(model, config, tokenizer=tokenizer, max_num_seqs=1, max_model_len=max_len,
                             max_num_batched_tokens=max(2048, max_len), async_scheduling=False)
        run = run_engine(llm, prompts, ignore_eos=ignore_eos, warmup=warmup)
        del llm
        result = {"name": name, **row, "config": config, **summarize(run), "run": run}
        log(f"[{time.monotonic() - start:7.1f} s] {name} {row.get('label', '')}: "
            f"hit {fmt_or_dash(result.get('hit_rate'), '.1%')}, score {fmt_or_dash(result['score'], '.2f')}")
        return result

    rows = []
    if dense:
        rows.append(one("dense", {**DENSE_CONFIG, "backend": backend}, store="resident", label="all tokens"))
    for name, base in configs.items():
        for top_k in top_ks:
            config = {**base, "backend": backend, "top_k": top_k, "sparse_policy": "always", "min_sparse_prompt_len": shortest}
            residents: dict[int, list[list[int]]] = {}  # the references, by the widest selection
            for m in multiples:
                tokens = buffer_tokens(config, m)
                hier = {**config, "store": "hierarchical", "device_buffer_tokens": tokens}
                parsed = load_config(hier)
                width = parsed.algorithm_class.max_selected_tokens(parsed)
                if width not in residents:  # SnapKV's tail of decoded tokens grows with the buffer
                    resident = one(name, {**hier, "store": "resident"}, top_k=top_k, store="resident",
                                   label="resident" if not residents else f"resident {tokens}")
                    rows.append(resident)
                    residents[width] = [a["token_ids"] for a in resident["run"]["answers"]]
                ref = residents[width]
                row = one(name, hier, top_k=top_k, store="hierarchical", buffer=tokens, multiple=m,
                          label=f"{tokens} ({m:g}x)")
                got = [a["token_ids"] for a in row["run"]["answers"]]
                row["same"] = sum(a == b for a, b in zip(got, ref))
                row["differs"] = [i for i, (a, b) in enumerate(zip(got, ref)) if a != b]
                rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return fmt_or_dash(None if x is None else 100 * x, ".1f")


def tables(rows: list[dict[str, Any]], samples: int) -> list[Table]:
    """Hit rates; hit rate by decode step; traffic and answers (80 columns each)."""
    hier = [r for r in rows if r["store"] == "hierarchical"]
    run = lambda r: f"{r['name']} k{r['top_k']}"  # noqa: E731
    t1 = new_table("buffer hit rate, % of selected tokens (decode layer-steps)",
                   f"fetched = 100 - hit (HiSparse: ~{100 - 100 * HISPARSE_HIT_RATE:.0f}% fetched per layer, "
                   f"~{100 * HISPARSE_HIT_RATE:.0f}% hits)\n1st: the first decode step (the buffer holds the sink "
                   "and recent window)\nlay min, median, max: over the sparse layers")
    for h in ("run", "buffer", "hit", "1st", "later", "lay min", "median", "max", "fetched"):
        t1.add_column(h, justify="left" if h == "run" else "right", no_wrap=True)
    for r in hier:
        lay = r.get("layer_hit_rate") or {}
        t1.add_row(run(r), r["label"], _pct(r.get("hit_rate")), _pct(r.get("hit_rate_first")),
                   _pct(r.get("hit_rate_later")), _pct(lay.get("min")), _pct(lay.get("median")), _pct(lay.get("max")),
                   _pct(None if r.get("hit_rate") is None else 1 - r["hit_rate"]))
    t2 = new_table("hit rate % by decode step (all prompts)", "columns: decode steps, 0 = the first")
    t2.add_column("run", no_wrap=True)
    t2.add_column("buffer", justify="right", no_wrap=True)
    keys = list(hier[0]["hit_rate_by_bucket"]) if hier else []
    for k in keys:
        t2.add_column(k, justify="right", no_wrap=True)
    for r in hier:
        t2.add_row(run(r), r["label"], *(_pct(r["hit_rate_by_bucket"][k]) for k in keys))
    t3 = new_table("host->device traffic per decode step, and the answers",
                   "KiB host->device in the first decode step, and per later step\n"
                   f"ms per decode step: swap-in measured (CUDA events; CPU: torch copies),\nPCIe: bytes / "
                   f"{PCIE_GBPS:g} GB/s\n"
                   f"same: prompts (of {samples}) whose tokens equal the resident store's")
    for h in ("run", "store", "KiB 1st", "later", "swap ms", "PCIe ms", "score", "same"):
        t3.add_column(h, justify="left" if h in ("run", "store") else "right", no_wrap=True)
    for r in rows:
        kib = [None if r.get(k) is None else r[k] / 1024 for k in ("bytes_first_step", "bytes_later_step")]
        t3.add_row("dense" if r["name"] == "dense" else run(r), r["label"], *(fmt_or_dash(x, ",.0f") for x in kib),
                   fmt_or_dash(r.get("swap_ms_per_step"), ".2f"), fmt_or_dash(r.get("pcie_floor_ms_per_step"), ".3f"),
                   fmt_or_dash(r["score"], ".2f"), str(r["same"]) if "same" in r else "-")
    return [t1, t2, t3]


def _top_k(item: str, context: int) -> int:
    """"512" or a fraction of the context ("1/16")."""
    try:
        value = int(Fraction(item) * context) if "/" in item else int(item)
    except ValueError:
        raise ConfigError(f"--top-k: {item!r} is neither an integer nor a fraction like 1/16") from None
    if value < 1:
        raise ConfigError(f"--top-k {item} is below one token at context {context}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default cuda where available)")
    p.add_argument("--dtype", help="model and store dtype (default bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--context", type=int, default=8192, help="RULER context, tokens (prompt + answer; default 8192)")
    p.add_argument("--samples", type=int, default=4, help="prompts per task (default 4)")
    p.add_argument("--seed", type=int, default=0, help="RULER generator seed (default 0; the sample cache's key)")
    p.add_argument("--tasks", default="niah_single_1,ruler_vt", help="RULER tasks (default niah_single_1,ruler_vt)")
    p.add_argument("--configs", default="quest,dsa", help=f"algorithms: {', '.join(CONFIGS)} (default quest,dsa)")
    p.add_argument("--top-k", default="1/16,1/8", help="top_k values: tokens or fractions of --context "
                   "(default 1/16,1/8: 512,1024 at 8K)")
    p.add_argument("--buffers", default="1,2,4", help="device buffers as multiples of top_k (default 1,2,4; 1x = "
                   "the least the config accepts: top_k + sink + recent in whole pages)")
    p.add_argument("--backend", help="attention backend (default triton on CUDA, torch_ref on the CPU)")
    p.add_argument("--no-dense", action="store_true", help="skip the dense baseline run")
    p.add_argument("--ignore-eos", action="store_true", help="generate each task's max tokens (more decode steps)")
    p.add_argument("--json", help="write {meta, results} here")
    p.add_argument("--append", action="store_true", help="keep the rows already in --json (an earlier call's "
                   "configs: split a grid over device calls) and print the tables of all")
    args = p.parse_args(argv)
    args.task_list = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for task in args.task_list:
        check_task(task)
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    if bad := [c for c in args.config_list if c not in CONFIGS]:
        raise ConfigError(f"--configs: unknown {bad}; choose from {', '.join(CONFIGS)}")
    args.top_ks = [_top_k(x.strip(), args.context) for x in args.top_k.split(",") if x.strip()]
    args.multiples = [float(x) for x in args.buffers.split(",") if x.strip()]
    if not (args.task_list and args.config_list and args.top_ks and args.multiples) or min(args.multiples) <= 0:
        raise ConfigError("--tasks, --configs, --top-k and --buffers need non-empty lists (buffers > 0)")
    if args.samples < 1 or args.context < 256:
        raise ConfigError("--samples must be >= 1 and --context >= 256")
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.backend = args.backend or ("triton" if cuda else "torch_ref")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sparse_framework.engine.llm import load_tokenizer
    from sparse_framework.engine.models import load_model
    from sparse_framework.engine.models.catalog import resolve_model

    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    model_dir = resolve_model(MODEL, say)
    tokenizer = load_tokenizer(model_dir)
    prompts = load_prompts(model_dir, tokenizer, args.task_list, args.context, args.samples, args.seed)
    model = load_model(model_dir, args.dtype, args.device)
    say(f"{len(prompts)} prompts of {min(len(p.ids) for p in prompts)}-{max(len(p.ids) for p in prompts)} tokens")
    rows = run_grid(model, tokenizer, prompts, {c: CONFIGS[c] for c in args.config_list}, args.top_ks, args.multiples,
                    backend=args.backend, dense=not args.no_dense, ignore_eos=args.ignore_eos,
                    warmup=torch.device(args.device).type == "cuda", log=say)
    earlier = json.loads(Path(args.json).read_text()) if args.append and args.json and Path(args.json).exists() else None
    if earlier is not None:
        rows = earlier["results"] + rows
    console = Console(width=80)
    for table in tables(rows, len(prompts)):
        console.print(table)
    if args.json:
        cuda = torch.device(args.device).type == "cuda"
        meta = {"model": MODEL, "device": torch.cuda.get_device_name(args.device) if cuda else "cpu",
                "dtype": args.dtype, "backend": args.backend, "context": args.context, "samples": args.samples,
                "tasks": args.task_list, "seed": args.seed, "top_ks": args.top_ks, "buffers": args.multiples,
                "prompt_tokens": [len(p.ids) for p in prompts], "pcie_gbps": PCIE_GBPS,
                "hisparse_hit_rate": HISPARSE_HIT_RATE, "torch": torch.__version__}
        if earlier is not None:
            meta["earlier_commands"] = [*earlier["meta"].get("earlier_commands", []), earlier["meta"]["command"]]
        write_results(args.json, meta, rows, "real_model_store.py", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
