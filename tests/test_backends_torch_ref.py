"""torch_ref paged decode attention vs a plain float64 dense attention."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.adaptors.flash_attention import FlashAttentionMetadata
from sparse_framework.backends.torch_ref import TorchRefBackend, paged_attention


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Hq, D], k [L, Hk, D], v [L, Hk, Dv] -> [Hq, Dv] in float64, by a loop over heads."""
    hq, hk = q.shape[0], k.shape[1]
    out = []
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].double(), v[:, h // (hq // hk)].double()
        p = (kh @ q[h].double() / math.sqrt(q.shape[-1])).softmax(0)
        out.append(p @ vh)
    return torch.stack(out)


def paged(seqs: list[tuple[torch.Tensor, torch.Tensor]], page: int, gen: torch.Generator, garbage: bool):
    """Scatter each sequence's K/V over randomly permuted pages of one cache.
    Returns (k_cache, v_cache, page_table, cache_seqlens); unused pages are NaN."""
    hk, d, dv = seqs[0][0].shape[1], seqs[0][0].shape[2], seqs[0][1].shape[2]
    counts = [-(-k.shape[0] // page) for k, _ in seqs]
    total = sum(counts) + 2
    order = torch.randperm(total, generator=gen)
    k_cache = torch.full((total, page, hk, d), float("nan"))
    v_cache = torch.full((total, page, hk, dv), float("nan"))
    width = max(counts) + 2
    table = torch.randint(0, total, (len(seqs), width), generator=gen) if garbage else torch.zeros(len(seqs), width, dtype=torch.long)
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
    garbage=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_equals_dense_and_ignores_unused_entries(page, hk, group, d, lens, garbage, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(n, hk, d, generator=g), torch.randn(n, hk, d, generator=g)) for n in lens]
    q = torch.randn(len(lens), hk * group, d, generator=g)
    k_cache, v_cache, table, seqlens = paged(seqs, page, g, garbage)
    meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=False)
    out = TorchRefBackend().run(q, k_cache, v_cache, meta)
    assert out.dtype == q.dtype and not out.isnan().any()
    for i, (k, v) in enumerate(seqs):
        assert torch.allclose(out[i].double(), dense(q[i], k, v), atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(hk=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 3]), page=st.sampled_from([1, 2, 4]), seed=st.integers(0, 999))
def test_folded_heads_attend_to_their_own_tokens(hk, group, page, seed) -> None:
    """Head-major cache [Hk * pages, P, 1, D]: folded sequence b*Hk+h = request b, KV head h,
    over its own subset of tokens."""
    g = torch.Generator().manual_seed(seed)
    b, n, d = 2, 24, 8
    k = torch.randn(b, n, hk, d, generator=g)
    v = torch.randn(b, n, hk, d, generator=g)
    q = torch.randn(b, hk * group, d, generator=g)
    pages_per_seq = n // page
    num_pages = b * pages_per_seq  # per head
    kc = torch.empty(hk, num_pages, page, 1, d)
    vc = torch.empty(hk, num_pages, page, 1, d)
    for bi in range(b):
        for p in range(pages_per_seq):
            kc[:, bi * pages_per_seq + p, :, 0] = k[bi, p * page : (p + 1) * page].transpose(0, 1)
            vc[:, bi * pages_per_seq + p, :, 0] = v[bi, p * page : (p + 1) * page].transpose(0, 1)
    table = torch.zeros(b * hk, pages_per_seq, dtype=torch.int32)
    seqlens = torch.zeros(b * hk, dtype=torch.int32)
    chosen = {}
    for bi in range(b):
        for h in range(hk):
            keep = sorted(torch.randperm(pages_per_seq, generator=g)[: 1 + (bi + h) % pages_per_seq].tolist())
            chosen[bi, h] = keep
            table[bi * hk + h, : len(keep)] = torch.tensor([h * num_pages + bi * pages_per_seq + p for p in keep])
            seqlens[bi * hk + h] = len(keep) * page
    meta = FlashAttentionMetadata(table, seqlens, page, heads_folded=True)
    out = TorchRefBackend().run(q, kc.reshape(-1, page, 1, d), vc.reshape(-1, page, 1, d), meta)
    for bi in range(b):
        for h in range(hk):
            toks = torch.cat([torch.arange(p * page, (p + 1) * page) for p in chosen[bi, h]])
            want = dense(q[bi, h * group : (h + 1) * group], k[bi, toks, h : h + 1], v[bi, toks, h : h + 1])
            assert torch.allclose(out[bi, h * group : (h + 1) * group].double(), want, atol=1e-5)


def test_bf16_output_follows_q_and_zero_length_gives_zeros() -> None:
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(10, 2, 8, generator=g), torch.randn(10, 2, 8, generator=g)
    q = torch.randn(2, 4, 8, generator=g)
    kc, vc = k.view(10, 1, 2, 8), v.view(10, 1, 2, 8)
    table = torch.arange(10, dtype=torch.int32).repeat(2, 1)
    meta = FlashAttentionMetadata(table, torch.tensor([10, 0], dtype=torch.int32), 1, False)
    out32 = TorchRefBackend().run(q, kc, vc, meta)
    assert bool((out32[1] == 0).all())
    out16 = TorchRefBackend().run(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), meta)
    assert out16.dtype == torch.bfloat16
    assert torch.allclose(out16.float(), out32, atol=3e-2)


def test_mla_value_is_a_prefix_of_the_latent() -> None:
    g = torch.Generator().manual_seed(1)
    lat = torch.randn(12, 1, 24, generator=g)
    q = torch.randn(1, 8, 24, generator=g)
    cache = lat.view(12, 1, 1, 24)
    out = paged_attention(q, cache, cache[..., :16], torch.arange(12, dtype=torch.int32).view(1, -1),
                          torch.tensor([12], dtype=torch.int32), 1 / math.sqrt(24))
    assert out.shape == (1, 8, 16)
    assert torch.allclose(out[0].double(), dense(q[0], lat, lat[..., :16]), atol=1e-5)
