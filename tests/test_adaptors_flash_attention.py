"""FlashAttention page-table adaptor: metadata semantics, folding, SGLang names."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor, check_page_runs
from sparse_framework.backends.torch_ref import TorchRefBackend

from test_backends_torch_ref import dense


def aligned_slots(gen: torch.Generator, b: int, h: int, page: int, num_pages: int, max_pages: int):
    """Random whole-page slot runs per row (last page maybe partial); -1 padded."""
    width = max_pages * page
    slots = torch.full((b, h, width), -1, dtype=torch.int32)
    lengths = torch.zeros(b, h, dtype=torch.int32)
    pages = {}
    for i in range(b):
        for j in range(h):
            n = int(torch.randint(1, max_pages + 1, (1,), generator=gen))
            ids = torch.randperm(num_pages, generator=gen)[:n]
            tail = int(torch.randint(1, page + 1, (1,), generator=gen))
            length = (n - 1) * page + tail
            run = (ids.unsqueeze(1) * page + torch.arange(page)).flatten()[:length]
            slots[i, j, :length] = run.to(torch.int32)
            lengths[i, j] = length
            pages[i, j] = ids
    return slots, lengths, pages


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h=st.sampled_from([1, 2, 4]), page=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 9999))
def test_plan_builds_the_page_table(b, h, page, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    num_pages = 12
    slots, lengths, pages = aligned_slots(g, b, h, page, num_pages, 5)
    check_page_runs(slots, lengths, page)
    meta = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=num_pages * page)
    assert meta.page_table.dtype == torch.int32 and meta.cache_seqlens.dtype == torch.int32
    assert meta.page_table.shape == (b * h, 5) and meta.heads_folded == (h > 1)
    assert torch.equal(meta.cache_seqlens, lengths.reshape(-1))
    for i in range(b):
        for j in range(h):
            ids = pages[i, j]
            row = meta.page_table[i * h + j]
            offset = j * num_pages if h > 1 else 0
            assert row[: ids.numel()].tolist() == (ids + offset).tolist()
            assert bool((row[ids.numel() :] == 0).all())
    sg = meta.sglang()
    assert sg["page_table"] is meta.page_table and sg["cache_seqlens_int32"] is meta.cache_seqlens
    assert sg["cu_seqlens_k"].dtype == torch.int32
    assert sg["cu_seqlens_k"].tolist() == [0] + lengths.reshape(-1).cumsum(0).tolist()


@settings(max_examples=25, deadline=None)
@given(h=st.sampled_from([1, 2]), page=st.sampled_from([1, 4]), seed=st.integers(0, 9999))
def test_plan_then_torch_ref_attends_exactly_the_selected_tokens(h, page, seed) -> None:
    """Per-request (h=1, token-major buffer) and per-KV-head (h=2, head-major buffer)."""
    g = torch.Generator().manual_seed(seed)
    b, hk, d, num_pages = 2, 2, 8, 10
    slots_total = num_pages * page
    k = torch.randn(slots_total, hk, d, generator=g)
    v = torch.randn(slots_total, hk, d, generator=g)
    q = torch.randn(b, hk * 2, d, generator=g)
    slots, lengths, _ = aligned_slots(g, b, h, page, num_pages, 4)
    meta = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=slots_total)
    if h > 1:  # head-major view
        kc = k.transpose(0, 1).reshape(-1, page, 1, d)
        vc = v.transpose(0, 1).reshape(-1, page, 1, d)
    else:
        kc, vc = k.reshape(-1, page, hk, d), v.reshape(-1, page, hk, d)
    out = TorchRefBackend().run(q, kc, vc, meta)
    for i in range(b):
        if h == 1:
            sl = slots[i, 0, : lengths[i, 0]].long()
            assert torch.allclose(out[i].double(), dense(q[i], k[sl], v[sl]), atol=1e-5)
        else:
            for j in range(hk):
                sl = slots[i, j, : lengths[i, j]].long()
                want = dense(q[i, 2 * j : 2 * j + 2], k[sl, j : j + 1], v[sl, j : j + 1])
                assert torch.allclose(out[i, 2 * j : 2 * j + 2].double(), want, atol=1e-5)


def test_check_page_runs_rejects_misaligned_runs() -> None:
    ok = torch.tensor([[[4, 5, 6, 7, 12, -1]]], dtype=torch.int32)
    check_page_runs(ok, torch.tensor([[5]], dtype=torch.int32), 4)
    for bad in ([[[5, 6, 7, 8, 12, -1]]], [[[4, 5, 7, 6, 12, -1]]]):
        with pytest.raises(ValueError, match="not whole aligned pages of size 4"):
            check_page_runs(torch.tensor(bad, dtype=torch.int32), torch.tensor([[5]], dtype=torch.int32), 4)
