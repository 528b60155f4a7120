"""The `flashmla` backend: its clear error without the library, its layout checks, and the call
it makes, checked on the CPU against stand-ins for the three generations of FlashMLA's Python
API (each asserting the documented contract, computing the documented result); on a GPU with
FlashMLA installed, the real kernel against torch_ref."""

from __future__ import annotations

import functools
import math
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from sparse_framework import Batch, ConfigError, KVLayout, Request, load_config
from sparse_framework.adaptors.flashmla import FlashMLAAdaptor, plan_query_tokens
from sparse_framework.backends.flashmla import FlashMLABackend
from sparse_framework.backends.torch_ref import TorchRefBackend
from sparse_framework.coordinator.core import SparseCoordinator
from sparse_framework.common.flashmla_format import pack_flashmla_fp8, unpack_flashmla_fp8
from helpers import HIERARCHICAL_ALWAYS  # noqa: E402

DSA = {**HIERARCHICAL_ALWAYS, "algorithm": "dsa", "top_k": 128, "page_size": 16, "sink_tokens": 4, "recent_tokens": 8,
       "min_sparse_prompt_len": 0, "device_buffer_tokens": 256,
       "extra": {"index_heads": 2, "index_dim": 16, "key_dtype": "bfloat16"}}


def fake_flash_mla(api: str) -> types.ModuleType:
    """A stand-in `flash_mla` for api "2025-09" (first sparse release), "2026" (upstream at
    9241ae3) or "sgl" (sgl-flash-mla). It asserts what the real one checks and returns the
    documented result: out bf16 [b, s_q, h_q, 512] = softmax(q·kᵀ·scale)·v over the named rows."""
    mod = types.ModuleType("flash_mla")
    mod.calls = {"metadata": 0, "decode": 0, "extra": None, "page_block_size": None}

    @dataclass
    class SchedMeta:
        have_initialized: bool = False

    def decode(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices):
        mod.calls["decode"] += 1
        assert q.dtype == torch.bfloat16 and q.is_contiguous() and q.dim() == 4
        b, s_q, h_q, d = q.shape
        assert h_q in (64, 128) and d == 576 and head_dim_v == 512
        assert k_cache.dtype == torch.uint8 and k_cache.dim() == 4 and k_cache.shape[2:] == (1, 656)
        assert k_cache.stride(1) == 656 and k_cache.stride(-1) == 1
        assert indices.dtype == torch.int32 and indices.shape[:2] == (b, s_q) and indices.shape[2] % 64 == 0
        assert is_fp8_kvcache is True and causal is False
        mod.calls["page_block_size"] = k_cache.shape[1]
        rows = k_cache.reshape(-1, 656)
        valid = indices >= 0
        kv = unpack_flashmla_fp8(rows[torch.where(valid, indices, 0).long()])  # [b, s_q, topk, 576]
        scale = softmax_scale if softmax_scale is not None else d**-0.5
        scores = torch.einsum("bshd,bstd->bsht", q.float(), kv) * scale
        scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
        p = scores.softmax(-1).nan_to_num(0.0)
        out = torch.einsum("bsht,bstd->bshd", p, kv[..., :512]).to(torch.bfloat16)
        return out, torch.zeros(b, h_q, s_q)

    if api == "2025-09":
        def get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
                             is_fp8_kvcache=False, topk=None):
            mod.calls["metadata"] += 1
            assert cache_seqlens.dtype == torch.int32 and num_heads_k == 1 and num_heads_q in (64, 128)
            assert is_fp8_kvcache and topk % 64 == 0 and num_q_tokens_per_head_k % num_heads_q == 0
            return torch.zeros(8, 8, dtype=torch.int32), torch.zeros(cache_seqlens.numel() + 1, dtype=torch.int32)

        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None):
            assert isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32
            assert cache_seqlens.shape == (q.shape[0],) and num_splits.shape == (q.shape[0] + 1,)
            assert k_cache.shape[1] == 64, "Currently page_block_size must be 64"
            return decode(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices)
    else:
        def get_mla_metadata(*args, **kwargs):
            mod.calls["metadata"] += 1
            return SchedMeta(), None

        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False, indices=None,
                                   attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                                   extra_topk_length=None, **more):
            assert isinstance(tile_scheduler_metadata, SchedMeta) and num_splits is None
            if api == "sgl":
                assert set(more) <= {"use_legacy", "kv_format", "enable_batch_invariant", "descale_q", "descale_k"}
                mod.calls["extra"] = more
            else:
                assert not more
            tile_scheduler_metadata.have_initialized = True
            return decode(q, k_cache, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices)

        if api == "sgl":  # the real signature names these; the backend reads the signature
            def flash_mla_with_kvcache_sgl(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                           num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None,
                                           indices=None, use_legacy=False, kv_format=None):
                assert use_legacy is True and kv_format == "V32", (use_legacy, kv_format)
                return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                              num_splits, softmax_scale, causal, is_fp8_kvcache, indices,
                                              use_legacy=use_legacy, kv_format=kv_format)
            mod.flash_mla_with_kvcache = flash_mla_with_kvcache_sgl
            mod.get_mla_metadata = get_mla_metadata
            return mod
    mod.get_mla_metadata = get_mla_metadata
    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod


