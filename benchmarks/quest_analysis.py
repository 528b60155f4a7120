"""Why Quest loses on a real model: its page bounds against exact attention, per layer.

On RULER prompts (SmolLM2-135M-Instruct by default, `--model` any catalog name) the model runs in transformers with a
custom attention function that records each layer's post-RoPE queries and keys (the prompt
densely, then the gold answer teacher-forced: the queries at the decode positions, as the
engine sees them — the first answer token comes from the dense prefill, every later one from
a sparse decode step). For each decode query, layer and KV head it measures:

  mass recall   attention mass (the group's mean softmax) on the selected tokens outside the
                forced sink / recent / newest pages, divided by the mass of the exact top-k of
                as many tokens outside them (the forced pages hold most of the mass and would
                hide the difference)
  page recall   overlap of the selected pages with the pages of highest exact page score
                (max q·k within the page, per query head, reduced over the group the same way)
  needle recall the share of the mass on the needle's tokens that the selection keeps
  rank corr.    Spearman correlation over pages between the reduced score and the exact one
  spread        std over pages of Quest's bound / std of the exact page score
  top-4 share   share of the bound's range term Σ_d |q_d|·(max_d − min_d)/2 from its 4 largest channels

for several page scores (`VARIANTS`: Quest's bound, the page midpoint q·(min+max)/2, the page
mean key, blends, the GQA reductions, page sizes), every one with sink + recent + newest pages
forced and the same token budget. `--simulate` then decodes greedily with each variant's
selection applied in every sparse layer (the prompt's dense KV cache is shared, so a variant
costs only its decode steps) and scores RULER's string-match; `--engine` measures the chosen
configs through the engine (`LLM.generate`), the figure that counts.

    python benchmarks/quest_analysis.py --contexts 2048,4096 --samples 4 --simulate
    python benchmarks/quest_analysis.py --device cuda --contexts 8192 --samples 20 --simulate \\
        --json benchmarks/results/quest_analysis_h100.json
    python benchmarks/quest_analysis.py --engine --contexts 2048 --samples 10 --json /tmp/engine.json

On a hybrid model (Gemma 3: sliding-window layers between full-attention ones) only the layers
whose `config.layer_types` entry is "full_attention" are captured and analysed (a selection in
a sliding layer is meaningless: it attends to its last `sliding_window` tokens); the tables and
JSON name the model's layer numbers, and `--dense-first` counts model layers as the engine's
`dense_first_layers` does. Every JSON records the command line and the commit (`provenance`).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timing import provenance  # noqa: E402

from sparse_framework.common.tables import new_table  # noqa: E402

MODEL = "smollm2-135m-instruct"
DEFAULT_JSON = "benchmarks/results/quest_analysis_cpu.json"


@dataclass(frozen=True)
class Variant:
    """One page-selection rule. score: "quest" (Σ_d max(q_d·min_d, q_d·max_d)), "mid"
    (q·(min+max)/2), "mean" (q·page mean key), "blend" (q·mean + lam·Σ_d |q_d|·(max_d−min_d)/2),
    "oracle" (exact page max of q·k), "oracle-mass" (the group's exact attention mass on the
    page: the best any page selection can do); reduce: "sum", "max", "softmax" (per head softmax of
    score/√d over pages, then summed), "union" (each query head's own ranking, round-robin)."""

    name: str
    score: str = "quest"
    reduce: str = "sum"
    page: int = 16
    lam: float = 1.0
    center: bool = False


VARIANTS = [
    Variant("quest sum (default)"),
    Variant("quest centered", center=True),
    Variant("quest max", reduce="max"),
    Variant("quest union", reduce="union"),
    Variant("quest softmax", reduce="softmax"),
    Variant("quest page 8", page=8),
    Variant("quest page 32", page=32),
    Variant("mid sum", score="mid"),
    Variant("mean sum", score="mean"),
    Variant("blend 0.5", score="blend", lam=0.5),
    Variant("blend 0.25", score="blend", lam=0.25),
    Variant("mean softmax", score="mean", reduce="softmax"),
    Variant("blend 0.5 softmax", score="blend", lam=0.5, reduce="softmax"),
    Variant("mid softmax", score="mid", reduce="softmax"),
    Variant("oracle page", score="oracle"),
    Variant("oracle mass", score="oracle-mass"),
]


@dataclass
class Captured:
    """One prompt's capture: keys [n, Hkv, D] per layer (prompt + answer), the decode queries
    [T, Hq, D] per layer at positions `positions`, the needle's token positions."""

    keys: list[torch.Tensor]
    queries: list[torch.Tensor]
    positions: list[int]
    needle: list[int]
    prompt_len: int
    cache: Any = None
    first_token: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    layers: list[int] = field(default_factory=list)  # the model layer of keys[i] / queries[i] (empty: i)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = list(range(len(self.keys)))


def full_layers(config: Any) -> list[int]:
    """The model's full-attention layers: those whose `layer_types` entry is "full_attention"
    (every layer where the config has no `layer_types` or no sliding window)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not types or not getattr(config, "sliding_window", None):
        return list(range(n))
    return [i for i in range(n) if types[i] == "full_attention"]


class Recorder:
    """The custom attention function: "capture" records post-RoPE q and k (and attends densely);
    "sparse" attends at decode only to the tokens `selector(layer, q, k)` keeps."""

    def __init__(self) -> None:
        self.mode = "capture"
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.selector: Any = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
        layer = module.layer_idx
        if self.mode == "capture":
            self.q[layer], self.k[layer] = query[0].detach(), key[0].detach()
        b, hq, lq, d = query.shape
        hk = key.shape[1]
        g = hq // hk
        k = key.repeat_interleave(g, dim=1)
        v = value.repeat_interleave(g, dim=1)
        scale = scaling if scaling is not None else d ** -0.5
        if lq == 1 and self.mode == "sparse" and self.selector is not None:
            keep = self.selector(layer, query[0, :, 0], key[0].transpose(0, 1))  # [Hkv, n] bool or None
            if keep is not None:
                logits = (query @ k.transpose(-1, -2)) * scale
                logits = logits.masked_fill(~keep.repeat_interleave(g, 0)[None, :, None], float("-inf"))
                out = logits.softmax(-1) @ v
                return out.transpose(1, 2).contiguous(), None
        mask = None
        window = kw.get("sliding_window") or getattr(module, "sliding_window", None)
        n = k.shape[2]
        if lq > 1 or (window and n > window):
            # causal, the queries being the last lq positions (a chunk after a cache); on a sliding
            # layer also within its window (transformers' rule: kv > q − window; its cache keeps a
            # contiguous tail, so the rule holds in the local positions)
            kv = torch.arange(n, device=k.device).view(1, -1)
            qp = torch.arange(n - lq, n, device=k.device).view(-1, 1)
            mask = kv <= qp
            if window:
                mask = mask & (kv > qp - window)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).contiguous(), None


def load(device: str, dtype: torch.dtype, name: str = MODEL) -> tuple[Any, Any, Recorder, Path]:
    """The catalog model `name` (or a checkpoint folder) in transformers with the recorder as
    its attention function."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from sparse_framework.engine.models.catalog import resolve_model

    path = resolve_model(name)
    rec = Recorder()
    AttentionInterface.register("quest_analysis", rec)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="quest_analysis", dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path), rec, path


