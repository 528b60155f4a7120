"""benchmarks/selection_prediction.py's metrics against plain set computations (no checkpoint):
a perfect prediction has recall 1 and no waste, a disjoint one recall 0, hand-counted cases,
random sets against Python sets, Quest's page score against quest_analysis's bound and
midpoint, the LRU buffer's evictions, and the early query against a tiny Llama's own query."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import load_benchmark as _load

bench = _load("selection_prediction")
qa = bench.qa


def _mask(rows: list[list[int]], pages: int) -> torch.Tensor:
    out = torch.zeros(len(rows), pages, dtype=torch.bool)
    for h, r in enumerate(rows):
        out[h, r] = True
    return out


def test_identical_prediction_has_recall_one_and_no_waste() -> None:
    gen = torch.Generator().manual_seed(0)
    actual = torch.rand(3, 40, generator=gen) < 0.3
    prev = torch.rand(3, 40, generator=gen) < 0.3
    free = torch.ones(40, dtype=torch.bool)
    free[0] = free[-3:] = False
    r = bench.rates(bench.overlap_counts(actual, actual, prev, free, prev))
    assert r["recall"] == 1.0 and r["miss_coverage"] == 1.0 and r["lru_coverage"] == 1.0
    assert r["waste"] == 0.0 and r["fetch_waste"] == 0.0


def test_disjoint_prediction_has_recall_zero() -> None:
    actual = _mask([[1, 2, 3], [4, 5]], 10)
    pred = ~actual
    free = torch.ones(10, dtype=torch.bool)
    c = bench.overlap_counts(pred, actual, torch.zeros_like(actual), free)
    r = bench.rates(c)
    assert r["recall"] == 0.0 and r["miss_coverage"] == 0.0
    assert c["pred"] - c["hit"] == 15  # every predicted page wasted: 10 - 3 + 10 - 2
    assert math.isnan(r["lru_coverage"])  # no buffer given: no LRU misses to cover


def test_hand_counted_case() -> None:
    # one head, 8 pages; page 0 and 7 forced (sink, newest)
    free = torch.tensor([False, True, True, True, True, True, True, False])
    actual = _mask([[0, 1, 2, 3, 7]], 8)   # free actual: 1 2 3
    prev = _mask([[0, 1, 5, 7]], 8)        # misses: 2 3
    pred = _mask([[0, 2, 4, 5]], 8)        # free pred: 2 4 5
    buffer = _mask([[0, 1, 2, 5]], 8)      # LRU misses: 3
    c = bench.overlap_counts(pred, actual, prev, free, buffer)
    assert c == {"n": 1, "actual": 3, "hit": 1, "pred": 3, "miss": 2, "miss_hit": 1, "fetch": 2,
                 "fetch_waste": 1, "lru_miss": 1, "lru_miss_hit": 0}
    r = bench.rates(c)
    assert r["recall"] == pytest.approx(1 / 3) and r["miss_coverage"] == 0.5 and r["lru_coverage"] == 0.0
    assert r["waste"] == 2 and r["fetch"] == 2 and r["fetch_waste"] == 1 and r["misses"] == 2


def test_counts_pool_over_steps() -> None:
    a = {"n": 1, "hit": 2}
    bench.add_counts(a, {"n": 3, "hit": 1, "miss": 4})
    assert a == {"n": 4, "hit": 3, "miss": 4}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 30), st.integers(0, 2**31 - 1))
def test_counts_match_python_sets(heads: int, pages: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pred, actual, prev, buf = (torch.rand(heads, pages, generator=gen) < 0.4 for _ in range(4))
    free = torch.rand(pages, generator=gen) < 0.8
    c = bench.overlap_counts(pred, actual, prev, free, buf)
    want = dict.fromkeys(c, 0)
    want["n"] = heads
    fr = {i for i in range(pages) if free[i]}
    for h in range(heads):
        p, a, v, b = ({i for i in range(pages) if m[h, i]} for m in (pred, actual, prev, buf))
        p, a = p & fr, a & fr  # only the pages that are not forced count
        want["actual"] += len(a)
        want["hit"] += len(p & a)
        want["pred"] += len(p)
        want["miss"] += len(a - v)
        want["miss_hit"] += len(p & (a - v))
        want["fetch"] += len(p - v)
        want["fetch_waste"] += len(p - v - a)
        want["lru_miss"] += len(a - b)
        want["lru_miss_hit"] += len(p & (a - b))
    assert c == want
    r = bench.rates(c)
    for key in ("recall", "miss_coverage", "lru_coverage"):
        assert math.isnan(r[key]) or 0.0 <= r[key] <= 1.0


def test_page_scores_are_the_bound_and_the_midpoint() -> None:
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(50, 2, 8, generator=gen)  # 50 keys: the last page partial
    q = torch.randn(6, 8, generator=gen)      # GQA group 3
    lo, hi, _ = qa.page_stats(k, 16)
    bound = qa.head_scores(qa.Variant("q"), q, k, (lo, hi, None)).sum(1)
    mid = qa.head_scores(qa.Variant("m", "mid"), q, k, (lo, hi, None)).sum(1)
    torch.testing.assert_close(bench.page_scores(q, lo, hi, 1.0), bound)
    torch.testing.assert_close(bench.page_scores(q, lo, hi, 0.0), mid)
    forced = qa.forced_pages(lo.shape[1], 16, 49, 16, 16)
    sel = bench.quest_select(q, lo, hi, forced, 1, 1.0)
    assert (sel.sum(-1) == int(forced.sum()) + 1).all() and sel[:, forced].all()


def test_pad_pages() -> None:
    m = bench.pad_pages(_mask([[0, 2]], 3), 5)
    assert m.tolist() == [[True, False, True, False, False]]


def test_lru_buffer_evicts_least_recent_unpinned() -> None:
    buf = bench.LruBuffer(1, 3)
    pinned = torch.tensor([True, False, False, False, False, False])
    buf.update(_mask([[0, 1, 2]], 6), pinned)
    buf.update(_mask([[0, 3]], 6), pinned)      # 4 held > 3: page 1 (older than 2, lower) goes
    assert buf.resident(6).tolist() == [[True, False, True, True, False, False]]
    buf.update(_mask([[0, 4, 5]], 6), pinned)   # 2 and 3 go (the selection itself stays)
    assert buf.resident(6).tolist() == [[True, False, False, False, True, True]]


def test_early_query_equals_the_layers_own_query() -> None:
    """From a layer's own input the early query is the layer's query (tiny random Llama)."""
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    seen: list[tuple[int, torch.Tensor]] = []

    def attend(module, query, key, value, mask, scaling=None, dropout=0.0, **kw):  # type: ignore[no-untyped-def]
        seen.append((module.layer_idx, query[0, :, -1].detach().clone()))
        k, v = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
        out = torch.nn.functional.scaled_dot_product_attention(query, k, v, is_causal=query.shape[2] > 1)
        return out.transpose(1, 2), None

    AttentionInterface.register("selection_prediction_test", attend)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.config._attn_implementation = "selection_prediction_test"
    tracer = bench.Tracer(model)
    with torch.no_grad():
        model(torch.tensor([[1, 5, 9, 3, 7]]))
    cos, sin = tracer.rope
    for layer, q in seen:
        mine = bench.early_query(tracer.layers[layer], tracer.h_in[layer], cos[:, -1:], sin[:, -1:])
        torch.testing.assert_close(mine, q)
    assert [x[0] for x in seen] == [0, 1]
