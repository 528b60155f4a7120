"""The FlashMLA adaptor (physical slots -> `indices`), torch_ref over its metadata, and the
coordinator with it: the same outputs as the FlashAttention adaptor and as dense attention,
on float MLA latents and on the fp8 store's packed FlashMLA rows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_framework import Batch, ConfigError, KVLayout, Request
from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor
from sparse_framework.adaptors.flashmla import FlashMLAAdaptor, FlashMLAMetadata, plan_query_tokens
from sparse_framework.backends.torch_ref import TorchRefBackend
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.common.flashmla_format import pack_flashmla_fp8, unpack_flashmla_fp8
from helpers import HIERARCHICAL_ALWAYS, SMALL_QUEST


def dense_mla(q: torch.Tensor, lat: torch.Tensor) -> torch.Tensor:
    """float64 attention of query heads q [Hq, 576] over latents [L, 576]: V = first 512 dims."""
    p = (q.double() @ lat.double().T / math.sqrt(q.shape[-1])).softmax(-1)
    return p @ lat.double()[:, :512]


# -- the plan -----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    width=st.integers(0, 150),
    page=st.sampled_from([1, 4, 16, 64]),
    pages=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_indices_are_the_slots_padded_to_a_multiple_of_64(b, width, page, pages, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    num_slots = pages * page * 8
    width = min(width, num_slots)
    lengths = torch.randint(0, width + 1, (b, 1), generator=g, dtype=torch.int32)
    slots = torch.stack([torch.randperm(num_slots, generator=g)[:width] for _ in range(b)]).view(b, 1, width)
    slots = torch.where(torch.arange(width) < lengths.unsqueeze(-1), slots, -1).to(torch.int32)
    meta = FlashMLAAdaptor().plan(slots, lengths, page_size=page, num_slots=num_slots)
    topk = max(64, -(-width // 64) * 64)
    assert meta.indices.shape == (b, 1, topk) and meta.indices.dtype == torch.int32
    assert meta.topk == topk and meta.s_q == 1 and meta.num_slots == num_slots
    assert torch.equal(meta.indices[..., :width], slots) and bool((meta.indices[..., width:] == -1).all())
    assert torch.equal(meta.lengths, lengths)
    assert meta.page_block_size == (64 if num_slots % 64 == 0 else page)
    # a row number is block * page_block_size + offset in the pool viewed with that block size
    pool = torch.arange(num_slots).view(-1, meta.page_block_size)
    valid = meta.indices >= 0
    idx = meta.indices[valid].long()
    assert torch.equal(pool[idx // meta.page_block_size, idx % meta.page_block_size], idx)


def test_entries_past_the_lengths_become_minus_one_and_heads_must_be_one() -> None:
    slots = torch.tensor([[[5, 6, 7, 8]], [[1, 2, 3, 4]]], dtype=torch.int32)
    meta = FlashMLAAdaptor().plan(slots, torch.tensor([[2], [4]], dtype=torch.int32), page_size=4, num_slots=40)
    assert meta.indices[0, 0, :4].tolist() == [5, 6, -1, -1] and meta.indices[1, 0, :4].tolist() == [1, 2, 3, 4]
    assert meta.page_block_size == 4  # 40 rows are not a multiple of 64
    with pytest.raises(ValueError, match=r"one selection per request .* \[batch, 1, width\]"):
        FlashMLAAdaptor().plan(slots.view(1, 2, 4), torch.ones(1, 2, dtype=torch.int32), page_size=4, num_slots=40)


def test_several_query_tokens_per_request() -> None:
    """s_q > 1 (speculative decoding): one slot row per query token."""
    slots = torch.tensor([[[0, 1, 2], [0, 1, 3]], [[7, -1, -1], [7, 8, -1]]], dtype=torch.int32)
    lengths = torch.tensor([[3, 3], [1, 2]], dtype=torch.int32)
    meta = plan_query_tokens(slots, lengths, page_size=1, num_slots=128)
    assert meta.indices.shape == (2, 2, 64) and meta.s_q == 2 and meta.page_block_size == 64
    assert meta.indices[1, 1, :3].tolist() == [7, 8, -1]
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(128, 1, 576, generator=g)
    cache = lat.view(2, 64, 1, 576)
    q = torch.randn(2, 2, 8, 576, generator=g)
    out = TorchRefBackend().run(q, cache, cache[..., :512], meta)
    assert out.shape == (2, 2, 8, 512)
    for i in range(2):
        for j in range(2):
            rows = slots[i, j, : int(lengths[i, j])].long()
            assert torch.allclose(out[i, j].double(), dense_mla(q[i, j], lat[rows, 0]), atol=1e-5)


def test_layouts_flashmla_cannot_serve_are_refused_when_the_coordinator_is_built() -> None:
    cfg = {**SMALL_QUEST, "adaptor": "flashmla"}
    bad = [
        (KVLayout(num_layers=1, num_kv_heads=2, head_dim=8), "needs an MLA KV layout"),
        (KVLayout.mla(1, latent_dim=24, v_head_dim=16), "needs head_dim 576"),
        (KVLayout.mla(1, latent_dim=576, v_head_dim=256), "needs v_head_dim 512"),
    ]
    for layout, msg in bad:
        with pytest.raises(ConfigError, match=f"adaptor 'flashmla' \\(algorithm 'quest'\\) {msg}"):
            SparseCoordinator(cfg, layout, max_requests=1, max_seq_len=64)
    # a per-KV-head algorithm (Quest) over the one latent KV head selects once per request: fine
    coord = SparseCoordinator(cfg, KVLayout.mla(1), max_requests=1, max_seq_len=64)
    assert isinstance(coord.adaptor, FlashMLAAdaptor)


# -- torch_ref over FlashMLA metadata ----------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), hq=st.sampled_from([1, 8]), packed=st.booleans(), seed=st.integers(0, 2**16))
def test_torch_ref_indices_equal_dense_over_the_named_rows(b, hq, packed, seed) -> None:
    """Rows named by the indices (any order, -1 anywhere after the valid ones), and only them;
    a packed cache is dequantised first, and rows no index names may hold anything."""
    g = torch.Generator().manual_seed(seed)
    pool = 96
    lat = torch.randn(pool, 1, 576, generator=g)
    cache = pack_flashmla_fp8(lat) if packed else lat.clone()
    seen = unpack_flashmla_fp8(cache) if packed else lat
    lengths = torch.randint(0, 70, (b, 1), generator=g, dtype=torch.int32)
    slots = torch.stack([torch.randperm(pool, generator=g)[:70] for _ in range(b)]).view(b, 1, 70).to(torch.int32)
    meta = FlashMLAAdaptor().plan(slots, lengths, page_size=4, num_slots=pool)
    named = torch.zeros(pool, dtype=torch.bool)
    named[meta.indices[meta.indices >= 0].long()] = True
    if packed:
        cache[~named] = 255  # e4m3 NaN bytes and NaN scales: must not be read
    else:
        cache[~named] = float("nan")
    view = cache.view(-1, 4, 1, cache.shape[-1])
    q = torch.randn(b, hq, 576, generator=g)
    out = TorchRefBackend().run(q, view, view if packed else view[..., :512], meta)
    assert out.shape == (b, hq, 512) and out.dtype == q.dtype
    for i in range(b):
        rows = slots[i, 0, : int(lengths[i, 0])].long()
        if rows.numel() == 0:
            assert bool((out[i] == 0).all())
        else:
            assert torch.allclose(out[i].double(), dense_mla(q[i], seen[rows, 0]), atol=1e-5)


def test_torch_ref_page_tables_over_packed_rows_read_only_their_pages() -> None:
    g = torch.Generator().manual_seed(5)
    lat = torch.randn(64, 1, 576, generator=g)
    cache = pack_flashmla_fp8(lat).view(16, 4, 1, 656)
    slots = torch.tensor([[[8, 9, 10, 11, 40, 41, 42, 43, 20, 21, -1, -1]], [[0, 1, 2, 3, -1, -1, -1, -1, -1, -1, -1, -1]]],
                         dtype=torch.int32)
    lengths = torch.tensor([[10], [0]], dtype=torch.int32)
    meta = FlashAttentionAdaptor().plan(slots, lengths, page_size=4, num_slots=64)
    cache[[0, 1, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14, 15]] = 255  # pages the table does not read
    q = torch.randn(2, 4, 576, generator=g, dtype=torch.float64).to(torch.bfloat16)
    out = TorchRefBackend().run(q, cache, cache, meta)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 512)
    want = dense_mla(q[0].float(), unpack_flashmla_fp8(pack_flashmla_fp8(lat))[slots[0, 0, :10].long(), 0])
    assert torch.allclose(out[0].double(), want, atol=2e-2)
    assert bool((out[1] == 0).all())


# -- the coordinator ---------------------------------------------------------------------------
def run_mla(config: dict, layout: KVLayout, steps: int = 3, q_heads: int = 8, seed: int = 0):
    """Prefill two requests, then decode `steps`; per step and layer (outputs, dense reference
    outputs over the latents as stored, metadata)."""
    coord = SparseCoordinator(config, layout, max_requests=2, max_seq_len=256)
    g = torch.Generator().manual_seed(seed)
    reqs = [Request("a", 150), Request("b", 70)]

    def model_inputs(n: int, prefill: bool) -> dict[str, torch.Tensor]:
        specs = coord.algorithm.prefill_inputs if prefill else coord.algorithm.decode_inputs
        return {name: torch.randn(n, *shape, generator=g) for name, shape in specs.items()}

    def as_stored(x: torch.Tensor) -> torch.Tensor:
        return unpack_flashmla_fp8(pack_flashmla_fp8(x)) if layout.is_flashmla_fp8 else x

    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    lat: dict[tuple[str, int], torch.Tensor] = {}
    for layer in range(layout.num_layers):
        k = torch.randn(220, 1, 576, generator=g)
        q = torch.randn(220, q_heads, 576, generator=g)
        meta = coord.attention_begin(layer, q, k, None, batch, model_inputs(220, True))
        coord.attention_end(layer, coord.attend(layer, q, meta), batch)
        lat[("a", layer)], lat[("b", layer)] = k[:150], k[150:]
    coord.forward_end(batch)
    results = []
    for _ in range(steps):
        batch = Batch(reqs)
        coord.forward_begin(batch)
        for layer in range(layout.num_layers):
            q = torch.randn(2, q_heads, 576, generator=g)
            k = torch.randn(2, 1, 576, generator=g)
            meta = coord.attention_begin(layer, q, k, None, batch, model_inputs(2, False))
            out = coord.attend(layer, q, meta)
            coord.attention_end(layer, out, batch)
            refs = []
            for i, r in enumerate(reqs):
                lat[(r.rid, layer)] = torch.cat([lat[(r.rid, layer)], k[i : i + 1]])
                refs.append(dense_mla(q[i], as_stored(lat[(r.rid, layer)])[:, 0]))
            results.append((out, torch.stack(refs), meta))
        coord.forward_end(batch)
    return results


DSA = {**HIERARCHICAL_ALWAYS, "algorithm": "dsa", "top_k": 256, "page_size": 16, "sink_tokens": 4, "recent_tokens": 8,
       "min_sparse_prompt_len": 0, "device_buffer_tokens": 512,
       "extra": {"index_heads": 2, "index_dim": 16, "key_dtype": "bfloat16"}}


@pytest.mark.parametrize("config", [{**SMALL_QUEST, "top_k": 256, "device_buffer_tokens": 512}, DSA],
                         ids=["quest", "dsa"])
def test_full_budget_equals_dense_and_the_flash_attention_adaptor(config) -> None:
    layout = KVLayout.mla(2)
    runs = {a: run_mla({**config, "adaptor": a}, layout) for a in ("flashmla", "flash_attention")}
    for (out, ref, meta), (out_fa, _, meta_fa) in zip(runs["flashmla"], runs["flash_attention"]):
        assert isinstance(meta.plan, FlashMLAMetadata) and meta.plan.indices.shape[:2] == (2, 1)
        assert torch.allclose(out.double(), ref, atol=1e-5)
        assert torch.allclose(out, out_fa, atol=1e-6)


@pytest.mark.parametrize("config", [{**SMALL_QUEST, "top_k": 32, "device_buffer_tokens": 64},
                                    {**DSA, "top_k": 48, "device_buffer_tokens": 64}], ids=["quest", "dsa"])
def test_sparse_budget_gives_the_same_outputs_through_either_adaptor(config) -> None:
    """Selections smaller than the context, scattered over the device buffer: the FlashMLA
    indices and the FlashAttention page table name the same rows."""
    layout = KVLayout.mla(1)
    a = run_mla({**config, "adaptor": "flashmla"}, layout, steps=4)
    b = run_mla({**config, "adaptor": "flash_attention"}, layout, steps=4)
    for (out, _, meta), (out_fa, _, meta_fa) in zip(a, b):
        assert torch.equal(meta.slots, meta_fa.slots)
        assert int(meta.selection.lengths.max()) < 150  # really sparse
        assert torch.allclose(out, out_fa, atol=1e-6)


def test_fp8_store_end_to_end_equals_dense_over_the_dequantised_latents() -> None:
    """DeepSeek V3.2's setup: DSA over FlashMLA's FP8 cache. With a budget covering the context
    the outputs are dense attention over exactly the values the cache holds, through either
    adaptor (the device buffer is read as packed rows and dequantised)."""
    layout = KVLayout.mla(1, dtype=torch.float8_e4m3fn)
    runs = {a: run_mla({**DSA, "adaptor": a}, layout) for a in ("flashmla", "flash_attention")}
    for (out, ref, meta), (out_fa, _, _) in zip(runs["flashmla"], runs["flash_attention"]):
        assert meta.k_cache.dtype == torch.uint8 and meta.k_cache.shape[-2:] == (1, 656)
        assert torch.allclose(out.double(), ref, atol=1e-5)
        assert torch.allclose(out, out_fa, atol=1e-6)
