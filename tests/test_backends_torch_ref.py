"""torch_ref paged decode attention vs a plain float64 dense attention.

The dense reference is written here from the definition, softmax(q·kᵀ·scale)·v per query head
with GQA (query head j reads KV head j // (Hq // Hk)), in float64, by a loop over heads.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.adaptors.flash_attention import FlashAttentionMetadata
from sparse_framework.backends.torch_ref import TorchRefBackend, indexed_attention, paged_attention

from helpers import dense_attention_f64, dense_loop_f64 as dense


GARBAGE = ("zeros", "in_range", "wild")


def garbage_ids(mode: str, shape: tuple[int, ...], total: int, gen: torch.Generator) -> torch.Tensor:
    """Page ids for table entries past a sequence's pages: zeros, random valid ids (which
    may point at other sequences' pages or at NaN pages), or wild ids (negative, huge)."""
    if mode == "zeros":
        return torch.zeros(shape, dtype=torch.long)
    if mode == "in_range":
        return torch.randint(0, total, shape, generator=gen)
    wild = torch.tensor([-1, -(2**20), total, total + 7, 2**30])
    return wild[torch.randint(0, wild.numel(), shape, generator=gen)]


def paged(
    seqs: list[tuple[torch.Tensor, torch.Tensor]],
    page: int,
    gen: torch.Generator,
    garbage: str = "zeros",
    fill: float = float("nan"),
    spare_pages: int = 2,
    spare_width: int = 2,
    spare_first: bool = False,
):
    """Scatter each sequence's K/V over randomly permuted physical pages of one cache
    [num_pages, page, Hk, D]. Returns (k_cache, v_cache, page_table int32, cache_seqlens int32).
    Everything not holding a token (spare pages, the tail of a partial last page) is `fill`;
    table entries past each sequence's pages are `garbage` ids. `spare_first` makes physical
    page 0 a spare (all `fill`): the first row of the cache is where a gather that clamps
    unused entries to 0 would read."""
    hk, d, dv = seqs[0][0].shape[1], seqs[0][0].shape[2], seqs[0][1].shape[2]
    counts = [-(-k.shape[0] // page) for k, _ in seqs]
    total = sum(counts) + spare_pages
    order = torch.randperm(total, generator=gen)
    if spare_first and spare_pages:
        zero = int((order == 0).nonzero())
        order[zero], order[-1] = order[-1].clone(), 0
    k_cache = torch.full((total, page, hk, d), fill)
    v_cache = torch.full((total, page, hk, dv), fill)
    width = max(counts) + spare_width
    table = garbage_ids(garbage, (len(seqs), width), total, gen)
    start = 0
    for i, ((k, v), n) in enumerate(zip(seqs, counts)):
        ids = order[start : start + n]
        start += n
        table[i, :n] = ids
        for j, pid in enumerate(ids.tolist()):
            rows = slice(j * page, min((j + 1) * page, k.shape[0]))
            k_cache[pid, : rows.stop - rows.start] = k[rows]
            v_cache[pid, : rows.stop - rows.start] = v[rows]
    lens = torch.tensor([k.shape[0] for k, _ in seqs], dtype=torch.int32)
    return k_cache, v_cache, table.to(torch.int32), lens


@settings(max_examples=40, deadline=None)
@given(
    page=st.integers(1, 8),
    hk=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([4, 8, 16]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    garbage=st.sampled_from(GARBAGE),
    spare_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_dense_over_the_sequence(page, hk, group, d, lens, garbage, spare_first, seed) -> None:
    """(a) A page table listing every page of each sequence (physical pages permuted, last
    page partial) gives dense attention over the tokens in logical order — through both
    `paged_attention` (explicit scale, float32 out) and `TorchRefBackend.run` (default scale)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)) for n in lens]
    q = torch.randn(len(lens), hk * group, d, generator=g)
    k_cache, v_cache, table, seqlens = paged(seqs, page, g, garbage, spare_first=spare_first)
    scale = 0.3 + float(torch.rand((), generator=g))
    raw = paged_attention(q, k_cache, v_cache, table, seqlens, scale)
    assert raw.dtype == torch.float32 and raw.shape == (len(lens), hk * group, d)
    meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=False)
    out = TorchRefBackend().run(q, k_cache, v_cache, meta)
    assert out.dtype == q.dtype and out.shape == q.shape
    scaled = TorchRefBackend().run(q, k_cache, v_cache, meta, scale=scale)
    assert not raw.isnan().any() and not out.isnan().any()
    assert torch.equal(scaled, raw)  # run = paged_attention in q's dtype (float32 here)
    for i, (k, v) in enumerate(seqs):
        assert torch.allclose(raw[i].double(), dense(q[i], k, v, scale), atol=1e-5, rtol=0)
        assert torch.allclose(out[i].double(), dense(q[i], k, v), atol=1e-5, rtol=0)


@settings(max_examples=30, deadline=None)
@given(
    page=st.integers(1, 8),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    lens=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    modes=st.tuples(st.sampled_from(GARBAGE), st.sampled_from(GARBAGE)),
    spare_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_entries_past_the_sequence_are_never_read(page, hk, group, lens, modes, spare_first, seed) -> None:
    """(b) The same sequences laid out identically, once with NaN in every unused row and
    garbage table ids past ceil(len / page), once with other garbage and random unused rows:
    the outputs are bit-identical and finite."""
    d = 8
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)) for n in lens]
    q = torch.randn(len(lens), hk * group, d, generator=g)
    outs = []
    for mode, fill in zip(modes, (float("nan"), 1e4)):
        layout = torch.Generator().manual_seed(seed)  # same physical permutation both times
        k_cache, v_cache, table, seqlens = paged(seqs, page, layout, "zeros", fill=fill, spare_first=spare_first)
        used = -(-seqlens.long() // page)
        past = torch.arange(table.shape[1]) >= used.unsqueeze(1)
        junk = garbage_ids(mode, tuple(table.shape), k_cache.shape[0], g).to(torch.int32)
        table = torch.where(past, junk, table)
        meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=False)
        outs.append(TorchRefBackend().run(q, k_cache, v_cache, meta))
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    hk=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3]),
    page=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_folded_heads_attend_to_their_own_tokens(b, hk, group, page, seed) -> None:
    """(c) Head-major cache [Hk * num_pages, P, 1, D] with heads_folded metadata: folded
    sequence b*Hk + h (request b, KV head h, with its G query heads) attends to its own subset
    of pages of its own head, in table order, the last one possibly partial."""
    g = torch.Generator().manual_seed(seed)
    d, pages_per_seq = 8, 6
    n = pages_per_seq * page
    k = torch.randn(b, n, hk, d, generator=g)
    v = torch.randn(b, n, hk, d, generator=g)
    q = torch.randn(b, hk * group, d, generator=g)
    num_pages = b * pages_per_seq + 1  # per head; one spare NaN page per head
    perm = torch.randperm(num_pages, generator=g)  # physical page of (request, logical page)
    kc = torch.full((hk, num_pages, page, 1, d), float("nan"))
    vc = torch.full((hk, num_pages, page, 1, d), float("nan"))
    for bi in range(b):
        for p in range(pages_per_seq):
            phys = int(perm[bi * pages_per_seq + p])
            kc[:, phys, :, 0] = k[bi, p * page : (p + 1) * page].transpose(0, 1)
            vc[:, phys, :, 0] = v[bi, p * page : (p + 1) * page].transpose(0, 1)
    table = torch.randint(-5, 10**6, (b * hk, pages_per_seq + 1), generator=g, dtype=torch.int32)
    seqlens = torch.zeros(b * hk, dtype=torch.int32)
    chosen = {}
    for bi in range(b):
        for h in range(hk):
            count = int(torch.randint(1, pages_per_seq + 1, (1,), generator=g))
            keep = sorted(torch.randperm(pages_per_seq, generator=g)[:count].tolist())
            tail = int(torch.randint(1, page + 1, (1,), generator=g))  # tokens used of the last page
            toks = torch.cat([torch.arange(p * page, (p + 1) * page) for p in keep])[: (count - 1) * page + tail]
            chosen[bi, h] = toks
            phys = [h * num_pages + int(perm[bi * pages_per_seq + p]) for p in keep]
            table[bi * hk + h, :count] = torch.tensor(phys, dtype=torch.int32)
            seqlens[bi * hk + h] = toks.numel()
    meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=True)
    out = TorchRefBackend().run(q, kc.reshape(-1, page, 1, d), vc.reshape(-1, page, 1, d), meta)
    assert out.shape == (b, hk * group, d) and not out.isnan().any()
    for bi in range(b):
        for h in range(hk):
            toks = chosen[bi, h]
            heads = slice(h * group, (h + 1) * group)
            want = dense(q[bi, heads], k[bi, toks, h : h + 1], v[bi, toks, h : h + 1])
            assert torch.allclose(out[bi, heads].double(), want, atol=1e-5, rtol=0)


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    page=st.integers(1, 4),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    lens=st.lists(st.integers(1, 24), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_low_precision_output_follows_q_and_is_close_to_float32(dtype, page, hk, group, lens, seed) -> None:
    """(d) bf16/fp16 q and caches: output in q's dtype, close to the float32 result over the
    same (rounded) inputs (float32 accumulation inside, one rounding at the end)."""
    d = 8
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)) for n in lens]
    q = torch.randn(len(lens), hk * group, d, generator=g).to(dtype)
    k_cache, v_cache, table, seqlens = paged(seqs, page, g, "in_range")
    meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=False)
    low = TorchRefBackend().run(q, k_cache.to(dtype), v_cache.to(dtype), meta)
    assert low.dtype == dtype
    ref = TorchRefBackend().run(q.float(), k_cache.to(dtype).float(), v_cache.to(dtype).float(), meta)
    assert ref.dtype == torch.float32
    eps = torch.finfo(dtype).eps
    assert torch.allclose(low.float(), ref, atol=2 * eps, rtol=2 * eps)
    for i, (k, v) in enumerate(seqs):  # and close to dense over the rounded inputs
        want = dense(q[i], k.to(dtype), v.to(dtype))
        assert torch.allclose(low[i].double(), want, atol=4 * eps, rtol=4 * eps)


@settings(max_examples=20, deadline=None)
@given(
    page=st.integers(1, 4),
    hk=st.sampled_from([1, 2]),
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=4).filter(lambda ls: 0 in ls),
    folded=st.booleans(),
    spare_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_zero_length_sequences_give_zeros(page, hk, lens, folded, spare_first, seed) -> None:
    """(e) A sequence of length 0 gives exact zeros (not NaN), even when its table row points
    at NaN pages; the other rows of the batch are unaffected."""
    d, group = 4, 2
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)) for n in lens]
    q = torch.randn(len(lens), hk * group, d, generator=g)
    nonempty = [s if s[0].shape[0] else (torch.zeros(1, hk, d), torch.zeros(1, hk, d)) for s in seqs]
    k_cache, v_cache, table, _ = paged(nonempty, page, g, "zeros", spare_pages=1, spare_first=spare_first)
    nan_page = int(torch.isnan(k_cache.flatten(1)).all(1).nonzero()[0])
    seqlens = torch.tensor(lens, dtype=torch.int32)
    for i, n in enumerate(lens):
        if n == 0:
            table[i] = nan_page
    if folded:  # one KV head: the folded and plain views coincide; fold the batch as (b, 1)
        k_cache, v_cache = k_cache[:, :, :1], v_cache[:, :, :1]
        seqs = [(k[:, :1], v[:, :1]) for k, v in seqs]
        q = q[:, :group]
    meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=folded)
    out = TorchRefBackend().run(q, k_cache, v_cache, meta)
    assert not out.isnan().any()
    for i, (k, v) in enumerate(seqs):
        if lens[i] == 0:
            assert bool((out[i] == 0).all())
        else:
            assert torch.allclose(out[i].double(), dense(q[i], k, v), atol=1e-5, rtol=0)
    raw = paged_attention(q, k_cache, v_cache, table, seqlens, 0.5)
    assert bool((raw[seqlens == 0] == 0).all())


def test_mla_value_is_a_prefix_of_the_latent() -> None:
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(12, 1, 24, generator=g)
    q = torch.randn(1, 8, 24, generator=g)
    cache = lat.view(12, 1, 1, 24)
    out = paged_attention(q, cache, cache[..., :16], torch.arange(12, dtype=torch.int32).view(1, -1),
                          torch.tensor([12], dtype=torch.int32), 1 / math.sqrt(24))
    assert out.shape == (1, 8, 16)
    assert torch.allclose(out[0].double(), dense(q[0], lat, lat[..., :16]), atol=1e-5)


# -- soft-capping and attention sinks ----------------------------------------------------------
OPTIONS = st.sampled_from([(None, False), (2.5, False), (None, True), (0.7, True)])  # (softcap, sinks?)


@settings(max_examples=30, deadline=None)
@given(
    page=st.integers(1, 4),
    hk=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=3),
    options=OPTIONS,
    folded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_softcap_and_sinks_follow_the_float64_formula(page, hk, group, lens, options, folded, seed) -> None:
    """paged_attention and the backend (plain and with the KV heads folded into the batch)
    against helpers.dense_attention_f64 written from the definition; logits large enough
    (q x 3) that the cap bends them; a sequence of length 0 gives zeros with or without sinks."""
    softcap, with_sinks = options
    g = torch.Generator().manual_seed(seed)
    d, scale = 8, 0.4
    seqs = [(torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)) for n in lens]
    k_cache, v_cache, table, seqlens = paged(seqs, page, g)
    q = torch.randn(len(lens), hk * group, d, generator=g) * 3
    sinks = torch.randn(hk * group, generator=g) * 2 if with_sinks else None
    raw = paged_attention(q, k_cache, v_cache, table, seqlens, scale, softcap=softcap, sinks=sinks)
    for i, (k, v) in enumerate(seqs):
        want = dense_attention_f64(q[i], k, v, scale, softcap, sinks)
        assert torch.allclose(raw[i].double(), want, atol=1e-5, rtol=0)
    if folded:  # the same sequences, one folded sequence per (request, KV head), head-major cache
        kc = k_cache.permute(2, 0, 1, 3).reshape(-1, page, 1, d)  # KV head h's pages: h * num_pages + p
        vc = v_cache.permute(2, 0, 1, 3).reshape(-1, page, 1, d)
        num_pages = k_cache.shape[0]
        ftable = torch.cat([table.unsqueeze(1) + h * num_pages for h in range(hk)], 1).view(-1, table.shape[1])
        ftable = torch.where(table.repeat_interleave(hk, 0) < 0, 0, ftable).int()  # garbage ids stay unread
        meta = FlashAttentionMetadata(ftable, seqlens.repeat_interleave(hk), page, heads_folded=True)
        out = TorchRefBackend().run(q, kc, vc, meta, scale=scale, softcap=softcap, sinks=sinks)
    else:
        meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=False)
        out = TorchRefBackend().run(q, k_cache, v_cache, meta, scale=scale, softcap=softcap, sinks=sinks)
    # two float32 implementations summing in different orders: O(1) outputs over ~20 tokens differ
    # by a few ulps (1.5e-6 seen in CI); each is held to the float64 formula at 1e-5 above
    torch.testing.assert_close(out, raw, atol=1e-5, rtol=0)


@settings(max_examples=20, deadline=None)
@given(options=OPTIONS, s_q=st.integers(1, 2), topk=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_indexed_softcap_and_sinks_follow_the_float64_formula(options, s_q, topk, seed) -> None:
    """indexed_attention (token rows named by index lists, -1 unused) with the options; a query
    token whose list is all -1 gives zeros."""
    softcap, with_sinks = options
    g = torch.Generator().manual_seed(seed)
    n, hk, group, d, rows = 2, 2, 2, 8, 20
    kv = torch.randn(rows, hk, d, generator=g)
    idx = torch.stack([torch.randperm(rows, generator=g)[:topk] for _ in range(n * s_q)]).view(n, s_q, topk)
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.3, -1, idx).int()
    idx[-1, -1] = -1
    q = torch.randn(n, s_q, hk * group, d, generator=g) * 3
    sinks = torch.randn(hk * group, generator=g) if with_sinks else None
    out = indexed_attention(q, kv, idx, 0.5, d, softcap=softcap, sinks=sinks)
    for i in range(n):
        for j in range(s_q):
            used = idx[i, j][idx[i, j] >= 0].long()
            want = dense_attention_f64(q[i, j], kv[used], kv[used], 0.5, softcap, sinks)
            assert torch.allclose(out[i, j].double(), want, atol=1e-5, rtol=0)
    assert bool((out[-1, -1] == 0).all())


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    q, k = torch.randn(1, 4, 8), torch.randn(2, 4, 2, 8)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        paged_attention(q, k, k, table, lens, 0.5, sinks=torch.zeros(3))
