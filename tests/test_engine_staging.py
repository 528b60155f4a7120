"""Prefill staging: span bookkeeping against a plain set of rows, chunk attention against a
float64 causal reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import CapacityError, KVLayout
from sparse_framework.engine.staging import PrefillStaging, chunk_attention

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64: query i of the last n sees keys 0..m-n+i."""
    n, hq, d = q.shape
    m, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) / math.sqrt(d)
    future = torch.arange(m).view(1, -1) > torch.arange(m - n, m).view(-1, 1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), n_frac=st.floats(0.01, 1.0), hkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_chunk_attention_equals_causal_reference(m, n_frac, hkv, group, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    n = max(1, int(m * n_frac))
    q = torch.randn(n, hkv * group, 8, generator=g)
    k, v = torch.randn(m, hkv, 8, generator=g), torch.randn(m, hkv, 8, generator=g)
    got = chunk_attention(q, k, v)
    assert got.shape == q.shape
    torch.testing.assert_close(got.double(), reference_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_chunks_over_a_staged_prompt_equal_one_whole_prompt() -> None:
    """A prompt staged and attended in three chunks gives what one causal pass gives."""
    g = torch.Generator().manual_seed(1)
    staging = PrefillStaging(LAYOUT, 64)
    assert staging.reserve("a", 37)
    q, k, v = torch.randn(37, 4, 8, generator=g), torch.randn(37, 2, 8, generator=g), torch.randn(37, 2, 8, generator=g)
    outs = []
    for start, stop in ((0, 10), (10, 11), (11, 37)):
        staging.write(1, "a", start, k[start:stop], v[start:stop])
        pk, pv = staging.prefix(1, "a", stop)
        outs.append(chunk_attention(q[start:stop], pk, pv))
    torch.testing.assert_close(torch.cat(outs).double(), reference_attention(q, k, v), atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 30)), min_size=1, max_size=40))
def test_spans_never_overlap_and_free_space_is_conserved(ops) -> None:
    """Random reserves and releases against a plain set of occupied rows: spans are disjoint,
    inside the capacity, a reserve fails only when no free run is long enough, and releasing
    everything gives back one free span of the whole capacity."""
    capacity = 64
    staging = PrefillStaging(LAYOUT, capacity)
    held: dict[str, set[int]] = {}
    for i, (add, size) in enumerate(ops):
        if add or not held:
            occupied = set().union(*held.values()) if held else set()
            longest = run = 0
            for row in range(capacity):
                run = 0 if row in occupied else run + 1
                longest = max(longest, run)
            ok = staging.reserve(f"r{i}", size)
            assert ok == (size <= longest) and staging.largest_free() <= longest
            if ok:
                start, n = staging.spans[f"r{i}"]
                rows = set(range(start, start + n))
                assert n == size and rows <= set(range(capacity)) and not rows & occupied
                held[f"r{i}"] = rows
        else:
            rid = sorted(held)[size % len(held)]
            staging.release(rid)
            del held[rid]
        assert staging.free_tokens == capacity - sum(len(r) for r in held.values())
    for rid in list(held):
        staging.release(rid)
    assert staging._free == [(0, capacity)]


def test_misuse_is_refused() -> None:
    staging = PrefillStaging(LAYOUT, 16)
    assert staging.reserve("a", 10) and not staging.reserve("b", 7)
    with pytest.raises(ValueError, match="already has a staging span"):
        staging.reserve("a", 1)
    with pytest.raises(ValueError, match=r"rows 8\.\.12 outside its staged prompt of 10 tokens"):
        staging.write(0, "a", 8, torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))
    with pytest.raises(ValueError, match="3 queries but only 2 keys"):
        chunk_attention(torch.zeros(3, 2, 8), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8))
    with pytest.raises(CapacityError, match="capacity_tokens=0"):
        PrefillStaging(LAYOUT, 0)
    assert PrefillStaging.bytes_per_token(LAYOUT) == 2 * 2 * 2 * 8 * 4


def test_mla_staging_keeps_latent_rows_and_indexer_keys() -> None:
    """MLA: one latent row per token (V a view of its first v_head_dim values, not a copy) and
    the indexer keys, written chunk by chunk and read back as the prompt's prefix."""
    layout = KVLayout.mla(2, latent_dim=12, v_head_dim=8, dtype=torch.float32)
    st_ = PrefillStaging(layout, 20, index_dim=4)
    assert st_.v is None and PrefillStaging.bytes_per_token(layout, 4) == 2 * (12 + 4) * 4
    assert st_.reserve("a", 3) and st_.reserve("b", 7)
    rows, keys = torch.randn(7, 1, 12), torch.randn(7, 4)
    st_.write(1, "b", 0, rows[:5], None, keys[:5])
    st_.write(1, "b", 5, rows[5:], None, keys[5:])
    k, v = st_.prefix(1, "b", 7)
    assert torch.equal(k, rows) and torch.equal(v, rows[..., :8]) and v.data_ptr() == k.data_ptr()
    assert torch.equal(st_.index_prefix(1, "b", 6), keys[:6])
    with pytest.raises(ValueError, match="index_k is required"):
        st_.write(0, "a", 0, rows[:1], None)
    with pytest.raises(ValueError, match="MLA models only"):
        PrefillStaging(LAYOUT, 8, index_dim=4)
