"""SnapKV (retrievable): votes vs a direct float64 re-computation, and the selection rules."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError, KVLayout, Request, load_config
from sparse_framework.algorithms.snapkv import SnapKV, SnapKVOptions, snapkv_votes
from helpers import batch_of


def direct_votes(keys, queries, window, kernel, pooling, how):
    """Per query head, by loops: causal softmax of the window queries, summed over the window
    on the keys before it, pooled with zero padding (average counts the padding), reduced."""
    n, hkv, d = keys.shape
    hq = queries.shape[1]
    w = min(window, n)
    prefix = n - w
    per_head = torch.zeros(hq, prefix, dtype=torch.float64)
    for j in range(hq):
        k = keys[:, j // (hq // hkv)].double()
        for i in range(w):
            t = n - w + i
            p = (k[: t + 1] @ queries[t, j].double() / math.sqrt(d)).softmax(0)
            per_head[j] += p[:prefix]
    pooled = torch.zeros_like(per_head)
    half = kernel // 2
    for x in range(prefix):
        lo, hi = x - half, x + half + 1
        window_vals = [per_head[:, y] if 0 <= y < prefix else torch.zeros(hq, dtype=torch.float64) for y in range(lo, hi)]
        stack = torch.stack(window_vals, dim=1)
        if pooling == "max":
            inside = torch.stack([per_head[:, y] for y in range(max(lo, 0), min(hi, prefix))], dim=1)
            pooled[:, x] = inside.amax(1)
        else:
            pooled[:, x] = stack.sum(1) / kernel
    grouped = pooled.view(hkv, hq // hkv, prefix)
    return {"max": grouped.amax(1), "sum": grouped.sum(1), "mean": grouped.mean(1)}[how]


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40), window=st.integers(1, 12), kernel=st.sampled_from([1, 3, 5, 7]),
    pooling=st.sampled_from(["max", "avg"]), how=st.sampled_from(["max", "sum", "mean"]),
    hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), seed=st.integers(0, 9999),
)
def test_votes_match_a_direct_computation(n, window, kernel, pooling, how, hkv, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, hkv, 8, generator=g)
    queries = torch.randn(n, hkv * group, 8, generator=g)
    opts = SnapKVOptions(window=window, kernel_size=kernel, pooling=pooling, gqa_reduce=how)
    got = snapkv_votes(keys, queries, opts)
    want = direct_votes(keys, queries, window, kernel, pooling, how)
    assert got.shape == want.shape == (hkv, max(0, n - window))
    assert torch.allclose(got.double(), want, atol=1e-5)


def make(top_k: int, window: int = 4, decoded: str = "on_top", **kw) -> SnapKV:
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "top_k": top_k, "sink_tokens": 0, "recent_tokens": 0,
                       "device_buffer_tokens": 512, "min_sparse_prompt_len": 0,
                       "extra": {"window": window, "kernel_size": 3, "decoded_tokens": decoded, **kw}})
    return SnapKV(cfg, KVLayout(num_layers=1, num_kv_heads=2, head_dim=8), max_requests=2, max_seq_len=128)



def test_selection_keeps_window_and_decode_tokens_then_the_best_voted() -> None:
    """decoded_tokens "in_budget": the window and decoded tokens take top_k places first."""
    g = torch.Generator().manual_seed(0)
    algo = make(top_k=12, window=4, decoded="in_budget")
    keys, queries = torch.randn(40, 2, 8, generator=g), torch.randn(40, 4, 8, generator=g)
    r = Request("a", 40, seq_len=43, slot=1)  # 3 decode tokens so far
    algo.build(0, r, keys, queries)
    sel = algo.select(0, torch.randn(1, 4, 8, generator=g), batch_of([r]))
    votes = snapkv_votes(keys, queries, algo.options)  # type: ignore[arg-type]
    for h in range(2):
        chosen = set(sel.indices[0, h, : sel.lengths[0, h]].tolist())
        assert set(range(36, 43)) <= chosen  # the window (36..39) and the decode tokens (40..42)
        # the newest token (42) is always kept outside the budget; the other six window and
        # decode tokens take 6 of the 12 budget slots, the best-voted prompt positions the rest
        # (max-pooled votes tie often: the lowest positions win a tie, as in every top-k here)
        best = set(votes[h].sort(descending=True, stable=True).indices[: 12 - 6].tolist())
        assert chosen == set(range(36, 43)) | best


def test_budget_covering_the_context_selects_everything_and_bad_options_fail() -> None:
    algo = make(top_k=64)
    r = Request("a", 30, seq_len=30, slot=0)
    algo.build(0, r, torch.randn(30, 2, 8), torch.randn(30, 4, 8))
    sel = algo.select(0, torch.randn(1, 4, 8), batch_of([r]))
    assert sel.lengths.tolist() == [[30, 30]]
    with pytest.raises(ConfigError, match="`extra.kernel_size` = 4: kernel_size must be odd"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "extra": {"kernel_size": 4}})
    with pytest.raises(ConfigError, match="`extra.pooling` = 'median'"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "extra": {"pooling": "median"}})
    with pytest.raises(ValueError, match="needs the prompt's queries"):
        algo.build(0, r, torch.randn(30, 2, 8))


def voted_counts(decoded: str, steps: list[int], **kw) -> tuple[list[int], SnapKV, dict]:
    """Voted prompt tokens (before the window, outside sink and recent) still selected after
    each number of decode steps, at the issue's defaults: sink 16, recent 64, top_k 256,
    a 1000-token prompt, window 32. Also returns the algorithm and the per-step selections."""
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "top_k": 256, "sink_tokens": 16, "recent_tokens": 64,
                       "device_buffer_tokens": 1024, "min_sparse_prompt_len": 0,
                       "extra": {"window": 32, "decoded_tokens": decoded, **kw}})
    algo = SnapKV(cfg, KVLayout(num_layers=1, num_kv_heads=1, head_dim=8), max_requests=2, max_seq_len=1400)
    g = torch.Generator().manual_seed(0)
    r = Request("a", 1000, seq_len=1000, slot=1)
    algo.build(0, r, torch.randn(1000, 1, 8, generator=g), torch.randn(1000, 2, 8, generator=g))
    counts, chosen = [], {}
    for step in steps:
        r.seq_len = 1000 + step  # `step` tokens decoded, the last of them being decoded now
        sel = algo.select(0, torch.randn(1, 2, 8, generator=g), batch_of([r]))
        toks = set(sel.indices[0, 0, : sel.lengths[0, 0]].tolist())
        chosen[step] = toks
        counts.append(len({t for t in toks if 16 <= t < 968 and t < r.seq_len - 64}))
    return counts, algo, chosen


def test_on_top_keeps_top_k_voted_tokens_for_the_whole_generation() -> None:
    """The original's rule: the top_k (= its capacity − window) best-voted prompt tokens stay
    selected at every step, the window and every decoded token on top; "in_budget" lets the
    window and decoded tokens take their places (256 → 188 → 88 → 0, as the issue measured)."""
    steps = [1, 100, 200, 300]
    on_top, algo, chosen = voted_counts("on_top", steps)
    assert on_top == [256] * 4
    in_budget, _, _ = voted_counts("in_budget", steps)
    assert in_budget == [256, 188, 88, 0]
    votes = algo.votes[0, 1, 0, :968]
    for step in steps:
        length = 1000 + step
        toks = chosen[step]
        assert set(range(968, length)) <= toks  # the window and every decoded token
        # the voted ones are the 256 best-voted of the positions outside sink and recent
        # (stable ties: lowest positions), the same set at every step
        eligible = [t for t in range(16, 968) if t < length - 64]
        best = sorted(eligible, key=lambda t: (-float(votes[t]), t))[:256]
        assert toks == set(range(16)) | set(best) | set(range(968, length)) | set(range(length - 64, length))
        assert len(toks) <= SnapKV.max_selected_tokens(algo.config)


def test_a_tail_longer_than_max_tail_tokens_takes_top_k_places() -> None:
    """on_top with max_tail_tokens 100: past it, the tail's oldest tokens (the window first)
    compete for top_k places ahead of the votes, so the selection keeps its width."""
    counts, algo, chosen = voted_counts("on_top", [1, 60, 200], max_tail_tokens=100)
    tail_len = {1: 33, 60: 92, 200: 232}
    for step, n in zip((1, 60, 200), counts):
        length = 1000 + step
        over = max(0, tail_len[step] - 100)  # tail tokens past the cap: scored +inf
        assert n == 256 - over
        assert set(range(968, length)) <= chosen[step]
    assert SnapKV.max_selected_tokens(algo.config) == 16 + 256 + 64 + 1 + 100


def test_max_tail_tokens_must_fit_the_device_buffer() -> None:
    base = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "top_k": 256, "sink_tokens": 16, "recent_tokens": 64, "device_buffer_tokens": 512}
    with pytest.raises(ConfigError, match=r"`extra.max_tail_tokens` = 200 does not fit the device buffer.*= 175"):
        load_config({**base, "extra": {"max_tail_tokens": 200}})
    cfg = load_config(base)  # unset: what the buffer leaves, at most 1024
    assert SnapKV.max_selected_tokens(cfg) == 512
    cfg = load_config({**base, "device_buffer_tokens": 4096})
    assert SnapKV.max_selected_tokens(cfg) == 16 + 256 + 64 + 1 + 1024
    cfg = load_config({**base, "extra": {"decoded_tokens": "in_budget"}})
    assert SnapKV.max_selected_tokens(cfg) == 16 + 256 + 64 + 1


def test_build_reads_only_the_last_prefill_query_rows() -> None:
    """An engine that prefills in chunks keeps only the last `prefill_query_rows` queries:
    the votes must not depend on the others (they are NaN here)."""
    algo = make(top_k=16, window=6)
    assert algo.prefill_query_rows == 6
    g = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(40, 2, 8, generator=g), torch.randn(40, 4, 8, generator=g)
    partial = queries.clone()
    partial[: 40 - 6] = float("nan")
    a, b = Request("a", 40, seq_len=40, slot=0), Request("b", 40, seq_len=40, slot=1)
    algo.build(0, a, keys, queries)
    algo.build(0, b, keys, partial)
    assert torch.equal(algo.votes[0, 0], algo.votes[0, 1]) and not algo.votes[0, 1].isnan().any()


def test_the_coordinator_takes_the_prompt_queries_in_their_tail_form() -> None:
    """At prefill the coordinator accepts q as only each prompt's last `prefill_query_rows`
    queries (the engine never builds a [prompt, q_heads, dim] tensor for SnapKV): the votes
    equal those of the full q, a wrong row count is one clear error, and `attend` at prefill
    (which needs every query) refuses the tail form."""
    from sparse_framework import Batch
    from sparse_framework.coordinator.core import SparseCoordinator

    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    config = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "backend": "torch_ref", "top_k": 8, "page_size": 4,
              "min_sparse_prompt_len": 0, "extra": {"window": 6}}
    g = torch.Generator().manual_seed(5)
    lens = [20, 4]  # the second prompt is shorter than the window: all its queries
    q, k, v = (torch.randn(sum(lens), h, 8, generator=g) for h in (4, 2, 2))
    tail = torch.cat([q[14:20], q[20:24]])
    votes = []
    for queries in (q, tail):
        coord = SparseCoordinator(config, layout, max_requests=2, max_seq_len=32)
        reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
        for r in reqs:
            coord.on_request_begin(r)
        batch = Batch(reqs, is_prefill=True)
        coord.forward_begin(batch)
        with pytest.raises(ValueError, match=r"last 6 queries: 10 rows"):
            coord.attention_begin(0, queries[:-1], k, v, batch)
        meta = coord.attention_begin(0, queries, k, v, batch)
        if queries is tail:
            with pytest.raises(ValueError, match="needs every prompt query"):
                coord.attend(0, queries, meta)
        coord.attention_end(0, None, batch)
        coord.forward_end(batch)
        votes.append(coord.algorithm.votes.clone())
    assert torch.equal(votes[0], votes[1])
