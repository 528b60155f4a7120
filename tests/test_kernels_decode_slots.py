"""The decode-step bookkeeping kernels (kernels/decode_slots.py) against their torch twins:
interpreted on the CPU (a subprocess with TRITON_INTERPRET=1) over random shapes, tables
and dtypes (hypothesis); the twins' own contracts are checked directly."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import run_interpreted

from sparse_framework.adaptors.flash_attention import page_table_torch
from sparse_framework.kv_store.copy import write_token_rows
from sparse_framework.kv_store.pages import paged_slots_rows


def random_table(g: torch.Generator, rows: int, pages: int, page_ids: int, holes: float) -> torch.Tensor:
    """int32 [rows, pages] of distinct page ids, a fraction `holes` of them unmapped (-1)."""
    ids = torch.randperm(page_ids, generator=g)[: rows * pages].view(rows, pages).to(torch.int32)
    return torch.where(torch.rand(rows, pages, generator=g) < holes, -1, ids).to(torch.int32)


def aligned_selection(g: torch.Generator, b: int, h: int, width: int, page: int, num_slots: int):
    """Physical slots [b, h, width] made of whole aligned pages, -1 past each row's length."""
    lengths = torch.randint(0, width + 1, (b, h), generator=g, dtype=torch.int32)
    pages = torch.randint(0, num_slots // page, (b, h, -(-width // page)), generator=g)
    pos = torch.arange(width)
    slots = pages.repeat_interleave(page, -1)[..., :width] * page + pos % page
    return torch.where(pos < lengths.unsqueeze(-1), slots, -1).to(torch.int32), lengths


def test_torch_twins_follow_their_contracts() -> None:
    g = torch.Generator().manual_seed(0)
    table = torch.tensor([[3, -1, 0], [1, 2, -1]], dtype=torch.int32)
    pos = torch.tensor([[0, 5, 9, -1], [4, 11, 3, 7]])
    slots = paged_slots_rows(table, torch.tensor([1, 0]), pos, 4, torch.int32)
    want = [[table[1, p // 4] * 4 + p % 4 if p >= 0 and table[1, p // 4] >= 0 else -1 for p in pos[0].tolist()],
            [table[0, p // 4] * 4 + p % 4 if p >= 0 and table[0, p // 4] >= 0 else -1 for p in pos[1].tolist()]]
    assert slots.dtype == torch.int32 and slots.tolist() == [[int(x) for x in r] for r in want]
    # write_token_rows: the new token of each request lands at its slot, nothing else changes
    buf = torch.zeros(32, 2, 3)
    tab = random_table(g, 3, 2, 8, 0.0)
    lens = torch.tensor([2, 7])
    x = torch.randn(2, 2, 3, generator=g)
    got = write_token_rows([buf], tab, torch.tensor([2, 0]), lens, [x], 4, head_major=False)
    assert got.tolist() == [int(tab[2, 0]) * 4 + 1, int(tab[0, 1]) * 4 + 2]
    assert torch.equal(buf[got], x) and int((buf != 0).any(-1).any(-1).sum()) == 2
    # page_table_torch: one entry per page run, 0 past the length, heads folded
    slots, lengths = aligned_selection(g, 2, 3, 10, 4, 64)
    table, seqlens = page_table_torch(slots, lengths, 4, 64)
    assert table.shape == (6, 3) and torch.equal(seqlens, lengths.flatten())
    for i in range(6):
        b, h = divmod(i, 3)
        n = -(-int(lengths[b, h]) // 4)
        want_row = [int(slots[b, h, 4 * p]) // 4 + h * 16 for p in range(n)] + [0] * (3 - n)
        assert table[i].tolist() == want_row


INTERPRETED = r"""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sparse_framework.adaptors.flash_attention import page_table_torch
from sparse_framework.kernels import decode_slots as ds
from sparse_framework.kv_store.copy import write_token_rows
from sparse_framework.kv_store.pages import paged_slots_rows
from test_kernels_decode_slots import aligned_selection, random_table

fast = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))

@fast
@given(b=st.integers(1, 5), rows=st.integers(1, 6), pages=st.integers(1, 5), p=st.sampled_from([1, 2, 4, 16]),
       width=st.integers(0, 70), holes=st.floats(0, 0.5), out=st.sampled_from([torch.int32, torch.int64]),
       seed=st.integers(0, 2**16))
def slots_equal(b, rows, pages, p, width, holes, out, seed):
    g = torch.Generator().manual_seed(seed)
    table = random_table(g, rows, pages, rows * pages + 3, holes)
    ids = torch.randint(0, rows, (b,), generator=g)
    pos = torch.randint(-1, pages * p, (b, width), generator=g).to(torch.int32)
    want = paged_slots_rows(table, ids, pos, p, out)
    got = ds.paged_slots_rows_triton(table, ids, pos, p, out)
    assert got.dtype == out and torch.equal(got, want), (got, want)

@fast
@given(b=st.integers(1, 5), h=st.integers(1, 3), d=st.sampled_from([1, 3, 8, 33]), p=st.sampled_from([1, 4, 16]),
       two=st.booleans(), head_major=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def writes_equal(b, h, d, p, two, head_major, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    pages = 3
    table = random_table(g, b + 1, pages, (b + 1) * pages + 2, 0.0)
    ids = torch.randperm(b + 1, generator=g)[:b]
    lens = torch.randint(1, pages * p + 1, (b,), generator=g, dtype=torch.int32)
    n_slots = ((b + 1) * pages + 2) * p
    shape = (h, n_slots, d) if head_major else (n_slots, h, d)
    def rnd(*s):
        return torch.randint(0, 200, s, generator=g).to(dtype)
    bufs = [rnd(*shape) for _ in range(2 if two else 1)]
    data = [rnd(b, h, 2 * d)[..., ::2] if strided else rnd(b, h, d) for _ in bufs]
    mine = [x.clone() for x in bufs]
    want = write_token_rows(bufs, table, ids, lens, data, p, head_major)
    got = ds.write_token_rows_triton(mine, table, ids, lens, data, p, head_major)
    assert torch.equal(got, want)
    for a, c in zip(mine, bufs):
        assert torch.equal(a, c)

@fast
@given(b=st.integers(1, 4), h=st.integers(1, 4), width=st.integers(0, 80), page=st.sampled_from([1, 2, 16]),
       seed=st.integers(0, 2**16))
def tables_equal(b, h, width, page, seed):
    g = torch.Generator().manual_seed(seed)
    num_slots = 64 * page
    slots, lengths = aligned_selection(g, b, h, width, page, num_slots)
    want = page_table_torch(slots, lengths, page, num_slots)
    got = ds.page_table_triton(slots, lengths, page, num_slots)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)

slots_equal()
writes_equal()
tables_equal()
print("decode slots ok")
"""


@pytest.mark.slow
def test_kernels_equal_their_twins_interpreted() -> None:
    pytest.importorskip("triton")
    run_interpreted(INTERPRETED, "decode slots ok")


def test_write_rejects_mismatched_buffers() -> None:
    pytest.importorskip("triton")
    from sparse_framework.kernels.decode_slots import write_token_rows_triton

    bufs = [torch.zeros(8, 1, 4), torch.zeros(8, 1, 4, dtype=torch.bfloat16)]
    data = [torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)]
    table, rows, lens = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.long), torch.ones(1)
    env_had = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        with pytest.raises(ValueError, match="dtype"):
            write_token_rows_triton(bufs, table, rows, lens, data, 4, False)
    finally:
        if env_had is None:
            del os.environ["TRITON_INTERPRET"]


def test_write_new_rows_wants_a_slot_column_per_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Head-major, the launch has a column per KV head: slots [n, 1] would skip heads 1.. (their
    host copies were lost that way, stop 40), so they are refused before any launch."""
    pytest.importorskip("triton")
    from sparse_framework.kernels.decode_slots import write_new_rows_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check
    heads = 2
    bufs, data = [torch.zeros(heads, 8, 4)], [torch.zeros(1, heads, 4)]
    one = torch.zeros(1, dtype=torch.long)
    args = (bufs, data, one, torch.ones(1, dtype=torch.int32), one, torch.ones(1, dtype=torch.bool))
    tail = (0, torch.zeros(1, 2, dtype=torch.int32), 4, (0, 0, 0), (0, 0, 0), torch.zeros(1, dtype=torch.long), True)
    with pytest.raises(ValueError, match=r"one column per stream \(2\)"):
        write_new_rows_triton(*args, torch.zeros(1, 1, dtype=torch.int32), *tail)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernels_equal_their_twins_past_int32_offsets() -> None:
    """At decode shapes on CUDA, with a head-major pool of 8 heads x 2**28 + 64 slots (more
    than 2**31 elements), so every product of a head and its stride must be 64-bit."""
    from sparse_framework.kernels import decode_slots as ds

    g = torch.Generator().manual_seed(0)
    heads, slots, page = 8, 2**28 + 64, 16
    buf = torch.zeros(heads, slots, 1, dtype=torch.bfloat16, device="cuda")
    mine = buf.clone()
    b, pages = 8, 64
    table = torch.randperm(slots // page, generator=g)[: b * pages].view(b, pages).to(torch.int32).cuda()
    rows = torch.randperm(b, generator=g).cuda()
    lens = torch.randint(1, pages * page + 1, (b,), generator=g, dtype=torch.int32).cuda()
    x = torch.randn(b, heads, 1, generator=g).to(torch.bfloat16).cuda()
    want = write_token_rows([buf], table, rows, lens, [x], page, head_major=True)
    got = ds.write_token_rows_triton([mine], table, rows, lens, [x], page, head_major=True)
    assert torch.equal(got, want) and int(want.max()) > 2**24
    assert torch.equal(mine[:, want], buf[:, want]) and torch.equal(mine[:, want, 0].T, x[..., 0])
    del buf, mine
    pos = torch.randint(-1, pages * page, (b, 2128), generator=g, dtype=torch.int32).cuda()
    for dtype in (torch.int32, torch.int64):
        assert torch.equal(ds.paged_slots_rows_triton(table, rows, pos, page, dtype), paged_slots_rows(table, rows, pos, page, dtype))
    sel, lengths = aligned_selection(g, b, heads, 2128, page, slots)
    sel, lengths = sel.cuda(), lengths.cuda()
    got_t, want_t = ds.page_table_triton(sel, lengths, page, slots), page_table_torch(sel, lengths, page, slots)
    assert torch.equal(got_t[0], want_t[0]) and torch.equal(got_t[1], want_t[1])
