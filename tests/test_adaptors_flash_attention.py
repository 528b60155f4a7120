"""FlashAttention page-table adaptor: metadata semantics, head folding, SGLang names, and
end to end with torch_ref over the paged view of a device buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor, check_page_runs
from sparse_framework.backends.torch_ref import TorchRefBackend

from helpers import dense_loop_f64 as dense


def aligned_slots(
    gen: torch.Generator, b: int, h: int, page: int, num_pages: int, max_pages: int, min_pages: int = 1,
    junk: bool = False,
):
    """Random whole-page slot runs per (request, head) row: `n` distinct physical pages in a
    random order, the last one maybe partial; -1 padded (or random junk when `junk`, which
    every consumer must ignore). Returns slots int32 [b, h, max_pages*page], lengths int32
    [b, h], and the physical page ids of every row."""
    width = max_pages * page
    if junk:
        slots = torch.randint(-3, num_pages * page + 3, (b, h, width), generator=gen, dtype=torch.int32)
    else:
        slots = torch.full((b, h, width), -1, dtype=torch.int32)
    lengths = torch.zeros(b, h, dtype=torch.int32)
    pages = {}
    for i in range(b):
        for j in range(h):
            n = int(torch.randint(min_pages, max_pages + 1, (1,), generator=gen))
            ids = torch.randperm(num_pages, generator=gen)[:n]
            tail = int(torch.randint(1, page + 1, (1,), generator=gen))
            length = max(0, (n - 1) * page + tail)
            run = (ids.unsqueeze(1) * page + torch.arange(page)).flatten()[:length]
            slots[i, j, :length] = run.to(torch.int32)
            lengths[i, j] = length
            pages[i, j] = ids
    return slots, lengths, pages


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 3),
    h=st.sampled_from([1, 2, 4]),
    page=st.sampled_from([1, 2, 4, 8]),
    num_pages=st.integers(5, 16),
    max_pages=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_plan_builds_the_page_table(b, h, page, num_pages, max_pages, seed) -> None:
    """Per request (heads=1): row i lists slot // P of each run of request i. Per KV head
    (heads=H): folded row i*H + j lists j * (num_slots // P) + slot // P. Entries past
    ceil(len / P) are 0; cache_seqlens = lengths; int32 throughout; SGLang's names."""
    g = torch.Generator().manual_seed(seed)
    num_slots = num_pages * page
    slots, lengths, pages = aligned_slots(g, b, h, page, num_pages, max_pages, min_pages=0)
    check_page_runs(slots, lengths, page)
    meta = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=num_slots)
    assert meta.page_table.dtype == torch.int32 and meta.cache_seqlens.dtype == torch.int32
    assert meta.page_table.shape == (b * h, max_pages) and meta.cache_seqlens.shape == (b * h,)
    assert meta.heads_folded == (h > 1) and meta.page_size == page
    assert meta.cache_seqlens.tolist() == lengths.reshape(-1).tolist()
    for i in range(b):
        for j in range(h):
            length = int(lengths[i, j])
            used = -(-length // page)
            # expected ids straight from the slots: the first slot of every run, divided by P
            runs = [int(slots[i, j, r * page]) // page for r in range(used)]
            assert runs == pages[i, j].tolist()[:used]
            offset = j * (num_slots // page) if h > 1 else 0
            row = meta.page_table[i * h + j].tolist()
            assert row[:used] == [p + offset for p in runs]
            assert row[used:] == [0] * (max_pages - used)
    sg = meta.sglang()
    assert sg["page_table"] is meta.page_table and sg["cache_seqlens_int32"] is meta.cache_seqlens
    assert sg["cu_seqlens_k"].dtype == torch.int32
    assert sg["cu_seqlens_k"].tolist() == [0] + torch.cumsum(lengths.reshape(-1), 0).tolist()


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    hk=st.sampled_from([1, 2, 4]),
    per_head=st.booleans(),
    group=st.sampled_from([1, 2]),
    page=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_plan_then_torch_ref_attends_exactly_the_selected_tokens(b, hk, per_head, group, page, seed) -> None:
    """plan + TorchRefBackend over the paged view of a device buffer = dense attention over
    exactly the selected slots. Per request: token-major view [num_pages, P, Hk, D]; per KV
    head: head-major view [Hk * num_pages, P, 1, D]. Junk after `lengths` is ignored."""
    g = torch.Generator().manual_seed(seed)
    d, num_pages = 8, 9
    num_slots = num_pages * page
    k = torch.randn(num_slots, hk, d, generator=g)
    v = torch.randn(num_slots, hk, d, generator=g)
    q = torch.randn(b, hk * group, d, generator=g)
    h = hk if per_head else 1
    slots, lengths, _ = aligned_slots(g, b, h, page, num_pages, 4, junk=True)
    meta = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=num_slots)
    if h > 1:  # head-major view of the buffer
        kc = k.transpose(0, 1).reshape(-1, page, 1, d)
        vc = v.transpose(0, 1).reshape(-1, page, 1, d)
    else:
        kc, vc = k.view(-1, page, hk, d), v.view(-1, page, hk, d)
    out = TorchRefBackend().run(q, kc, vc, meta)
    assert out.shape == q.shape
    for i in range(b):
        if h == 1:
            sel = slots[i, 0, : lengths[i, 0]].long()
            assert torch.allclose(out[i].double(), dense(q[i], k[sel], v[sel]), atol=1e-5, rtol=0)
        else:
            for j in range(hk):
                sel = slots[i, j, : lengths[i, j]].long()
                heads = slice(j * group, (j + 1) * group)
                want = dense(q[i, heads], k[sel, j : j + 1], v[sel, j : j + 1])
                assert torch.allclose(out[i, heads].double(), want, atol=1e-5, rtol=0)


@settings(max_examples=50, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.sampled_from([1, 2]),
    page=st.sampled_from([2, 4, 8]),
    kind=st.sampled_from(["shift", "swap", "foreign"]),
    seed=st.integers(0, 2**16),
)
def test_check_page_runs_passes_aligned_runs_and_rejects_broken_ones(b, h, page, kind, seed) -> None:
    """Aligned runs pass (whatever follows `lengths`); a run shifted off its page boundary,
    two swapped slots inside a run, or a slot from another page raise."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 12
    slots, lengths, _ = aligned_slots(g, b, h, page, num_pages, 4, junk=True)
    check_page_runs(slots, lengths, page)
    # break one row that has at least two tokens
    i, j = int(torch.randint(0, b, (1,), generator=g)), int(torch.randint(0, h, (1,), generator=g))
    length = int(lengths[i, j])
    if length < 2:
        lengths[i, j] = length = 2
        slots[i, j, :page] = torch.arange(page, dtype=torch.int32)
        check_page_runs(slots, lengths, page)
    bad = slots.clone()
    r = int(torch.randint(0, -(-length // page), (1,), generator=g))  # a run of the row
    start, stop = r * page, min((r + 1) * page, length)
    if kind == "shift" or stop - start < 2:  # a one-token run can only break by misalignment
        bad[i, j, start:stop] += int(torch.randint(1, page, (1,), generator=g))
    elif kind == "swap":
        bad[i, j, start], bad[i, j, start + 1] = slots[i, j, start + 1], slots[i, j, start]
    else:  # one slot of the run replaced by the same offset in another page
        t = start + int(torch.randint(0, stop - start, (1,), generator=g))
        bad[i, j, t] = (int(slots[i, j, t]) + page * int(torch.randint(1, num_pages, (1,), generator=g))) % (num_pages * page)
    with pytest.raises(ValueError, match=f"not whole aligned pages of size {page}"):
        check_page_runs(bad, lengths, page)


def test_check_page_runs_examples() -> None:
    lens = torch.tensor([[5]], dtype=torch.int32)
    check_page_runs(torch.tensor([[[4, 5, 6, 7, 12, -1, -1, -1]]], dtype=torch.int32), lens, 4)
    check_page_runs(torch.tensor([[[4, 5, 6, 7, 12, 99, 3, 0]]], dtype=torch.int32), lens, 4)  # junk after len
    for bad in ([[[5, 6, 7, 8, 12, -1, -1, -1]]], [[[4, 5, 7, 6, 12, -1, -1, -1]]], [[[4, 5, 6, 7, 13, -1, -1, -1]]]):
        with pytest.raises(ValueError, match="not whole aligned pages of size 4"):
            check_page_runs(torch.tensor(bad, dtype=torch.int32), lens, 4)
