"""Quest: page min/max representations, incremental appends, the Σ_d max(q·min, q·max)
bound and the page selection, each against a direct re-computation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import ConfigError, KVLayout, Request, load_config
from sparse_framework.algorithms.quest import Quest
from helpers import batch_of

MAX_REQUESTS, MAX_SEQ_LEN, LAYERS = 3, 128, 2


def make(page: int, how: str = "max", top_k: int = 8, sink: int = 0, recent: int = 0, hk: int = 2,
         d: int = 6, dtype: torch.dtype = torch.float32, min_pages: int = 0, newest_in_top_k: bool = True,
         range_weight: float = 1.0) -> Quest:
    cfg = load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": max(top_k, page), "page_size": page, "sink_tokens": sink,
                       "recent_tokens": recent, "device_buffer_tokens": 4096, "min_sparse_prompt_len": 0,
                       "extra": {"gqa_reduce": how, "min_pages": min_pages, "newest_in_top_k": newest_in_top_k,
                                 "range_weight": range_weight}})
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=hk, head_dim=d, dtype=dtype)
    return Quest(cfg, layout, max_requests=MAX_REQUESTS, max_seq_len=MAX_SEQ_LEN)



def requests(lens: list[int], gen: torch.Generator) -> list[Request]:
    """Requests of the given lengths in distinct, shuffled pool slots."""
    slots = torch.randperm(MAX_REQUESTS, generator=gen)[: len(lens)].tolist()
    return [Request(f"r{i}", n, seq_len=n, slot=s) for i, (n, s) in enumerate(zip(lens, slots))]


def page_bounds(keys: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [n, kv_heads, dim] -> [kv_heads, pages, dim] element-wise min and max of each
    page's keys (the last page partial), by a loop over pages."""
    n = keys.shape[0]
    lo = torch.stack([keys[s : s + page].amin(0) for s in range(0, n, page)], dim=1)
    hi = torch.stack([keys[s : s + page].amax(0) for s in range(0, n, page)], dim=1)
    return lo, hi


def head_bounds(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per query head, float64: q [Hq, D], lo/hi [Hk, P, D] -> [Hq, P] with
    bound[j, p] = Σ_d max(q_jd · lo_hd, q_jd · hi_hd), h = j // (Hq // Hk)."""
    hq, hk = q.shape[0], lo.shape[0]
    rows = []
    for j in range(hq):
        h = j // (hq // hk)
        qj = q[j].double()
        rows.append(torch.stack([
            torch.stack([qj * lo[h, p].double(), qj * hi[h, p].double()]).amax(0).sum()
            for p in range(lo.shape[1])
        ]))
    return torch.stack(rows)


def weighted_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, w: float) -> torch.Tensor:
    """`range_weight`'s definition, float64, by loops: q [Hq, D], lo/hi [Hk, P, D] -> [Hq, P]
    with s[j, p] = Σ_d q_jd·(lo_hd + hi_hd)/2 + w·|q_jd|·(hi_hd − lo_hd)/2, h = j // (Hq // Hk)."""
    hq, hk = q.shape[0], lo.shape[0]
    out = torch.zeros(hq, lo.shape[1], dtype=torch.float64)
    for j in range(hq):
        h = j // (hq // hk)
        for p in range(lo.shape[1]):
            for d in range(q.shape[1]):
                qd, m, big = float(q[j, d]), float(lo[h, p, d]), float(hi[h, p, d])
                out[j, p] += qd * (m + big) / 2 + w * abs(qd) * (big - m) / 2
    return out


