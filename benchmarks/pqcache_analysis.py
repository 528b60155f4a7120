"""Why PQCache loses on a real model: its token selection against the exact top-k, per layer.

The same capture as `quest_analysis.py` (SmolLM2-135M-Instruct by default, `--model` any catalog
model, on RULER prompts: post-RoPE keys of the prompt and the gold answer, the queries of the
decode positions; on Gemma 3 only the full-attention layers, numbered as the model's). For each layer
the PQCache algorithm itself (`sparse_framework.algorithms.pqcache.PQCache`, torch scoring)
builds its codebooks from the prompt's keys, appends the answer's keys one by one, and selects
at every decode position with the framework's sink / recent / budget; per option set
(`OPTION_SETS`: the original's 2 sub-vectors × 6 bits × 20 iterations, more sub-vectors,
more centroids, more iterations, `candidates: all`) it measures

  mass recall   the group's mean softmax mass on the selected tokens outside the forced sink
                and recent window / the mass of the exact top-k of as many tokens there
  token recall  |selected ∩ exact top-k| / k over the same tokens
  needle recall share of the needle tokens' mass that the selection keeps (heads weighted
                by their mass on the needle)
  needle tokens share of the needle's tokens that the selection keeps (mean over KV heads)
  logit corr.   Pearson correlation of the PQ logits with q·k over the stored tokens
  exact probs   the same selection rule with exact logits (no quantisation): what the
                group-softmax rule itself costs, apart from the codebooks

`--simulate` decodes greedily with each option set's selection applied in every layer (the
prompt's dense cache shared) and scores RULER's string-match.

    python benchmarks/pqcache_analysis.py --contexts 4096 --samples 3 --fractions 16 --simulate
    python benchmarks/pqcache_analysis.py --device cuda --contexts 8192 --samples 20 --fractions 32 --simulate \\
        --json benchmarks/results/pqcache_analysis_h100.json
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quest_analysis import Captured, Recorder, capture, common_args, load  # noqa: E402
from timing import provenance  # noqa: E402

from sparse_framework import KVLayout, Request, load_config  # noqa: E402
from sparse_framework.algorithms.pqcache import PQCache  # noqa: E402
from sparse_framework.common.tables import new_table  # noqa: E402
from sparse_framework.common.batch import Batch  # noqa: E402

DEFAULT_JSON = "benchmarks/results/pqcache_analysis_cpu.json"
OPTION_SETS: dict[str, dict[str, Any]] = {
    "default (M2 b6 it20)": {},
    "iterations 100": {"iterations": 100},
    "bits 8": {"bits": 8},
    "subvectors 4": {"subvectors": 4},
    "subvectors 8": {"subvectors": 8},
    "candidates all": {"candidates": "all"},
}
EXACT = "exact logits"


def algorithm(layers: int, hk: int, d: int, budget: int, sink: int, recent: int, options: dict[str, Any],
              max_len: int) -> PQCache:
    """A PQCache over one request slot with the run's framework settings and `options`."""
    cfg = load_config({"algorithm": "pqcache", "top_k": budget, "sink_tokens": sink, "recent_tokens": recent,
                       "device_buffer_tokens": budget + sink + recent + 64, "min_sparse_prompt_len": 0,
                       "extra": {"impl": "torch", **options}})
    return PQCache(cfg, KVLayout(num_layers=layers, num_kv_heads=hk, head_dim=d, dtype=torch.float32), 1, max_len)


def batch(request: Request) -> Batch:
    b = Batch([request])
    b.seq_lens = torch.tensor([request.seq_len], dtype=torch.int32)
    b.slot_ids = torch.tensor([request.slot], dtype=torch.int64)
    b.max_seq_len = request.seq_len
    return b


def selection_mask(sel: Any, t: int) -> torch.Tensor:
    """Selection of one request -> bool [Hkv, t+1]."""
    idx, lens = sel.indices[0], sel.lengths[0]
    keep = torch.zeros(idx.shape[0], t + 1, dtype=torch.bool)
    for h in range(idx.shape[0]):
        keep[h, idx[h, : lens[h]].long()] = True
    return keep


def exact_selection(q: torch.Tensor, k: torch.Tensor, t: int, budget: int, sink: int, recent: int) -> torch.Tensor:
    """PQCache's rule with exact logits: each head's softmax over [sink, t − recent), summed over
    the group, top `budget` there, plus sink, recent and newest."""
    hk, d = k.shape[1], k.shape[2]
    logits = torch.einsum("hgd,nhd->hgn", q.view(hk, -1, d), k[:t]) / math.sqrt(d)
    pos = torch.arange(t)
    mid = (pos >= sink) & (pos < t + 1 - max(recent, 1))
    probs = logits.masked_fill(~mid, float("-inf")).softmax(-1).nan_to_num(0.0).sum(1)
    keep = torch.zeros(hk, t + 1, dtype=torch.bool)
    keep[:, : min(sink, t)] = True
    keep[:, max(0, t + 1 - recent):] = True
    keep[:, t] = True
    top = probs.masked_fill(~mid, float("-inf")).topk(min(budget, int(mid.sum())), -1).indices
    keep.scatter_(-1, top, True)
    return keep


