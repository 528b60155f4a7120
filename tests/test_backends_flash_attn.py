"""The `flash_attn` backend: its clear error where flash-attn is missing, the way it hands our
page table to the library (checked on the CPU with a stand-in library that records the call
and computes with torch_ref), and on a GPU with flash-attn installed the real kernel against
torch_ref through the coordinator."""

from __future__ import annotations

import pytest
import torch

from sparse_framework import ConfigError, KVLayout, Request
from sparse_framework.common.errors import UnsupportedFeatureError
from sparse_framework.adaptors.flash_attention import FlashAttentionAdaptor
from sparse_framework.backends import flash_attn as fa_backend
from sparse_framework.backends.flash_attn import FlashAttnBackend
from sparse_framework.backends.torch_ref import TorchRefBackend, paged_attention
from sparse_framework.coordinator.core import SparseCoordinator

from helpers import SMALL_QUEST
from coordinator_driver import Driver

AVAILABLE = FlashAttnBackend.unavailable_reason() is None


@pytest.mark.skipif(AVAILABLE, reason="flash-attn is installed here")
def test_missing_library_is_one_clear_error_naming_the_extra() -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ConfigError) as info:
        SparseCoordinator({**SMALL_QUEST, "backend": "flash_attn"}, layout)
    msg = str(info.value)
    assert "backend 'flash_attn' is unavailable" in msg and 'pip install -e ".[flash-attn]"' in msg


@pytest.fixture
def fake_library(monkeypatch):
    """Stand in for flash-attn 4 or 3: record the arguments, compute with torch_ref."""
    calls = []

    def fa4(q, k, v, *, seqused_k, page_table, softmax_scale):
        calls.append(dict(q=q, k=k, v=v, seqlens=seqused_k, table=page_table, scale=softmax_scale))
        out = paged_attention(q[:, 0], k, v, page_table, seqused_k, softmax_scale).unsqueeze(1)
        return out.to(q.dtype), None

    def fa3(q, k, v, *, cache_seqlens, page_table, softmax_scale):
        return fa4(q, k, v, seqused_k=cache_seqlens, page_table=page_table, softmax_scale=softmax_scale)[0]

    def use(version: int) -> list:
        found = ("flash-attn 4", fa4) if version == 4 else ("flash-attn 3", fa3)
        monkeypatch.setattr(fa_backend, "_find_library", lambda: found)
        return calls

    return use