def find_needle(ids: list[int], answer: list[int]) -> list[int]:
    """Positions in the prompt of every occurrence of the answer's digits (leading space
    token dropped): the needle's value tokens."""
    a = answer[1:] if len(answer) > 1 else answer
    out: list[int] = []
    for s in range(len(ids) - len(a) + 1):
        if ids[s : s + len(a)] == a:
            out.extend(range(s, s + len(a)))
    return out


@torch.no_grad()
def capture(model: Any, tok: Any, rec: Recorder, sample: Any, device: str) -> Captured:
    """Dense prefill of the prompt (its KV cache kept for `simulate`), then the gold answer
    teacher-forced on a copy of the cache: the decode positions' queries and all keys."""
    from sparse_framework.eval.ruler import prompt_ids

    ids = prompt_ids(sample, tok, True)  # as the engine's RULER runner encodes it (one BOS where the model has one)
    answer = tok(" " + sample.outputs[0], add_special_tokens=False).input_ids
    t = teacher_forced(model, rec, ids, answer, device)
    p = len(ids)
    return Captured(t.keys, t.queries, list(range(p, p + len(answer) - 1)), find_needle(ids, answer), p, t.cache,
                    t.first, {"task": sample.task, "index": sample.index, "answer": sample.outputs[0]}, t.layers)


