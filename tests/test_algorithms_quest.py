"""Quest: page min/max representations and the Σ_d max(q·min, q·max) bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import Batch, KVLayout, Request, load_config
from sparse_framework.algorithms.quest import Quest


def make(page: int, how: str = "max", top_k: int = 8, sink: int = 0, recent: int = 0, hk: int = 2) -> Quest:
    cfg = load_config({"algorithm": "quest", "top_k": max(top_k, page), "page_size": page, "sink_tokens": sink,
                       "recent_tokens": recent, "device_buffer_tokens": 4096, "min_sparse_prompt_len": 0,
                       "extra": {"gqa_reduce": how}})
    return Quest(cfg, KVLayout(num_layers=2, num_kv_heads=hk, head_dim=6), max_requests=3, max_seq_len=128)


def batch_of(reqs: list[Request]) -> Batch:
    b = Batch(reqs)
    b.seq_lens = torch.tensor([r.seq_len for r in reqs], dtype=torch.int32)
    b.slot_ids = torch.tensor([r.slot for r in reqs])
    b.max_seq_len = max(r.seq_len for r in reqs)
    return b


def page_bounds(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[kv_heads, pages, dim] min and max, by a loop."""
    n = keys.shape[0]
    lo = torch.stack([keys[s : s + page].amin(0) for s in range(0, n, page)], dim=1)
    hi = torch.stack([keys[s : s + page].amax(0) for s in range(0, n, page)], dim=1)
    return lo, hi


def direct_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, how: str) -> torch.Tensor:
    """q [Hq, D]; lo/hi [Hk, P, D] -> [Hk, P] by an explicit loop over heads and pages."""
    hq, hk = q.shape[0], lo.shape[0]
    g = hq // hk
    out = torch.empty(hk, lo.shape[1])
    for h in range(hk):
        per_head = []
        for j in range(h * g, (h + 1) * g):
            per_head.append(torch.tensor([
                sum(max(float(q[j, d] * lo[h, p, d]), float(q[j, d] * hi[h, p, d])) for d in range(q.shape[1]))
                for p in range(lo.shape[1])
            ]))
        stack = torch.stack(per_head)
        out[h] = {"max": stack.amax(0), "sum": stack.sum(0), "mean": stack.mean(0)}[how]
    return out


@settings(max_examples=30, deadline=None)
@given(page=st.sampled_from([1, 2, 4, 16]), n=st.integers(1, 70), steps=st.integers(0, 20), seed=st.integers(0, 9999))
def test_build_then_append_equals_build_over_everything(page, n, steps, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    quest = make(page)
    keys = torch.randn(n + steps, 2, 6, generator=g)
    r = Request("a", n, seq_len=n, slot=1)
    quest.build(0, r, keys[:n])
    for t in range(n, n + steps):
        r.seq_len = t + 1
        quest.append(0, batch_of([r]), keys[t : t + 1])
    lo, hi = page_bounds(keys, page)
    pages = lo.shape[1]
    assert torch.equal(quest.page_min[0, 1, :, :pages], lo)
    assert torch.equal(quest.page_max[0, 1, :, :pages], hi)


@settings(max_examples=30, deadline=None)
@given(how=st.sampled_from(["max", "sum", "mean"]), page=st.sampled_from([2, 4]), group=st.sampled_from([1, 3]),
       seed=st.integers(0, 9999))
def test_scores_match_a_direct_computation_and_bound_every_key(how, page, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    quest = make(page, how)
    lens = [23, 40]
    reqs = [Request(f"r{i}", n, seq_len=n, slot=i) for i, n in enumerate(lens)]
    keys = [torch.randn(n, 2, 6, generator=g) for n in lens]
    for r, k in zip(reqs, keys):
        quest.build(1, r, k)
    q = torch.randn(2, 2 * group, 6, generator=g)
    scores = quest.score(1, q, batch_of(reqs))
    for i, (r, k) in enumerate(zip(reqs, keys)):
        lo, hi = page_bounds(k, page)
        want = direct_scores(q[i], lo, hi, how)
        assert torch.allclose(scores[i, :, : lo.shape[1]], want, atol=1e-5)
        if how == "max":  # the group's max of upper bounds bounds every head's q·k in the page
            for h in range(2):
                for j in range(h * group, (h + 1) * group):
                    dots = k[:, h] @ q[i, j]
                    page_of = torch.arange(r.seq_len) // page
                    assert bool((dots <= scores[i, h, page_of] + 1e-5).all())


def test_select_keeps_the_best_pages_plus_sink_recent_and_last() -> None:
    g = torch.Generator().manual_seed(0)
    quest = make(4, top_k=8, sink=4, recent=4, hk=1)  # budget: 2 pages
    keys = torch.randn(50, 1, 6, generator=g)
    r = Request("a", 50, seq_len=50, slot=0)
    quest.build(0, r, keys)
    q = torch.randn(1, 2, 6, generator=g)
    b = batch_of([r])
    scores = quest.score(0, q, b)[0, 0, :13]
    sel = quest.select(0, q, b)
    pages = sorted({t // 4 for t in sel.indices[0, 0, : sel.lengths[0, 0]].tolist()})
    forced = {0, 11, 12}  # sink page, recent window 46..49 -> pages 11 and 12 (the partial last one)
    best = [int(p) for p in scores.argsort(descending=True) if int(p) not in forced][:2]
    assert pages == sorted(forced | set(best))
    assert sel.lengths[0, 0] == 4 * 4 + 2  # four whole pages and the 2-token last page


def test_budget_covering_the_context_selects_everything() -> None:
    quest = make(4, top_k=64)
    r = Request("a", 30, seq_len=30, slot=2)
    quest.build(0, r, torch.randn(30, 2, 6))
    sel = quest.select(0, torch.randn(1, 4, 6), batch_of([r]))
    assert sel.lengths.tolist() == [[30, 30]]
    assert sel.indices[0, :, :30].tolist() == [list(range(30))] * 2


def test_bad_gqa_reduce_is_a_config_error() -> None:
    from sparse_framework import ConfigError

    with pytest.raises(ConfigError, match="`extra.gqa_reduce` = 'median'"):
        load_config({"algorithm": "quest", "extra": {"gqa_reduce": "median"}})