def reduce(per_head: torch.Tensor, hk: int, how: str) -> torch.Tensor:
    """[Hq, P] -> [Hk, P] over each GQA group, by a loop."""
    group = per_head.shape[0] // hk
    out = []
    for h in range(hk):
        rows = [per_head[j] for j in range(h * group, (h + 1) * group)]
        total = sum(rows)
        out.append({"max": torch.stack(rows).amax(0), "sum": total, "mean": total / group}[how])
    return torch.stack(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view (torch.empty may hold NaNs, which torch.equal never calls equal)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


@settings(max_examples=30, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=MAX_REQUESTS),
    hk=st.sampled_from([1, 2]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_build_gives_each_pages_min_and_max(page, lens, hk, dtype, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    quest = make(page, hk=hk, dtype=dtype)
    reqs = requests(lens, g)
    keys = [torch.randn(n, hk, 6, generator=g).to(dtype) for n in lens]
    other_layer = bits(quest.page_min[0]), bits(quest.page_max[0])
    for r, k in zip(reqs, keys):
        quest.build(1, r, k)
    for r, k in zip(reqs, keys):
        lo, hi = page_bounds(k, page)
        pages = lo.shape[1]
        assert torch.equal(quest.page_min[1, r.slot, :, :pages], lo)
        assert torch.equal(quest.page_max[1, r.slot, :, :pages], hi)
    assert torch.equal(bits(quest.page_min[0]), other_layer[0])  # other layers untouched
    assert torch.equal(bits(quest.page_max[0]), other_layer[1])


@settings(max_examples=30, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 16]),
    lens=st.lists(st.integers(1, 50), min_size=1, max_size=MAX_REQUESTS),
    steps=st.integers(1, 40),
    hk=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_appends_equal_a_fresh_build_over_all_keys(page, lens, steps, hk, seed) -> None:
    """Decode steps of one token per request (a random non-empty subset of the requests each
    step, so lengths diverge and page boundaries are crossed at different steps); afterwards
    every request's pages equal a build over all its keys."""
    g = torch.Generator().manual_seed(seed)
    quest = make(page, hk=hk)
    reqs = requests(lens, g)
    keys = [torch.randn(n + steps, hk, 6, generator=g) for n in lens]
    for r, k in zip(reqs, keys):
        quest.build(0, r, k[: r.seq_len])
    other_layer = bits(quest.page_min[1]), bits(quest.page_max[1])
    for _ in range(steps):
        mask = torch.rand(len(reqs), generator=g) < 0.7
        mask[int(torch.randint(0, len(reqs), (1,), generator=g))] = True
        step = [r for r, m in zip(reqs, mask.tolist()) if m]
        for r in step:
            r.seq_len += 1  # seq_lens include this step's token
        new = torch.stack([keys[reqs.index(r)][r.seq_len - 1] for r in step])  # [B, Hk, D]
        quest.append(0, batch_of(step), new)
    for r, k in zip(reqs, keys):
        lo, hi = page_bounds(k[: r.seq_len], page)
        pages = lo.shape[1]
        assert torch.equal(quest.page_min[0, r.slot, :, :pages], lo)
        assert torch.equal(quest.page_max[0, r.slot, :, :pages], hi)
    assert torch.equal(bits(quest.page_min[1]), other_layer[0])
    assert torch.equal(bits(quest.page_max[1]), other_layer[1])


@settings(max_examples=30, deadline=None)
@given(
    how=st.sampled_from(["max", "sum", "mean"]),
    page=st.sampled_from([1, 2, 4, 8]),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=MAX_REQUESTS),
    seed=st.integers(0, 2**16),
)
def test_scores_match_a_direct_computation_and_bound_every_key(how, page, hk, group, lens, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 6
    quest = make(page, how, hk=hk, d=d)
    reqs = requests(lens, g)
    keys = [torch.randn(n, hk, d, generator=g) for n in lens]
    for r, k in zip(reqs, keys):
        quest.build(1, r, k)
    q = torch.randn(len(reqs), hk * group, d, generator=g)
    scores = quest.score(1, q, batch_of(reqs))
    assert scores.dtype == torch.float32
    assert scores.shape == (len(reqs), hk, -(-max(lens) // page))
    for i, (r, k) in enumerate(zip(reqs, keys)):
        lo, hi = page_bounds(k, page)
        per_head = head_bounds(q[i], lo, hi)  # [Hq, pages]
        got = scores[i, :, : lo.shape[1]].double()
        assert torch.allclose(got, reduce(per_head, hk, how), atol=1e-5, rtol=1e-5)
        # per query head, the bound is an upper bound of q·k for every key of the page
        page_of = torch.arange(r.seq_len) // page
        dots = torch.stack([k[:, j // group].double() @ q[i, j].double() for j in range(hk * group)])  # [Hq, n]
        assert bool((dots <= per_head[:, page_of] + 1e-9).all())
        # and the group's reduced score bounds the group's reduced q·k of every key
        reduced_dots = reduce(dots, hk, how)  # [Hk, n]
        assert bool((reduced_dots <= got[:, page_of] + 1e-5).all())
        if how == "max":  # max of upper bounds: an upper bound for every head of the group
            for j in range(hk * group):
                assert bool((dots[j] <= got[j // group, page_of] + 1e-5).all())


def forced_pages(length: int, page: int, sink: int, recent: int, newest: bool = True) -> set[int]:
    """Pages kept outside the budget: the sink's and the recent window's, and (newest) the last."""
    toks = set(range(min(sink, length))) | set(range(max(0, length - recent), length)) | ({length - 1} if newest else set())
    return {t // page for t in toks}


@settings(max_examples=40, deadline=None)
@given(
    how=st.sampled_from(["max", "sum", "mean"]),
    page=st.sampled_from([1, 2, 4, 8]),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    budget=st.integers(1, 6),
    min_pages=st.integers(0, 4),
    sink=st.integers(0, 9),
    recent=st.integers(0, 12),
    lens=st.lists(st.integers(1, 60), min_size=1, max_size=MAX_REQUESTS),
    seed=st.integers(0, 2**16),
    newest_in_top_k=st.booleans(),
)
def test_select_keeps_the_best_pages_plus_sink_recent_and_last(
    how, page, hk, group, budget, min_pages, sink, recent, lens, seed, newest_in_top_k
) -> None:
    """Per request and KV head: the sink pages, the recent window's pages and the last page,
    plus the max(min_pages, top_k // page) best pages of the rest by the directly computed
    score (near-ties within 1e-4 may go either way), as whole pages, ascending, -1 padded.
    newest_in_top_k: the last page, unless the sink or recent window holds it, is one of
    those best pages instead of one more."""
    g = torch.Generator().manual_seed(seed)
    d = 6
    quest = make(page, how, top_k=budget * page, sink=sink, recent=recent, hk=hk, d=d, min_pages=min_pages,
                 newest_in_top_k=newest_in_top_k)
    reqs = requests(lens, g)
    keys = [torch.randn(n, hk, d, generator=g) for n in lens]
    for r, k in zip(reqs, keys):
        quest.build(0, r, k)
    q = torch.randn(len(reqs), hk * group, d, generator=g)
    batch = batch_of(reqs)
    sel = quest.select(0, q, batch)
    sel.validate(batch.seq_lens)
    assert sel.page_size == page and sel.per_kv_head == (hk > 1)
    assert sel.indices.shape[:2] == (len(reqs), hk)
    assert sel.indices.shape[2] <= Quest.max_selected_tokens(quest.config)
    for i, (r, k) in enumerate(zip(reqs, keys)):
        lo, hi = page_bounds(k, page)
        want = reduce(head_bounds(q[i], lo, hi), hk, how)  # [Hk, pages]
        n_pages = lo.shape[1]
        forced = forced_pages(r.seq_len, page, sink, recent, newest=not newest_in_top_k)
        last = (r.seq_len - 1) // page
        for h in range(hk):
            toks = sel.indices[i, h, : sel.lengths[i, h]].tolist()
            pages = {t // page for t in toks}
            assert toks == [t for p in sorted(pages) for t in range(p * page, min((p + 1) * page, r.seq_len))]
            assert forced | {last} <= pages
            chosen = pages - forced
            rest = set(range(n_pages)) - forced
            assert chosen <= rest and len(chosen) == min(max(min_pages, budget), len(rest))
            if last in chosen:  # counted inside the budget, whatever its score
                chosen, rest = chosen - {last}, rest - {last}
            if chosen and rest - chosen:
                worst_chosen = min(float(want[h, p]) for p in chosen)
                best_left = max(float(want[h, p]) for p in rest - chosen)
                assert worst_chosen >= best_left - 1e-4


@settings(max_examples=20, deadline=None)
@given(
    page=st.sampled_from([1, 2, 4, 8]),
    hk=st.sampled_from([1, 2]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=MAX_REQUESTS),
    sink=st.integers(0, 8),
    recent=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_budget_covering_the_context_selects_everything(page, hk, lens, sink, recent, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    # the budget is top_k // page_size pages: cover the longest context in whole pages
    quest = make(page, top_k=-(-max(lens) // page) * page + page * int(torch.randint(0, 3, (1,), generator=g)), sink=sink,
                 recent=recent, hk=hk, range_weight=float(torch.rand(1, generator=g)))
    reqs = requests(lens, g)
    for r in reqs:
        quest.build(1, r, torch.randn(r.seq_len, hk, 6, generator=g))
    sel = quest.select(1, torch.randn(len(reqs), 2 * hk, 6, generator=g), batch_of(reqs))
    for i, n in enumerate(lens):
        assert sel.lengths[i].tolist() == [n] * hk
        for h in range(hk):
            row = sel.indices[i, h].tolist()
            assert row == list(range(n)) + [-1] * (len(row) - n)


def test_select_example_with_sink_recent_and_a_partial_last_page() -> None:
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


def test_bad_gqa_reduce_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="`extra.gqa_reduce` = 'median'"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "extra": {"gqa_reduce": "median"}})


@settings(max_examples=30, deadline=None)
@given(
    how=st.sampled_from(["max", "sum", "mean"]),
    w=st.sampled_from([0.0, 0.25, 0.5, 1.0]) | st.floats(0.0, 1.0),
    page=st.sampled_from([1, 2, 4, 8]),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=MAX_REQUESTS),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_range_weight_scores_match_their_definition(how, w, page, hk, group, lens, dtype, seed) -> None:
    """`range_weight` w: per query head Σ_d q_d·(min_d + max_d)/2 + w·|q_d|·(max_d − min_d)/2
    (a float64 loop over the definition), reduced over the group; w = 1 is the paper's bound,
    bit for bit, and w = 0 scores the page midpoint."""
    g = torch.Generator().manual_seed(seed)
    d = 6
    quest = make(page, how, hk=hk, d=d, dtype=dtype, range_weight=w)
    paper = make(page, how, hk=hk, d=d, dtype=dtype)
    reqs = requests(lens, g)
    keys = [torch.randn(n, hk, d, generator=g).to(dtype) for n in lens]
    for r, k in zip(reqs, keys):
        quest.build(1, r, k)
        paper.build(1, r, k)
    q = torch.randn(len(reqs), hk * group, d, generator=g).to(dtype)
    scores, bound = quest.score(1, q, batch_of(reqs)), paper.score(1, q, batch_of(reqs))
    for i, (r, k) in enumerate(zip(reqs, keys)):
        lo, hi = page_bounds(k, page)
        n_pages = lo.shape[1]  # pages past a request's length hold anything
        want = reduce(weighted_scores(q[i], lo, hi, w), hk, how)
        assert torch.allclose(scores[i, :, :n_pages].double(), want, atol=1e-4, rtol=1e-4)
        if w == 1.0:
            assert torch.equal(scores[i, :, :n_pages], bound[i, :, :n_pages])


def test_range_weight_zero_ranks_pages_by_their_midpoint() -> None:
    """A worked example: page A's keys sit near q's direction but vary little; page B spreads
    far in a channel q barely uses. The bound (w = 1) prefers B for its spread, w = 0 prefers A."""
    q = torch.tensor([[[1.0, 0.1]]])  # one request, one query head
    keys = torch.tensor([[0.9, 0.0], [1.1, 0.0], [0.0, -9.0], [0.0, 9.0]]).view(4, 1, 2)  # pages of 2: A, B
    r = Request("a", 4, seq_len=4, slot=0)
    got = {}
    for w in (1.0, 0.0):
        quest = make(2, "sum", hk=1, d=2, range_weight=w)
        quest.build(0, r, keys)
        got[w] = quest.score(0, q, batch_of([r]))[0, 0].tolist()
    assert got[1.0] == pytest.approx([1.1, 0.9])  # A: 1.1 + 0; B: 0 + 0.9
    assert got[0.0] == pytest.approx([1.0, 0.0])  # A: q·(1.0, 0); B: q·(0, 0)


def test_range_weight_outside_zero_one_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="range_weight"):
        load_config({"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "extra": {"range_weight": 1.5}})


@pytest.mark.parametrize("range_weight", [0.0, 0.5])
def test_range_weight_with_a_budget_covering_the_context_equals_dense(range_weight) -> None:
    """Through the coordinator, against float64 dense attention, over a few decode steps."""
    from coordinator_driver import Driver, make as make_coordinator

    cfg = {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 128, "page_size": 4, "sink_tokens": 3, "recent_tokens": 5,
           "extra": {"dense_first_layers": 0, "range_weight": range_weight}}
    coord = make_coordinator(cfg, kv_heads=2)
    drv = Driver(coord, q_heads=4, seed=7)
    reqs = [Request("a", 40), Request("b", 77)]
    drv.prefill(reqs)
    for _ in range(4):
        for out, ref, _meta in drv.decode(reqs):
            assert torch.allclose(out.double(), ref, atol=1e-5, rtol=0)
