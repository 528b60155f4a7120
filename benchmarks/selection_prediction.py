"""Can layer l+1's Quest selection be predicted in time to prefetch its misses? (issue 33, item 1)

The hierarchical store copies the selected pages that are not in a layer's device buffer
("misses") host->device on the critical path. Overlapping layer l+1's swap-in with layer l's
compute needs layer l+1's selection before layer l runs, so this script measures how well a
prediction made that early matches the real one, on SmolLM2-135M-Instruct and RULER prompts.
The model runs in transformers with `quest_analysis.py`'s recording attention function: a dense
prefill, then greedy decode steps in which every sparse layer attends only to its own Quest
selection (page min/max bounds over all keys, the newest included, as the engine's `append`
precedes `select`; sink/recent/newest pages forced, top_k // page_size more pages per KV head,
GQA scores summed; `dense_first_layers` attend densely). Per decode step and target layer l+1:

  previous step   layer l+1's selection at the previous step (what a buffer holds anyway)
  previous layer  layer l's selection at this step (layer 1's for layer 2: computed, not used)
  early query     InfiniGen-style: q̂ = RoPE(W_q^{l+1} · input_norm^{l+1}(h_l)), h_l the residual
                  stream ENTERING layer l (known before layer l runs), scored with the same rule
  mid query       the same from the residual after layer l's attention (before its MLP)
  early query 2x  the early query's top 2·k pages (more prefetch, more waste)

Metrics, over pages outside the forced ones (sink, recent window, newest page) per KV head:
  recall      |pred ∩ actual| / |actual|
  miss cov.   of actual pages not in layer l+1's selection at the previous step (the misses
              of a buffer holding just the last selection), the share the prediction holds
  LRU cov.    the same for the misses of an LRU buffer of --buffer-tokens per (layer, head)
              (pinned sink/recent/newest pages, evicting the least recently selected)
  waste       predicted pages not in the actual selection, per step and KV head
  fetch       predicted pages not in the previous step's selection (what a prefetch copies),
              and "f.waste" those of them not selected after all, per step and KV head
Means pool counts over steps 1..N (step 0, the first decode step, has no previous step),
KV heads, prompts and target layers dense_first+1..L-1 (so "previous layer" is a sparse one).
Decoding runs on past EOS (a niah answer is ~8 tokens); a second table keeps the answer's steps.

On the CPU (float32; one thread: two threads sharing 2 busy cores ran 8x slower), ~7 min:
    OMP_NUM_THREADS=1 python benchmarks/selection_prediction.py --tasks niah_single_1,ruler_cwe \\
        --samples 6 --steps 32 --range-weights 0,1   # -> benchmarks/results/selection_prediction_smollm2.json
    python benchmarks/selection_prediction.py --samples 1 --steps 4 --json /tmp/sp.json   # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quest_analysis as qa  # noqa: E402
from sparse_framework.common.tables import new_table  # noqa: E402

DEFAULT_JSON = "benchmarks/results/selection_prediction_smollm2.json"
PREDICTORS = ("previous step", "previous layer", "early query", "mid query", "early query 2x")
SHORT = {"previous step": "pS", "previous layer": "pL", "early query": "eq", "mid query": "mq", "early query 2x": "eq2"}
COUNTS = ("n", "actual", "hit", "pred", "miss", "miss_hit", "fetch", "fetch_waste", "lru_miss", "lru_miss_hit")


# -- metrics (pure functions: tests/test_benchmarks_selection_prediction.py) ------------------
def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, range_weight: float) -> torch.Tensor:
    """Quest's page score, the engine's rule (kernels/reference/scores.py): per query head
    q·(min+max)/2 + range_weight·Σ_d |q_d|·(max_d − min_d)/2, summed over the GQA group.
    q [Hq, D]; lo, hi [Hkv, P, D] -> [Hkv, P]."""
    hk, _, d = lo.shape
    qq = q.view(hk, -1, 1, d)
    mid, half = ((lo + hi) / 2)[:, None], ((hi - lo) / 2)[:, None]
    return ((qq * mid).sum(-1) + range_weight * (qq.abs() * half).sum(-1)).sum(1)


def quest_select(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, forced: torch.Tensor, budget: int,
                 range_weight: float) -> torch.Tensor:
    """bool [Hkv, P]: the forced pages plus the `budget` best others (quest_analysis's rule)."""
    return qa.select_pages(page_scores(q, lo, hi, range_weight), forced, budget)


def pad_pages(mask: torch.Tensor, pages: int) -> torch.Tensor:
    """bool [H, P'] -> [H, pages]: a selection made when the sequence had fewer pages."""
    return torch.nn.functional.pad(mask, (0, pages - mask.shape[-1]), value=False)


def overlap_counts(pred: torch.Tensor, actual: torch.Tensor, prev: torch.Tensor, free: torch.Tensor,
                   buffer: torch.Tensor | None = None) -> dict[str, int]:
    """Counts, summed over heads, for one prediction. pred, actual, prev (the previous step's
    selection of the same layer), buffer (pages an LRU buffer holds before this step): bool
    [H, P]; free: bool [P] or [H, P], the pages that are not forced (only they count).
    Counts, not ratios, so that steps, heads, prompts and layers pool exactly."""
    a, p = actual & free, pred & free
    miss, fetch = a & ~prev, p & ~prev
    lru = a & ~buffer if buffer is not None else torch.zeros_like(a)
    vals = {"n": a.shape[0], "actual": a.sum(), "hit": (p & a).sum(), "pred": p.sum(), "miss": miss.sum(),
            "miss_hit": (p & miss).sum(), "fetch": fetch.sum(), "fetch_waste": (fetch & ~a).sum(),
            "lru_miss": lru.sum(), "lru_miss_hit": (p & lru).sum()}
    return {k: int(v) for k, v in vals.items()}


def add_counts(into: dict[str, int], more: dict[str, int]) -> None:
    """into += more, key by key."""
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def rates(c: dict[str, int]) -> dict[str, float]:
    """Pooled ratios of summed counts (nan where the denominator is 0); per-step figures are
    per step and KV head (`n` counts step × head instances)."""
    def div(a: float, b: float) -> float:
        return a / b if b else float("nan")
    return {"recall": div(c["hit"], c["actual"]), "miss_coverage": div(c["miss_hit"], c["miss"]),
            "lru_coverage": div(c["lru_miss_hit"], c["lru_miss"]), "waste": div(c["pred"] - c["hit"], c["n"]),
            "fetch": div(c["fetch"], c["n"]), "fetch_waste": div(c["fetch_waste"], c["n"]),
            "misses": div(c["miss"], c["n"]), "lru_misses": div(c["lru_miss"], c["n"])}


class LruBuffer:
    """One layer's device buffers, one per KV head, in pages: the store's policy reduced to
    sets (selected pages become resident and are stamped; beyond `capacity` the least recently
    selected non-pinned page goes, ties to the lower page, as SlotMaps.victims picks)."""

    def __init__(self, heads: int, capacity: int) -> None:
        self.capacity = capacity
        self.last: list[dict[int, int]] = [{} for _ in range(heads)]
        self.clock = 0

    def resident(self, pages: int) -> torch.Tensor:
        """bool [H, pages]: what each buffer holds now."""
        out = torch.zeros(len(self.last), pages, dtype=torch.bool)
        for h, held in enumerate(self.last):
            out[h, [p for p in held if p < pages]] = True
        return out

    def update(self, selected: torch.Tensor, pinned: torch.Tensor) -> None:
        """After a step: selected bool [H, P] becomes resident; pinned bool [P] never leaves."""
        self.clock += 1
        for h, held in enumerate(self.last):
            for p in selected[h].nonzero().flatten().tolist():
                held[p] = self.clock
            spare = sorted((t, p) for p, t in held.items() if t < self.clock and not (p < len(pinned) and pinned[p]))
            for _, p in spare[: max(0, len(held) - self.capacity)]:
                del held[p]


# -- the model ---------------------------------------------------------------------------------
def early_query(layer: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s post-RoPE query [Hq, D] computed from the residual h [hidden] of an
    earlier point of the network: input_norm, W_q, RoPE, as LlamaAttention does (no bias)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    q = attn.q_proj(layer.input_layernorm(h.view(1, 1, -1))).view(1, 1, -1, attn.head_dim).transpose(1, 2)
    return apply_rotary_pos_emb(q, q, cos, sin)[0][0, :, 0].float()


class Tracer:
    """Forward hooks: the last position's residual entering each decoder layer and after its
    attention, and the RoPE cos/sin the layers get (the same for every layer)."""

    def __init__(self, model: Any) -> None:
        self.layers = model.model.layers
        self.h_in: dict[int, torch.Tensor] = {}
        self.h_mid: dict[int, torch.Tensor] = {}
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(partial(self._enter, i), with_kwargs=True)
            layer.post_attention_layernorm.register_forward_pre_hook(partial(self._mid, i))

    def _enter(self, i: int, module: Any, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        self.h_in[i] = h[0, -1].detach()
        self.rope = kwargs.get("position_embeddings")

    def _mid(self, i: int, module: Any, args: tuple) -> None:
        self.h_mid[i] = args[0][0, -1].detach()


class Step:
    """What one decode step's selector saw: per layer the actual selection, the predictions
    made from the previous layer's residuals, and the forced pages."""

    def __init__(self) -> None:
        self.actual: dict[int, torch.Tensor] = {}
        self.preds: dict[int, dict[str, torch.Tensor]] = {}
        self.forced: torch.Tensor | None = None


def make_selector(tracer: Tracer, step: list[Step], rw: float, args: argparse.Namespace) -> Any:
    """The recorder's selector: selects every layer (dense ones too, unused), predicts it from
    layer l−1's residuals, and returns the token mask for sparse layers (None: dense)."""
    budget = args.top_k // args.page

    def selector(layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        s = step[0]
        t = k.shape[0] - 1
        lo, hi, _ = qa.page_stats(k.float(), args.page)
        forced = qa.forced_pages(lo.shape[1], args.page, t, args.sink, args.recent)
        s.actual[layer], s.forced = quest_select(q.float(), lo, hi, forced, budget, rw), forced
        if layer > 0:
            assert tracer.rope is not None
            cos, sin = tracer.rope
            target = tracer.layers[layer]
            eq = page_scores(early_query(target, tracer.h_in[layer - 1], cos, sin), lo, hi, rw)
            mq = page_scores(early_query(target, tracer.h_mid[layer - 1], cos, sin), lo, hi, rw)
            s.preds[layer] = {"early query": qa.select_pages(eq, forced, budget),
                              "early query 2x": qa.select_pages(eq, forced, 2 * budget),
                              "mid query": qa.select_pages(mq, forced, budget)}
        if layer < args.dense_first or args.dense_decode:
            return None
        return qa.pages_to_tokens(s.actual[layer], args.page, t)

    return selector


@torch.no_grad()
def run_sample(model: Any, tok: Any, rec: qa.Recorder, tracer: Tracer, sample: Any, rws: list[float],
               args: argparse.Namespace, acc: dict[float, dict[str, Any]]) -> list[dict[str, Any]]:
    """One prompt: a dense prefill, then per range_weight `args.steps` + 1 greedy sparse decode
    steps from a copy of its cache; counts added into acc[rw]["layers"][L][pred],
    acc[rw]["steps"][s][pred] and, for steps that feed a token before the first EOS (the answer
    proper; later steps decode past it), acc[rw]["answer"][pred], both over the target layers."""
    from sparse_framework.eval.ruler import prompt_text, score

    ids = tok(prompt_text(sample, tok, True), add_special_tokens=False).input_ids
    rec.mode, rec.selector = "sparse", None
    out = model(torch.tensor([ids]), use_cache=True)
    cache0, first = out.past_key_values, int(out.logits[0, -1].argmax())
    n_layers = len(tracer.layers)
    cap = -(-args.buffer_tokens // args.page)
    info = []
    for rw in rws:
        cache, token, tokens, step = copy.deepcopy(cache0), first, [first], [Step()]
        rec.selector = make_selector(tracer, step, rw, args)
        prev: dict[int, torch.Tensor] = {}
        lru = {layer: LruBuffer(model.config.num_key_value_heads, cap) for layer in range(n_layers)}
        for s in range(args.steps + 1):
            step[0] = Step()
            logits = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            st, answering = step[0], tok.eos_token_id not in tokens[:-1]  # the fed token precedes any EOS
            assert st.forced is not None
            free, pages = ~st.forced, st.forced.shape[0]
            for layer in range(1, n_layers):
                actual = st.actual[layer]
                if s > 0:
                    before = pad_pages(prev[layer], pages)
                    buffer = lru[layer].resident(pages)
                    preds = {"previous step": before, "previous layer": st.actual[layer - 1], **st.preds[layer]}
                    for name, pred in preds.items():
                        c = overlap_counts(pred, actual, before, free, buffer)
                        add_counts(acc[rw]["layers"].setdefault(layer, {}).setdefault(name, {}), c)
                        if layer > args.dense_first:
                            add_counts(acc[rw]["steps"].setdefault(s, {}).setdefault(name, {}), c)
                            if answering:
                                add_counts(acc[rw]["answer"].setdefault(name, {}), c)
                lru[layer].update(actual, st.forced)
                prev[layer] = actual
        eos = tok.eos_token_id
        answer = tokens[: tokens.index(eos)] if eos in tokens else tokens
        text = tok.decode(answer, skip_special_tokens=True)
        info.append({"index": sample.index, "range_weight": rw, "prompt_tokens": len(ids), "text": text,
                     "score": score(text, sample.outputs), "eos_step": tokens.index(eos) if eos in tokens else None})
    rec.selector = None
    return info


# -- report ------------------------------------------------------------------------------------
def pooled(layers: dict[int, dict[str, dict[str, int]]], lo: int) -> dict[str, dict[str, int]]:
    """Counts per predictor summed over layers >= lo."""
    out: dict[str, dict[str, int]] = {}
    for layer, per in layers.items():
        if layer >= lo:
            for name, c in per.items():
                add_counts(out.setdefault(name, {}), c)
    return out


def print_run(console: Console, run: dict[str, Any], dense_first: int) -> None:
    """Summary (pooled over target layers) and per-layer table of one task and range_weight."""
    mean = run["mean"]
    r0 = mean["previous step"]
    scores = [x["score"] for x in run["samples"]]
    t = new_table(f"{run['task']} {run['context']}, range_weight {run['range_weight']}: layers "
                  f"{dense_first + 1}-{max(map(int, run['layers']))}, steps 1-{run['steps']}",
                  caption=f"per step and KV head: {r0['misses']:.2f} pages miss a buffer of the last selection, "
                          f"{r0['lru_misses']:.2f} an LRU buffer of {run['buffer_tokens']} tokens (of "
                          f"{run['budget_pages']} free pages selected); answers {sum(scores) / len(scores):.2f}")
    for col in ("predictor", "recall", "miss cov.", "LRU cov.", "waste/st", "fetch/st", "f.waste/st"):
        t.add_column(col, justify="right")
    for name in PREDICTORS:
        m = mean[name]
        t.add_row(name, f"{m['recall']:.3f}", f"{m['miss_coverage']:.3f}", f"{m['lru_coverage']:.3f}",
                  f"{m['waste']:.2f}", f"{m['fetch']:.2f}", f"{m['fetch_waste']:.2f}")
    console.print(t)
    if run["answer"]:
        n = run["answer_counts"]["previous step"]["n"] // max(1, len(run["layers"]) - dense_first)
        t = new_table(f"answer steps only (before EOS; {n} step-heads)",
                      caption="later steps decode past the end of the answer")
        for col in ("predictor", "recall", "miss cov.", "LRU cov.", "waste/st", "misses/st"):
            t.add_column(col, justify="right")
        for name in PREDICTORS:
            m = run["answer"][name]
            t.add_row(name, f"{m['recall']:.3f}", f"{m['miss_coverage']:.3f}", f"{m['lru_coverage']:.3f}",
                      f"{m['waste']:.2f}", f"{m['misses']:.2f}")
        console.print(t)
    t = new_table("per target layer: recall (rec) / miss coverage (cov)", tight=True,
                  caption="pS previous step, pL previous layer, eq early query, mq mid query; miss: pages per "
                          "step and head missing a buffer of the last selection" +
                          (f"; layer {dense_first}'s pL is layer {dense_first - 1}'s (dense) selection"
                           if dense_first else ""))
    cols = [("pS", "recall"), ("pL", "recall"), ("pL", "miss_coverage"), ("eq", "recall"), ("eq", "miss_coverage"),
            ("mq", "recall"), ("mq", "miss_coverage"), ("eq2", "miss_coverage")]
    for col in ["L", "miss", *[f"{p} {'rec' if m == 'recall' else 'cov'}" for p, m in cols]]:
        t.add_column(col, justify="right")
    inv = {v: k for k, v in SHORT.items()}
    for layer, per in sorted(run["layers"].items(), key=lambda x: int(x[0])):
        if int(layer) < dense_first:
            continue
        r = {name: rates(c) for name, c in per.items()}
        t.add_row(str(layer), f"{r['previous step']['misses']:.1f}", *[f"{r[inv[p]][m]:.2f}" for p, m in cols])
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(doc.split("\n\n")[1:]))
    ap.add_argument("--tasks", default="niah_single_1", help="RULER tasks, comma separated")
    ap.add_argument("--context", type=int, default=4096, help="RULER context length (tokens)")
    ap.add_argument("--samples", type=int, default=8, help="prompts per task")
    ap.add_argument("--seed", type=int, default=0, help="RULER sample seed")
    ap.add_argument("--steps", type=int, default=32, help="measured decode steps (one more runs first)")
    ap.add_argument("--range-weights", default="0,1", help="Quest range_weight values, comma separated")
    ap.add_argument("--top-k", type=int, default=512, help="Quest top_k in tokens (512 = 1/8 of 4K)")
    ap.add_argument("--page", type=int, default=16, help="page_size")
    ap.add_argument("--sink", type=int, default=16, help="sink_tokens")
    ap.add_argument("--recent", type=int, default=64, help="recent_tokens")
    ap.add_argument("--dense-first", type=int, default=2, help="Quest's dense_first_layers")
    ap.add_argument("--buffer-tokens", type=int, default=1024, help="LRU buffer per layer and KV head (tokens)")
    ap.add_argument("--dense-decode", action="store_true",
                    help="attend densely while decoding (selections still measured)")
    ap.add_argument("--json", default=DEFAULT_JSON, help="where the counts and rates go")
    args = ap.parse_args(argv)
    if -(-args.buffer_tokens // args.page) < args.top_k // args.page + 2 + (args.sink + args.recent) // args.page:
        ap.error("--buffer-tokens must hold a whole selection (top_k + sink + recent, in pages)")
    console = Console(width=80)
    torch.manual_seed(0)
    from sparse_framework.engine.models.catalog import resolve_model
    from sparse_framework.eval.ruler import ruler_samples

    model, tok, rec, _ = qa.load("cpu", torch.float32)
    tracer = Tracer(model)
    rws = [float(x) for x in args.range_weights.split(",")]
    import transformers

    report: dict[str, Any] = {"args": vars(args), "model": qa.MODEL, "predictors": list(PREDICTORS), "runs": [],
                              "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                              "device": "cpu, float32"}
    t_start = time.time()
    for task in args.tasks.split(","):
        samples = ruler_samples(resolve_model(qa.MODEL), task, args.context, args.samples, args.seed)
        acc: dict[float, dict[str, Any]] = {rw: {"layers": {}, "steps": {}, "answer": {}} for rw in rws}
        infos: list[dict[str, Any]] = []
        for sample in samples:
            t0 = time.time()
            infos += run_sample(model, tok, rec, tracer, sample, rws, args, acc)
            answers = "; ".join(f"rw {x['range_weight']:g}: {x['score']:.1f} {x['text'][:20]!r}" for x in infos[-len(rws):])
            console.print(f"{task} #{sample.index}: {time.time() - t0:.0f} s; {answers}")
        for rw in rws:
            a = acc[rw]
            run = {"task": task, "context": args.context, "range_weight": rw, "steps": args.steps,
                   "buffer_tokens": args.buffer_tokens, "budget_pages": args.top_k // args.page,
                   "samples": [x for x in infos if x["range_weight"] == rw],
                   "mean": {n: rates(c) for n, c in pooled(a["layers"], args.dense_first + 1).items()},
                   "mean_counts": pooled(a["layers"], args.dense_first + 1),
                   "answer": {n: rates(c) for n, c in a["answer"].items()}, "answer_counts": a["answer"],
                   "layers": {str(k): v for k, v in sorted(a["layers"].items())},
                   "layer_rates": {str(k): {n: rates(c) for n, c in v.items()} for k, v in sorted(a["layers"].items())},
                   "step_rates": {str(k): {n: rates(c) for n, c in v.items()} for k, v in sorted(a["steps"].items())}}
            report["runs"].append(run)
            print_run(console, run, args.dense_first)
    report["seconds"] = time.time() - t_start
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.json} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