@pytest.mark.parametrize("version", [3, 4])
@pytest.mark.parametrize("heads, page", [(1, 4), (2, 1), (2, 4)])
def test_page_table_is_passed_as_the_library_expects(fake_library, version, heads, page) -> None:
    calls = fake_library(version)
    b, hk, g, d, n_slots = 3, 2, 4, 16, 64
    gen = torch.Generator().manual_seed(version * 10 + heads + page)
    perm = torch.stack([torch.randperm(n_slots // page, generator=gen) for _ in range(b * heads)]).view(b, heads, -1)
    slots = (perm[..., :5, None] * page + torch.arange(page)).flatten(-2).int()  # 5 whole pages each
    lengths = torch.randint(1, 5 * page + 1, (b, heads), generator=gen).int()
    slots = torch.where(torch.arange(5 * page) < lengths.unsqueeze(-1), slots, -1)
    plan = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=n_slots)
    cache_heads = 1 if heads > 1 else hk
    k_cache = torch.randn(hk * n_slots // page if heads > 1 else n_slots // page, page, cache_heads, d, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    q = torch.randn(b, hk * g, d, generator=gen)
    out = FlashAttnBackend().run(q, k_cache, v_cache, plan)
    call = calls[-1]
    rows = b * heads
    assert tuple(call["q"].shape) == (rows, 1, hk * g // heads, d)  # one query token per sequence
    assert call["table"] is plan.page_table and call["seqlens"] is plan.cache_seqlens
    assert call["k"] is k_cache and call["v"] is v_cache and call["scale"] == pytest.approx(d**-0.5)
    want = TorchRefBackend().run(q, k_cache, v_cache, plan)
    torch.testing.assert_close(out, want)


@pytest.fixture
def fake_library_with_options(monkeypatch):
    """flash-attn 4 with `softcap` and `learnable_sink` (bfloat16 [heads], as its interface
    asserts) or flash-attn 3 with `softcap` only; records the calls, computes with torch_ref."""
    calls = []

    def fa4(q, k, v, *, seqused_k, page_table, softmax_scale, softcap=None, learnable_sink=None):
        assert learnable_sink is None or (learnable_sink.dtype == torch.bfloat16 and learnable_sink.shape == (q.shape[2],))
        calls.append(dict(q=q, softcap=softcap, sink=learnable_sink, table=page_table))
        out = paged_attention(q[:, 0], k, v, page_table, seqused_k, softmax_scale, softcap=softcap, sinks=learnable_sink)
        return out.unsqueeze(1).to(q.dtype), None

    def fa3(q, k, v, *, cache_seqlens, page_table, softmax_scale, softcap=0.0):
        calls.append(dict(q=q, softcap=softcap, table=page_table))
        out = paged_attention(q[:, 0], k, v, page_table, cache_seqlens, softmax_scale, softcap=softcap or None)
        return out.unsqueeze(1).to(q.dtype)

    def use(version: int) -> list:
        found = ("flash-attn 4", fa4) if version == 4 else ("flash-attn 3", fa3)
        monkeypatch.setattr(fa_backend, "_find_library", lambda: found)
        return calls

    return use


@pytest.mark.parametrize("heads", [1, 2])
def test_softcap_and_sinks_are_passed_where_the_library_takes_them(fake_library_with_options, heads) -> None:
    """flash-attn 4: softcap and learnable_sink; with the KV heads folded into the batch, one
    call per KV head with that head's group of sinks. Equal to torch_ref with the same options
    (the sinks rounded to bfloat16, as flash-attn 4 takes them)."""
    calls = fake_library_with_options(4)
    b, hk, g, d, page, n_slots = 2, 2, 3, 16, 4, 64
    gen = torch.Generator().manual_seed(heads)
    perm = torch.stack([torch.randperm(n_slots // page, generator=gen) for _ in range(b * heads)]).view(b, heads, -1)
    slots = (perm[..., :5, None] * page + torch.arange(page)).flatten(-2).int()
    lengths = torch.randint(1, 5 * page + 1, (b, heads), generator=gen).int()
    slots = torch.where(torch.arange(5 * page) < lengths.unsqueeze(-1), slots, -1)
    plan = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=n_slots)
    k_cache = torch.randn(hk * n_slots // page if heads > 1 else n_slots // page, page, 1 if heads > 1 else hk, d, generator=gen)
    v_cache = torch.randn(k_cache.shape, generator=gen)
    q = torch.randn(b, hk * g, d, generator=gen) * 3
    sinks = torch.randn(hk * g, generator=gen).bfloat16().float()  # exact in bfloat16
    out = FlashAttnBackend().run(q, k_cache, v_cache, plan, softcap=2.0, sinks=sinks)
    assert len(calls) == (hk if heads > 1 else 1) and all(c["softcap"] == 2.0 for c in calls)
    if heads > 1:
        for h, call in enumerate(calls):
            torch.testing.assert_close(call["sink"].float(), sinks[h * g : (h + 1) * g])
            torch.testing.assert_close(call["table"], plan.page_table[h::hk])
    want = TorchRefBackend().run(q, k_cache, v_cache, plan, softcap=2.0, sinks=sinks)
    torch.testing.assert_close(out, want)


def test_a_library_without_sinks_refuses_them_by_name(fake_library_with_options) -> None:
    """flash-attn 3 has softcap but no sinks: sinks raise UnsupportedFeatureError (a ConfigError
    and a NotImplementedError) naming the option, when configured and if run anyway."""
    from sparse_framework.common.errors import UnsupportedFeatureError

    fake_library_with_options(3)
    FlashAttnBackend.check_attention_options(50.0, None)  # softcap: taken
    with pytest.raises(UnsupportedFeatureError, match="cannot apply sinks .its keyword 'learnable_sink'.: the installed flash-attn 3"):
        FlashAttnBackend.check_attention_options(None, torch.zeros(4))
    plan = FlashAttentionAdaptor().plan(torch.arange(4, dtype=torch.int32).view(1, 1, 4), torch.tensor([[4]], dtype=torch.int32),
                                        page_size=4, num_slots=8)
    k = torch.randn(2, 4, 2, 8)
    with pytest.raises(NotImplementedError, match="sinks"):
        FlashAttnBackend().run(torch.randn(1, 4, 8), k, k, plan, sinks=torch.zeros(4))
    out = FlashAttnBackend().run(torch.randn(1, 4, 8), k, k, plan, softcap=5.0)
    assert out.shape == (1, 4, 8) and not out.isnan().any()


def test_mla_and_odd_head_dims_are_rejected_naming_the_alternatives(fake_library, monkeypatch) -> None:
    fake_library(4)
    monkeypatch.setattr(FlashAttnBackend, "device_types", ("cpu", "cuda"))
    with pytest.raises(ConfigError, match="MLA latent .*'flashmla', 'triton' or 'torch_ref'"):
        FlashAttnBackend.check_layout(KVLayout.mla(1, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="multiple of 8 in 8..256, got 12"):
        FlashAttnBackend.check_layout(KVLayout(1, 2, 12, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="supports dtypes float16, bfloat16"):
        FlashAttnBackend.check_layout(KVLayout(1, 2, 64, dtype=torch.float32))


def backend_outputs(config: dict, layout: KVLayout, q_heads: int, lens: list[int], steps: int) -> list[torch.Tensor]:
    """Every decode output of a fixed random run (same seed: same inputs and selections)."""
    coord = SparseCoordinator(config, layout, max_requests=len(lens), max_seq_len=max(lens) + steps + 1)
    drv = Driver(coord, q_heads=q_heads, seed=0)
    reqs = [Request(f"r{i}", n) for i, n in enumerate(lens)]
    drv.prefill(reqs)
    return [out for _ in range(steps) for out, _, _ in drv.decode(reqs)]


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and AVAILABLE), reason="needs a CUDA GPU and flash-attn")
@pytest.mark.parametrize(
    "config",
    [
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 256, "page_size": 16, "device_buffer_tokens": 512, "extra": {"dense_first_layers": 0}},
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "quest", "top_k": 256, "page_size": 128, "device_buffer_tokens": 1024, "extra": {"dense_first_layers": 0}},
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "dsa", "top_k": 256, "page_size": 16, "device_buffer_tokens": 512, "extra": {"source": "keys"}},
        {"store": "hierarchical", "sparse_policy": "always", "algorithm": "snapkv", "top_k": 256, "page_size": 16, "device_buffer_tokens": 512},
    ],
)
def test_flash_attn_matches_torch_ref_on_the_gpu(config) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, device="cuda")
    base = {"sink_tokens": 16, "recent_tokens": 32, "min_sparse_prompt_len": 0, **config}
    lens = [3000, 1200, 700]
    ref = backend_outputs({**base, "backend": "torch_ref"}, layout, 16, lens, steps=3)
    got = backend_outputs({**base, "backend": "flash_attn"}, layout, 16, lens, steps=3)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("heads, page", [(1, 4), (2, 16)])
def test_vllm_fa3_decode_is_the_varlen_call_over_the_block_table(monkeypatch, heads, page) -> None:
    """vLLM's FlashAttention 3 (a stand-in varlen function computing with torch_ref) serves the
    page table as a block table, one query per sequence, pinned to fa_version 3; the backend's
    output equals torch_ref's, softcap included."""
    import sys
    import types

    calls = []

    def varlen(q, k, v, *, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, block_table, softmax_scale,
               causal, softcap, fa_version):
        calls.append(dict(q=q, cu=cu_seqlens_q, max_k=max_seqlen_k, causal=causal, version=fa_version))
        assert max_seqlen_q == 1 and cu_seqlens_q.tolist() == list(range(q.shape[0] + 1))
        cap = softcap if softcap else None
        return paged_attention(q, k, v, block_table, seqused_k, softmax_scale, softcap=cap).to(q.dtype)

    fake = types.ModuleType("vllm.vllm_flash_attn")
    fake.flash_attn_varlen_func = varlen
    fake.is_fa_version_supported = lambda version: version == 3
    for name in ("flash_attn.cute", "flash_attn_interface"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", fake)
    fa_backend._find_library.cache_clear()
    try:
        name, _ = fa_backend._find_library()
        assert name == "vLLM's flash-attn 3"
        b, hk, g, d, n_slots = 3, 2, 4, 16, 128
        gen = torch.Generator().manual_seed(heads * 100 + page)
        perm = torch.stack([torch.randperm(n_slots // page, generator=gen) for _ in range(b * heads)]).view(b, heads, -1)
        slots = (perm[..., :3, None] * page + torch.arange(page)).flatten(-2).int()
        lengths = torch.randint(1, 3 * page + 1, (b, heads), generator=gen).int()
        slots = torch.where(torch.arange(3 * page) < lengths.unsqueeze(-1), slots, -1)
        plan = FlashAttentionAdaptor().plan(slots, lengths, page_size=page, num_slots=n_slots)
        cache_heads = 1 if heads > 1 else hk
        pages = hk * n_slots // page if heads > 1 else n_slots // page
        k_cache = torch.randn(pages, page, cache_heads, d, generator=gen)
        v_cache = torch.randn(k_cache.shape, generator=gen)
        q = torch.randn(b, hk * g, d, generator=gen)
        for softcap in (None, 5.0):
            out = FlashAttnBackend().run(q, k_cache, v_cache, plan, softcap=softcap)
            torch.testing.assert_close(out, TorchRefBackend().run(q, k_cache, v_cache, plan, softcap=softcap))
        assert calls[-1]["version"] == 3 and calls[-1]["causal"]
        assert calls[-1]["max_k"] == plan.page_table.shape[1] * page
        with pytest.raises(UnsupportedFeatureError, match="vLLM's flash-attn 3"):
            FlashAttnBackend().run(q, k_cache, v_cache, plan, sinks=torch.zeros(hk * g))
    finally:
        fa_backend._find_library.cache_clear()