@pytest.fixture
def no_flash_mla(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # `import flash_mla` raises ImportError


def test_without_the_library_one_config_error_names_the_package_and_how_to_install_it(no_flash_mla) -> None:
    config = load_config({**DSA, "backend": "flashmla"})  # the config itself is fine
    assert config.adaptor_name == "flashmla"
    with pytest.raises(ConfigError) as err:
        SparseCoordinator(config, KVLayout.mla(1, dtype=torch.float8_e4m3fn), max_requests=1, max_seq_len=64)
    msg = str(err.value)
    assert msg.startswith("backend 'flashmla' is unavailable: the `flash_mla` package (FlashMLA) cannot be imported")
    assert "github.com/deepseek-ai/FlashMLA" in msg and "pip install" in msg and "sgl-flash-mla" in msg
    assert msg.count("backend 'flashmla'") == 1
    reason = FlashMLABackend.unavailable_reason()
    assert reason is not None and "ModuleNotFoundError" in reason
    with pytest.raises(ConfigError, match="adaptor 'flash_attention' was chosen"):
        load_config({**DSA, "backend": "flashmla", "adaptor": "flash_attention"})


def test_layout_checks_name_the_constraint(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla("2026"))
    assert FlashMLABackend.unavailable_reason() is None
    cases = [
        (KVLayout.mla(1, dtype=torch.bfloat16), "reads only FlashMLA's FP8 cache .* dtype to torch.float8_e4m3fn, not torch.bfloat16"),
        (KVLayout(num_layers=1, num_kv_heads=1, head_dim=576, dtype=torch.float8_e4m3fn), "runs MLA decode only"),
        (KVLayout.mla(1, dtype=torch.float8_e4m3fn), "runs on cuda only"),  # this test's device is the CPU
    ]
    for layout, msg in cases:
        with pytest.raises(ConfigError, match=f"^backend 'flashmla' {msg}"):
            SparseCoordinator({**DSA, "backend": "flashmla"}, layout, max_requests=1, max_seq_len=64)


@functools.lru_cache(maxsize=None)
def fp8_step(q_heads: int):
    """One decode step of a CPU coordinator over the fp8 MLA store with the FlashMLA adaptor
    (torch_ref backend): (q, metadata, torch_ref output)."""
    layout = KVLayout.mla(1, dtype=torch.float8_e4m3fn)
    coord = SparseCoordinator({**DSA, "adaptor": "flashmla"}, layout, max_requests=2, max_seq_len=256)
    g = torch.Generator().manual_seed(q_heads)

    def inputs(n: int, prefill: bool) -> dict[str, torch.Tensor]:
        specs = coord.algorithm.prefill_inputs if prefill else coord.algorithm.decode_inputs
        return {name: torch.randn(n, *shape, generator=g) for name, shape in specs.items()}

    reqs = [Request("a", 200), Request("b", 90)]
    for r in reqs:
        coord.on_request_begin(r)
    batch = Batch(reqs, is_prefill=True)
    coord.forward_begin(batch)
    q = torch.randn(290, q_heads, 576, generator=g)
    meta = coord.attention_begin(0, q, torch.randn(290, 1, 576, generator=g), None, batch, inputs(290, True))
    coord.attention_end(0, coord.attend(0, q, meta), batch)
    coord.forward_end(batch)
    batch = Batch(reqs)
    coord.forward_begin(batch)
    q = torch.randn(2, q_heads, 576, generator=g).to(torch.bfloat16)
    meta = coord.attention_begin(0, q, torch.randn(2, 1, 576, generator=g), None, batch, inputs(2, False))
    return q, meta, coord.attend(0, q, meta)


@pytest.mark.parametrize("api", ["2025-09", "2026", "sgl"])
@pytest.mark.parametrize("q_heads", [16, 64, 128])
def test_the_call_matches_each_api_generation_and_torch_ref(monkeypatch, api, q_heads) -> None:
    lib = fake_flash_mla(api)
    monkeypatch.setitem(sys.modules, "flash_mla", lib)
    q, meta, want = fp8_step(q_heads)
    assert meta.plan.page_block_size == 64 and meta.k_cache.dtype == torch.uint8
    backend = FlashMLABackend()
    out = backend.run(q, meta.k_cache, meta.v_cache, meta.plan)
    assert out.shape == (2, q_heads, 512) and out.dtype == torch.bfloat16
    assert lib.calls["page_block_size"] == 64
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
    if api == "sgl":
        assert lib.calls["extra"] == {"use_legacy": True, "kv_format": "V32"}
    backend.run(q, meta.k_cache, meta.v_cache, meta.plan)  # same shapes: the scheduler state is reused
    assert lib.calls["metadata"] == 1 and lib.calls["decode"] == 2


def test_head_counts_and_page_blocks_the_kernel_cannot_take(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(40, 1, 576, generator=g)
    cache = pack_flashmla_fp8(lat).view(10, 4, 1, 656)  # 40 rows: no 64-row blocks
    slots = torch.randperm(40, generator=g)[:30].view(1, 1, 30).to(torch.int32)
    meta = FlashMLAAdaptor().plan(slots, torch.tensor([[30]], dtype=torch.int32), page_size=4, num_slots=40)
    assert meta.page_block_size == 4
    q = torch.randn(1, 64, 576, generator=g)
    monkeypatch.setitem(sys.modules, "flash_mla", fake_flash_mla("2025-09"))
    with pytest.raises(ValueError, match="needs page_block_size 64"):
        FlashMLABackend().run(q, cache, cache, meta)
    lib = fake_flash_mla("2026")  # later releases take any block size
    monkeypatch.setitem(sys.modules, "flash_mla", lib)
    out = FlashMLABackend().run(q, cache, cache, meta)
    assert lib.calls["page_block_size"] == 4
    torch.testing.assert_close(out, TorchRefBackend().run(q, cache, cache, meta), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="runs 64 or 128 query heads"):
        FlashMLABackend().run(torch.randn(1, 129, 576), cache, cache, meta)
    with pytest.raises(ValueError, match="uint8 \\[pages, page_size, 1, 656\\]"):
        FlashMLABackend().run(q, unpack_flashmla_fp8(cache), cache, meta)


def test_several_query_tokens_and_library_errors(monkeypatch) -> None:
    lib = fake_flash_mla("2026")
    monkeypatch.setitem(sys.modules, "flash_mla", lib)
    g = torch.Generator().manual_seed(1)
    cache = pack_flashmla_fp8(torch.randn(128, 1, 576, generator=g)).view(2, 64, 1, 656)
    slots = torch.stack([torch.randperm(128, generator=g)[:50] for _ in range(6)]).view(3, 2, 50).to(torch.int32)
    meta = plan_query_tokens(slots, torch.full((3, 2), 50, dtype=torch.int32), page_size=64, num_slots=128)
    q = torch.randn(3, 2, 64, 576, generator=g)
    out = FlashMLABackend().run(q, cache, cache, meta)
    assert out.shape == (3, 2, 64, 512) and out.dtype == torch.float32
    torch.testing.assert_close(out, TorchRefBackend().run(q, cache, cache, meta), rtol=2e-2, atol=2e-2)

    def broken(*args, **kwargs):
        raise RuntimeError("Unsupported bytes_per_token")

    lib.flash_mla_with_kvcache = broken
    with pytest.raises(RuntimeError, match="Unsupported bytes_per_token .* 656 bytes per token"):
        FlashMLABackend().run(q, cache, cache, meta)


def _real_flash_mla() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        return False
    return FlashMLABackend.unavailable_reason() is None


@pytest.mark.gpu
@pytest.mark.skipif(not _real_flash_mla(), reason="needs an SM90/SM100 GPU and an importable flash_mla (FlashMLA)")
@pytest.mark.parametrize("q_heads", [16, 64, 128])
def test_real_flashmla_matches_torch_ref_on_the_gpu(q_heads) -> None:
    """The same decode steps through backend flashmla and backend torch_ref (same seeds, so the
    same selections): FlashMLA's bf16 outputs against the float32 reference."""
    layout = KVLayout.mla(2, dtype=torch.float8_e4m3fn, device="cuda")
    config = {**DSA, "top_k": 256, "device_buffer_tokens": 512}
    outs = {}
    for backend in ("flashmla", "torch_ref"):
        coord = SparseCoordinator({**config, "backend": backend, "adaptor": "flashmla"}, layout,
                                  max_requests=4, max_seq_len=2048)
        g = torch.Generator(device="cuda").manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g, device="cuda")

        def inputs(n: int, prefill: bool) -> dict[str, torch.Tensor]:
            specs = coord.algorithm.prefill_inputs if prefill else coord.algorithm.decode_inputs
            return {name: rand(n, *shape) for name, shape in specs.items()}

        reqs = [Request(f"r{i}", n) for i, n in enumerate((1500, 700, 300, 1200))]
        for r in reqs:
            coord.on_request_begin(r)
        batch = Batch(reqs, is_prefill=True)
        coord.forward_begin(batch)
        n = sum(r.prompt_len for r in reqs)
        for layer in range(2):
            q = rand(n, q_heads, 576).to(torch.bfloat16)
            meta = coord.attention_begin(layer, q, rand(n, 1, 576).to(torch.bfloat16), None, batch, inputs(n, True))
            coord.attention_end(layer, coord.attend(layer, q, meta), batch)
        coord.forward_end(batch)
        steps = []
        for _ in range(3):
            batch = Batch(reqs)
            coord.forward_begin(batch)
            for layer in range(2):
                q = rand(4, q_heads, 576).to(torch.bfloat16)
                meta = coord.attention_begin(layer, q, rand(4, 1, 576).to(torch.bfloat16), None, batch, inputs(4, False))
                steps.append(coord.attend(layer, q, meta).float())
                coord.attention_end(layer, steps[-1], batch)
            coord.forward_end(batch)
        outs[backend] = torch.stack(steps)
    got, want = outs["flashmla"], outs["torch_ref"]
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert float(cos) > 0.9995, float(cos)
    assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()) + 1e-3
    assert not math.isnan(float(got.sum()))