@dataclass
class TeacherForced:
    """What `teacher_forced` records, per full-attention layer (`layers`: the model's numbers)."""

    keys: list[torch.Tensor]  # [prompt + answer - 1, Hkv, D]: every position, post-RoPE
    queries: list[torch.Tensor]  # [answer - 1, Hq, D]: the decode positions'
    layers: list[int]
    first: int  # the dense prefill's greedy first token
    cache: Any  # the prompt's KV cache (the answer ran on a copy)
    voters: list[torch.Tensor]  # the prompt's last `voters` queries [voters, Hq, D] (none when 0)


@torch.no_grad()
def teacher_forced(model: Any, rec: Recorder, ids: list[int], answer: list[int], device: str,
                   voters: int = 0) -> TeacherForced:
    """Dense prefill of `ids`, then `answer[:-1]` teacher-forced on a copy of its cache, through
    the recording attention: the capture the loss analyses share (this script's `capture`,
    fwe_analysis.py's)."""
    rec.mode, rec.q, rec.k = "capture", {}, {}
    out = model(torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    layers = full_layers(model.config)  # a hybrid model's sliding layers are left out
    voter_q = [rec.q[i][:, -voters:].transpose(0, 1).float().cpu() for i in layers] if voters else []
    cache, first = out.past_key_values, int(out.logits[0, -1].argmax())
    rec.q, rec.k = {}, {}
    step_cache = copy.deepcopy(cache)
    model(torch.tensor([answer[:-1]], device=device), past_key_values=step_cache, use_cache=True, logits_to_keep=1)
    keys = [rec.k[i].transpose(0, 1).float().cpu() for i in layers]  # cache-extended: all positions
    queries = [rec.q[i].transpose(0, 1).float().cpu() for i in layers]  # [T, Hq, D]
    return TeacherForced(keys, queries, layers, first, cache, voter_q)


# -- page scores ---------------------------------------------------------------------------
def page_stats(k: torch.Tensor, page: int, mu: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """k [n, Hkv, D] -> min, max, mean [Hkv, P, D] (the last page partial); mu [Hkv, D]
    subtracted first when given (centering)."""
    if mu is not None:
        k = k - mu
    n, hk, d = k.shape
    pages = -(-n // page)
    pad = pages * page - n
    kk = k.transpose(0, 1)
    lo = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=float("inf")).view(hk, pages, page, d).amin(2)
    hi = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=float("-inf")).view(hk, pages, page, d).amax(2)
    cnt = torch.full((pages,), float(page))
    cnt[-1] = n - (pages - 1) * page
    mean = torch.nn.functional.pad(kk, (0, 0, 0, pad)).view(hk, pages, page, d).sum(2) / cnt.view(1, -1, 1)
    return lo, hi, mean


def head_scores(v: Variant, q: torch.Tensor, k: torch.Tensor, stats: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Per query head page scores [Hkv, G, P]. q [Hq, D] float; k [n, Hkv, D] the stored keys."""
    lo, hi, mean = stats
    hk, pages, d = lo.shape
    qq = q.view(hk, -1, 1, d)
    if v.score == "quest":
        return torch.maximum(qq * lo[:, None], qq * hi[:, None]).sum(-1)
    if v.score == "mid":
        return (qq * (lo + hi)[:, None] / 2).sum(-1)
    if v.score == "mean":
        return (qq * mean[:, None]).sum(-1)
    if v.score == "blend":
        return (qq * mean[:, None]).sum(-1) + v.lam * (qq.abs() * (hi - lo)[:, None] / 2).sum(-1)
    if v.score == "oracle":
        logits = torch.einsum("hgd,nhd->hgn", q.view(hk, -1, d), k)
        pad = pages * v.page - logits.shape[-1]
        return torch.nn.functional.pad(logits, (0, pad), value=float("-inf")).view(hk, -1, pages, v.page).amax(-1)
    raise ValueError(v.score)


def reduce_heads(v: Variant, s: torch.Tensor, d: int) -> torch.Tensor:
    """[Hkv, G, P] -> [Hkv, P] ("union" returns per-head scores' ranks turned into a round-robin key)."""
    if v.reduce == "sum":
        return s.sum(1)
    if v.reduce == "max":
        return s.amax(1)
    if v.reduce == "softmax":
        return (s / math.sqrt(d)).softmax(-1).sum(1)
    if v.reduce == "union":  # rank r of head g -> key -(r * G + g): the best of each head first
        g = s.shape[1]
        ranks = s.argsort(-1, descending=True).argsort(-1).float()
        key = -(ranks * g + torch.arange(g).view(1, -1, 1))
        return key.amax(1)
    raise ValueError(v.reduce)


def select_pages(scores: torch.Tensor, forced: torch.Tensor, budget: int) -> torch.Tensor:
    """scores [Hkv, P], forced bool [P] -> bool [Hkv, P]: forced plus the best `budget` others."""
    ranked = scores.masked_fill(forced, float("-inf"))
    keep = forced.expand_as(scores).clone()
    k = min(budget, int((~forced).sum()))
    if k > 0:
        keep.scatter_(-1, ranked.topk(k, dim=-1).indices, True)
    return keep


def forced_pages(n_pages: int, page: int, t: int, sink: int, recent: int) -> torch.Tensor:
    """Pages holding a sink token, a token of the recent window (of t + 1 tokens) or the newest."""
    ids = torch.arange(n_pages)
    return (ids * page < sink) | ((ids + 1) * page > t + 1 - max(recent, 1))


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(ra.norm() * rb.norm())
    return float((ra * rb).sum() / den) if den > 0 else 0.0


def variant_scores(v: Variant, q: torch.Tensor, k: torch.Tensor, t: int, sink: int, recent: int,
                   mu: torch.Tensor | None = None, memo: dict | None = None,
                   mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced page scores [Hkv, P] over the stored keys k[:t] for query q [Hq, D], and the
    forced pages [P] (t is the newest token's position). `memo` caches the page statistics;
    "oracle-mass" needs `mass` [Hkv, t+1] (the group's exact attention)."""
    stored = k[:t]
    key = (v.page, v.center)
    if memo is None or key not in memo:
        stats = page_stats(stored, v.page, mu if v.center else None)
        if memo is not None:
            memo[key] = stats
    else:
        stats = memo[key]
    if v.score == "oracle-mass":
        assert mass is not None
        pad = stats[0].shape[1] * v.page - t
        red = torch.nn.functional.pad(mass[:, :t], (0, pad)).view(mass.shape[0], -1, v.page).sum(-1)
    else:
        red = reduce_heads(v, head_scores(v, q, stored, stats), q.shape[-1])
    return red, forced_pages(red.shape[-1], v.page, t, sink, recent)


def pages_to_tokens(pages: torch.Tensor, page: int, t: int) -> torch.Tensor:
    """bool [Hkv, P] -> token mask [Hkv, t+1] (the newest token t always kept)."""
    tok = pages.repeat_interleave(page, -1)[:, :t]
    return torch.cat([tok, torch.ones(tok.shape[0], 1, dtype=torch.bool)], -1)


def group_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], k [n, Hkv, D] -> [Hkv, n]: the attention mass each KV head's query group puts
    on each key (the mean of the group's softmax): what an exact token selection ranks by."""
    hk, d = k.shape[1], k.shape[2]
    return (torch.einsum("hgd,nhd->hgn", q.view(hk, -1, d), k) / math.sqrt(d)).softmax(-1).mean(1)


def variant_mask(v: Variant, q: torch.Tensor, k: torch.Tensor, t: int, budget_tokens: int, sink: int, recent: int,
                 mu: torch.Tensor | None = None) -> torch.Tensor:
    """Token mask [Hkv, t+1] of `v`'s selection for query q [Hq, D] over keys k [>t, Hkv, D]."""
    mass = group_mass(q, k[: t + 1]) if v.score == "oracle-mass" else None
    red, forced = variant_scores(v, q, k, t, sink, recent, mu, mass=mass)
    return pages_to_tokens(select_pages(red, forced, budget_tokens // v.page), v.page, t)


def analyse(c: Captured, budgets: list[int], sink: int, recent: int, variants: list[Variant]) -> dict[str, Any]:
    """Per layer, variant and budget: mean retrieved-mass / page / needle recall over decode
    steps and KV heads; per layer: how Quest's bound relates to the exact page scores."""
    res: dict[str, Any] = {"layers": []}
    for layer, model_layer in enumerate(c.layers):
        k_all = c.keys[layer]
        hk, d = k_all.shape[1], k_all.shape[2]
        mu = k_all[: c.prompt_len].mean(0)  # frozen after the prompt
        row: dict[str, Any] = {"layer": model_layer, "variants": {}}
        absk = k_all[: c.prompt_len].abs().mean(0)  # [Hkv, D]
        row["key_top4_share"] = float((absk.topk(4, -1).values.sum(-1) / absk.sum(-1)).mean())
        row["key_max_over_median"] = float((absk.amax(-1) / absk.median(-1).values).mean())
        acc: dict[str, list[float]] = {}
        for i, t in enumerate(c.positions):
            q = c.queries[layer][i]
            logits = torch.einsum("hgd,nhd->hgn", q.view(hk, -1, d), k_all[: t + 1]) / math.sqrt(d)
            mass = logits.softmax(-1).mean(1)  # [Hkv, t+1]
            needle = torch.zeros(t + 1, dtype=torch.bool)
            needle[[p for p in c.needle if p <= t]] = True
            memo: dict = {}
            quest, forced16 = variant_scores(Variant("q"), q, k_all, t, sink, recent, memo=memo)
            oracle, _ = variant_scores(Variant("o", "oracle"), q, k_all, t, sink, recent, memo=memo)
            mid, _ = variant_scores(Variant("m", "mid"), q, k_all, t, sink, recent, memo=memo)
            lo, hi = memo[(16, False)][:2]
            rng = q.view(hk, -1, 1, d).abs() * (hi - lo)[:, None] / 2  # [Hkv, G, P, D]
            rs = rng.sum(-1)
            acc.setdefault("range_top4_share", []).append(float((rng.topk(4, -1).values.sum(-1) / rs.clamp(min=1e-9)).mean()))
            free = ~forced16
            for h in range(hk):
                acc.setdefault("spearman_quest", []).append(spearman(quest[h, free], oracle[h, free]))
                acc.setdefault("spearman_mid", []).append(spearman(mid[h, free], oracle[h, free]))
                acc.setdefault("spread", []).append(float(quest[h, free].std() / oracle[h, free].std().clamp(min=1e-9)))
                acc.setdefault("range_share", []).append(float(rs[h].sum(0)[free].std() / quest[h, free].std().clamp(min=1e-9)))
            nm = (mass * needle).sum(-1)
            w = nm / nm.sum().clamp(min=1e-12)  # heads weighted by their mass on the needle
            exact_pages = {b: select_pages(oracle, forced16, b // 16) & free for b in budgets}
            for v in variants:
                red, forced = variant_scores(v, q, k_all, t, sink, recent, mu, memo, mass)
                for b in budgets:
                    pages = select_pages(red, forced, b // v.page)
                    keep = pages_to_tokens(pages, v.page, t)
                    fkeep = pages_to_tokens(forced.expand_as(pages), v.page, t)
                    # retrieved mass: the budget's tokens against the exact top-k of as many
                    # tokens among those not forced
                    rest = mass.masked_fill(fkeep, 0.0)
                    got = (rest * keep).sum(-1)
                    n_sel = (keep & ~fkeep).sum(-1)
                    srt = rest.sort(-1, descending=True).values.cumsum(-1)
                    best = srt.gather(-1, (n_sel - 1).clamp(min=0).view(-1, 1)).squeeze(-1)
                    key = f"{v.name}|{b}"
                    acc.setdefault(f"mass|{key}", []).extend((got / best.clamp(min=1e-12)).tolist())
                    if v.page == 16:
                        ex = exact_pages[b]
                        acc.setdefault(f"page|{key}", []).extend(((pages & ex).sum(-1) / ex.sum(-1).clamp(min=1)).tolist())
                    if float(nm.sum()) > 0:
                        acc.setdefault(f"needle|{key}", []).append(float((((mass * keep * needle).sum(-1) / nm.clamp(min=1e-12)) * w).sum()))
        for name, vals in acc.items():
            parts = name.split("|")
            if len(parts) == 1:
                row[name] = sum(vals) / len(vals)
            else:
                row["variants"].setdefault(f"{parts[1]}|{parts[2]}", {})[parts[0]] = sum(vals) / len(vals)
        res["layers"].append(row)
    return res


# -- simulated accuracy ----------------------------------------------------------------------
@torch.no_grad()
def simulate(model: Any, tok: Any, rec: Recorder, c: Captured, v: Variant | None, budget: int, sink: int, recent: int,
             dense_first: int, max_new: int, device: str) -> str:
    """Greedy decode from the prompt's dense cache with `v`'s selection in every layer from
    `dense_first` on (None: dense). Centering uses the prompt's mean key, frozen."""
    cache = copy.deepcopy(c.cache)
    means: dict[int, torch.Tensor] = {}

    def selector(layer: int, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
        if v is None or layer < dense_first or layer not in c.layers:  # dense, or a sliding layer
            return None
        k = k.float().cpu()  # the analysis's helpers run on the CPU
        if layer not in means:
            means[layer] = k[: c.prompt_len].mean(0)
        t = k.shape[0] - 1
        return variant_mask(v, q.float().cpu(), k, t, budget, sink, recent, means[layer]).to(q.device)

    rec.mode, rec.selector = "sparse", selector
    out, token = [c.first_token], c.first_token
    eos = tok.eos_token_id
    for _ in range(max_new - 1):
        if token == eos:
            break
        logits = model(torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True).logits
        token = int(logits[0, -1].argmax())
        out.append(token)
    rec.mode, rec.selector = "capture", None
    return tok.decode(out, skip_special_tokens=True)


# -- engine ----------------------------------------------------------------------------------
ENGINE_CONFIGS: dict[str, dict[str, Any]] = {
    "dense": {},
    "quest": {"algorithm": "quest"},
}


def engine_accuracy(samples: list[Any], configs: dict[str, dict[str, Any]], budgets: list[int], ctx: int,
                    max_tokens: int | None, log: Any, device: str = "cpu", name: str = MODEL) -> dict[str, Any]:
    """RULER string-match through `LLM.generate` (greedy) per config and budget."""
    from sparse_framework.engine import LLM
    from sparse_framework.config import DENSE_CONFIG
    from sparse_framework.engine.sampling import SamplingParams
    from sparse_framework.eval.ruler import RULER_TASKS, prompt_text, score

    out: dict[str, Any] = {}
    for name, extra in configs.items():
        for b in budgets if extra else [0]:
            cfg = ({"algorithm": extra.get("algorithm", "quest"), "top_k": b, "device_buffer_tokens": b + 256,
                    "sparse_policy": "always", "min_sparse_prompt_len": 0, "extra": extra.get("extra", {}), **{k: w for k, w in extra.items() if k not in ("algorithm", "extra")}}
                   if extra else DENSE_CONFIG)
            t0 = time.time()
            llm = LLM(name, cfg, device=device, max_model_len=ctx + 256, max_num_seqs=4)
            prompts = [prompt_text(s, llm.tokenizer, True) for s in samples]
            params = [SamplingParams(max_tokens=max_tokens or RULER_TASKS[s.task].max_new_tokens, temperature=0) for s in samples]
            res = llm.generate(prompts, params)
            scores = [score(r.text or "", s.outputs) for r, s in zip(res, samples)]
            key = f"{name}|{b}"
            out[key] = {"config": cfg, "accuracy": sum(scores) / len(scores), "scores": scores,
                        "texts": [r.text for r in res], "seconds": time.time() - t0}
            log(f"engine {key}: {out[key]['accuracy']:.2f} ({time.time() - t0:.0f} s)")
            del llm
    return out


# -- report ----------------------------------------------------------------------------------
def layer_table(console: Console, layers: list[dict[str, Any]], budget: int, names: list[str]) -> None:
    """Per layer: Quest's rank correlation, spread, mass recall of a few variants."""
    t = new_table(f"per layer, budget {budget} tokens: mass recall vs exact top-k (needle recall)", tight=True)
    for col in ("L", "ρ quest", "ρ mid", "spread", "top4", *names):
        t.add_column(col, justify="right")
    for row in layers:
        cells = [str(row["layer"]), f"{row['spearman_quest']:.2f}", f"{row['spearman_mid']:.2f}", f"{row['spread']:.1f}",
                 f"{row['range_top4_share']:.2f}"]
        for n in names:
            m = row["variants"].get(f"{n}|{budget}", {})
            cells.append(f"{m.get('mass', float('nan')):.2f} ({m.get('needle', float('nan')):.2f})")
        t.add_row(*cells)
    console.print(t)


def merge(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean over prompts of every per-layer number."""
    out = []
    for i in range(len(results[0]["layers"])):
        rows = [r["layers"][i] for r in results]
        m: dict[str, Any] = {"layer": rows[0]["layer"], "variants": {}}
        for key, val in rows[0].items():
            if isinstance(val, float):
                m[key] = sum(r[key] for r in rows) / len(rows)
        for vk in rows[0]["variants"]:
            m["variants"][vk] = {s: sum(r["variants"][vk][s] for r in rows) / len(rows) for s in rows[0]["variants"][vk]}
        out.append(m)
    return out


def common_args(doc: str, contexts: str, samples: int, fractions: str, json_path: str) -> argparse.ArgumentParser:
    """The parser with the arguments the three loss-analysis scripts share (this one,
    fwe_analysis.py, pqcache_analysis.py), with each script's defaults."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(doc.split("\n\n")[1:]))
    ap.add_argument("--model", default=MODEL, help="catalog name or checkpoint folder of the model to capture")
    ap.add_argument("--contexts", default=contexts, help="context lengths, comma separated")
    ap.add_argument("--samples", type=int, default=samples, help="prompts per task and context")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fractions", default=fractions, help="budgets as 1/x of the context, comma separated")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=json_path)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = common_args(__doc__, "2048", 4, "8,16", DEFAULT_JSON)
    ap.add_argument("--tasks", default="niah_single_1", help="RULER tasks, comma separated")
    ap.add_argument("--dense-first", type=int, default=2,
                    help="Quest's dense_first_layers in --simulate (model layers)")
    ap.add_argument("--variants", default="", help="variant names to run (comma separated; default all)")
    ap.add_argument("--simulate", action="store_true", help="greedy decode with each variant's selection (RULER score)")
    ap.add_argument("--simulate-variants", default="", help="variant names to simulate (comma separated; default all)")
    ap.add_argument("--max-new", type=int, default=16, help="tokens per simulated answer")
    ap.add_argument("--engine", action="store_true", help="measure ENGINE_CONFIGS through LLM.generate instead")
    ap.add_argument("--engine-extra", default="", help="JSON {name: sparse config} added to the engine's configs")
    ap.add_argument("--engine-only", default="", help="engine config names to run (comma separated; default all)")
    ap.add_argument("--max-tokens", type=int, default=None, help="engine answer budget (default: the task's)")
    args = ap.parse_args(argv)
    console = Console(width=80)
    torch.manual_seed(0)
    variants = [v for v in VARIANTS if not args.variants or v.name in args.variants.split(",")]
    report: dict[str, Any] = {**provenance("quest_analysis.py", argv), "args": vars(args), "model": args.model,
                              "variants": [asdict(v) for v in variants], "runs": []}
    model = tok = rec = None
    for task in args.tasks.split(","):
        for ctx in map(int, args.contexts.split(",")):
            budgets = [ctx // int(f) for f in args.fractions.split(",")]
            from sparse_framework.engine.models.catalog import resolve_model
            from sparse_framework.eval.ruler import ruler_samples

            samples = ruler_samples(resolve_model(args.model), task, ctx, args.samples, args.seed)
            run: dict[str, Any] = {"task": task, "context": ctx, "budgets": budgets}
            if args.engine:
                configs = {**ENGINE_CONFIGS, **(json.loads(args.engine_extra) if args.engine_extra else {})}
                if args.engine_only:
                    configs = {k: v for k, v in configs.items() if k in args.engine_only.split(",")}
                run["engine"] = engine_accuracy(samples, configs, budgets, ctx, args.max_tokens, console.print,
                                                args.device, args.model)
                report["runs"].append(run)
                continue
            if model is None:
                model, tok, rec, _ = load(args.device, torch.float32, args.model)
            per_prompt, sims = [], {}
            from sparse_framework.eval.ruler import score

            for s in samples:
                t0 = time.time()
                c = capture(model, tok, rec, s, args.device)
                t1 = time.time()
                per_prompt.append(analyse(c, budgets, args.sink, args.recent, variants))
                t2 = time.time()
                if args.simulate:
                    chosen = [v for v in variants if not args.simulate_variants or v.name in args.simulate_variants.split(",")]
                    todo = [("dense", None, 0)] + [(v.name, v, b) for v in chosen for b in budgets]
                    for name, v, b in todo:
                        text = simulate(model, tok, rec, c, v, b, args.sink, args.recent, args.dense_first, args.max_new, args.device)
                        sims.setdefault(f"{name}|{b}", []).append({"score": score(text, s.outputs), "text": text})
                console.print(f"{task} {ctx} #{s.index}: {len(c.positions)} decode queries, needle at "
                              f"{c.needle[:1]}, capture {t1 - t0:.0f} s, analysis {t2 - t1:.0f} s, "
                              f"simulation {time.time() - t2:.0f} s")
                c.cache = None
            run["layers"] = merge(per_prompt)
            if sims:
                run["simulated"] = {k: {"accuracy": sum(x["score"] for x in v) / len(v), "texts": [x["text"] for x in v]}
                                    for k, v in sims.items()}
            report["runs"].append(run)
    for run in report["runs"]:
        if "layers" in run:
            names = ["quest sum (default)", "quest max", "mid sum", "mean sum", "oracle page"]
            names = [n for n in names if any(v.name == n for v in variants)][:4]
            for b in run["budgets"]:
                layer_table(console, run["layers"], b, names)
            summary = new_table(f"{run['task']} {run['context']}: mean over (full-attention) layers "
                                f">= {args.dense_first}", tight=True)
            for col in ("variant", "budget", "mass", "page", "needle", "simulated acc."):
                summary.add_column(col, justify="right")
            sparse_layers = [r for r in run["layers"] if r["layer"] >= args.dense_first]
            for v in variants:
                for b in run["budgets"]:
                    vals = [r["variants"][f"{v.name}|{b}"] for r in sparse_layers]
                    mean = {s: sum(x.get(s, float("nan")) for x in vals) / len(vals) for s in ("mass", "page", "needle")}
                    sim = run.get("simulated", {}).get(f"{v.name}|{b}", {}).get("accuracy", float("nan"))
                    summary.add_row(v.name, str(b), f"{mean['mass']:.3f}", f"{mean['page']:.3f}", f"{mean['needle']:.3f}", f"{sim:.2f}")
            if "simulated" in run:
                summary.add_row("dense", "-", "", "", "", f"{run['simulated']['dense|0']['accuracy']:.2f}")
            console.print(summary)
        for key, e in run.get("engine", {}).items():
            console.print(f"engine {run['task']} {run['context']} {key}: {e['accuracy']:.2f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