def analyse(c: Captured, budget: int, sink: int, recent: int, sets: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per captured layer (`c.layers`: the model's numbers) and option set: mean recalls over
    decode positions and KV heads."""
    layers = len(c.keys)
    _, hk, d = c.keys[0].shape
    out: dict[str, Any] = {"layers": [{"layer": c.layers[i], "sets": {}} for i in range(layers)]}
    for name, options in {**sets, EXACT: {}}.items():
        algo = None if name == EXACT else algorithm(layers, hk, d, budget, sink, recent, options, c.keys[0].shape[0] + 1)
        for layer in range(layers):
            k_all = c.keys[layer]
            req = Request("r", c.prompt_len, seq_len=c.prompt_len, slot=0)
            if algo is not None:
                algo.build(layer, req, k_all[: c.prompt_len])
            acc: dict[str, list[float]] = {}
            for i, t in enumerate(c.positions):
                q = c.queries[layer][i]
                req.seq_len = t + 1  # the decode step's length (its own key appended after select)
                if algo is not None:
                    b = batch(req)
                    keep = selection_mask(algo.select(layer, q[None], b), t)
                    approx = algo.token_logits(q[None], algo.codebooks[layer], algo.codes[layer], b.slot_ids, t, "none")[0]
                    exact_l = torch.einsum("hgd,nhd->hgn", q.view(hk, -1, d), k_all[:t])
                    a, e = approx.flatten(), exact_l.flatten()
                    a, e = a - a.mean(), e - e.mean()
                    acc.setdefault("logit_corr", []).append(float((a * e).sum() / (a.norm() * e.norm()).clamp(min=1e-12)))
                    algo.append(layer, b, k_all[t][None])
                else:
                    keep = exact_selection(q, k_all, t, budget, sink, recent)
                logits = torch.einsum("hgd,nhd->hgn", q.view(hk, -1, d), k_all[: t + 1]) / math.sqrt(d)
                mass = logits.softmax(-1).mean(1)
                forced = torch.zeros(t + 1, dtype=torch.bool)
                forced[: min(sink, t)] = True
                forced[max(0, t + 1 - recent):] = True
                forced[t] = True
                rest = mass.masked_fill(forced, 0.0)
                n_sel = (keep & ~forced).sum(-1)
                top = rest.sort(-1, descending=True)
                best = top.values.cumsum(-1).gather(-1, (n_sel - 1).clamp(min=0).view(-1, 1)).squeeze(-1)
                acc.setdefault("mass", []).extend(((rest * keep).sum(-1) / best.clamp(min=1e-12)).tolist())
                exact_top = torch.zeros_like(keep)
                exact_top.scatter_(-1, top.indices[:, :budget], True)
                exact_top &= ~forced
                acc.setdefault("token", []).extend(((keep & exact_top).sum(-1) / exact_top.sum(-1).clamp(min=1)).tolist())
                needle = torch.zeros(t + 1, dtype=torch.bool)
                needle[[p for p in c.needle if p <= t]] = True
                nm = (mass * needle).sum(-1)
                if bool(needle.any()):  # the share of the needle's tokens kept, mean over KV heads
                    acc.setdefault("needle_tokens", []).append(float(keep[:, needle].float().mean()))
                if float(nm.sum()) > 0:
                    w = nm / nm.sum()
                    acc.setdefault("needle", []).append(float((((mass * keep * needle).sum(-1) / nm.clamp(min=1e-12)) * w).sum()))
            out["layers"][layer]["sets"][name] = {k: sum(v) / len(v) for k, v in acc.items()}
    return out


def decode_selector(layers: list[int], key_shape: torch.Size, prompt_len: int, budget: int, sink: int, recent: int,
                    options: dict[str, Any], max_new: int) -> Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]:
    """PQCache (`options`) selecting at decode in the model layers `layers`: select(model_layer,
    q [Hq, D], k [n, Hkv, D]) -> keep [Hkv, n] on the CPU (the algorithm runs there, in float32).
    The codebooks are built from the prompt's keys at a layer's first call, and every key
    decoded since is appended."""
    _, hk, d = key_shape
    algo = algorithm(len(layers), hk, d, budget, sink, recent, options, prompt_len + max_new + 1)
    req = Request("r", prompt_len, seq_len=prompt_len, slot=0)
    stored: dict[int, int] = {}  # per layer: how many keys the representation holds

    def select(model_layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        layer, t = layers.index(model_layer), k.shape[0] - 1
        if layer not in stored:
            req.seq_len = prompt_len
            algo.build(layer, req, k[:prompt_len].float().cpu())
            stored[layer] = prompt_len
        for p in range(stored[layer], t):  # keys decoded since (the answer's first token on)
            req.seq_len = p + 1
            algo.append(layer, batch(req), k[p][None].float().cpu())
        stored[layer] = t
        req.seq_len = t + 1
        return selection_mask(algo.select(layer, q.float().cpu()[None], batch(req)), t)

    return select


@torch.no_grad()
def simulate(model: Any, tok: Any, rec: Recorder, c: Captured, options: dict[str, Any] | None, budget: int, sink: int,
             recent: int, max_new: int, device: str) -> str:
    """Greedy decode from the prompt's dense cache, PQCache (`options`) selecting in every layer."""
    import copy

    cache = copy.deepcopy(c.cache)
    select = None if options is None else decode_selector(c.layers, c.keys[0].shape, c.prompt_len, budget, sink,
                                                          recent, options, max_new)

    def selector(model_layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        if select is None or model_layer not in c.layers:  # dense, or a sliding layer
            return None
        return select(model_layer, q, k).to(q.device)

    rec.mode, rec.selector = "sparse", selector
    out, token = [c.first_token], c.first_token
    for _ in range(max_new - 1):
        if token == tok.eos_token_id:
            break
        logits = model(torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
    rec.mode, rec.selector = "capture", None
    return tok.decode(out, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    ap = common_args(__doc__, "4096", 3, "16", DEFAULT_JSON)
    ap.add_argument("--tasks", default="niah_single_1")
    ap.add_argument("--sets", default="", help="option-set names (comma separated; default all)")
    ap.add_argument("--extra-sets", default="", help="JSON {name: PQCache options} added to the option sets")
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--max-new", type=int, default=16)
    args = ap.parse_args(argv)
    console = Console(width=80)
    sets = {k: v for k, v in OPTION_SETS.items() if not args.sets or k in args.sets.split(",")}
    sets.update(json.loads(args.extra_sets) if args.extra_sets else {})
    from sparse_framework.engine.models.catalog import resolve_model
    from sparse_framework.eval.ruler import ruler_samples, score

    model, tok, rec, _ = load(args.device, torch.float32, args.model)
    report: dict[str, Any] = {**provenance("pqcache_analysis.py", argv), "args": vars(args), "model": args.model,
                              "sets": sets, "runs": []}
    for task in args.tasks.split(","):
        for ctx in map(int, args.contexts.split(",")):
            for frac in map(int, args.fractions.split(",")):
                budget = ctx // frac
                samples = ruler_samples(resolve_model(args.model), task, ctx, args.samples, args.seed)
                per, sims = [], {}
                for s in samples:
                    t0 = time.time()
                    c = capture(model, tok, rec, s, args.device)
                    per.append(analyse(c, budget, args.sink, args.recent, sets))
                    if args.simulate:
                        for name, opts in {"dense": None, **sets}.items():
                            text = simulate(model, tok, rec, c, opts, budget, args.sink, args.recent, args.max_new, args.device)
                            sims.setdefault(name, []).append({"score": score(text, s.outputs), "text": text})
                    console.print(f"{task} {ctx} #{s.index}: {time.time() - t0:.0f} s")
                    c.cache = None
                layers = [{"layer": per[0]["layers"][i]["layer"],
                           "sets": {n: {m: sum(p["layers"][i]["sets"][n][m] for p in per) / len(per)
                                        for m in per[0]["layers"][i]["sets"][n]}
                                    for n in per[0]["layers"][i]["sets"]}}
                          for i in range(len(per[0]["layers"]))]
                run = {"task": task, "context": ctx, "budget": budget, "layers": layers,
                       "simulated": {n: {"accuracy": sum(x["score"] for x in v) / len(v), "texts": [x["text"] for x in v]}
                                     for n, v in sims.items()}}
                report["runs"].append(run)
                t = new_table(f"{task} {ctx}, top_k {budget}: mean over layers", tight=True)
                for col in ("option set", "mass", "token", "needle", "logit ρ", "sim. acc."):
                    t.add_column(col, justify="right")
                for n in [*sets, EXACT]:
                    vals = [r["sets"][n] for r in layers]
                    m = {k: sum(v.get(k, float("nan")) for v in vals) / len(vals) for k in ("mass", "token", "needle", "logit_corr")}
                    acc = run["simulated"].get(n, {}).get("accuracy", float("nan"))
                    t.add_row(n, *(f"{m[k]:.3f}" for k in ("mass", "token", "needle", "logit_corr")), f"{acc:.2f}")
                if "dense" in run["simulated"]:
                    t.add_row("dense", "", "", "", "", f"{run['simulated']['dense']['accuracy']:.2f}")
                console.print(t)
                lt = new_table(f"per layer: mass recall (needle recall), top_k {budget}", tight=True)
                cols = [n for n in [*sets, EXACT]][:5]
                lt.add_column("L", justify="right")
                for n in cols:
                    lt.add_column(n[:14], justify="right")
                for r in layers:
                    lt.add_row(str(r["layer"]), *(f"{r['sets'][n]['mass']:.2f} ({r['sets'][n].get('needle', float('nan')):.2f})" for n in cols))
                console.print(lt)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
