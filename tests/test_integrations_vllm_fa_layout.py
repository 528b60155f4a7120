"""sparse_framework.integrations.vllm.fa_layout: vLLM 0.26's FlashAttention cache seen as pages
of one KV head (folded, or per KV head), run by a torch reference of flash_attn_varlen_func
(no vLLM needed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_cases import BASE, fa_cache, fill, paged_case, reference_attention

from sparse_framework.integrations.vllm.fa_layout import attend_paged, decode_calls, folded_kv, reference_call
from sparse_framework.integrations.vllm.paged import folded_page_table, load_vllm_config, paged_algorithm


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(1, 200), min_size=1, max_size=3),
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 3]),
    dim=st.sampled_from([8, 32]),
    bs=st.sampled_from([16, 32]),
    pages=st.integers(1, 4),
    layout=st.sampled_from(["HND", "NHD", "padded"]),
    seed=st.integers(0, 2**16),
)
def test_fa_layout_decode_equals_float64_over_the_selection(lens, hkv, group, dim, bs, pages, layout, seed) -> None:
    config = load_vllm_config({**BASE, "top_k": pages * bs, "sink_tokens": 4, "recent_tokens": 8}, block_size=bs)
    algo = paged_algorithm(config)
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    q, keys, values, table, k_cache, v_cache = paged_case(lens, hkv, group, dim, bs, num_blocks, seed=seed)
    state = fill(algo, lens, keys, values, table, k_cache, v_cache, bs, chunk=bs + 3)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    selection = algo.select(state, q, table, seq_lens)
    metadata = folded_page_table(selection, table, hkv, bs)
    kv_cache = fa_cache(k_cache, v_cache, layout)
    calls = decode_calls(q, kv_cache, metadata, hkv, dim)
    head_major = layout == "HND" or hkv == 1 or num_blocks == 1
    assert len(calls) == (1 if head_major else hkv) and all(c.folded == head_major for c in calls)
    for call in calls:  # views of the cache, never copies
        assert call.k.untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    scale = 1 / math.sqrt(dim)
    got = attend_paged(q, kv_cache, metadata, hkv, dim, lambda call: reference_call(call, scale=scale))
    torch.testing.assert_close(got.double(), reference_attention(q, keys, values, selection, scale), atol=1e-5, rtol=1e-5)


def test_folded_views_read_the_cache_in_place() -> None:
    nb, hk, bs, d = 3, 2, 16, 8
    kv_cache = fa_cache(torch.zeros(nb, hk, bs, d), torch.zeros(nb, hk, bs, d), "HND")
    k, v = folded_kv(kv_cache, d)
    assert k.shape == (nb * hk, bs, 1, d) and k.stride()[2:] == (d, 1)
    kv_cache[2, 1, 5, :d] = 1.0  # K of block 2, head 1, offset 5: folded page 2 * 2 + 1
    kv_cache[2, 1, 5, d:] = 2.0
    assert bool((k[5, 5] == 1).all()) and bool((v[5, 5] == 2).all()) and float(k.sum()) == d
    with pytest.raises(ValueError, match="head-major"):
        folded_kv(fa_cache(torch.zeros(nb, hk, bs, d), torch.zeros(nb, hk, bs, d), "NHD"), d)


