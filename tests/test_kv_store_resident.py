"""ResidentKVStore: page allocation, slot maps, paged views in both layouts."""

from __future__ import annotations

import pytest
import torch

from sparse_framework import Batch, CapacityError, KVLayout, Request, Selection
from sparse_framework.kv_store.resident import ResidentKVStore


def store(head_major: bool, **kw) -> ResidentKVStore:
    layout = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4)
    return ResidentKVStore(layout, **{"page_size": 4, "max_requests": 3, "max_seq_len": 40, "head_major": head_major, **kw})


def admitted(s: ResidentKVStore, rid: str, n: int, slot: int) -> Request:
    r = Request(rid, n, seq_len=n, slot=slot)
    s.admit(r)
    return r


@pytest.mark.parametrize("head_major", [False, True])
def test_prefill_then_paged_view_holds_rows_at_their_slots(head_major: bool) -> None:
    s = store(head_major)
    a = admitted(s, "a", 10, 0)
    b = admitted(s, "b", 6, 1)
    ka, va = torch.randn(10, 3, 4), torch.randn(10, 3, 4)
    kb, vb = torch.randn(6, 3, 4), torch.randn(6, 3, 4)
    s.write_prefill(1, a, ka, va)
    s.write_prefill(1, b, kb, vb)
    batch = Batch([a, b], seq_lens=torch.tensor([10, 6], dtype=torch.int32), slot_ids=torch.tensor([0, 1]))
    idx = torch.tensor([[[0, 5, 9]], [[2, 5, -1]]], dtype=torch.int32)
    slots = s.ensure_resident(1, batch, Selection(idx, torch.tensor([[3], [2]], dtype=torch.int32)))
    assert slots.dtype == torch.int32 and slots[1, 0, 2] == -1
    kc, vc = s.paged_view(1, 1)
    for bi, (k, v) in enumerate([(ka, va), (kb, vb)]):
        for j in range(int((idx[bi, 0] >= 0).sum())):
            slot, pos = int(slots[bi, 0, j]), int(idx[bi, 0, j])
            if head_major:  # page (h, slot) is h * num_slots + slot, one head per page
                got = torch.stack([kc[h * s.num_slots + slot, 0, 0] for h in range(3)])
            else:
                got = kc[slot, 0]
            assert torch.equal(got, k[pos])
    # pages are whole: a logical page maps to one physical page
    assert bool((slots[0, 0, :2] // 4 != -1).all())
    assert s.device_tokens(a) == 12 and s.device_tokens(b) == 8


def test_decode_writes_at_the_newest_position_and_grows_by_pages() -> None:
    s = store(False)
    a = admitted(s, "a", 4, 2)
    s.write_prefill(0, a, torch.zeros(4, 3, 4), torch.zeros(4, 3, 4))
    assert s.device_tokens(a) == 4
    a.seq_len = 5
    batch = Batch([a], seq_lens=torch.tensor([5], dtype=torch.int32), slot_ids=torch.tensor([2]))
    s.grow(batch)
    assert s.device_tokens(a) == 8
    k = torch.randn(1, 3, 4)
    s.write_decode(0, batch, k, -k)
    rk, rv = s.read(0, a)
    assert torch.equal(rk[4], k[0]) and torch.equal(rv[4], -k[0]) and bool((rk[:4] == 0).all())


def test_capacity_error_and_release_returns_pages() -> None:
    s = store(False, capacity_tokens=16)
    a = admitted(s, "a", 9, 0)  # 3 pages
    with pytest.raises(CapacityError, match="needs 2 more pages of 4 tokens, 1 of 4 are free"):
        admitted(s, "b", 5, 1)
    assert s.used_tokens() == 12
    s.release(a)
    assert s.used_tokens() == 0 and bool((s.page_table == -1).all())
    admitted(s, "c", 16, 1)
    assert s.used_tokens() == 16


def test_device_bytes_follow_the_layout() -> None:
    s = store(True)
    admitted(s, "a", 8, 0)
    # 8 tokens * 2 layers * (K + V) * 3 heads * 4 dims * 4 bytes
    assert s.device_bytes() == 8 * 2 * 2 * 3 * 4 * 4
