"""How close dense is to losing a NIAH answer, and whether each selection loses it (issue 47, stop 54).

Why: on the H200 (bf16, 50 prompts at 16K, every answer kept:
benchmarks/results/ruler_gemma3_niah16k_gpu.jsonl) DSA over the keys, SnapKV and PQCache at 1/8
lose the same two prompts (15 and 23), Quest one of them, though the loss analysis
(docs/ruler_losses.md) found the needle's value tokens kept by token top-k (0.997) and SnapKV
(1.000) on prompt 15. If the losses are prompts where dense itself barely holds the answer, the
first answer digit's logit margin says so, and a selection's decode from the same dense prefill
shows whether the loss appears without bf16.

Per prompt: one dense prefill in float32 (transformers, `quest_analysis.Recorder`), then greedy
decodes from copies of its cache with each selection in every full-attention layer (the
selections of `fwe_analysis.py`: the exact token top-k of the attention mass, SnapKV's prefill
votes, Quest's page midpoints), recording per step the chosen token, the margin between the two
best logits and the gold token's logit gap.

    python benchmarks/oneoff/niah_margins.py --model gemma3-270m --context 16384 --samples 50 \\
        --indices 15,23,0,1 --json benchmarks/results/niah_margins_gemma3_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))
from fwe_analysis import snapkv_keep, token_topk  # noqa: E402
from pqcache_analysis import decode_selector  # noqa: E402
from quest_analysis import Variant, group_mass, load, teacher_forced, variant_mask  # noqa: E402
from timing import provenance  # noqa: E402

from sparse_framework.algorithms.snapkv import SnapKVOptions, snapkv_votes  # noqa: E402

Selector = Callable[[int, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def selectors(layers: list[int], prompt_len: int, voters: list[torch.Tensor], keys: list[torch.Tensor],
              budget: int, sink: int, recent: int) -> dict[str, Selector | None]:
    """name -> selector(layer, q [Hq, D], k [n, Hkv, D]) -> keep [Hkv, n] (None: dense)."""
    votes = {layer: snapkv_votes(keys[i][:prompt_len], voters[i], SnapKVOptions(), "torch")
             for i, layer in enumerate(layers)}
    means = {layer: keys[i][:prompt_len].mean(0) for i, layer in enumerate(layers)}
    mid = Variant("mid sum", score="mid")

    def oracle(layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return token_topk(group_mass(q, k), k.shape[0] - 1, budget, sink, recent)

    def snapkv(layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        v = votes[layer]
        return snapkv_keep(v, v.shape[-1], k.shape[0] - 1, budget, sink, recent)

    def quest(layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return variant_mask(mid, q, k, k.shape[0] - 1, budget, sink, recent, means[layer])

    return {"dense": None, "oracle token": oracle, "snapkv": snapkv, "quest mid": quest}


@torch.no_grad()
def decode(model: Any, rec: Any, cache: Any, first: int, layers: list[int], sel: Selector | None,
           gold: list[int], steps: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Greedy steps from a copy of `cache` with `sel` on the full layers: per step the token,
    the top-2 logit margin and the gold token's gap to the best (gold: the dense answer)."""
    cache = copy.deepcopy(cache)

    def on_full(layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        if sel is None or layer not in layers:
            return None
        return sel(layer, q.float().cpu(), k.float().cpu()).to(q.device)

    rec.mode, rec.selector = "sparse", on_full
    token, out = first, []
    for i in range(steps):
        logits = model(torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True).logits[0, -1].float()
        top = logits.topk(2)
        token = int(top.indices[0])
        g = gold[i] if i < len(gold) else token
        out.append({"token": token, "margin": float(top.values[0] - top.values[1]),
                    "gold_gap": float(top.values[0] - logits[g])})
    rec.mode, rec.selector = "capture", None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--indices", default="", help="prompt indices, comma separated (default: all)")
    ap.add_argument("--fraction", type=int, default=8, help="budget = context / fraction")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cuda: every prompt of a cell in minutes (the selections "
                    "still run on the CPU, as fwe_analysis.py's do)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="bfloat16: the model as the H200 cells ran it")
    ap.add_argument("--pqcache", action="store_true", help="also PQCache, default and bits 8 (a build per prompt)")
    ap.add_argument("--only-pqcache", action="store_true", help="dense and PQCache only")
    ap.add_argument("--json", default="benchmarks/results/niah_margins_gemma3_cpu.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from sparse_framework.engine.models.catalog import resolve_model
    from sparse_framework.eval.ruler import prompt_ids, ruler_samples

    model, tok, rec, _ = load(args.device, getattr(torch, args.dtype), args.model)
    drawn = {s.index: s for s in ruler_samples(resolve_model(args.model), args.task, args.context, args.samples,
                                               args.seed)}
    want = [int(i) for i in args.indices.split(",")] if args.indices else sorted(drawn)
    if missing := [i for i in want if i not in drawn]:
        ap.error(f"--indices {missing} are not among the {len(drawn)} prompts of --samples {args.samples}")
    samples = [drawn[i] for i in want]  # in the order given: the likeliest to tell first
    report: dict[str, Any] = {**provenance("oneoff/niah_margins.py", argv), "args": vars(args), "prompts": []}
    for s in samples:
        t0 = time.time()
        ids = prompt_ids(s, tok, True)
        answer = tok(" " + s.outputs[0], add_special_tokens=False).input_ids
        t = teacher_forced(model, rec, ids, answer, args.device, voters=32)
        runs = {}
        budget = args.context // args.fraction
        sels = selectors(t.layers, len(ids), t.voters, t.keys, budget, args.sink, args.recent)
        if args.only_pqcache:
            sels = {"dense": None}
        if args.pqcache or args.only_pqcache:
            for name, opts in (("pqcache", {}), ("pqcache bits 8", {"bits": 8})):
                sels[name] = decode_selector(t.layers, t.keys[0].shape, len(ids), budget, args.sink, args.recent,
                                             opts, args.steps + 1)
        for name, sel in sels.items():
            steps = decode(model, rec, t.cache, t.first, t.layers, sel, answer, args.steps, args.device)
            runs[name] = {"text": tok.decode([t.first] + [x["token"] for x in steps]), "steps": steps}
        row = {"index": s.index, "answer": s.outputs[0], "prompt_len": len(ids), "first": tok.decode([t.first]),
               "seconds": round(time.time() - t0, 1), "runs": runs}
        report["prompts"].append(row)
        d = runs["dense"]["steps"]
        print(f"#{s.index} ({len(ids)} tokens, {row['seconds']} s) gold {s.outputs[0]}; dense margins "
              + " ".join(f"{x['margin']:.2f}" for x in d[:9]))
        for name, r in runs.items():
            print(f"   {name:13s} {r['text'][:40]!r:44s} gold gaps "
                  + " ".join(f"{x['gold_gap']:.1f}" for x in r["steps"][:9]))
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
