"""Why sparse decode loses RULER on a real model: what each selection keeps of the tokens the
answer needs, per layer and KV head (issue 47, step 3).

The capture is `quest_analysis.py`'s (transformers with a recording attention function; the
prompt dense, then the gold answer teacher-forced: the decode queries as the engine sees
them), on raw prompts by default (`--chat` for the chat template), encoded as the engine's
RULER runner does (the tokenizer's own BOS, which Gemma needs); `--model` picks the catalog
model (on Gemma 3 only its full-attention layers are analysed, numbered as the model's). The
marked tokens are

  ruler_fwe      every token of every occurrence in the prompt of the three answer words
                 (`sample.outputs`, the most frequent coded words): counting needs them all
  niah_*         the needle's value tokens (`quest_analysis.find_needle`)

and for each decode query, layer, KV head, selection and budget (1/x of the context) it
measures

  token share   the share of the marked tokens the selection keeps
  occ. share    the share of the occurrences kept whole (every token of the word)
  mass share    the share of the marked tokens' attention mass (the group's mean softmax)
                that the selection keeps
  marked mass   the dense attention mass on the marked tokens (how much the layer looks)
  total mass    the share of all the attention mass (every token) the selection keeps
  w. mass       the mass share, each layer and head weighted by its marked mass (a layer
                that does not look at the marked tokens cannot lose them)

Selections (sink + recent forced, the same token budget): Quest's bound ("quest sum
(default)"), Quest with range_weight 0 ("mid sum", the page midpoint), Quest's GQA "max"
reduction, pages of 8 and 4, the exact page max ("oracle page"), the exact token top-k of the
group's attention mass ("oracle token", a DSA indexer at its best) and, on NIAH prompts,
SnapKV's prefill-time selection (the last `window` prompt queries vote, pooled, fixed for the
whole decode; its options in `SNAPKV_SETS`). `--pqcache` also runs `pqcache_analysis.analyse`
on the same captures (a forward at 8K costs minutes on a CPU, so one capture serves both).

    python benchmarks/fwe_analysis.py --task ruler_fwe --contexts 4096 --samples 8
    python benchmarks/fwe_analysis.py --task niah_single_1 --contexts 4096,8192 --samples 2 --pqcache \\
        --json benchmarks/results/ruler_losses_cpu_niah.json
    python benchmarks/fwe_analysis.py --model gemma3-270m --contexts 8192 --samples 4 \\
        --json benchmarks/results/ruler_losses_gemma3_cpu_fwe.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from quest_analysis import (  # noqa: E402
    Captured, Recorder, Variant, common_args, find_needle, group_mass, load, pages_to_tokens, select_pages,
    teacher_forced, variant_scores,
)

from timing import provenance  # noqa: E402

from sparse_framework.algorithms.snapkv import SnapKVOptions, snapkv_votes  # noqa: E402
from sparse_framework.common.tables import new_table  # noqa: E402

DEFAULT_JSON = "benchmarks/results/ruler_losses_cpu.json"
PAGE_VARIANTS = [
    Variant("quest sum (default)"),
    Variant("mid sum", score="mid"),
    Variant("quest max", reduce="max"),
    Variant("quest page 8", page=8),
    Variant("oracle page", score="oracle"),
    Variant("mid page 8", score="mid", page=8),
    Variant("mid page 4", score="mid", page=4),
    Variant("oracle page 4", score="oracle", page=4),
]
ORACLE_TOKEN = "oracle token"
SNAPKV_SETS: dict[str, dict[str, Any]] = {
    "snapkv (w32 k7 max)": {},
    "snapkv window 64": {"window": 64},
    "snapkv gqa max": {"gqa_reduce": "max"},
    "snapkv kernel 1": {"kernel_size": 1},
}


# -- marked tokens -----------------------------------------------------------------------------
def word_spans(text: str, words: list[str] | tuple[str, ...]) -> dict[str, list[tuple[int, int]]]:
    """Character spans of every whole-word occurrence of each word (letters on neither side:
    "abc" is not found inside "xabc")."""
    return {w: [(m.start(), m.end()) for m in re.finditer(rf"(?<![A-Za-z]){re.escape(w)}(?![A-Za-z])", text)]
            for w in words}


def span_tokens(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[list[int]]:
    """For each character span, the tokens whose [start, end) offsets overlap it (a token that
    holds the leading space and the word's first letters counts)."""
    out: list[list[int]] = []
    starts = [s for s, _ in offsets]
    for a, b in spans:
        toks, i = [], max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(offsets) and offsets[i][0] < b:
            s, e = offsets[i]
            if e > a and e > s:
                toks.append(i)
            i += 1
        out.append(toks)
    return out


def occurrences(tok: Any, text: str, words: list[str] | tuple[str, ...]) -> tuple[list[int], dict[str, list[list[int]]]]:
    """The prompt's token ids (with the tokenizer's own special tokens, as `ruler.prompt_ids`
    encodes: Gemma's BOS) and, per word, the token positions of each of its occurrences."""
    enc = tok(text, add_special_tokens=True, return_offsets_mapping=True)
    spans = word_spans(text, words)
    return enc.input_ids, {w: span_tokens(enc.offset_mapping, spans[w]) for w in words}


@dataclass
class Shares:
    """Per KV head [Hkv]: token share, whole-occurrence share, mass share kept (nan where the
    marked tokens have no mass)."""

    token: torch.Tensor
    occurrence: torch.Tensor
    mass: torch.Tensor


def kept_shares(keep: torch.Tensor, occ: list[list[int]], mass: torch.Tensor) -> Shares:
    """keep bool [Hkv, n], occ: token positions per occurrence (< n), mass [Hkv, n] ->
    what `keep` retains of the marked tokens (`Shares`)."""
    pos = sorted({p for o in occ for p in o})
    if not pos:
        nan = torch.full((keep.shape[0],), float("nan"))
        return Shares(nan, nan, nan)
    idx = torch.tensor(pos)
    token = keep[:, idx].float().mean(-1)
    occ = [o for o in occ if o]
    flat = torch.tensor([p for o in occ for p in o])
    owner = torch.tensor([i for i, o in enumerate(occ) for _ in o])
    missed = torch.zeros(keep.shape[0], len(occ)).index_add_(1, owner, (~keep[:, flat]).float())
    whole = (missed == 0).float().mean(-1)
    m = mass[:, idx]
    tot = m.sum(-1)
    kept = (m * keep[:, idx]).sum(-1)
    return Shares(token, whole, torch.where(tot > 0, kept / tot.clamp(min=1e-30), torch.full_like(tot, float("nan"))))


# -- selections --------------------------------------------------------------------------------
def forced_tokens(t: int, sink: int, recent: int) -> torch.Tensor:
    """bool [t+1]: the sink tokens, the recent window and the newest token."""
    f = torch.zeros(t + 1, dtype=torch.bool)
    f[: min(sink, t + 1)] = True
    f[max(0, t + 1 - max(recent, 1)):] = True
    return f


def token_topk(scores: torch.Tensor, t: int, budget: int, sink: int, recent: int) -> torch.Tensor:
    """scores [Hkv, >=t+1] -> bool [Hkv, t+1]: the forced tokens plus the best `budget` others."""
    forced = forced_tokens(t, sink, recent)
    s = scores[:, : t + 1].masked_fill(forced, float("-inf"))
    keep = forced.expand(scores.shape[0], -1).clone()
    k = min(budget, int((~forced).sum()))
    if k > 0:
        keep.scatter_(-1, s.topk(k, -1).indices, True)
    return keep


def snapkv_keep(votes: torch.Tensor, window_start: int, t: int, budget: int, sink: int, recent: int) -> torch.Tensor:
    """SnapKV's "on_top" selection at decode position t: votes [Hkv, window_start] (the prompt
    before its observation window) -> bool [Hkv, t+1]: the best `budget` votes plus sink,
    recent, the window and every decoded token."""
    hk = votes.shape[0]
    scores = torch.full((hk, t + 1), float("-inf"))
    scores[:, :window_start] = votes[:, :window_start]
    keep = token_topk(scores, t, budget, sink, recent)
    keep[:, window_start:] = True
    return keep


# -- capture -----------------------------------------------------------------------------------
@torch.no_grad()
def capture(model: Any, tok: Any, rec: Recorder, sample: Any, chat: bool, device: str, window: int = 64
            ) -> tuple[Captured, dict[str, list[list[int]]], list[torch.Tensor]]:
    """Dense prefill of the prompt, then the gold answer teacher-forced (fwe: the three words,
    comma separated; NIAH: the value). Returns the capture, the marked occurrences per word,
    and per layer the prompt's last `window` queries [window, Hq, D] (SnapKV's voters)."""
    from sparse_framework.eval.ruler import prompt_ids, prompt_text

    text = prompt_text(sample, tok, chat)
    if sample.task == "ruler_fwe":
        ids, occ = occurrences(tok, text, sample.outputs)
        assert ids == prompt_ids(sample, tok, chat), "the marked ids differ from the engine's encoding"
        answer = tok(" " + ", ".join(sample.outputs), add_special_tokens=False).input_ids
    else:
        ids = prompt_ids(sample, tok, chat)
        answer = tok(" " + sample.outputs[0], add_special_tokens=False).input_ids
        needle = find_needle(ids, answer)
        occ = {sample.outputs[0]: [needle]} if needle else {}
    t = teacher_forced(model, rec, ids, answer, device, voters=window)
    p = len(ids)
    flat = sorted({x for o in occ.values() for y in o for x in y})
    return (Captured(t.keys, t.queries, list(range(p, p + len(answer) - 1)), flat, p, None, t.first,
                     {"task": sample.task, "index": sample.index, "answer": list(sample.outputs)}, t.layers),
            occ, t.voters)


# -- analysis ----------------------------------------------------------------------------------
def analyse(c: Captured, occ: dict[str, list[list[int]]], voters: list[torch.Tensor], budgets: list[int], sink: int,
            recent: int, snapkv: bool, only: set[str] | None = None) -> dict[str, Any]:
    """Per layer: the marked tokens' dense mass, and per selection and budget the mean over
    decode queries of each KV head's `Shares` (plus, for fwe, per answer word's token share).
    `only`: the selection names to measure (None: all)."""
    page_variants = [v for v in PAGE_VARIANTS if only is None or v.name in only]
    snap_sets = {n: o for n, o in SNAPKV_SETS.items() if only is None or n in only}
    allocc = [o for w in occ.values() for o in w]
    res: dict[str, Any] = {"marked_tokens": len({p for o in allocc for p in o}), "occurrences": len(allocc),
                           "per_word_occurrences": {w: len(v) for w, v in occ.items()}, "layers": []}
    for layer, model_layer in enumerate(c.layers):
        k_all = c.keys[layer]
        votes: dict[str, torch.Tensor] = {}
        if snapkv:
            for name, opts in snap_sets.items():
                o = SnapKVOptions(**opts)
                votes[name] = snapkv_votes(k_all[: c.prompt_len], voters[layer], o, "torch")
        acc: dict[str, list[torch.Tensor]] = {}
        for i, t in enumerate(c.positions):
            q = c.queries[layer][i]
            mass = group_mass(q, k_all[: t + 1])
            marked = torch.zeros(t + 1, dtype=torch.bool)
            marked[[p for p in c.needle if p <= t]] = True
            acc.setdefault("marked_mass", []).append((mass * marked).sum(-1))
            keeps: dict[str, torch.Tensor] = {}
            memo: dict = {}
            for v in page_variants:
                red, forced = variant_scores(v, q, k_all, t, sink, recent, None, memo)
                for b in budgets:
                    keeps[f"{v.name}|{b}"] = pages_to_tokens(select_pages(red, forced, b // v.page), v.page, t)
            for b in budgets:
                if only is None or ORACLE_TOKEN in only:
                    keeps[f"{ORACLE_TOKEN}|{b}"] = token_topk(mass, t, b, sink, recent)
                for name, vt in votes.items():
                    keeps[f"{name}|{b}"] = snapkv_keep(vt, vt.shape[-1], t, b, sink, recent)
            for key, keep in keeps.items():
                s = kept_shares(keep, allocc, mass)
                for m in ("token", "occurrence", "mass"):
                    acc.setdefault(f"{m}|{key}", []).append(getattr(s, m))
                acc.setdefault(f"total|{key}", []).append((mass * keep).sum(-1))  # of all the attention mass
                if len(occ) > 1:
                    for w, wo in occ.items():
                        acc.setdefault(f"word {w}|{key}", []).append(kept_shares(keep, wo, mass).token)
        row: dict[str, Any] = {"layer": model_layer, "sel": {}}
        for name, vals in acc.items():
            per_head = torch.stack(vals).nanmean(0).tolist()
            if "|" not in name:
                row[name] = per_head
                continue
            metric, sel, b = name.split("|")
            row["sel"].setdefault(f"{sel}|{b}", {})[metric] = per_head
        res["layers"].append(row)
    return res


def merge(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over prompts, per layer, selection, metric and KV head (per-word keys differ
    between prompts: folded into "word 1..3" by the order of `outputs`)."""
    def fold(r: dict[str, Any]) -> dict[str, Any]:
        words = list(r["per_word_occurrences"])
        out = []
        for row in r["layers"]:
            sel = {}
            for key, ms in row["sel"].items():
                sel[key] = {(f"word {words.index(m[5:]) + 1}" if m.startswith("word ") else m): v for m, v in ms.items()}
            out.append({**row, "sel": sel})
        return out

    folded = [fold(r) for r in results]

    def mean(xs: list[list[float]]) -> list[float]:
        t = torch.tensor(xs)
        return t.nanmean(0).tolist()

    out = []
    for i in range(len(folded[0])):
        rows = [f[i] for f in folded]
        m: dict[str, Any] = {"layer": rows[0]["layer"], "marked_mass": mean([r["marked_mass"] for r in rows]),
                             "sel": {}}
        for key in rows[0]["sel"]:
            m["sel"][key] = {metric: mean([r["sel"][key][metric] for r in rows]) for metric in rows[0]["sel"][key]}
        out.append(m)
    return out


def _avg(xs: list[float]) -> float:
    v = [x for x in xs if not math.isnan(x)]
    return sum(v) / len(v) if v else float("nan")


# -- report ------------------------------------------------------------------------------------
def weighted_mass(layers: list[dict[str, Any]], key: str) -> float:
    """The marked tokens' mass share kept, each layer and head weighted by its dense mass on
    them: a layer that does not look at the needle cannot lose it."""
    num = den = 0.0
    for r in layers:
        for w, m in zip(r["marked_mass"], r["sel"][key]["mass"]):
            if not math.isnan(m):
                num, den = num + w * m, den + w
    return num / den if den > 0 else float("nan")


def print_pqcache(console: Console, run: dict[str, Any]) -> None:
    """PQCache's recalls (`pqcache_analysis.analyse`), mean over all layers (PQCache has no
    dense layers); "w. needle": the needle recall, layers weighted by their mass on it."""
    for b, layers in run.get("pqcache", {}).items():
        t = new_table(f"PQCache {run['task']} {run['context']}, top_k {b}: mean over layers", tight=True)
        for col in ("option set", "mass", "token", "needle", "w. needle", "needle tok.", "logit ρ"):
            t.add_column(col, justify="right")
        weights = [_avg(r["marked_mass"]) for r in run["layers"]]
        for n in layers[0]["sets"]:
            vals = [r["sets"][n] for r in layers]
            num = sum(w * v["needle"] for w, v in zip(weights, vals) if not math.isnan(v.get("needle", float("nan"))))
            t.add_row(n, *(f"{_avg([v.get(m, float('nan')) for v in vals]):.3f}" for m in ("mass", "token", "needle")),
                      f"{num / sum(weights):.3f}",
                      *(f"{_avg([v.get(m, float('nan')) for v in vals]):.3f}" for m in ("needle_tokens", "logit_corr")))
        console.print(t)


def print_run(console: Console, run: dict[str, Any], dense_first: int) -> None:
    """The summary over sparse layers (model layers >= `dense_first`; on a hybrid model the
    full-attention ones), and per layer the token share of the main selections."""
    layers = run["layers"]
    sparse = [r for r in layers if r["layer"] >= dense_first]
    sels = list(layers[0]["sel"])
    t = new_table(f"{run['task']} {run['context']}: marked tokens kept, layers >= {dense_first}, mean of heads "
                  f"({run['marked_tokens']:.0f} marked tokens, {run['occurrences']:.0f} occ.)", tight=True)
    for col in ("selection", "budget", "fits", "token", "occ.", "mass", "w. mass", "head min", "all mass"):
        t.add_column(col, justify="right")
    for key in sels:
        name, b = key.split("|")
        vals = {m: _avg([_avg(r["sel"][key][m]) for r in sparse]) for m in ("token", "occurrence", "mass")}
        heads = [_avg([r["sel"][key]["token"][h] for r in sparse]) for h in range(len(layers[0]["marked_mass"]))]
        fits = min(1.0, int(b) / max(run["marked_tokens"], 1))  # the most a budget of b can hold
        t.add_row(name, b, f"{fits:.3f}", f"{vals['token']:.3f}", f"{vals['occurrence']:.3f}", f"{vals['mass']:.3f}",
                  f"{weighted_mass(sparse, key):.3f}", f"{min(heads):.3f}",
                  f"{_avg([_avg(r['sel'][key]['total']) for r in sparse]):.3f}")
    console.print(t)
    main = [s for s in ("quest sum (default)", "mid sum", "oracle page", ORACLE_TOKEN, "snapkv (w32 k7 max)")
            if any(k.startswith(s + "|") for k in sels)]
    for b in run["budgets"]:
        lt = new_table(f"per layer, budget {b}: token share kept (mass share)", tight=True)
        lt.add_column("L", justify="right")
        lt.add_column("mass on", justify="right")
        for n in main:
            lt.add_column(n.replace(" (default)", "").replace(" (w32 k7 max)", ""), justify="right")
        for r in layers:
            cells = [str(r["layer"]), f"{_avg(r['marked_mass']):.3f}"]
            for n in main:
                m = r["sel"][f"{n}|{b}"]
                cells.append(f"{_avg(m['token']):.2f} ({_avg(m['mass']):.2f})")
            lt.add_row(*cells)
        console.print(lt)


def summarise(ctx: int, budgets: list[int], per: list[dict[str, Any]], pq: list[dict[str, Any]]) -> dict[str, Any]:
    """One context's run from its prompts' analyses (`per`) and PQCache analyses (`pq`)."""
    run: dict[str, Any] = {"context": ctx, "budgets": budgets, "samples": len(per),
                           "marked_tokens": _avg([p["marked_tokens"] for p in per]),
                           "occurrences": _avg([p["occurrences"] for p in per]),
                           "prompts": [{**{k: p[k] for k in ("prompt_len", "marked_tokens", "occurrences", "per_word_occurrences")},
                                        "answer": p["answer"], "marked_mass": [_avg(r["marked_mass"]) for r in p["layers"]],
                                        "sel": {key: {m: [_avg(r["sel"][key][m]) for r in p["layers"]] for m in ("token", "mass")}
                                                for key in p["layers"][0]["sel"]}}
                                       for p in per],
                           "layers": merge(per)}
    if pq:
        run["pqcache"] = {b: [{"layer": pq[0][b]["layers"][i]["layer"],
                               "sets": {n: {m: _avg([p[b]["layers"][i]["sets"][n].get(m, float("nan")) for p in pq])
                                            for m in pq[0][b]["layers"][i]["sets"][n]}
                                        for n in pq[0][b]["layers"][i]["sets"]}}
                              for i in range(len(pq[0][b]["layers"]))] for b in pq[0]}
    return run


def _indices(text: str) -> set[int]:
    """--indices: comma-separated non-negative prompt indices."""
    try:
        out = {int(i) for i in text.split(",") if i.strip()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated prompt indices such as 15,36, got {text!r}") from None
    if any(i < 0 for i in out):
        raise argparse.ArgumentTypeError(f"prompt indices are 0 or more, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common_args(__doc__, "4096", 8, "8,32", DEFAULT_JSON)
    ap.add_argument("--task", default="ruler_fwe", help="ruler_fwe or a niah task")
    ap.add_argument("--dense-first", type=int, default=2, help="layers left out of the summary (dense_first_layers)")
    ap.add_argument("--chat", action="store_true", help="prompts through the chat template (default: raw)")
    ap.add_argument("--snapkv", action="store_true", help="add SnapKV's prefill selections (default on for NIAH)")
    ap.add_argument("--pqcache", action="store_true", help="also run pqcache_analysis.analyse on each capture")
    ap.add_argument("--pq-sets", default="default (M2 b6 it20),bits 8", help="PQCache option sets (names)")
    ap.add_argument("--selections", default="", help="selection names to measure (comma separated; default all)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--indices", default="", type=_indices, help="only these prompts of the --samples set "
                    "(comma separated indices, e.g. the ones a GPU cell answered differently)")
    ap.add_argument("--show", default="", help="print the tables of a results JSON (runs nothing)")
    args = ap.parse_args(argv)
    if args.show:
        shown = json.loads(Path(args.show).read_text())
        for run in shown["runs"]:
            print_pqcache(Console(width=80), run)
            print_run(Console(width=80), run, shown["args"]["dense_first"])
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=80)
    from sparse_framework.engine.models.catalog import resolve_model
    from sparse_framework.eval.ruler import ruler_samples

    model, tok, rec, _ = load(args.device, torch.float32, args.model)
    snap = args.snapkv or args.task.startswith("niah")
    report: dict[str, Any] = {**provenance("fwe_analysis.py", argv), "args": vars(args), "model": args.model,
                              "runs": []}
    for ctx in map(int, args.contexts.split(",")):
        budgets = [ctx // int(f) for f in args.fractions.split(",")]
        samples = ruler_samples(resolve_model(args.model), args.task, ctx, args.samples, args.seed)
        if args.indices:
            missing = args.indices - {s.index for s in samples}
            if missing:
                ap.error(f"--indices {sorted(missing)} are not among the {len(samples)} prompts of --samples "
                         f"{args.samples} (indices 0..{len(samples) - 1})")
            samples = [s for s in samples if s.index in args.indices]
        per, pq = [], []
        for s in samples:
            t0 = time.time()
            c, occ, voters = capture(model, tok, rec, s, args.chat, args.device)
            t1 = time.time()
            r = analyse(c, occ, voters, budgets, args.sink, args.recent, snap,
                        set(args.selections.split(",")) if args.selections else None)
            r["prompt_len"], r["answer"] = c.prompt_len, c.meta["answer"]
            per.append(r)
            if args.pqcache:
                from pqcache_analysis import OPTION_SETS
                from pqcache_analysis import analyse as pq_analyse

                sets = {n: OPTION_SETS[n] for n in args.pq_sets.split(",")}
                pq.append({str(b): pq_analyse(c, b, args.sink, args.recent, sets) for b in budgets})
            console.print(f"{args.task} {ctx} #{s.index}: {c.prompt_len} tokens, {r['occurrences']} occurrences "
                          f"({r['marked_tokens']} tokens; {r['per_word_occurrences']}), capture {t1 - t0:.0f} s, "
                          f"analysis {time.time() - t1:.0f} s")
            run = {"task": args.task, **summarise(ctx, budgets, per, pq)}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)  # after every prompt: a long run keeps its part
            Path(args.json).write_text(json.dumps({**report, "runs": [*report["runs"], run]}, indent=1))
        report["runs"].append(run)
        print_pqcache(console, run)
        print_run(console, run, args.dense_first)
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
